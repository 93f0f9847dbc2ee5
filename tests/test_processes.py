"""safepoint.local.processes: a process named beyond its pid, liveness without zombies, and a group stop
that signals nothing unless the identity still matches."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from safepoint.local import processes as ps

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc (Linux)")


def wait_for(predicate, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while not predicate() and time.monotonic() < end:
        time.sleep(0.05)
    return predicate()


@pytest.fixture
def group():
    """A process group: a shell leader with a `sleep` child."""
    proc = subprocess.Popen(["sh", "-c", "sleep 300 & wait"], start_new_session=True)
    assert wait_for(lambda: len(ps.group_members(proc.pid)) == 2)
    yield proc
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def test_this_process_is_named_by_pid_start_time_host_and_boot():
    me = ps.identify()
    assert me is not None and me.pid == os.getpid() and me.start_ticks.isdigit() and me.host and me.boot_id
    assert ps.same_process(me) and ps.alive(me)
    assert ps.identify(2**22 + 12345) is None  # above pid_max: no such process


@pytest.mark.parametrize("field, value", [("start_ticks", "1"), ("host", "node-b"), ("boot_id", "other-boot")])
def test_a_reused_or_foreign_identity_is_never_signalled(group, field, value):
    foreign = dataclasses.replace(ps.identify(group.pid), **{field: value})
    assert not ps.same_process(foreign) and not ps.alive(foreign)
    assert ps.stop_group(foreign, grace_s=1) is True  # the process it named is not running here
    assert group.poll() is None and len(ps.group_members(group.pid)) == 2  # nothing was sent


def test_stop_group_ends_the_leader_and_its_children(group):
    ident = ps.identify(group.pid)
    assert ps.stop_group(ident, grace_s=5) is True
    assert ps.group_members(group.pid) == [] and not ps.alive(ident)


def test_a_zombie_is_not_alive():
    child = subprocess.Popen(["true"])
    ident = ps.identify(child.pid)
    assert wait_for(lambda: ps.zombie(child.pid))  # exited, not reaped yet
    assert ps.same_process(ident) and not ps.alive(ident)
    assert ps.stop_group(ident, grace_s=1) is True
    child.wait()
    assert not ps.same_process(ident)


def test_a_process_that_leads_no_group_is_stopped_alone():
    child = subprocess.Popen(["sleep", "300"])  # in the test's own process group
    try:
        assert ps.stop_group(ps.identify(child.pid), grace_s=5) is True
        assert child.wait(5) == -signal.SIGTERM
    finally:
        child.kill()
        child.wait()


def test_a_child_armed_with_dies_with_this_process_ends_when_its_parent_is_killed():
    code = ("import subprocess, sys, time; from safepoint.local.processes import dies_with_this_process; "
            "p = subprocess.Popen(['sleep', '300'], preexec_fn=dies_with_this_process()); "
            "print(p.pid, flush=True); time.sleep(300)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    ident = ps.identify(child)
    try:
        assert ps.alive(ident)
        parent.kill()  # SIGKILL: no clean-up of its own runs
        parent.wait()
        assert wait_for(lambda: not ps.alive(ident)), "the child outlived its parent"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
