"""The host-memory floor: never let staging push MemAvailable below a fraction of RAM.

A checkpoint that exhausts host memory gets the training job killed by the OOM killer, which is
worse than a late checkpoint. `floor_allows` is the pure rule; `MemoryGuard` reads /proc/meminfo
and keeps a record of every refusal so the Snapshotter can report it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class MemInfo:
    total: int       # bytes
    available: int   # bytes (MemAvailable: free + reclaimable page cache)


def read_meminfo(path: str = "/proc/meminfo") -> MemInfo | None:
    """MemTotal and MemAvailable in bytes, or None where /proc/meminfo is unavailable."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if key in ("MemTotal", "MemAvailable") and parts:
            values[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1)
    if "MemTotal" not in values or "MemAvailable" not in values:
        return None
    return MemInfo(values["MemTotal"], values["MemAvailable"])


def floor_allows(info: MemInfo | None, request_bytes: int, floor_fraction: float) -> bool:
    """True when taking `request_bytes` more leaves MemAvailable at or above floor_fraction of MemTotal."""
    if info is None or floor_fraction <= 0:
        return True
    return info.available - request_bytes >= floor_fraction * info.total


@dataclass(frozen=True)
class Refusal:
    request_bytes: int
    available: int
    floor_bytes: int

    def message(self) -> str:
        gib = 2**30
        left = (self.available - self.request_bytes) / gib
        return (f"taking {self.request_bytes / gib:.2f} GiB would leave {left:.2f} GiB available, "
                f"below the floor of {self.floor_bytes / gib:.2f} GiB")


class MemoryGuard:
    """Checks the floor before host memory is allocated for staging, and records the refusals."""

    def __init__(self, floor_fraction: float = 0.25, reader: Callable[[], MemInfo | None] = read_meminfo) -> None:
        if not 0 <= floor_fraction < 1:
            raise ValueError("memory floor must be a fraction in [0, 1)")
        self.floor_fraction = floor_fraction
        self.reader = reader
        self.refusals = 0
        self.last_refusal: Refusal | None = None
        self._lock = threading.Lock()

    def allows(self, request_bytes: int) -> bool:
        info = self.reader()
        if floor_allows(info, request_bytes, self.floor_fraction):
            return True
        assert info is not None
        with self._lock:
            self.refusals += 1
            self.last_refusal = Refusal(request_bytes, info.available, int(self.floor_fraction * info.total))
        return False
