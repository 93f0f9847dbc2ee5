"""Which process a recorded pid names, whether it still runs, and stopping its group: written once.

A pid alone names a process only until it exits: the kernel hands the number to the next process,
and a file on a filesystem shared by several nodes (NFS home directories on a cluster) names a pid
of another machine. A `ProcessId` adds what a reused or foreign pid cannot match: the process's
start time (clock ticks since boot, /proc/PID/stat), the host name and the boot id
(/proc/sys/kernel/random/boot_id). Nothing is signalled unless all of them still match.

Linux only for the strong checks (/proc); elsewhere the start time and boot id read as empty, so
an identity is pid and host, as good as the platform allows. A zombie (exited, not yet reaped) is
not alive. psutil would do the same reads, but it is no runtime dependency of Safepoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass(frozen=True)
class ProcessId:
    """A process beyond doubt: a pid alone is reused and means nothing on another host or boot."""

    pid: int
    start_ticks: str  # field 22 of /proc/PID/stat; "" where there is no /proc
    host: str
    boot_id: str  # "" where there is no /proc


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces and parentheses): state is [0]."""
    try:
        return (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def boot_id() -> str:
    try:
        return (PROC / "sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def identify(pid: int | None = None) -> ProcessId | None:
    """The identity of `pid` (default: this process) now; None if there is no such process."""
    pid = pid or os.getpid()
    fields = _stat_fields(pid)
    if fields is None:
        if PROC.joinpath("self").exists() or not _exists(pid):  # /proc but no entry: no such process
            return None
        return ProcessId(pid, "", socket.gethostname(), "")
    return ProcessId(pid, fields[19], socket.gethostname(), boot_id())


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def same_process(ident: ProcessId) -> bool:
    """True if `ident` names a process of this host and boot that still holds its pid (zombies included)."""
    return identify(ident.pid) == ident


def zombie(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] in ("Z", "X")


def alive(ident: ProcessId) -> bool:
    """The very process `ident` names is running: not exited, not a zombie, not a reused or foreign pid."""
    return same_process(ident) and not zombie(ident.pid)


def pid_running(pid: int) -> bool:
    """Some process of this host, not a zombie, holds `pid` (for records that kept only a pid)."""
    ident = identify(pid)
    return ident is not None and alive(ident)


def cmdline(pid: int) -> list[str]:
    """The process's arguments ([] if unreadable: gone, another user's under hidepid, or no /proc)."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def group_members(pgid: int) -> list[int]:
    """Running (non-zombie) processes of process group `pgid`."""
    members = []
    for entry in PROC.glob("[0-9]*"):
        fields = _stat_fields(int(entry.name))
        if fields is not None and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            members.append(int(entry.name))
    return members


def _signal_group(ident: ProcessId, pgid: int, sig: int) -> None:
    """`sig` to the group `ident` led, re-checked right before: its leader is `ident` or has exited.

    While any member runs the group id cannot be handed to a new process, so once the leader
    itself was verified and has exited the group still is the one it led.
    """
    if not same_process(ident) and identify(ident.pid) is not None:  # the pid names someone else now
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if pgid == ident.pid:
            os.killpg(pgid, sig)
        else:
            os.kill(ident.pid, sig)


def stop_group(ident: ProcessId, grace_s: float = 30.0, poll_s: float = 0.1) -> bool:
    """SIGTERM the process group `ident` leads (or just the process, if it leads none), SIGKILL what lingers.

    Nothing is signalled unless `ident` still names a process here (a zombie leader included: its
    group may still run). True once nothing of it runs, False if something still does.
    """
    if not same_process(ident):
        return True  # exited, or the pid is someone else's now: nothing of ours to signal
    try:
        pgid = os.getpgid(ident.pid)
    except ProcessLookupError:
        return True
    if pgid != ident.pid:
        pgid = -1  # not a group leader: this process only

    def running() -> bool:
        return bool(group_members(pgid)) if pgid > 0 else alive(ident)

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        if not running():
            return True
        _signal_group(ident, pgid, sig)
        end = time.monotonic() + wait_s
        while running() and time.monotonic() < end:
            time.sleep(poll_s)
    return not running()


def dies_with_this_process(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A preexec_fn: the kernel sends the child `sig` when its parent dies, even by SIGKILL (Linux PR_SET_PDEATHSIG).

    So a server started by a keeper never outlives the keeper. Strictly, it fires when the thread
    that started the child ends: call Popen from the main thread. Elsewhere it does nothing.
    """
    import ctypes  # here, not at the top: only the keeper pays for it; before the fork, never in the child

    parent = os.getpid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # no libc prctl: not Linux
        prctl = None

    def arm() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent exited before prctl took effect
            os.kill(os.getpid(), sig)

    return arm
