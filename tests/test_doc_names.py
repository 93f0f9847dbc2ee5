"""Every dotted `safepoint.*` name in the docs, README and docstrings/comments names a module or attribute that exists.

Modules move (safepoint.reconcile became safepoint.ops.reconcile); a stale reference sends a
reader to nothing. Names that are not Python (event names, format identifiers) are listed below.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

from safepoint.ops.trackers import KEYS as TRACKER_KEYS

REPO = Path(__file__).resolve().parents[1]
NAME = re.compile(r"(?<![\w./-])safepoint(?:\.[A-Za-z_]\w*)+")
#: dotted names that are not Python objects, and what they are
NOT_PYTHON = {
    "safepoint.checkpoint.committed": "the Prefect event a commit emits",
    "safepoint.checkpoint.verified": "the Prefect event of a verified checkpoint (flows/automations.py)",
    "safepoint.checkpoint.corrupt": "the Prefect event of a corrupt checkpoint",
    "safepoint.checkpoint.invalid": "the Prefect event of an invalid checkpoint",
    "safepoint.checkpoint.RUN.STEP": "a checkpoint's Prefect resource id",
    "safepoint.manifest": "MANIFEST.json's format identifier",
    "safepoint.marker": "COMMITTED's format identifier",
    "safepoint.snapshot": "a rank-done/snapshot format identifier (docs/format.md)",
    "safepoint.node": "a Prefect event resource label (safepoint.events)",
}
NOT_PYTHON.update({f"safepoint.{k}": "a tracker tag or metadata key (safepoint.ops.trackers.KEYS)"
                   for k in TRACKER_KEYS})


def resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def texts() -> list[tuple[Path, str]]:
    out = [(p, p.read_text()) for p in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]]
    for root in ("safepoint", "flows", "tasks"):
        for p in sorted((REPO / root).rglob("*.py")):
            src = p.read_text()
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node, clean=False)
                    if doc:
                        out.append((p, doc))
            out.append((p, "\n".join(line.split("#", 1)[1] for line in src.splitlines() if "#" in line)))
    return out


def stale(items: list[tuple[Path, str]]) -> list[str]:
    found = set()
    for path, text in items:
        for m in NAME.finditer(text):
            name = m.group(0).rstrip(".")
            if name not in NOT_PYTHON and not resolves(name):
                found.add(f"{path.relative_to(REPO) if path.is_absolute() else path}: {name}")
    return sorted(found)


def test_a_stale_name_is_found():
    assert stale([(Path("x.md"), "see safepoint.sandbox and safepoint.ops.fetch.fetch_snapshot")]) == \
        ["x.md: safepoint.sandbox"]


def test_no_doc_names_a_module_that_is_gone():
    bad = stale(texts())
    assert not bad, "\n".join(bad)
