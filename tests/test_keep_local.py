"""`keep_local=N`, the retention a trainer uses instead of `save_total_limit`: an older local folder
goes only once a newer checkpoint is verified and the old one has a verified durable replica (the
rule as a table, then HF `Trainer` and Lightning removing their own folders through the real ingest
and catalog, and the training process importing no catalog to do it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from safepoint.catalog.views import LocalCopy
from safepoint.core.config import Config
from safepoint.core.states import CheckpointState as C
from safepoint.core.states import ReplicaState as R
from safepoint.local.snapshot import is_committed
from safepoint.ops.evict import Usage
from safepoint.ops.ingest import ingest
from safepoint.rules.eviction import plan_keep_local

REPO = Path(__file__).resolve().parents[1]
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def copy(step: int, state: C = C.VERIFIED, nver: int = 1, run: str = "r") -> LocalCopy:
    return LocalCopy(checkpoint_id=step, run=run, step=step, state=C(state), version=1,
                     created_at=T0 + timedelta(hours=step), path=f"/nvme/{run}/{step}", verified_replicas=nver)


CASES = [
    # copies, keep -> evicted steps
    ("the newest verified stays, older replicated ones go", [copy(1), copy(2), copy(3)], 1, [1, 2]),
    ("keep 2", [copy(1), copy(2), copy(3)], 2, [1]),
    ("nothing goes before a newer one has passed", [copy(1), copy(2, C.VALIDATING)], 1, []),
    ("a newer invalid one does not count: the previous verified stays", [copy(1), copy(2), copy(3, C.INVALID)], 1,
     [1]),
    ("a newer pending one does not count", [copy(1), copy(2), copy(3, C.REPLICATED), copy(4, C.COMMITTED)], 1, [1]),
    ("no verified replica: stays", [copy(1, nver=0), copy(2)], 1, []),
    ("older corrupt or incomplete: stays (the local copy may be the good one)",
     [copy(1, C.CORRUPT), copy(2, C.INCOMPLETE), copy(3)], 1, []),
    ("older invalid with a replica: goes", [copy(1, C.INVALID), copy(2)], 1, [1]),
    ("per run", [copy(1, run="a"), copy(2, run="b"), copy(3, run="a"), copy(4, run="b", state=C.VALIDATING)], 1,
     [1]),
    ("fewer verified than kept: nothing goes", [copy(1), copy(2)], 3, []),
]


@pytest.mark.parametrize("name,copies,keep,expected", CASES, ids=[c[0] for c in CASES])
def test_plan_keep_local_table(name, copies, keep, expected) -> None:
    p = plan_keep_local(copies, {c.path: 10 for c in copies}, Usage(1, 100), keep)
    assert sorted(d.copy.step for d in p.evict) == expected
    assert len(p.decisions) == len(copies) and all(d.reason for d in p.decisions) and p.keep_local == keep


def test_plan_keep_local_refuses_a_count_below_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        plan_keep_local([], {}, Usage(1, 2), 0)
    from safepoint.integrations.keep_local import LocalRetention

    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="keep_local must be"):
            LocalRetention(bad)


# ------------------------------------------------------------------------------------ the trainers

def ingested(catalog, durable: str, folder: Path) -> None:
    outcome = ingest(folder, [durable], catalog, Config())
    assert outcome.state is C.VERIFIED, outcome.message


def test_hf_keep_local_removes_an_old_folder_once_a_newer_one_is_verified(tmp_path: Path, sqlite_catalog) -> None:
    """Saves at 2, 4, 6 with keep_local=1; each ingested as soon as it is sealed except 6 (its ingest still
    to come): 2 goes (4 verified, 2 replicated), 4 stays (the newest verified), 6 stays (not verified yet)."""
    from transformers import TrainerCallback

    from safepoint.integrations.huggingface import SafepointCallback
    from tests.helpers_trainers import hf_trainer_run

    durable = (tmp_path / "durable").as_uri()

    class IngestAtOnce(TrainerCallback):  # what `safepoint serve` does on the committed event
        def on_save(self, args, state, control, **kwargs):
            if state.global_step != 6:
                ingested(sqlite_catalog, durable, Path(args.output_dir) / f"checkpoint-{state.global_step}")

    cb = SafepointCallback(run="hf-keep", keep_local=1)
    out = tmp_path / "node"
    hf_trainer_run(out, steps=6, save_steps=2, callbacks=[cb, IngestAtOnce()])
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert cb.retention.evicted == [str((out / "checkpoint-2").resolve())]
    assert all(is_committed(out / n) for n in ("checkpoint-4", "checkpoint-6"))
    row = sqlite_catalog.get("hf-keep", 2)
    assert row.state is C.VERIFIED and row.local_path is None           # the catalog knows it is gone
    assert [r.state for r in sqlite_catalog.replicas(row.id)] == [R.VERIFIED]
    assert sqlite_catalog.get("hf-keep", 4).local_path == str((out / "checkpoint-4").resolve())


def test_lightning_keep_local_keeps_a_folder_whose_replica_is_not_verified(tmp_path: Path, sqlite_catalog) -> None:
    """Saves at 2, 4, 6; 2 and 4 ingested during the run, 2's replica then found corrupt: with
    keep_local=1 nothing goes (4 is the newest verified, 2 has no verified replica left)."""
    import pytorch_lightning as pl

    from safepoint.integrations.lightning import SafepointCheckpointIO
    from tests.helpers_trainers import _lightning_module

    durable = (tmp_path / "durable").as_uri()
    io = SafepointCheckpointIO(run="pl-keep", keep_local=1)

    class IngestSealed(pl.Callback):  # ModelCheckpoint runs last: this sees the folders sealed before this batch
        def on_train_batch_end(self, *args, **kwargs):
            for folder in io.sealed:
                if sqlite_catalog.get("pl-keep", int(folder.name.split("-")[1])) is None:
                    ingested(sqlite_catalog, durable, folder)
                    if folder.name == "step-2":
                        row = sqlite_catalog.get("pl-keep", 2)
                        [rep] = sqlite_catalog.replicas(row.id)
                        sqlite_catalog.set_replica(row.id, rep.url, rep.destination, R.CORRUPT, error="test")

    root = tmp_path / "pl"
    dirpath = root / "ckpts"
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=root, plugins=[io],
                         callbacks=[IngestSealed(), pl.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_train_steps=2,
                                                                                 save_top_k=-1)])
    trainer.fit(_lightning_module())
    assert [p.name for p in io.sealed] == ["step-2", "step-4", "step-6"]
    assert sqlite_catalog.get("pl-keep", 4).state is C.VERIFIED
    assert sorted(p.name for p in dirpath.iterdir()) == ["step-2", "step-4", "step-6"]   # nothing could go
    assert io.retention.evicted == []

    # the replica is good again (re-verified): the next pass removes step-2
    row = sqlite_catalog.get("pl-keep", 2)
    [rep] = sqlite_catalog.replicas(row.id)
    sqlite_catalog.set_replica(row.id, rep.url, rep.destination, R.VERIFIED)
    io.retention.after_seal(dirpath)
    io.teardown()
    assert sorted(p.name for p in dirpath.iterdir()) == ["step-4", "step-6"]
    assert io.retention.evicted == [str((dirpath / "step-2").resolve())]


def test_a_failing_pass_is_logged_and_training_goes_on(tmp_path: Path, caplog) -> None:
    """No catalog reachable: the pass says why in one line; nothing is removed, nothing raised."""
    from safepoint.integrations.keep_local import LocalRetention
    from safepoint.local.commit import commit

    for step in (1, 2):
        (tmp_path / f"step-{step}").mkdir()
        (tmp_path / f"step-{step}" / "w.bin").write_bytes(b"x")
        commit(tmp_path / f"step-{step}", "r", step)
    keep = LocalRetention(1, catalog="postgresql+psycopg://postgres@127.0.0.1:1/test")  # nothing listens
    with caplog.at_level("WARNING", logger="safepoint.integrations"):
        keep.after_seal(tmp_path)
        keep.finish()
    assert keep.evicted == [] and all(is_committed(tmp_path / f"step-{s}") for s in (1, 2))
    [line] = [r.getMessage() for r in caplog.records if "keep_local" in r.getMessage()]
    assert "no local checkpoint removed" in line and "(exit 2)" in line


def test_keep_local_loads_no_catalog_in_the_training_process(tmp_path: Path, sqlite_catalog_url) -> None:
    """A pass started and finished from the training side leaves SQLAlchemy, fsspec, Prefect and rich out of
    the training process: the catalog is read in the child."""
    code = ("import json, sys\nfrom safepoint.integrations.keep_local import LocalRetention\n"
            "from safepoint.local.commit import commit\nfrom pathlib import Path\n"
            f"root = Path({str(tmp_path / 'ck')!r})\n"
            "for s in (1, 2):\n    (root / f'step-{s}').mkdir(parents=True)\n"
            "    (root / f'step-{s}' / 'w.bin').write_bytes(b'x')\n    commit(root / f'step-{s}', 'r', s)\n"
            "k = LocalRetention(1)\nk.after_seal(root)\nk.finish()\n"
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'sqlalchemy', 'fsspec', 'prefect', 'rich', "
            "'alembic'})\nprint(json.dumps({'heavy': heavy, 'evicted': k.evicted}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == {"heavy": [], "evicted": []}  # unknown to the catalog: kept


def test_safepoint_evict_keep_local_on_real_folders(tmp_path: Path, sqlite_catalog, sqlite_catalog_url,
                                                    capsys) -> None:
    """The command a pass runs: step 3 invalid, 4 pending, so 2 (the newest verified) stays and only 1 goes;
    a count below 1 is refused in one line (exit 2)."""
    from safepoint.cli.main import main
    from tests.helpers_catalog import local_folder, seed

    seed(sqlite_catalog, tmp_path, "r", 1)
    seed(sqlite_catalog, tmp_path, "r", 2)
    seed(sqlite_catalog, tmp_path, "r", 3, state=C.INVALID)
    seed(sqlite_catalog, tmp_path, "r", 4, state=C.REPLICATED)
    root = tmp_path / "nvme"
    capsys.readouterr()
    assert main(["evict", str(root), "--keep-local", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["keep_local"] == 1 and doc["evicted"] == [str(local_folder(tmp_path, "r", 1).resolve())]
    assert [p.name for p in sorted((root / "r").iterdir())] == ["step-2", "step-3", "step-4"]
    why = {d["step"]: d["reason"] for d in doc["decisions"]}
    assert "newest 1 verified" in why[2] and "newer than" in why[3] and "newer than" in why[4]
    assert sqlite_catalog.get("r", 1).local_path is None

    assert main(["evict", str(root), "--keep-local", "0"]) == 2
    assert "--keep-local must be at least 1, got 0" in capsys.readouterr().err
