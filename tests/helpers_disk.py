"""A small tmpfs for the disk-full tests (tests/faults/test_disk_full.py, tests/test_restore.py).

Where mounting is not allowed (not root, no CAP_SYS_ADMIN) the test skips with the reason, but fails
in CI (CI=true, or SAFEPOINT_REQUIRE_DISKFULL=1 as .ci/run sets), so CI cannot pass without them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


def required() -> bool:
    """CI must run the disk-full tests, never skip them."""
    return (os.environ.get("SAFEPOINT_REQUIRE_DISKFULL") == "1"
            or os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"))


def mount_tmpfs(mnt: Path, size: str = "2m") -> None:
    """Mount a tmpfs at `mnt`; where that is not allowed, skip, or fail when the tests are required."""
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        detail = getattr(e, "stderr", b"") or b""
        why = f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {e} {detail.decode().strip()}"
        if required():
            pytest.fail(f"{why}; the disk-full tests are required here (CI / SAFEPOINT_REQUIRE_DISKFULL=1)")
        pytest.skip(why)
