"""Lightning ships as two packages: the unified `lightning` (`import lightning.pytorch as pl`, what
Lightning's docs use) and `pytorch_lightning`, each with its own copy of `CheckpointIO`; a Trainer
accepts only a plugin of its own copy. `SafepointCheckpointIO` trains, seals, restores and resumes
under either import with both installed, with each installed alone, and says what to install with
neither. "Installed alone" is a fresh interpreter in which a `sys.meta_path` finder makes the other
package unimportable, as it is where it was never installed.
"""

from __future__ import annotations

import importlib
import importlib.abc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BOTH = ()
ONLY_LIGHTNING = ("pytorch_lightning", "lightning_fabric")
ONLY_PYTORCH_LIGHTNING = ("lightning",)
NEITHER = ("lightning", "pytorch_lightning", "lightning_fabric")


class Uninstalled(importlib.abc.MetaPathFinder):
    """Makes the top-level packages `names` (and all under them) unimportable."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


def uninstall(names: tuple[str, ...]) -> None:
    sys.meta_path.insert(0, Uninstalled(names))


def importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError:
        return False
    return True


def train_seal_restore_resume(package: str, root: Path) -> dict:
    """Under `package`'s Trainer: 4 steps, checkpoints at 2 and 4 sealed and ingested; step 4 restored
    by `safepoint.restore` and resumed by `fit(ckpt_path=...)` to step 6. What happened, as JSON."""
    import torch

    import safepoint
    from safepoint.catalog import open_catalog
    from safepoint.core.config import Config
    from safepoint.integrations.lightning import SafepointCheckpointIO, sealed_checkpoint
    from safepoint.ops.ingest import ingest
    from tests.helpers_trainers import _lightning_module, lightning_fit

    catalog = open_catalog(f"sqlite:///{root / 'catalog.db'}")
    io = SafepointCheckpointIO(run="pl")
    lightning_fit(root / "node", _lightning_module(package), steps=4, every=2, plugins=[io], package=package)
    states = [str(ingest(f, [(root / "durable").as_uri()], catalog, Config()).state) for f in io.sealed]
    restored = safepoint.restore("pl", root / "resume", catalog=catalog)
    again = SafepointCheckpointIO(run="pl")
    module = _lightning_module(package)
    lightning_fit(root / "resumed", module, steps=6, every=2, plugins=[again], package=package,
                  ckpt_path=sealed_checkpoint(restored.path))
    return {
        "bases": sorted(b.__module__ for b in SafepointCheckpointIO.__mro__ if b.__name__ == "CheckpointIO"),
        "module_base": type(module).__mro__[1].__module__,
        "sealed": [f.name for f in io.sealed],
        "marked": [(f / "COMMITTED").is_file() and (f / "MANIFEST.json").is_file() for f in io.sealed],
        "states": states,
        "restored_step": restored.step,
        "resumed_sealed": [f.name for f in again.sealed],
        "resumed_global_step": torch.load(next(again.sealed[0].glob("*.ckpt")), weights_only=False)["global_step"],
    }


def in_fresh_interpreter(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def run_installed(installed_without: tuple[str, ...], package: str, root: Path) -> dict:
    code = ("import json, pathlib\n"
            "from tests.test_lightning_packages import uninstall, importable, train_seal_restore_resume\n"
            f"uninstall({installed_without!r})\n"
            f"absent = [n for n in {installed_without!r} if importable(n)]\n"
            f"print(json.dumps({{'still_importable': absent, **train_seal_restore_resume({package!r}, "
            f"pathlib.Path({os.fspath(root)!r}))}}))")
    r = in_fresh_interpreter(code)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


INSTALLATIONS = [
    pytest.param(BOTH, "lightning.pytorch", ["lightning.fabric.plugins.io.checkpoint_io",
                                             "lightning_fabric.plugins.io.checkpoint_io"], id="both-lightning.pytorch"),
    pytest.param(BOTH, "pytorch_lightning", ["lightning.fabric.plugins.io.checkpoint_io",
                                             "lightning_fabric.plugins.io.checkpoint_io"], id="both-pytorch_lightning"),
    pytest.param(ONLY_LIGHTNING, "lightning.pytorch", ["lightning.fabric.plugins.io.checkpoint_io"],
                 id="only-lightning"),
    pytest.param(ONLY_PYTORCH_LIGHTNING, "pytorch_lightning", ["lightning_fabric.plugins.io.checkpoint_io"],
                 id="only-pytorch_lightning"),
]


@pytest.mark.parametrize(("installed_without", "package", "bases"), INSTALLATIONS)
def test_each_installation_trains_seals_restores_and_resumes(installed_without, package, bases, tmp_path):
    pytest.importorskip("lightning")
    pytest.importorskip("pytorch_lightning")
    got = run_installed(installed_without, package, tmp_path)
    assert got["still_importable"] == []
    assert got["bases"] == bases                        # the CheckpointIO of each package there, no other
    assert got["module_base"].startswith(package)       # the module and Trainer were `package`'s own
    assert got["sealed"] == ["step-2", "step-4"] and got["marked"] == [True, True]
    assert got["states"] == ["verified", "verified"]
    assert got["restored_step"] == 4
    assert got["resumed_sealed"] == ["step-6"]          # resumed at 4: steps 2 and 4 not trained again
    assert got["resumed_global_step"] == 6


def test_with_both_installed_each_trainer_accepts_the_one_plugin():
    """The README's one import gives a plugin both Trainers take (each checks `isinstance` against its
    own copy of CheckpointIO, which a plugin of the other package's copy fails)."""
    lpl = pytest.importorskip("lightning.pytorch")
    ppl = pytest.importorskip("pytorch_lightning")
    from safepoint.integrations.lightning import SafepointCheckpointIO

    io = SafepointCheckpointIO(run="pl")
    for pl in (lpl, ppl):
        trainer = pl.Trainer(plugins=[io], accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                             enable_model_summary=False)
        assert trainer.strategy.checkpoint_io is io
    assert isinstance(io, lpl.plugins.CheckpointIO) and isinstance(io, ppl.plugins.CheckpointIO)


def test_neither_installed_is_a_clear_import_error():
    code = ("from tests.test_lightning_packages import uninstall\n"
            f"uninstall({NEITHER!r})\n"
            "try:\n"
            "    import safepoint.integrations.lightning\n"
            "except ImportError as e:\n"
            "    print(type(e).__name__, e)\n")
    r = in_fresh_interpreter(code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ImportError safepoint.integrations.lightning needs Lightning")
    assert "pip install lightning" in r.stdout and "pytorch-lightning" in r.stdout
