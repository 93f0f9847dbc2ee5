"""Hostile inputs, round four, found by the red-team pass after the fixes (issue 37).

`safepoint verify DIR` cuts a local folder's manifest into batches of 256 files and each batch
re-opens the folder, parsing the whole manifest again (safepoint/ops/verify.py verify_local_batch):
N entries cost N/256 full parses, quadratic in the entry count. A manifest inside every bound
(300,000 one-segment paths, 31 MB of the 64 MiB allowed) then did not finish in 120 s, and 20,000
entries took 35 s. The guard counts parses, not seconds, so it does not depend on the machine's load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import safepoint.cli.main as cli
import safepoint.local.snapshot as snapshot
from safepoint.core.format import MANIFEST_NAME, MARKER_NAME, digest_bytes

EMPTY_BLAKE3 = "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"


def _plant(folder: Path, entries: int) -> None:
    """A committed folder whose manifest names `entries` empty files, none of them present."""
    folder.mkdir(parents=True)
    files = [{"path": f"f{i}", "size": 0, "blake3": EMPTY_BLAKE3} for i in range(entries)]
    manifest = json.dumps({"format": "safepoint.manifest", "format_version": 1, "run": "r", "step": 1,
                           "created": "2026-12-04T00:00:00.000000Z", "hash": "blake3", "files": files,
                           "meta": {}}).encode()
    (folder / MANIFEST_NAME).write_bytes(manifest)
    (folder / MARKER_NAME).write_text(json.dumps({"format": "safepoint.marker", "format_version": 1,
                                                  "manifest_blake3": digest_bytes(manifest), "run": "r",
                                                  "step": 1}))


def test_local_verify_parses_the_manifest_a_bounded_number_of_times(tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "snap"
    _plant(folder, 256 * 8)
    monkeypatch.setenv("SAFEPOINT_HOME", str(tmp_path / "home"))
    parses: list[int] = []
    real = snapshot.load_committed

    def counted(*args, **kwargs):
        parses.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(snapshot, "load_committed", counted)
    assert cli.main(["verify", str(folder)]) == 1  # every file missing: a verdict
    assert len(parses) <= 2, f"{len(parses)} full parses of one manifest for 8 batches"


def test_server_stop_leaves_the_keeper_of_another_home_running(tmp_path: Path) -> None:
    """A state file copied from home A into home B (`cp -a ~/.prefect ...`) names A's live keeper.

    It passes every identity check (pid, start time, host, boot id, and a command line naming the
    keeper module and A's home), so `server stop` under B stopped A's server and `status` reported it.
    """
    import os
    import signal
    import subprocess
    import sys
    from dataclasses import asdict

    from safepoint.flows import local_server

    home_a, home_b = tmp_path / "a", tmp_path / "b"
    home_a.mkdir()
    home_b.mkdir()
    keeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "-m",
                               local_server.KEEPER_MODULE, str(home_a)], start_new_session=True)
    try:
        state = local_server.state_of(keeper.pid, 9, home_a)
        (home_b / local_server.STATE_NAME).write_text(json.dumps(asdict(state)))
        env = {**os.environ, "PREFECT_HOME": str(home_b), "SAFEPOINT_HOME": str(tmp_path / "sp"),
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
        env.pop("PREFECT_API_URL", None)
        subprocess.run([sys.executable, "-m", "safepoint.cli", "server", "stop"], env=env, timeout=120,
                       capture_output=True)
        assert keeper.poll() is None, "server stop under home B signalled the keeper of home A"
    finally:
        if keeper.poll() is None:
            os.killpg(keeper.pid, signal.SIGKILL)
        keeper.wait()


def test_a_secret_query_in_an_s3_url_never_reaches_the_error_line(tmp_path: Path) -> None:
    """`s3://bkt/p?password=S/...`: the S3 destination takes `?password=S` as part of the key, and
    botocore's error names the key %-encoded (`p%3Fpassword%3DS`), which `redact` does not mask:
    the secret reached stderr here, and the Prefect database and catalog through `ingest --to`."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "SAFEPOINT_HOME": str(tmp_path / "sp"), "PREFECT_HOME": str(tmp_path / "pf"),
           "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b", "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
    done = subprocess.run([sys.executable, "-m", "safepoint.cli", "verify", "s3://bkt/p?password=HUSH42/r/1"],
                          env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 2
    assert "HUSH42" not in done.stdout + done.stderr


def _cli(tmp_path: Path, *args: str, **extra: str):
    import os
    import subprocess
    import sys

    env = {**os.environ, "SAFEPOINT_HOME": str(tmp_path / "sp"), "PREFECT_HOME": str(tmp_path / "pf"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **extra}
    env.pop("PREFECT_API_URL", None)
    env.pop("SAFEPOINT_CATALOG_URL", None)
    return subprocess.run([sys.executable, "-m", "safepoint.cli", *args], env=env, timeout=120,
                          capture_output=True, text=True, cwd=tmp_path)


def test_a_stale_file_is_set_aside_even_when_a_stale_directory_is_in_the_way(tmp_path: Path) -> None:
    """A state file that was a directory is set aside as `safepoint-server.json.stale/`; the next
    stale file then cannot be renamed over it, and every `ingest` and `server stop` failed with
    `IsADirectoryError` (exit 2) until someone removed it by hand."""
    from safepoint.flows import local_server

    home = tmp_path / "pf"
    (home / (local_server.STATE_NAME + local_server.STALE_SUFFIX) / "x").mkdir(parents=True)
    (home / local_server.STATE_NAME).write_text('{"pid": 1, "port": 9}')
    done = _cli(tmp_path, "server", "stop")
    assert done.returncode == 0, done.stderr
    assert not (home / local_server.STATE_NAME).exists()


@pytest.mark.parametrize("command", [["resume-point", "--run", "r"], ["show", "r", "1"], ["lineage", "r", "1"]])
def test_a_read_command_creates_no_catalog_at_a_mistyped_path(tmp_path: Path, command: list[str]) -> None:
    """`ls` says "no catalog at ... yet" and creates nothing; `resume-point`, `show` and `lineage`
    created the missing folders and an empty database, then answered exit 1 (a verdict) from it."""
    done = _cli(tmp_path, "--catalog", "sqlite:///typo/dir/cat.db", *command)
    assert not (tmp_path / "typo").exists(), done.stderr


def _plant_one(folder: Path, raw_manifest: bytes) -> None:
    folder.mkdir(parents=True)
    (folder / MANIFEST_NAME).write_bytes(raw_manifest)
    (folder / MARKER_NAME).write_text(json.dumps({"format": "safepoint.marker", "format_version": 1,
                                                  "manifest_blake3": digest_bytes(raw_manifest), "run": "r",
                                                  "step": 1}))


def _one_entry(path: str, size: str = "0") -> bytes:
    entry = f'{{"path": {json.dumps(path)}, "size": {size}, "blake3": "{EMPTY_BLAKE3}"}}'
    return (f'{{"format": "safepoint.manifest", "format_version": 1, "run": "r", "step": 1, "created": '
            f'"2026-12-04T00:00:00.000000Z", "hash": "blake3", "files": [{entry}], "meta": {{}}}}').encode()


@pytest.mark.parametrize("manifest", [
    _one_entry("/".join(["a" * 255] * 16)[:4096]),  # 4096 bytes: inside the bound, over PATH_MAX once joined
    _one_entry("f", size="9" * 5000),  # over Python's 4300-digit int limit
], ids=["path-4096-bytes", "size-5000-digits"])
def test_a_hostile_manifest_is_a_verdict_not_an_infrastructure_error(tmp_path: Path, manifest: bytes) -> None:
    """`safepoint verify DIR` answered exit 2 (`OSError: [Errno 36] File name too long`, or
    `ValueError: Exceeds the limit (4300 digits) ...`): these manifests are corrupt copies (exit 1)."""
    _plant_one(tmp_path / "snap", manifest)
    done = _cli(tmp_path, "verify", str(tmp_path / "snap"))
    assert done.returncode == 1, done.stdout + done.stderr


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///", "sqlite:///:memory:", "sqlite+pysqlite:///:memory:",
                                 "sqlite:///file::memory:?uri=true", "sqlite:///file:x?mode=memory&uri=true"])
@pytest.mark.parametrize("command", [["resume-point", "--run", "r"], ["ls"], ["show", "r", "1"]])
def test_an_in_memory_catalog_is_refused_in_one_line(tmp_path: Path, url: str, command: list[str]) -> None:
    """A catalog that keeps nothing past the command cannot record a verdict or answer one: exit 2."""
    done = _cli(tmp_path, "--catalog", url, *command)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("safepoint: error:") and "in-memory" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("args", [["prune", "--run", "r", "--keep-every", "0"],
                                  ["prune", "--run", "r", "--keep-every", "-1"],
                                  ["prune", "--run", "r", "--keep-last", "-1"],
                                  ["risk", "--last", "-1"], ["risk", "--last", "x"]])
def test_a_count_out_of_range_is_a_usage_error(tmp_path: Path, args: list[str]) -> None:
    done = _cli(tmp_path, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("safepoint: error: invalid"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_destination_with_a_query_is_refused_before_any_server_starts(tmp_path: Path) -> None:
    """The URL form is checked while the command line is read: no Prefect server is started for it."""
    done = _cli(tmp_path, "ingest", str(tmp_path), "--to", "file:///tmp/d?password=HUSH42#token=T")
    assert done.returncode == 2 and "HUSH42" not in done.stdout + done.stderr, done.stderr
    assert done.stderr.startswith("safepoint: error: a file:// destination takes no query"), done.stderr
    assert not (tmp_path / "pf").exists()  # PREFECT_HOME untouched: nothing was started
