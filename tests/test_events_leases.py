"""Concurrency: one ingest of a checkpoint per destination at a time, and a per-host cap on uploads.

Both are catalog leases (safepoint.leases), so these run on SQLite and PostgreSQL alike.
"""

from __future__ import annotations

import threading
import time

import pytest

from safepoint import commit
from safepoint.core.config import Config
from safepoint.local.snapshot import LocalSnapshot
from safepoint.ops import leases

pytestmark = pytest.mark.catalog_backends  # catalog-level: on SQLite and PostgreSQL


def run_threads(n: int, body) -> None:
    errors: list[BaseException] = []

    def wrap(i: int) -> None:
        try:
            body(i)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


class Occupancy:
    def __init__(self):
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0
        self.entries = 0

    def __enter__(self):
        with self.lock:
            self.now += 1
            self.entries += 1
            self.peak = max(self.peak, self.now)

    def __exit__(self, *exc):
        with self.lock:
            self.now -= 1


def test_held_is_exclusive_and_renewed_past_its_ttl(catalog):
    occ = Occupancy()

    def body(i):
        with leases.held(catalog, "ingest:r/1/all@x", ttl_s=0.6, wait_s=30, poll_s=0.05), occ:
            time.sleep(1.5)  # longer than the ttl: only renewal keeps the others out

    run_threads(3, body)
    assert (occ.peak, occ.entries) == (1, 3)
    assert catalog.lease_holder("ingest:r/1/all@x") is None  # released


def test_wait_is_bounded(catalog):
    assert catalog.acquire_lease("busy", "someone-else", 60)
    t0 = time.monotonic()
    with pytest.raises(leases.LeaseBusy), leases.held(catalog, "busy", wait_s=0.5, poll_s=0.1):
        pass
    assert time.monotonic() - t0 < 10


def test_a_dead_holders_lease_expires(catalog):
    assert catalog.acquire_lease("orphan", "dead-process", 0.5)  # never renewed, never released
    with leases.held(catalog, "orphan", wait_s=20, poll_s=0.1) as name:
        assert name == "orphan"


def test_slot_caps_concurrency(catalog):
    occ = Occupancy()

    def body(i):
        with leases.slot(catalog, "uploads:host-a", 2, ttl_s=30, wait_s=60, poll_s=0.05), occ:
            time.sleep(0.3)

    run_threads(6, body)
    assert occ.peak == 2 and occ.entries == 6


def test_ingest_exclusivity_is_per_checkpoint_part_and_destination(tmp_path, catalog):
    from safepoint.ops.leases import ingest_leases

    folder = tmp_path / "s"
    folder.mkdir()
    (folder / "w.bin").write_bytes(b"1" * 10)
    commit(folder, "r", 1)
    snap = LocalSnapshot.open(folder)
    config = Config(sections={"limits": {"uploads_per_host": 8, "lease_ttl_s": 30}})
    same, different = Occupancy(), Occupancy()

    def body(i):
        with ingest_leases(catalog, snap.manifest, "file:///dest-a", config), same:
            time.sleep(0.3)

    run_threads(3, body)
    assert same.peak == 1

    def body2(i):
        with ingest_leases(catalog, snap.manifest, f"file:///dest-{i}", config), different:
            time.sleep(0.5)

    run_threads(3, body2)
    assert different.peak > 1  # other destinations proceed at the same time


@pytest.mark.parametrize(("holder", "expected"), [
    ("node-a:4242:abcd1234", True),          # this host, process gone: take over at once
    ("node-a:1:abcd1234", False),            # this host, process alive
    ("node-b:4242:abcd1234", False),         # another host: only its TTL can tell
    ("node-a:notapid:abcd1234", False),
    ("someone", False),
    (None, False),
    ("ip-10-0-0-1:ec2:4242:ab", False),      # a host name with colons: never mistaken for ours
])
def test_holder_is_dead(holder, expected):
    from safepoint.ops.leases import holder_is_dead

    assert holder_is_dead(holder, "node-a", alive=lambda pid: pid == 1) is expected


def test_a_killed_holders_lease_is_taken_over_without_waiting_for_its_ttl(catalog):
    import socket
    import subprocess
    import sys

    from safepoint.ops.leases import held

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # a pid that existed and is gone
    catalog.acquire_lease("ingest:r/1/all@x", f"{socket.gethostname()}:{p.pid}:dead0000", 600)
    t0 = time.monotonic()
    with held(catalog, "ingest:r/1/all@x", ttl_s=30, wait_s=20):
        assert time.monotonic() - t0 < 5
