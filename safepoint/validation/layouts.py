"""Which trainer wrote a snapshot, and the step it recorded inside, checked against the catalog's step.

Recognised as written (no conversion): Hugging Face `Trainer` `checkpoint-N/` (`trainer_state.json`
with `global_step`), Lightning `.ckpt` files (`global_step`), DCP folders (`.metadata`; torchtitan's
`train_state.step`), and Accelerate `save_state` folders (`random_states_*.pkl`, `optimizer.bin`).
The step a trainer wrote is the strongest evidence of what a checkpoint is: a folder committed under
the wrong step would be restored as the wrong point of the run. Pure functions of file names and of
the values validation read.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["ACCELERATE", "DCP", "HF_TRAINER", "LIGHTNING", "PLAIN", "STEP_LEAVES", "RecordedStep", "detect_layout",
           "step_mismatches"]

HF_TRAINER, LIGHTNING, DCP, ACCELERATE, PLAIN = "huggingface-trainer", "lightning", "dcp", "accelerate", "plain"
TRAINER_STATE = "trainer_state.json"
# Leaves that hold the step a trainer recorded, per layout: (file glob, dotted name).
STEP_LEAVES: dict[str, tuple[tuple[str, str], ...]] = {
    LIGHTNING: (("*.ckpt", "global_step"),),
    DCP: (("*.metadata", "train_state.step"),),
}


@dataclass(frozen=True)
class RecordedStep:
    file: str
    key: str
    value: Any


def _base(rel: str) -> str:
    return rel.rsplit("/", 1)[-1]


def detect_layout(files: Iterable[str]) -> str:
    """The trainer layout of a snapshot's file list."""
    bases = {_base(f) for f in files}
    if TRAINER_STATE in bases:
        return HF_TRAINER
    if any(b.endswith(".ckpt") for b in bases):
        return LIGHTNING
    if any(fnmatch.fnmatchcase(b, "random_states_*.pkl") for b in bases) or {"optimizer.bin", "scheduler.bin"} & bases:
        return ACCELERATE
    if ".metadata" in bases:
        return DCP
    return PLAIN


def is_step_leaf(layout: str, file: str, name: str) -> bool:
    return any(fnmatch.fnmatchcase(_base(file), pat) and name == key for pat, key in STEP_LEAVES.get(layout, ()))


def step_mismatches(layout: str, recorded: list[RecordedStep], step: int | None) -> list[tuple[RecordedStep, str]]:
    """(recorded, why) for each recorded step that contradicts the catalog's `step`. Pure.

    Several Lightning files in one folder (a flat ModelCheckpoint dirpath committed whole): the
    newest of them must be the catalog's step.
    """
    if step is None or not recorded:
        return []
    out: list[tuple[RecordedStep, str]] = []
    numbers: list[tuple[RecordedStep, int]] = []
    for r in recorded:
        v = r.value
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            out.append((r, f"{r.file}: {r.key} = {r.value!r} is not a step number"))
        else:
            numbers.append((r, v))
    if not numbers:
        return out
    if layout == LIGHTNING and len(numbers) > 1:
        r, v = max(numbers, key=lambda x: x[1])
        numbers = [(r, v)]
    for r, v in numbers:
        if v != step:
            out.append((r, f"{r.file}: {r.key} records step {v}, the catalog says step {step}"))
    return out
