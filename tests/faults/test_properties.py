"""Property-based tests of the pure decisions, over generated histories (hypothesis).

A stateful machine plays a run's history as training and the failures would: checkpoints are
committed, finish verified, invalid or corrupt, lose replicas to rot, get repaired, and retention
runs with a random policy at any moment. After every step the decisions must hold:

- resume_point never picks a checkpoint that is not verified with enough verified replicas, and
  never skips a newer one that qualifies;
- retention never deletes the newest verified checkpoint, a pinned or pending one, or anything
  older than a pending one, keeps two verified while two exist, and never leaves a run that had a
  good checkpoint without one;
- the reconciler's rules never remove a committed replica, never remove anything younger than the
  grace period, and only finish deleting what retention pruned;
- completeness is complete exactly when every expected rank delivered, and gives up only after
  the timeout.

Budget: bounded examples and steps, no deadline (CI machines are slow and shared).
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from safepoint.catalog.views import CheckpointView, ReplicaView
from safepoint.core.states import CheckpointState as CS
from safepoint.core.states import ReplicaState as RS
from safepoint.rules import retention
from safepoint.rules.completeness import Completeness, assess
from safepoint.rules.reconcile import Action, Found, Known, Remote, Settle, decide, plan_checkpoint
from safepoint.rules.resume import PENDING, is_good, resume_point

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
BUDGET = settings(max_examples=60, stateful_step_count=40, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

policies = st.one_of(
    st.builds(retention.KeepLastN, st.integers(0, 4)),
    st.builds(retention.KeepEveryNSteps, st.integers(1, 50)),
    st.builds(retention.KeepWithin, st.integers(0, 48).map(lambda h: timedelta(hours=h))),
    st.builds(retention.KeepPinnedOrTagged, st.one_of(st.none(), st.just(frozenset({"best"})))),
    st.builds(retention.KeepBestN, st.just("loss"), st.integers(0, 3), st.sampled_from(["min", "max"])),
).flatmap(lambda p: st.one_of(st.just(p), st.builds(lambda q: retention.AnyOf(p, q),
                                                    st.builds(retention.KeepLastN, st.integers(0, 2)))))


class History(RuleBasedStateMachine):
    """One run's checkpoints, as the catalog would hold them."""

    @initialize()
    def start(self) -> None:
        self.rows: dict[int, dict] = {}      # step -> mutable fields of a CheckpointView
        self.next_step = 0
        self.now = T0

    def _view(self, step: int) -> CheckpointView:
        r = self.rows[step]
        reps = tuple(ReplicaView(f"file:///d{i}/r/{step}", f"file:///d{i}", s, self.now if s is RS.VERIFIED else None)
                     for i, s in enumerate(r["replicas"]))
        return CheckpointView(id=step + 1, run="r", step=step, state=r["state"], local_path=None,
                              created_at=r["created"], total_bytes=100, pinned=r["pinned"], tags=r["tags"],
                              metrics=r["metrics"], parent=None, world_size=1, replicas=reps, version=r["version"])

    def views(self) -> list[CheckpointView]:
        return [self._view(s) for s in sorted(self.rows)]

    def _touch(self, step: int, **kw) -> None:
        self.rows[step].update(kw)
        self.rows[step]["version"] += 1

    @rule(steps=st.integers(1, 30), pinned=st.booleans(), tagged=st.booleans(), loss=st.floats(0, 10))
    def commit(self, steps: int, pinned: bool, tagged: bool, loss: float) -> None:
        self.now += timedelta(hours=1)
        self.next_step += steps
        self.rows[self.next_step] = {"state": CS.REPLICATING, "replicas": [RS.PENDING, RS.PENDING],
                                     "created": self.now, "pinned": pinned, "tags": ("best",) if tagged else (),
                                     "metrics": {"loss": loss}, "version": 1}

    def _pending(self) -> list[int]:
        return [s for s, r in self.rows.items() if r["state"] in PENDING]

    @precondition(lambda self: bool(self._pending()))
    @rule(data=st.data(), outcome=st.sampled_from(["verified", "verified", "invalid", "corrupt", "one_failed"]))
    def finish(self, data, outcome: str) -> None:
        step = data.draw(st.sampled_from(self._pending()))
        if outcome == "verified":
            self._touch(step, state=CS.VERIFIED, replicas=[RS.VERIFIED, RS.VERIFIED])
        elif outcome == "one_failed":
            self._touch(step, state=CS.VERIFIED, replicas=[RS.VERIFIED, RS.FAILED])
        elif outcome == "invalid":
            self._touch(step, state=CS.INVALID, replicas=[RS.VERIFIED, RS.VERIFIED])
        else:
            self._touch(step, state=CS.CORRUPT, replicas=[RS.FAILED, RS.FAILED])

    def _verified(self) -> list[int]:
        return [s for s, r in self.rows.items() if r["state"] is CS.VERIFIED]

    @precondition(lambda self: bool(self._verified()))
    @rule(data=st.data(), which=st.integers(0, 1), how=st.sampled_from([RS.CORRUPT, RS.MISSING]))
    def rot(self, data, which: int, how: RS) -> None:
        """A scrub finds a replica bad; with no verified copy left the checkpoint is corrupt."""
        step = data.draw(st.sampled_from(self._verified()))
        reps = list(self.rows[step]["replicas"])
        reps[which] = how
        state = CS.VERIFIED if RS.VERIFIED in reps else CS.CORRUPT
        self._touch(step, replicas=reps, state=state)

    @precondition(lambda self: any(RS.CORRUPT in r["replicas"] or RS.MISSING in r["replicas"]
                                   for r in self.rows.values() if r["state"] is not CS.PRUNED))
    @rule(data=st.data())
    def repair(self, data) -> None:
        """The reconciler re-replicates from a good copy, when one exists."""
        steps = [s for s, r in self.rows.items() if r["state"] in (CS.VERIFIED, CS.CORRUPT)
                 and RS.VERIFIED in r["replicas"] and (RS.CORRUPT in r["replicas"] or RS.MISSING in r["replicas"])]
        if not steps:
            return
        step = data.draw(st.sampled_from(steps))
        self._touch(step, replicas=[RS.VERIFIED if s in (RS.CORRUPT, RS.MISSING) else s
                                    for s in self.rows[step]["replicas"]])

    @rule(policy=policies, min_replicas=st.integers(1, 2))
    def prune(self, policy, min_replicas: int) -> None:
        self.now += timedelta(minutes=30)
        before = self.views()
        newest_verified = max((c.step for c in before if c.state is CS.VERIFIED), default=None)
        good_before = [c for c in before if is_good(c, max(1, min_replicas))]
        plan = retention.plan(before, policy, self.now, min_replicas=min_replicas)
        deleted = {c.step for c in plan.delete}
        verified = [c for c in before if c.state is CS.VERIFIED]
        newest_pending = max((c.step for c in before if c.state in PENDING), default=None)
        assert newest_verified not in deleted, "deleted the newest verified checkpoint"
        assert not {c.step for c in before if c.pinned} & deleted, "deleted a pinned checkpoint"
        assert not {c.step for c in before if c.state in PENDING} & deleted, "deleted a pending checkpoint"
        if newest_pending is not None:
            assert all(s > newest_pending for s in deleted), "deleted something older than a pending checkpoint"
        kept_verified = [c for c in verified if c.step not in deleted]
        assert len(kept_verified) >= min(2, len(verified)), "kept fewer than two verified"
        if good_before:
            assert any(c.step not in deleted for c in good_before), "deleted every good checkpoint"
        # Retention re-checked against its own fresh plan deletes a subset (catalog.mark_pruned).
        assert retention.still_deletable(plan)(before) <= {c.id for c in plan.delete}
        for s in deleted:
            self._touch(s, state=CS.PRUNED, replicas=[RS.DELETED for _ in self.rows[s]["replicas"]])

    @invariant()
    def resume_point_is_sound(self) -> None:
        if not hasattr(self, "rows"):
            return
        views = self.views()
        with pytest.raises(ValueError):  # a resume point needs at least one verified copy (issue 14)
            resume_point(views, min_replicas=0)
        for k in (1, 2):
            d = resume_point(views, min_replicas=k)
            ok = [c for c in views if c.state is CS.VERIFIED
                  and sum(r.state is RS.VERIFIED for r in c.replicas) >= k]
            if d.chosen is None:
                assert not ok
            else:
                assert d.chosen.state is CS.VERIFIED
                assert sum(r.state is RS.VERIFIED for r in d.chosen.replicas) >= k
                assert d.chosen.step == max(c.step for c in ok)
                assert all(c.step > d.chosen.step for c, _why in d.passed_over)

TestHistory = History.TestCase
TestHistory.settings = BUDGET


# -- completeness ------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(world=st.integers(1, 12), data=st.data(), timeout_s=st.integers(1, 1000), now_s=st.integers(0, 3000))
def test_completeness(world: int, data, timeout_s: int, now_s: int) -> None:
    expected = data.draw(st.one_of(st.none(), st.sets(st.integers(0, world - 1), min_size=1)))
    delivered = data.draw(st.dictionaries(st.integers(0, world + 2), st.integers(0, 2000), max_size=world + 3))
    got = {r: T0 + timedelta(seconds=t) for r, t in delivered.items()}
    a = assess(world, got, T0 + timedelta(seconds=now_s), timedelta(seconds=timeout_s), expected=expected)
    exp = set(range(world)) if expected is None else expected
    have = exp & set(got)
    assert a.complete == (have == exp)
    assert set(a.missing) == exp - have
    if a.status is Completeness.INCOMPLETE:
        first = min(got[r] for r in have)
        assert T0 + timedelta(seconds=now_s) >= first + timedelta(seconds=timeout_s)
    if not have:
        assert a.status is Completeness.WAITING and a.deadline is None


# -- the reconciler's rules --------------------------------------------------------------------

remotes = st.builds(Remote, st.sampled_from(list(Found)), st.sampled_from([None, "a", "b"]),
                    st.one_of(st.none(), st.floats(0, 10_000)), st.sampled_from([None, True, False]), st.booleans())
knowns = st.builds(Known, st.one_of(st.none(), st.sampled_from(list(CS))), st.sampled_from([None, "a", "b"]),
                   st.one_of(st.none(), st.sampled_from(list(RS))), st.one_of(st.none(), st.floats(0, 10_000)))


@settings(max_examples=500, deadline=None)
@given(remote=remotes, known=knowns, grace=st.floats(0, 5000))
def test_reconcile_rules_never_lose_data(remote: Remote, known: Known, grace: float) -> None:
    action = decide(remote, known, grace)
    if action is Action.REMOVE_PARTIAL:
        assert remote.found is Found.PARTIAL, "removed something with a marker"
        ages = [a for a in (remote.age_s, known.replica_age_s if known.replica is RS.PENDING else None)
                if a is not None]
        assert ages and min(ages) >= grace, "removed a partial younger than the grace period"
        assert known.replica is not RS.VERIFIED or known.state is CS.PRUNED
    if action is Action.FINISH_PRUNE:
        assert known.state is CS.PRUNED, "deleted a replica retention did not prune"
    if remote.found in (Found.COMMITTED, Found.BROKEN) and known.state is not CS.PRUNED:
        assert action not in (Action.REMOVE_PARTIAL, Action.FINISH_PRUNE), "deleted a committed replica"
    if action in (Action.ADOPT, Action.CONFIRM):
        assert remote.found is Found.COMMITTED   # and the reconciler re-hashes every byte before recording
    if remote.found is Found.PARTS:
        assert action in (Action.NONE, Action.FINISH_PRUNE)


@settings(max_examples=300, deadline=None)
@given(state=st.sampled_from(list(CS)), age=st.floats(0, 10_000), verified=st.integers(0, 3),
       grace=st.floats(0, 5000), world=st.integers(1, 4))
def test_reconcile_never_validates_without_a_verified_replica(state, age, verified, grace, world) -> None:
    s = plan_checkpoint(state, age, verified, grace, world)
    if s is Settle.FINISH:
        assert verified >= 1, "would validate (and maybe verify) a checkpoint with no verified replica"
    if s in (Settle.FINISH, Settle.ABANDON) and state in PENDING - {CS.COMMITTED}:
        assert age >= grace and world == 1, "took over an ingest that may still be running"
    if state is CS.PRUNED:
        assert s is Settle.NONE
