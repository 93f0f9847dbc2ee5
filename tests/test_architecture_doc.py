"""docs/architecture.md stays true: every file and `file.py:name` it names exists (a bare file name
in the layer table is looked up in that row's package), so a moved or renamed operation fails here.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
#: `ops/ingest.py`, `ops/ingest.py:ingest`, `format.py`, `tasks/runner.py:PrefectSteps`
REF = re.compile(r"`([\w/]+\.py)(?::(\w+))?`")
#: the package column of the layer table -> the folder it names
PACKAGE = re.compile(r"`((?:safepoint/)?[\w]+/)`")


def _file(ref: str, package: Path | None) -> Path | None:
    for base in ([package] if package and "/" not in ref else []) + [REPO, REPO / "safepoint"]:
        if (base / ref).is_file():
            return base / ref
    return None


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def _layer_rows() -> list[tuple[Path, str]]:
    rows = []
    for line in DOC.read_text().splitlines():
        cells = line.split("|")
        if len(cells) > 4 and (m := PACKAGE.search(cells[2])):
            rows.append((REPO / m.group(1), line))
    return rows


def test_every_file_and_function_the_architecture_names_exists():
    missing = []
    rows = dict((line, pkg) for pkg, line in _layer_rows())
    for line in DOC.read_text().splitlines():
        for ref, name in REF.findall(line):
            path = _file(ref, rows.get(line))
            if path is None:
                missing.append(ref)
            elif name and not _defines(path, name):
                missing.append(f"{ref}:{name}")
    assert not missing, f"docs/architecture.md names what the tree lacks: {missing}"

