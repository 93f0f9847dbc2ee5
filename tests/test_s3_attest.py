"""A replica attested by the store: S3 checks each request's checksum (CRC32 by default, or
`checksum = "SHA256"`) as the bytes arrive and returns it with HeadObject, so the upload needs no
read-back (proof "s3-crc32", "s3-sha256"); with `checksum = "none"`, or where the store has nothing
to show, every byte is read back as before (proof "read-back").
Against a real SeaweedFS (what it honours: bench/s3_checksums.py). Here each test starts with a store
that has already earned its trust (no read-back audits); how it is earned, and lost:
tests/test_hostile_round4_store.py."""

from __future__ import annotations

import os

import pytest

from safepoint import commit
from safepoint.catalog.store import open_catalog
from safepoint.core.config import Config
from safepoint.core.format import FileEntry
from safepoint.core.states import ReplicaState
from safepoint.destinations import attestation, open_destination
from safepoint.destinations.s3 import S3Destination
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops.replicate import replicate
from safepoint.ops.steps import register, replicate_to

pytestmark = pytest.mark.s3

MiB = 1024 * 1024
PARTS = {"part_size": 5 * MiB, "max_parts_in_flight": 3, "read_window": 2}


@pytest.fixture(autouse=True)
def earned(monkeypatch):
    """A fresh process whose stores need no audit read-back (the probe still decides)."""
    monkeypatch.setattr(attestation, "TRUST_BYTES", 0)
    monkeypatch.setattr(attestation, "AUDIT_FRACTION", 0.0)
    attestation.forget()
    yield
    attestation.forget()


@pytest.fixture
def snapshot(tmp_path):
    """A multipart file (3 parts, the last partial), a single-PUT file above 1 MiB, and a tiny one."""
    d = tmp_path / "local" / "att"
    d.mkdir(parents=True)
    (d / "big.bin").write_bytes(os.urandom(12 * MiB + 7))
    (d / "mid.bin").write_bytes(os.urandom(3 * MiB))
    (d / "meta.json").write_bytes(b'{"step": 3}')
    commit(d, "att", 3)
    return LocalSnapshot.open(d)


def s3dest(env, prefix: str, **options) -> S3Destination:
    dest = open_destination(env.url(prefix), {**PARTS, **options}, retries=False)  # the backend itself
    assert isinstance(dest, S3Destination)
    return dest


def no_read_back(dest: S3Destination) -> list[str]:
    """Make the read-back fail loudly; returns the files it was asked for."""
    asked: list[str] = []

    def digest(run, step, relpath):
        asked.append(relpath)
        return "0" * 64  # a wrong hash: any file read back fails to verify

    dest.digest = digest  # type: ignore[method-assign]
    return asked


@pytest.mark.parametrize("algo", ["SHA256", "CRC32"])
def test_a_checksum_checked_by_the_store_stands_for_the_read_back(s3_env, snapshot, algo):
    dest = s3dest(s3_env, f"att-{algo.lower()}", checksum=algo)
    asked = no_read_back(dest)
    result = replicate(snapshot, dest)
    assert result.state is ReplicaState.VERIFIED, result.error
    assert asked == []
    proof = f"s3-{algo.lower()}"
    assert result.proofs == {"big.bin": proof, "mid.bin": proof, "meta.json": proof}
    assert result.proof == proof
    head = s3_env.server.client().head_object(Bucket=s3_env.bucket, ChecksumMode="ENABLED",
                                              Key=s3_env.key(f"att-{algo.lower()}/att/3/big.bin"))
    assert head[f"Checksum{algo}"].endswith("-3")  # composite, over the 3 parts


def test_by_default_the_store_attests_crc32(s3_env, snapshot):
    """No `checksum` set: SeaweedFS refuses a wrong CRC32, so CRC32 goes with every request and no byte
    is read back."""
    dest = s3dest(s3_env, "auto")
    assert dest.tuning.checksum == "AUTO"
    asked = no_read_back(dest)
    result = replicate(snapshot, dest)
    assert result.state is ReplicaState.VERIFIED, result.error
    assert asked == [] and result.proof == "s3-crc32"
    head = s3_env.server.client().head_object(Bucket=s3_env.bucket, ChecksumMode="ENABLED",
                                              Key=s3_env.key("auto/att/3/big.bin"))
    assert head["ChecksumCRC32"].endswith("-3")


@pytest.mark.parametrize("off", ["none", "off", False])
def test_without_a_checksum_every_byte_is_read_back(s3_env, snapshot, off):
    dest = s3dest(s3_env, "plain", checksum=off)
    assert dest.tuning.checksum is None
    result = replicate(snapshot, dest)
    assert result.state is ReplicaState.VERIFIED, result.error
    assert result.proof == "read-back"
    head = s3_env.server.client().head_object(Bucket=s3_env.bucket, ChecksumMode="ENABLED",
                                              Key=s3_env.key("plain/att/3/big.bin"))
    assert not any(k.startswith("Checksum") and k != "ChecksumType" for k in head)  # nothing was sent
    other = s3dest(s3_env, "plain2", checksum=off)
    asked = no_read_back(other)
    assert replicate(snapshot, other).state is ReplicaState.CORRUPT  # the (sabotaged) read-back decided
    assert sorted(asked) == ["big.bin", "meta.json", "mid.bin"]


def test_a_store_that_keeps_no_checksum_falls_back_to_the_read_back(s3_env, snapshot):
    """Objects replaced behind the upload's back (here: the same size, other bytes, no checksum) are not
    attested: the stored checksum is not the one sent, so the replica is read back and found corrupt."""
    dest = s3dest(s3_env, "swap", checksum="SHA256")
    entry = next(e for e in snapshot.manifest.files if e.path == "mid.bin")
    assert dest.upload("att", 3, entry, snapshot.path_of("mid.bin")) == entry.blake3
    client = s3_env.server.client()
    client.put_object(Bucket=s3_env.bucket, Key=s3_env.key("swap/att/3/mid.bin"), Body=os.urandom(entry.size))
    assert dest.attest("att", 3, "mid.bin", entry.size) is None
    assert dest.digest("att", 3, "mid.bin") != entry.blake3  # what the read-back then finds


def test_attest_is_only_for_what_this_destination_just_uploaded(s3_env, snapshot):
    dest = s3dest(s3_env, "once", checksum="SHA256")
    entry: FileEntry = next(e for e in snapshot.manifest.files if e.path == "big.bin")
    dest.upload("att", 3, entry, snapshot.path_of("big.bin"))
    assert dest.attest("att", 3, "big.bin", entry.size) == "s3-sha256"
    assert dest.attest("att", 3, "big.bin", entry.size) is None  # once: a later check reads back
    assert s3dest(s3_env, "once", checksum="SHA256").attest("att", 3, "big.bin", entry.size) is None


def test_the_catalog_records_each_replicas_proof(s3_env, snapshot, tmp_path):
    catalog = open_catalog(f"sqlite:///{tmp_path / 'catalog.db'}")
    row = register(catalog, snapshot)
    config = Config(storage={s3_env.url("cat-sha"): {**PARTS, "checksum": "SHA256"}, s3_env.url("cat-auto"): PARTS,
                             s3_env.url("cat-plain"): {**PARTS, "checksum": "none"}})
    for url in (s3_env.url("cat-sha"), s3_env.url("cat-auto"), s3_env.url("cat-plain")):
        assert replicate_to(catalog, row.id, snapshot, url, config).state is ReplicaState.VERIFIED
    proofs = {r.destination: (r.state, r.proof) for r in catalog.replicas(row.id)}
    assert proofs == {s3_env.url("cat-sha"): (ReplicaState.VERIFIED, "s3-sha256"),
                      s3_env.url("cat-auto"): (ReplicaState.VERIFIED, "s3-crc32"),
                      s3_env.url("cat-plain"): (ReplicaState.VERIFIED, "read-back")}
    sha_url = next(r.url for r in catalog.replicas(row.id) if r.destination == s3_env.url("cat-sha"))
    catalog.set_replica(row.id, sha_url, s3_env.url("cat-sha"), ReplicaState.CORRUPT, error="rot")
    assert {r.destination: r.proof for r in catalog.replicas(row.id)}[s3_env.url("cat-sha")] is None


def test_the_store_is_asked_with_a_request_like_the_next_one(s3_env, snapshot):
    """A PUT and a part of the size class about to be sent, random bytes under a random key; asked
    again only for a larger body (or when the random countdown runs out)."""
    dest = s3dest(s3_env, "probe", checksum="CRC32")
    assert dest._store_checks("CRC32", "put", 3 * MiB) is True  # SeaweedFS refuses it (BadDigest)
    assert dest._store_checks("CRC32", "part", 5 * MiB) is True
    (trust,) = attestation._stores.values()
    assert trust.refused == {"put": 4 * MiB, "part": 5 * MiB} and not trust.lax
    asked: list[tuple[str, int]] = []
    dest._ask_store = lambda algo, kind, size: asked.append((kind, size)) or True  # type: ignore[method-assign]
    assert dest._store_checks("CRC32", "put", 1000) and dest._store_checks("CRC32", "part", 5 * MiB)
    assert asked == []  # already shown at those sizes
    assert dest._store_checks("CRC32", "put", 5 * MiB) and asked == [("put", 5 * MiB)]
    client = s3_env.server.client()
    listed = client.list_objects_v2(Bucket=s3_env.bucket, Prefix=s3_env.key("probe")).get("Contents", [])
    assert listed == [] and dest.pending_uploads() == []  # the probe leaves nothing behind
    # A call the store accepts is no refusal, and the object it made is removed again.
    key = s3_env.key("probe/accepted")
    assert dest._refuses(lambda: client.put_object(Bucket=s3_env.bucket, Key=key, Body=b"x"), key) is False
    assert client.list_objects_v2(Bucket=s3_env.bucket, Prefix=key).get("KeyCount") == 0


def test_a_store_that_does_not_refuse_a_wrong_checksum_is_read_back(s3_env, snapshot, monkeypatch):
    """A store that kept any checksum it was sent would attest bytes nobody compared: not trusted."""
    monkeypatch.setattr(S3Destination, "_refuses", lambda self, call, created: False)
    dest = s3dest(s3_env, "lax", checksum="SHA256")
    result = replicate(snapshot, dest)
    assert result.state is ReplicaState.VERIFIED and result.proof == "read-back"


def test_auto_sends_nothing_to_a_store_that_does_not_refuse_and_says_so_quietly(s3_env, snapshot, monkeypatch,
                                                                                caplog):
    """"auto" on a lax store: no checksum goes out (a store that cannot take one is not troubled with
    it), every byte is read back, and the log says so at INFO (nobody asked for a checksum)."""
    monkeypatch.setattr(S3Destination, "_refuses", lambda self, call, created: False)
    dest = s3dest(s3_env, "lax-auto")
    with caplog.at_level("INFO", logger="safepoint.destinations.s3"):
        result = replicate(snapshot, dest)
    assert result.state is ReplicaState.VERIFIED and result.proof == "read-back"
    head = s3_env.server.client().head_object(Bucket=s3_env.bucket, ChecksumMode="ENABLED",
                                              Key=s3_env.key("lax-auto/att/3/big.bin"))
    assert "ChecksumCRC32" not in head  # SeaweedFS keeps what a multipart upload was sent: nothing
    said = [r for r in caplog.records if "does not refuse a wrong CRC32" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO"


def test_a_store_that_gives_no_answer_is_read_back_and_asked_again(s3_env, snapshot, monkeypatch):
    """A 503 or a reset on the probe is no verdict: that upload is read back, and the next one asks again."""
    answers = iter([None, True])
    asked: list[bool] = []

    def refuses(self, call, created):
        asked.append(True)
        return next(answers)

    monkeypatch.setattr(S3Destination, "_refuses", refuses)
    dest = s3dest(s3_env, "flaky")
    assert dest._algorithm("put", 1000) is None  # no answer: nothing sent, nothing remembered
    (trust,) = attestation._stores.values()
    assert trust.refused == {} and not trust.lax
    assert dest._algorithm("put", 1000) == "CRC32"  # asked again: refused
    assert dest._algorithm("put", 1000) == "CRC32" and len(asked) == 2  # then remembered for the process
