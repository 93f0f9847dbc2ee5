"""The pure decisions of a restore (safepoint.restore_plan), as tables."""

from __future__ import annotations

import pytest

from safepoint.rules.restore import (
    Attempt,
    Outcome,
    Source,
    TargetAction,
    Verdict,
    checkpoint_verdict,
    file_verdict,
    replica_findings,
    reuse_plan,
    source_order,
    target_action,
)

S3A = ("s3://a/ckpt/r/7", "s3://a/ckpt")
S3B = ("s3://b/ckpt/r/7", "s3://b/ckpt")
NFS = ("file:///nfs/ckpt/r/7", "file:///nfs/ckpt")


@pytest.mark.parametrize(("local", "replicas", "prefer", "forced", "expected"), [
    # the local copy first, then catalog order
    ("/nvme/r/7", [S3A, NFS], [], [], ["/nvme/r/7", "s3://a/ckpt/r/7", "file:///nfs/ckpt/r/7"]),
    (None, [S3A, NFS], [], [], ["s3://a/ckpt/r/7", "file:///nfs/ckpt/r/7"]),
    # configured preference by prefix; unmatched ones last, in catalog order
    (None, [S3A, S3B, NFS], ["file:///nfs"], [], ["file:///nfs/ckpt/r/7", "s3://a/ckpt/r/7", "s3://b/ckpt/r/7"]),
    (None, [S3A, S3B, NFS], ["s3://b", "file://"], [],
     ["s3://b/ckpt/r/7", "file:///nfs/ckpt/r/7", "s3://a/ckpt/r/7"]),
    ("/nvme/r/7", [S3A, S3B], ["s3://b"], [], ["/nvme/r/7", "s3://b/ckpt/r/7", "s3://a/ckpt/r/7"]),
    # --from forces exactly its sources, in its order; base or snapshot URL both match
    ("/nvme/r/7", [S3A, S3B], [], ["s3://b/ckpt"], ["s3://b/ckpt/r/7"]),
    ("/nvme/r/7", [S3A, S3B], [], ["s3://b/ckpt/r/7", "s3://a"], ["s3://b/ckpt/r/7", "s3://a/ckpt/r/7"]),
    ("/nvme/r/7", [S3A], [], ["file:///nvme/r/7"], ["/nvme/r/7"]),
    # a prefix must end at a '/': s3://a does not match s3://ab
    (None, [("s3://ab/x/r/7", "s3://ab/x")], [], ["s3://a"], ["s3://a/r/7"]),
    # an unknown --from URL is read as a destination base, or a snapshot URL of this checkpoint
    (None, [S3A], [], ["s3://elsewhere/p"], ["s3://elsewhere/p/r/7"]),
    (None, [S3A], [], ["s3://elsewhere/p/r/7"], ["s3://elsewhere/p/r/7"]),
])
def test_source_order(local, replicas, prefer, forced, expected):
    got = source_order(local, replicas, run="r", step=7, prefer=prefer, forced=forced)
    assert [s.url for s in got] == expected
    assert all(s.cataloged == (s.url != "s3://elsewhere/p/r/7" and s.url != "s3://a/r/7") for s in got)
    assert [s.local for s in got] == [u.startswith("/") for u in expected]


P0, P1 = ("/n0/r/step-7", "a" * 64), ("/n1/r/step-7", "b" * 64)


@pytest.mark.parametrize(("parts", "prefer", "forced", "expected"), [
    # a multi-node checkpoint: every local part first (in rank order), each held to its part digest
    ([P0, P1], [], [], [("/n0/r/step-7", "a" * 64), ("/n1/r/step-7", "b" * 64), ("s3://a/ckpt/r/7", None),
                        ("file:///nfs/ckpt/r/7", None)]),
    ([P0, P1], ["file:///nfs"], [], [("/n0/r/step-7", "a" * 64), ("/n1/r/step-7", "b" * 64),
                                     ("file:///nfs/ckpt/r/7", None), ("s3://a/ckpt/r/7", None)]),
    ([P0, P0], [], [], [("/n0/r/step-7", "a" * 64), ("s3://a/ckpt/r/7", None), ("file:///nfs/ckpt/r/7", None)]),
    # --from a replica: the parts are not read
    ([P0, P1], [], ["s3://a"], [("s3://a/ckpt/r/7", None)]),
    ([P0, P1], [], ["file:///n1/r/step-7"], [("/n1/r/step-7", "b" * 64)]),
])
def test_source_order_with_parts(parts, prefer, forced, expected):
    got = source_order(None, [S3A, NFS], run="r", step=7, prefer=prefer, forced=forced, parts=parts)
    assert [(s.url, s.part) for s in got] == expected
    assert [s.local for s in got] == [p is not None for _u, p in expected]


@pytest.mark.parametrize(("names", "committed_as", "state", "force", "expected"), [
    ([], None, False, False, TargetAction.FRESH),
    ([], None, False, True, TargetAction.FRESH),
    (["a.pt", "COMMITTED", "MANIFEST.json"], ("r", 7), False, False, TargetAction.PRESENT),
    (["a.pt", ".safepoint-tmp-restore.json"], None, True, False, TargetAction.RESUME),
    (["a.pt", "COMMITTED", "MANIFEST.json"], ("r", 6), False, False, TargetAction.REFUSE),
    (["a.pt", "COMMITTED", "MANIFEST.json"], ("other", 7), True, False, TargetAction.REFUSE),
    (["notes.txt"], None, False, False, TargetAction.REFUSE),
    (["notes.txt"], None, False, True, TargetAction.CLEAR),
    (["a.pt", "COMMITTED"], ("r", 6), False, True, TargetAction.CLEAR),
])
def test_target_action(names, committed_as, state, force, expected):
    assert target_action(names, committed_as=committed_as, restore_state=state, want=("r", 7), force=force) \
        is expected


@pytest.mark.parametrize(("on_disk", "rehash", "fetch"), [
    ({}, [], ["a", "b", "c"]),
    ({"a": 10, "b": 20, "c": 30}, ["a", "b", "c"], []),
    ({"a": 10, "b": 19, "c": None}, ["a"], ["b", "c"]),   # wrong size or absent: fetched without hashing
    ({"a": 11, "zz": 5}, [], ["a", "b", "c"]),
])
def test_reuse_plan(on_disk, rehash, fetch):
    assert reuse_plan({"a": 10, "b": 20, "c": 30}, on_disk) == (rehash, fetch)


A, B, L = Source("s3://a", "s3://a/r/7"), Source("s3://b", "s3://b/r/7"), Source("/n/r/7", "/n/r/7", local=True)
OK, BAD, MISS, ERR = Outcome.OK, Outcome.BAD, Outcome.MISSING, Outcome.ERROR


@pytest.mark.parametrize(("outcomes", "sources", "expected"), [
    ([OK], 2, Verdict.WHOLE),
    ([BAD, OK], 2, Verdict.WHOLE),
    ([BAD], 2, None),                  # another source is left to try
    ([BAD, MISS], 2, Verdict.NO_COPY),
    ([BAD, ERR], 2, Verdict.UNREADABLE),  # an unreadable copy might be good: never a fallback
    ([ERR, ERR], 2, Verdict.UNREADABLE),
    ([], 0, Verdict.NO_COPY),
])
def test_file_verdict(outcomes, sources, expected):
    assert file_verdict([Attempt(A, o) for o in outcomes], sources) is expected


@pytest.mark.parametrize(("files", "expected"), [
    ([], Verdict.WHOLE),
    ([Verdict.WHOLE, Verdict.WHOLE], Verdict.WHOLE),
    ([Verdict.WHOLE, Verdict.UNREADABLE], Verdict.UNREADABLE),
    ([Verdict.UNREADABLE, Verdict.NO_COPY], Verdict.NO_COPY),  # one file bad everywhere is proof enough
])
def test_checkpoint_verdict(files, expected):
    assert checkpoint_verdict(files) is expected


def test_replica_findings():
    attempts = {
        "a.pt": [Attempt(A, MISS, "missing"), Attempt(B, OK)],
        "b.pt": [Attempt(A, BAD, "BLAKE3 mismatch"), Attempt(B, ERR, "reset")],
        "c.pt": [Attempt(L, BAD, "BLAKE3 mismatch"), Attempt(B, OK)],
        "d.pt": [Attempt(Source("s3://x", "s3://x/r/7", cataloged=False), BAD, "size")],
    }
    # corrupt wins over missing; errors are not findings; the local copy and uncataloged sources are no replicas
    assert replica_findings(attempts) == {A: ("corrupt", "b.pt: BLAKE3 mismatch")}
    assert replica_findings({"a.pt": [Attempt(B, MISS, "missing")]}) == {B: ("missing", "a.pt: missing")}
