"""The consistency rules as tables: one tensor across two steps, the stale/duplicate rules, the torn rule."""

from __future__ import annotations

import pytest

from safepoint.rules.consistency import (
    DUPLICATE,
    MAX_NAMED,
    STALE_OPTIMIZER,
    STALE_WEIGHTS,
    TORN,
    Change,
    Counters,
    consistency_findings,
    is_step_counter,
    tensor_change,
)


def row(name: str, head: str | None = "h", digest: str | None = "d", role: str = "parameter", **stats) -> dict:
    base = {"name": name, "role": role, "dtype": "float32", "shape": [4], "norm": 1.0, "max_abs": 0.5,
            "nan_count": 0, "inf_count": 0, "value": None, "head": head, "digest": digest}
    return {**base, **stats}


@pytest.mark.parametrize("old, new, expected", [
    (row("w", "a", "x"), row("w", "b", None), Change.MOVED),                       # heads differ
    (row("w", "a", "x"), row("w", "a", "x"), Change.SAME),                         # whole digests equal
    (row("w", "a", "x"), row("w", "a", "y"), Change.MOVED),                        # same head, tail moved
    (row("w", "a", None), row("w", "a", "y"), Change.SAME_BY_STATS),               # older: no whole digest
    (row("w", "a", None), row("w", "a", "y", norm=1.5), Change.MOVED),             # ... and the stats differ
    (row("w", "a", None), row("w", "a", "y", value=2.0), Change.MOVED),
    (row("w", None, None), row("w", "a", "y"), Change.UNKNOWN),                     # a row from before 0003
    (row("w", "a", "x"), row("w", "a", "x", shape=[2, 2]), Change.MOVED),          # same bytes, other tensor
    (row("w", "a", "x"), row("w", "a", "x", dtype="int32"), Change.MOVED),
])
def test_tensor_change(old, new, expected):
    assert tensor_change(old, new) is expected


@pytest.mark.parametrize("name, expected", [
    ("optimizer.state.0.step", True), ("optimizer_states.0.state.3.step", True),
    ("optim.state.layers.0.weight.step", True), ("f.pt:optimizer.state.0.step", True),
    ("optimizer.state.0.exp_avg", False), ("model.step", False), ("train_state.step", False),
])
def test_is_step_counter(name, expected):
    assert is_step_counter(name) is expected


def Par(name: str, h: str) -> dict:  # a parameter with head and whole digest h
    return row(f"model.{name}", h, h)


def Opt(name: str, h: str) -> dict:  # optimizer state
    return row(f"optimizer.state.{name}", h, h, role="optimizer_state")


STEP = Opt("0.step", "s1")
BASE = [Par("a", "a1"), Par("b", "b1"), Opt("0.exp_avg", "m1"), Opt("0.exp_avg_sq", "v1"), STEP]


def ck(a: str, b: str, m: str, v: str, step: str) -> list[dict]:
    """Two parameters, their Adam moments and step counter, by head (= whole digest)."""
    return [Par("a", a), Par("b", b), Opt("0.exp_avg", m), Opt("0.exp_avg_sq", v), Opt("0.step", step)]


NO_DIGESTS = [dict(r, head=None, digest=None) if r["role"] == "optimizer_state" else r for r in BASE]


def _run(current, baseline=BASE, *, counters=None, before=None):
    counters = counters or Counters(catalog=20)
    before = before or Counters(catalog=10)
    return consistency_findings(current, {r["name"]: r for r in baseline}, counters=counters, before=before)


@pytest.mark.parametrize("current, rule, named, baseline", [(*case, BASE)[:4] for case in [
    # a correct step: everything moved
    (ck("a2", "b2", "m2", "v2", "s2"), None, ()),
    # NeMo-RL#4183: the first step's optimizer state (step counter included) saved again
    ([Par("a", "a2"), Par("b", "b2"), Opt("0.exp_avg", "m1"), Opt("0.exp_avg_sq", "v1"), STEP], STALE_OPTIMIZER,
     ("optimizer.state.0.exp_avg", "optimizer.state.0.exp_avg_sq")),
    # weights from before optimizer.step(), optimizer after it, against the step that wrote those weights
    (ck("a1", "b1", "m2", "v2", "s2"), STALE_WEIGHTS,
     ("model.a", "model.b")),
    # the same bytes under a later step
    (BASE, DUPLICATE, ("model.a", "model.b", "optimizer.state.0.exp_avg", "optimizer.state.0.exp_avg_sq")),
    # half the layers frozen: those parameters are identical, the rest moved, the optimizer moved
    (ck("a1", "b2", "m2", "v2", "s2"), None, ()),
    # one optimizer tensor unchanged (a parameter with no gradient since): not every tensor, not stale
    (ck("a2", "b2", "m1", "v2", "s2"), None, ()),
    # only the step counter moved: still a stale optimizer (counters are the torn rule's)
    (ck("a2", "b2", "m1", "v1", "s2"), STALE_OPTIMIZER,
     ("optimizer.state.0.exp_avg", "optimizer.state.0.exp_avg_sq")),
    # new optimizer state (a layer unfrozen) counts as moved
    ([*ck("a2", "b2", "m1", "v1", "s1"), Opt("1.exp_avg", "n1")], None, ()),
    # a baseline from before digests were recorded: unknown, never called unchanged
    ([Par("a", "a2"), Par("b", "b2"), Opt("0.exp_avg", "m1"), Opt("0.exp_avg_sq", "v1")], None, (), NO_DIGESTS),
    # weights only, same bytes: duplicate
    ([Par("a", "a1"), Par("b", "b1")], DUPLICATE, ("model.a", "model.b")),
]])
def test_stale_and_duplicate_rules(current, rule, named, baseline):
    found = _run(current, baseline)
    assert [f.rule for f in found] == ([rule] if rule else [])
    if rule:
        f = found[0]
        assert f.tensors == named and f.count == len(named) and f.steps == (10, 20)
        assert "step 10" in f.message and "step 20" in f.message
        assert all(n in f.message for n in named)


def test_duplicate_message_names_the_step():
    (f,) = _run(BASE)
    assert f.message.startswith("duplicate of step 10:")


def test_identity_by_stats_is_said():
    baseline = [dict(r, digest=None) for r in BASE]  # heads only: step 10 was not hashed whole
    current = [Par("a", "a2"), Par("b", "b2"), Opt("0.exp_avg", "m1"), Opt("0.exp_avg_sq", "v1")]
    (f,) = _run(current, baseline)
    assert f.rule == STALE_OPTIMIZER and "judged identical by equal norm" in f.message


def test_findings_name_a_bounded_list_and_count_all():
    params = [Par(f"p{i}", f"x{i}") for i in range(12)]
    (f,) = _run(params, params)
    assert f.rule == DUPLICATE and f.count == 12 and len(f.tensors) == MAX_NAMED and "and 7 more" in f.message


@pytest.mark.parametrize("now, before, expected", [
    # consistent: every counter moved by 10
    (Counters(20, optimizer=20, scheduler=20, trainer=20), Counters(10, 10, 10, 10), []),
    # nvidia-resiliency-ext#376: Adam step one ahead of the trainer's global_step in the same checkpoint
    (Counters(1, optimizer=2, trainer=1), None, [("trainer global_step", "step 1", "2", "global_step 1")]),
    # a fp16 GradScaler skipped 3 steps: the optimizer lags the trainer, which is normal
    (Counters(20, optimizer=17, scheduler=20, trainer=20), Counters(10, 10, 10, 10), []),
    # the optimizer advanced more than the catalog step
    (Counters(20, optimizer=25), Counters(10, optimizer=10), [("catalog step", "+15", "+10")]),
    # ... and more than the scheduler, which stepped with it before
    (Counters(20, optimizer=25, scheduler=20), Counters(10, 10, 10),
     [("scheduler last_epoch", "+15", "+10"), ("catalog step", "+15", "+10")]),
    # a per-epoch scheduler (not equal to Adam step before): not compared
    (Counters(20, optimizer=20, scheduler=3), Counters(10, 10, 2), []),
    # a catalog step that counts samples: not compared
    (Counters(2000, optimizer=25), Counters(1000, optimizer=10), []),
    # no optimizer counter: nothing to say
    (Counters(20, trainer=20), Counters(10, trainer=10), []),
])
def test_torn_rule(now, before, expected):
    found = [f for f in consistency_findings([], {}, counters=now, before=before) if f.rule == TORN]
    assert len(found) == len(expected)
    for f, words in zip(found, expected):
        assert words[0] in f.tensors and f.message.startswith("torn:")
        assert all(w in f.message for w in words[1:])
        assert f"step {now.catalog}" in f.message


# ------------------------------------------------------------------------------------ gathering the inputs

def _stat(name: str, value: float | None, file: str = "last.ckpt"):
    from safepoint.validation.audit import TensorStat

    return TensorStat(name=name, file=file, dtype="float32", shape=(), numel=1, norm=0.0, max_abs=0.0, nan_count=0,
                      inf_count=0, value=value)


@pytest.mark.parametrize("stats, values, recorded, expected", [
    # torch >= 2.0: Adam `step` is a tensor; the largest is the optimizer's count (a lagging parameter is less)
    ([_stat("optimizer_states.0.state.0.step", 5.0), _stat("optimizer_states.0.state.1.step", 4.0)],
     {"lr_schedulers.0.last_epoch": 5}, [5], Counters(7, optimizer=5.0, scheduler=5.0, trainer=5.0)),
    # older torch: a plain float; HF's scheduler.pt holds `last_epoch` at its top level
    ([], {"state.0.step": 3.0, "last_epoch": 3}, [], Counters(7, optimizer=3.0, scheduler=3.0)),
    # two schedulers that disagree: no scheduler counter; a `step` that is a parameter is not Adam's
    ([_stat("model.step", 9.0)], {"lr_schedulers.0.last_epoch": 5, "lr_schedulers.1.last_epoch": 1}, [],
     Counters(7)),
    # a recorded step that is not a number is not a counter
    ([], {}, ["last"], Counters(7)),
])
def test_counters_of(stats, values, recorded, expected):
    from safepoint.validation.consistency import counters_of
    from safepoint.validation.layouts import RecordedStep
    from safepoint.validation.roles import Rules

    rules = Rules()
    roles = {(s.file, s.name): rules.role(s.file, s.name) for s in stats}
    got = counters_of(stats, values, [RecordedStep("last.ckpt", "global_step", v) for v in recorded], roles, 7)
    assert got == expected


def test_consistency_line():
    from safepoint.validation.report import consistency_line

    assert consistency_line({"checks": {}}) is None  # a report from before the rules
    first = {"checks": {"consistency": {"against": None, "findings": []}, "counters": {"catalog": 1, "optimizer": 1.0}}}
    assert consistency_line(first) == ("no earlier verified checkpoint (step counters only): nothing stale, "
                                       "duplicated or torn; counters: catalog 1, optimizer 1")
    dup = {"checks": {"consistency": {"against": "r/2", "findings": [{"rule": "duplicate", "steps": [2, 4]}]}}}
    assert consistency_line(dup) == "against r/2: duplicate (2 -> 4)"


# ------------------------------------------------------------------------------ names are not trusted alone

def _two_layers(a: str, b: str, ma: str, mb: str) -> list[dict]:
    """Two equal-shape layers and their Adam moments."""
    return [Par("l0", a), Par("l1", b), Opt("0.exp_avg", ma), Opt("1.exp_avg", mb)]


def test_stale_optimizer_with_equal_shape_entries_swapped_is_stale():
    before = _two_layers("a1", "b1", "m0", "m1")
    swapped = _two_layers("a2", "b2", "m1", "m0")   # step 10's moments, state.0 <-> state.1
    (f,) = _run(swapped, before)
    assert f.rule == STALE_OPTIMIZER and "under other names" in f.message
    assert set(f.tensors) == {"optimizer.state.0.exp_avg", "optimizer.state.1.exp_avg"}


@pytest.mark.parametrize("current", [
    _two_layers("a2", "b2", "m1", "m2"),   # one moved: no multiset match
    _two_layers("a2", "b2", "m1", "m1"),   # the same earlier tensor cannot match twice
])
def test_a_partial_or_repeated_match_is_not_stale(current):
    assert _run(current, _two_layers("a1", "b1", "m0", "m1")) == []


# ------------------------------------------------------------------------------ fp16 GradScaler skips

@pytest.mark.parametrize("now, before, skipped", [
    # scale halved, Adam step unchanged, the trainer counted the step: a skipped step
    (Counters(20, optimizer=10.0, trainer=20, scaler=32768.0), Counters(10, optimizer=10.0, trainer=10,
                                                                        scaler=65536.0), True),
    # the same bytes with the same scale: the dirty-buffer duplicate, still caught
    (Counters(20, optimizer=10.0, trainer=20, scaler=65536.0), Counters(10, optimizer=10.0, trainer=10,
                                                                        scaler=65536.0), False),
    # scale went down but the optimizer stepped: not a skip, the unchanged state is stale
    (Counters(20, optimizer=11.0, trainer=20, scaler=32768.0), Counters(10, optimizer=10.0, trainer=10,
                                                                        scaler=65536.0), False),
    # no scaler at all
    (Counters(20, optimizer=10.0, trainer=20), Counters(10, optimizer=10.0, trainer=10), False),
])
def test_a_gradscaler_skipped_step_is_not_duplicate(now, before, skipped):
    rules = [f.rule for f in _run(BASE, counters=now, before=before)]
    assert (DUPLICATE not in rules) is skipped
