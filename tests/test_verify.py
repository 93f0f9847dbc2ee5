"""Pure verification decisions: per-file status and the checkpoint outcome they imply."""

import pytest

from safepoint.core.format import FileEntry
from safepoint.core.states import CheckpointState as CS
from safepoint.core.verify import FileStatus as F
from safepoint.core.verify import check_file, outcome_of

E = FileEntry("a", 10, "ab" * 32)


def never():
    raise AssertionError("the digest must not be computed when the size already differs")


@pytest.mark.parametrize("size,digest,expected", [
    (None, never, F.MISSING),
    (9, never, F.SIZE_MISMATCH),
    (11, never, F.SIZE_MISMATCH),
    (10, lambda: "ab" * 32, F.OK),
    (10, lambda: "cd" * 32, F.HASH_MISMATCH),
])
def test_check_file(size, digest, expected):
    assert check_file(E, size, digest) is expected


@pytest.mark.parametrize("statuses,error,expected", [
    ([], None, CS.VERIFIED),
    ([F.OK, F.OK], None, CS.VERIFIED),
    ([F.OK, F.MISSING], None, CS.INCOMPLETE),
    ([F.MISSING, F.HASH_MISMATCH], None, CS.CORRUPT),
    ([F.SIZE_MISMATCH], None, CS.CORRUPT),
    ([F.UNSAFE_PATH, F.OK], None, CS.CORRUPT),
    ([F.OK], "marker without manifest", CS.CORRUPT),
])
def test_outcome_of(statuses, error, expected):
    assert outcome_of(statuses, error) is expected
