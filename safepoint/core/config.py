"""Configuration: environment first, then an optional TOML file, then defaults.

`$SAFEPOINT_HOME` (default `~/.safepoint`) holds the SQLite catalog and `config.toml`:

    [catalog]
    url = "postgresql+psycopg://ckpt@db/safepoint"   # or SAFEPOINT_CATALOG_URL

    [storage."s3://my-bucket"]                      # fsspec storage options by URL prefix
    endpoint_url = "http://127.0.0.1:8333"

    [runs.llama-7b]
    model = "mypkg.models:build"                     # model factory for validation

Secrets belong in the environment or AWS profiles, not here; they are never logged or stored.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safepoint.core.errors import UsageError
from safepoint.core.naming import config_file


@dataclass(frozen=True)
class Config:
    catalog_url: str | None = None
    storage: dict[str, dict[str, Any]] = field(default_factory=dict)
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    validation: dict[str, Any] = field(default_factory=dict)
    # Every other table of config.toml ([events], [multinode], [fanout], [limits], ...), read by
    # the modules that own them through `section()`.
    sections: dict[str, Any] = field(default_factory=dict)

    def storage_options(self, url: str) -> dict[str, Any]:
        """Options of the longest configured prefix of `url` (its userinfo aside: s3://KEY:SECRET@bucket)."""
        from safepoint.core.redact import redact_url

        url = redact_url(url)
        best = ""
        for prefix in self.storage:
            if url.startswith(prefix.rstrip("/")) and len(prefix) > len(best):
                best = prefix
        return dict(self.storage.get(best, {}))

    def run_setting(self, run: str, key: str, default: Any = None) -> Any:
        return self.runs.get(run, {}).get(key, default)

    def section(self, name: str) -> dict[str, Any]:
        """The `[name]` table of config.toml (empty when absent)."""
        value = self.sections.get(name, {})
        return dict(value) if isinstance(value, dict) else {}


# The parsed file by (path, inode, size, mtime): one command asks for the config from several layers
# (CLI, sandbox, ops), and a long-lived watcher still sees an edited file.
_parsed: dict[tuple, dict[str, Any]] = {}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        st = path.stat()
    except OSError:
        return {}
    if not path.is_file():
        return {}
    key = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _parsed:
        import tomllib  # only when there is a file: every command loads the config, most have none

        try:
            doc = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"{path}: not valid TOML ({e})") from None
        if len(_parsed) >= 8:                # a few files at once (tests, several homes), bounded
            _parsed.pop(next(iter(_parsed)))
        _parsed[key] = doc
    return copy.deepcopy(_parsed[key])


def load_config(path: str | os.PathLike | None = None) -> Config:
    path = Path(path or os.environ.get("SAFEPOINT_CONFIG") or config_file())
    doc = _read_toml(path)
    return Config(
        catalog_url=os.environ.get("SAFEPOINT_CATALOG_URL") or doc.get("catalog", {}).get("url"),
        storage=doc.get("storage", {}),
        runs=doc.get("runs", {}),
        validation=doc.get("validation", {}),
        sections={k: v for k, v in doc.items() if isinstance(v, dict)},
    )


def fanout_settings(config: Config | None) -> dict[str, Any]:
    """`[fanout]`, with SAFEPOINT_FANOUT_RUNNER / SAFEPOINT_FANOUT_ADDRESS taking precedence."""
    sec = dict((config or Config()).section("fanout"))
    if os.environ.get("SAFEPOINT_FANOUT_RUNNER"):
        sec["runner"] = os.environ["SAFEPOINT_FANOUT_RUNNER"]
    if os.environ.get("SAFEPOINT_FANOUT_ADDRESS"):
        sec["address"] = os.environ["SAFEPOINT_FANOUT_ADDRESS"]
    return sec
