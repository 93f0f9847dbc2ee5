"""The README's code blocks, run as a new user would run them.

Every fenced block is one of three kinds, said by the comment line just above it:
- no comment: run as written. The tour's `sh` and `python` blocks run in order, in one empty folder,
  each in a fresh process, with a fresh SAFEPOINT_HOME and PREFECT_HOME and no PREFECT_API_URL (so the
  first command starts the local Prefect server, as on a new machine); `toml` blocks must load as config;
- `<!-- readme-test: trainer NAME -->`: a trainer snippet, run with a tiny stock model standing in for
  the user's own (`model`, `args`, `ds`, ...): its lines train and seal, `safepoint watch --once`
  ingests what they sealed, then its `# to resume` lines run;
- `<!-- readme-test: not run (why) -->`: never run, and the reason is said there (a server that runs
  until stopped, the whole test suite). The test below fails on a block of any other kind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

import safepoint.cli.main as cli
from safepoint.flows import local_server

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_BLOCK = re.compile(r"(?:<!-- readme-test: (?P<directive>[^\n]*?) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```", re.S)


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    code: str
    directive: str | None

    @property
    def trainer(self) -> str | None:
        d = self.directive or ""
        return d.removeprefix("trainer ").strip() if d.startswith("trainer ") else None


def blocks() -> list[Block]:
    text = README.read_text()
    return [Block(text.count("\n", 0, m.start("lang")) + 1, m["lang"], m["code"], m["directive"])
            for m in _BLOCK.finditer(text)]


def tour() -> list[Block]:
    return [b for b in blocks() if b.directive is None and b.lang in ("sh", "python")]


def test_every_block_is_run_or_says_why_not():
    found = blocks()
    assert len(found) >= 10
    for b in found:
        assert b.lang in ("sh", "python", "toml"), f"README.md:{b.line}: a ```{b.lang} block"
        if b.directive is None:
            continue
        if b.trainer:
            assert b.trainer in TRAINERS, f"README.md:{b.line}: no prelude for trainer {b.trainer!r}"
            continue
        reason = re.fullmatch(r"not run \((.{10,})\)", b.directive)
        assert reason, f"README.md:{b.line}: {b.directive!r} is neither run nor says why not"
    assert {b.trainer for b in found if b.trainer} == set(TRAINERS)
    assert [b.lang for b in tour()].count("sh") >= 6


def test_the_set_up_commands_are_the_documented_ones():
    shown = {b.code.strip() for b in blocks()}
    assert "bash .ci/run" in shown
    assert any(c.startswith("python3 -m venv .venv") and c.endswith("safepoint demo") for c in shown)
    # .ci/run calls the README's test command (plus CI's own report options)
    ci = (README.parent / ".ci" / "run").read_text()
    command = "python -m pytest -q -n 2 --dist loadfile"
    assert f"`{command}`" in README.read_text()
    assert re.search(rf"^{re.escape(command)} -p no:cacheprovider --durations=\d+$", ci, re.M), ci


def _fresh_env(base: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "SAFEPOINT_")) and k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    env.update(SAFEPOINT_HOME=str(base / "sp-home"), PREFECT_HOME=str(base / "prefect-home"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PATH=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", ""),
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    return env


def _key(b: Block) -> str:
    """A tour block's name: its first command (the subcommand for `safepoint`), or 'python'."""
    if b.lang == "python":
        return "python"
    words = b.code.split()
    return words[1] if words[0] == "safepoint" else words[0]


@pytest.mark.slow  # a new user's local Prefect server, a process per block
def test_the_tour_runs_as_written(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    env = _fresh_env(tmp_path)
    outputs = []
    try:
        for b in tour():
            argv = ["bash", "-euo", "pipefail", "-c", b.code] if b.lang == "sh" else [sys.executable, "-c", b.code]
            r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"README.md:{b.line} exited {r.returncode}:\n{b.code}\n{r.stdout}\n{r.stderr}"
            outputs.append((b, r))
    finally:
        local_server.stop(Path(env["PREFECT_HOME"]))
    text = {_key(b): r for b, r in outputs}
    durable = (work / "durable").as_uri()
    assert "my-run/100: verified" in text["ingest"].stdout
    ls = text["ls"].stdout.splitlines()  # piped: whole values, one line per checkpoint
    assert ls[0].split()[:3] == ["run", "step", "state"] and len(ls) == 2
    assert ls[1].split()[:3] == ["my-run", "100", "verified"] and f"{durable}/my-run/100 (verified)" in ls[1]
    [row] = json.loads((work / "checkpoints.json").read_text())
    assert row["state"] == "verified" and row["replicas"] == [{"url": f"{durable}/my-run/100", "state": "verified"}]
    rp = text["resume-point"]
    assert rp.stdout.splitlines()[0] == f"my-run step 100: {durable}/my-run/100"
    assert "no checkpoints recorded for run 'my-rnu' (did you mean 'my-run'?)" in rp.stderr
    assert "exit 1: nothing found" in rp.stdout
    assert (work / "resume" / "COMMITTED").is_file() and (work / "resume" / "model.pt").is_file()
    assert "restored my-run step 100 into" in text["rm"].stdout
    show = text["show"].stdout
    assert "my-run/100: verified" in show and "model.pt" in show and "parameter" in show
    assert f"{durable}/my-run/100: verified" in show  # the verify line of the same block
    assert text["python"].stdout.startswith("resuming my-run at step 100 from ")
    assert (work / "resume-py" / "COMMITTED").is_file()


def test_the_config_block_loads(tmp_path):
    from safepoint.core.config import load_config
    from safepoint.ops.retention import require_spec
    from safepoint.validation.settings import ValidationSettings

    [toml] = [b for b in blocks() if b.lang == "toml"]
    path = tmp_path / "config.toml"
    path.write_text(toml.code)
    tomllib.loads(toml.code)
    config = load_config(path)
    assert config.catalog_url == "postgresql+psycopg://ckpt@db/safepoint"
    assert config.storage_options("s3://ckpt-bucket/ckpt")["endpoint_url"] == "http://127.0.0.1:8333"
    assert require_spec("my-run", config) == {"keep_last": 3, "keep_tagged": True}
    assert config.section("restore")["prefer"] == ["s3://fast-bucket", "file:///nfs"]
    settings = ValidationSettings.from_config(config, "my-run")
    assert settings.model == "mypkg.models:build"


# ---------------------------------------------------------------------------------------- trainers
# What the README's trainer snippets call "yours": a tiny stock model and what it needs, and the
# folders under which the snippet's trainer writes (for `safepoint watch --once`).

TRAINERS: dict[str, tuple[str, list[str]]] = {
    "huggingface": ("""
import safepoint
from transformers import Trainer, TrainingArguments
from tests.helpers_trainers import _Tokens, tiny_gpt2
model, ds = tiny_gpt2(), _Tokens()
args = TrainingArguments(output_dir="out", max_steps=4, save_steps=2, per_device_train_batch_size=4, use_cpu=True,
                         report_to=[], disable_tqdm=True, dataloader_num_workers=0, save_strategy="steps")
""", ["out"]),
    "lightning": ("""
import safepoint
from pytorch_lightning.callbacks import ModelCheckpoint
from tests.helpers_trainers import _lightning_module
model = _lightning_module()
checkpointing = ModelCheckpoint(dirpath="ckpts", every_n_train_steps=2, save_top_k=-1)
""", ["ckpts"]),
    "lightning.pytorch": ("""
import safepoint
from lightning.pytorch.callbacks import ModelCheckpoint
from tests.helpers_trainers import _lightning_module
model = _lightning_module("lightning.pytorch")
checkpointing = ModelCheckpoint(dirpath="ckpts", every_n_train_steps=2, save_top_k=-1)
""", ["ckpts"]),
    "dcp": ("""
import safepoint
import torch
import torch.distributed.checkpoint as dcp
model = torch.nn.Linear(4, 2)
state_dict = {"model": model.state_dict()}
dcp.save(state_dict, checkpoint_id="outputs/checkpoint/step-5")  # as torchtitan's CheckpointManager would
with torch.no_grad():
    model.weight.add_(1.0)  # training moved on
step = 10
""", ["outputs/checkpoint", "ckpt"]),
    "accelerate": ("""
import safepoint
from tests.helpers_trainers import accelerate_train
accelerator = accelerate_train(3)
step = 3
""", ["ckpt"]),
}

RESUME = "# to resume"


@dataclass
class Trained:
    name: str
    work: Path
    catalog_url: str
    namespace: dict
    resume: str


@pytest.fixture(scope="module", params=list(TRAINERS))
def trained(request, tmp_path_factory, prefect_api):
    """The trainer snippet's lines up to its resume lines, run; what they sealed, ingested."""
    name = request.param
    [block] = [b for b in blocks() if b.trainer == name]
    lines = block.code.splitlines()
    train = "\n".join(line for line in lines if not line.rstrip().endswith(RESUME))
    resume = "\n".join(line for line in lines if line.rstrip().endswith(RESUME))
    assert resume, f"README.md:{block.line}: no '{RESUME}' line"
    work = tmp_path_factory.mktemp(f"readme-{name}")
    catalog_url = f"sqlite:///{work / 'catalog.db'}"
    prelude, roots = TRAINERS[name]
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(work)
        mp.setenv("SAFEPOINT_CATALOG_URL", catalog_url)
        mp.setenv("SAFEPOINT_HOME", str(work / "sp-home"))
        mp.syspath_prepend(str(ROOT))
        namespace: dict = {"__name__": f"readme_{name}"}
        exec(compile(prelude + "\n" + train, f"README.md:{block.line}", "exec"), namespace)  # noqa: S102
        for root in roots:
            assert cli.main(["watch", root, "--once", "--to", (work / "durable").as_uri()]) == 0, root
    return Trained(name, work, catalog_url, namespace, resume)


@pytest.mark.slow  # five trainers trained and ingested
def test_trainer_snippet_seals_what_it_saves_and_each_is_verified(trained):
    from safepoint.catalog.store import open_catalog

    views = open_catalog(trained.catalog_url).list_checkpoints("my-run")
    assert views and all(str(v.state) == "verified" for v in views), [(v.step, str(v.state)) for v in views]


@pytest.mark.slow
def test_trainer_snippet_resumes_from_a_restore(trained, monkeypatch):
    monkeypatch.chdir(trained.work)
    monkeypatch.setenv("SAFEPOINT_CATALOG_URL", trained.catalog_url)
    exec(compile(trained.resume, f"README.md ({trained.name}, resume)", "exec"), trained.namespace)  # noqa: S102
    assert (trained.work / "resume" / "COMMITTED").is_file()
