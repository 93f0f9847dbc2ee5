"""The tree shows the architecture: layers import downwards only, never in a loop, and only the
Prefect edge imports Prefect (docs/architecture.md).

Every import counts, function-local ones too: a loop hidden inside a function is still a loop.
Imports under ``if TYPE_CHECKING:`` are annotations only and do not count.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PACKAGE_DIR: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]

#: lowest first; a module may import its own layer's modules (without a loop) and any layer below
LAYERS = [
    ("core", ["safepoint.core"]),
    ("rules", ["safepoint.rules"]),
    ("local", ["safepoint.local"]),
    ("destinations", ["safepoint.destinations"]),
    ("validation", ["safepoint.validation"]),
    ("snapshotter", ["safepoint.snapshotter"]),
    ("catalog", ["safepoint.catalog", "safepoint.migrations"]),
    ("ops", ["safepoint.ops"]),
    ("events", ["safepoint.events"]),
    ("edge", ["safepoint.flows", "safepoint.tasks"]),
    ("integrations", ["safepoint.integrations"]),
    ("cli", ["safepoint.cli"]),
]
#: the only packages allowed to import prefect (and prefect_dask)
PREFECT_EDGE = ("safepoint.flows", "safepoint.tasks")


def _source_roots() -> dict[str, Path]:
    roots = {"safepoint": REPO / "safepoint"}
    roots.update({pkg: REPO / folder for pkg, folder in PACKAGE_DIR.items()})
    return roots


def project_modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg, root in _source_roots().items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([pkg, *parts])] = path
    return mods


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def _eager_nodes(tree: ast.AST) -> list[ast.AST]:
    """The nodes that run when the module is imported: all but function bodies."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return out


def imports_of(module: str, path: Path, known: set[str], *, eager: bool = False) -> set[str]:
    """Project modules (and external top-level names) that `module` imports anywhere in its body;
    with `eager`, only those its import runs (not inside a function)."""
    tree = ast.parse(path.read_text())
    skip = _type_checking_lines(tree)
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in (_eager_nodes(tree) if eager else ast.walk(tree)):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known and "." in name:
                name = name.rpartition(".")[0]
            if name != module:
                found.add(name)
    return found


def graph(*, eager: bool = False) -> dict[str, set[str]]:
    mods = project_modules()
    known = set(mods)
    return {m: imports_of(m, p, known, eager=eager) for m, p in mods.items()}


def loaded_by(module: str, g: dict[str, set[str]]) -> set[str]:
    """Every project module and external top-level name that importing `module` runs (with its packages)."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(g.get(name, ()))
        if "." in name:
            todo.append(name.rpartition(".")[0])
    return seen


def layer_of(module: str) -> int | None:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle between project modules, or None (iterative DFS, colours)."""
    colour: dict[str, int] = {}
    for start in sorted(g):
        if colour.get(start):
            continue
        stack = [(start, iter(sorted(d for d in g[start] if d in g)))]
        path = [start]
        colour[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                path.pop()
                continue
            if colour.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if not colour.get(nxt):
                colour[nxt] = 1
                path.append(nxt)
                stack.append((nxt, iter(sorted(d for d in g[nxt] if d in g))))
    return None


def test_find_cycle_finds_a_planted_loop():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycles():
    cycle = find_cycle(graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_every_module_has_a_layer():
    unlayered = [m for m in project_modules() if m != "safepoint" and layer_of(m) is None]
    assert not unlayered, f"modules outside every layer (add them to LAYERS and docs/architecture.md): {unlayered}"


def test_imports_run_down_the_layers():
    upward = []
    for module, deps in graph().items():
        mine = layer_of(module)
        if mine is None:
            continue
        for dep in deps:
            theirs = layer_of(dep)
            if theirs is not None and theirs > mine:
                upward.append(f"{module} ({LAYERS[mine][0]}) imports {dep} ({LAYERS[theirs][0]})")
    assert not upward, "\n".join(sorted(upward))


def test_only_the_prefect_edge_imports_prefect():
    offenders = sorted(
        f"{m} imports {d}" for m, deps in graph().items() for d in deps
        if d.split(".")[0] in ("prefect", "prefect_dask") and not m.startswith(PREFECT_EDGE)
    )
    assert not offenders, "\n".join(offenders)


#: the training side: what a training process imports to seal (and snapshot) its checkpoints
TRAINING_SIDE = ("safepoint.integrations", "safepoint.snapshotter", "safepoint.local.commit")
#: what the training side may not load when imported: the catalog, Prefect, the object-store and CLI stacks
TRAINING_MUST_NOT_LOAD = ("sqlalchemy", "alembic", "prefect", "prefect_dask", "botocore", "boto3", "fsspec",
                          "s3fs", "rich")
#: and the layers above it that pull those in (an integration may import them inside a function, when used)
TRAINING_MUST_NOT_IMPORT = ("catalog", "ops", "events", "edge", "cli")


def test_the_training_side_imports_no_catalog_prefect_or_object_store():
    """An HF, Lightning, Accelerate or DCP training process pays for sealing, not for the catalog
    (docs/architecture.md): importing the training side runs no import of a heavy layer or library."""
    g = graph(eager=True)
    offenders = []
    for module in sorted(m for m in g if m.startswith(TRAINING_SIDE)):
        for dep in sorted(loaded_by(module, g)):
            layer = layer_of(dep)
            barred_layer = layer is not None and LAYERS[layer][0] in TRAINING_MUST_NOT_IMPORT
            if barred_layer or dep.split(".")[0] in TRAINING_MUST_NOT_LOAD:
                offenders.append(f"{module} loads {dep}")
    assert not offenders, "\n".join(offenders)


def test_loaded_by_follows_eager_imports_and_packages():
    g = {"a.b": {"c"}, "c": {"d"}, "a": set(), "d": set(), "e": {"f"}}
    assert loaded_by("a.b", g) == {"a.b", "a", "c", "d"}


#: each training-side module and the trainer library it imports first (whose own imports are not ours)
TRAINING_IMPORTS = [
    ("safepoint.integrations.huggingface", "transformers.trainer_utils, transformers.trainer_callback"),
    ("safepoint.integrations.lightning", "lightning.fabric.plugins.io.torch_io, lightning_fabric.plugins.io.torch_io"),
    ("safepoint.integrations.accelerate", None),
    ("safepoint.integrations.dcp", None),
    ("safepoint.integrations.sealing", None),
    ("safepoint.snapshotter", None),
    ("safepoint.local.commit", None),
]


@pytest.mark.parametrize(("module", "trainer_lib"), TRAINING_IMPORTS, ids=[m for m, _ in TRAINING_IMPORTS])
def test_importing_the_training_side_loads_no_heavy_module(module, trainer_lib):
    """What `python -X importtime -c "import <module>"` shows, in a fresh interpreter: the modules of
    TRAINING_MUST_NOT_LOAD that the import adds beyond what the trainer library loads itself."""
    if trainer_lib:
        pytest.importorskip(trainer_lib.split(",")[0].strip())
    before = f"import {trainer_lib}\n" if trainer_lib else ""
    code = (f"import json, sys\n{before}"
            "known = set(sys.modules)\n"
            f"import {module}\n"
            f"print(json.dumps(sorted(m for m in set(sys.modules) - known if m.split('.')[0] in "
            f"{TRAINING_MUST_NOT_LOAD!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []


def test_pyproject_lists_every_package():
    packages = {m for m, p in project_modules().items() if p.name == "__init__.py"}
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert packages == listed, f"missing: {packages - listed}, stale: {listed - packages}"


def loaded_in_fresh_interpreter(imports: str, roots: tuple[str, ...]) -> list[str]:
    """The modules under `roots` that `import <imports>` loads in a fresh interpreter."""
    code = (f"import json, sys, {imports}\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {roots!r})))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_import_safepoint_and_catalog_pulls_in_neither_prefect_nor_torch():
    assert loaded_in_fresh_interpreter("safepoint, safepoint.catalog, safepoint.catalog.store",
                                       ("prefect", "torch")) == []


def test_the_ingest_flow_imports_no_torch():
    """Torch is the readers' (the sandboxed child's): the process that runs the ingest flow, judges and
    records never imports it, so the CLI's fork server can import it in parallel (safepoint.validation.sandbox)."""
    assert loaded_in_fresh_interpreter("safepoint.flows.ingest, safepoint.ops.validation, "
                                       "safepoint.validation.validate", ("torch",)) == []


@pytest.mark.slow
def test_pip_install_puts_only_safepoint_in_site_packages(tmp_path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                        "--target", str(target), str(REPO)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    top = sorted(p.name for p in target.iterdir() if p.name != "bin")
    assert [n for n in top if not n.endswith(".dist-info")] == ["safepoint"], top
    assert (target / "safepoint" / "catalog" / "store.py").is_file()
    assert (target / "safepoint" / "migrations" / "versions" / "0001_initial.py").is_file()
    assert (target / "safepoint" / "migrations" / "script.py.mako").is_file()


#: what `safepoint verify` of a local folder must not load: the catalog proper, the Prefect edge, torch,
#: and rich (a plain line to a pipe needs none of it), so it starts about as fast as `b3sum` (bench/verify_start.py)
VERIFY_MUST_NOT_LOAD = ("sqlalchemy", "alembic", "prefect", "torch", "rich")


@pytest.mark.parametrize("catalog", ["none yet", "does not know the folder"])
def test_verify_of_an_unknown_local_folder_loads_no_heavy_module(catalog, tmp_path):
    from safepoint.local.commit import commit

    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "w.bin").write_bytes(b"x" * 4096)
    commit(folder, "r", 1)
    home = tmp_path / "home"
    home.mkdir()
    if catalog != "none yet":
        from safepoint.catalog import db
        from safepoint.catalog.store import open_catalog

        url = f"sqlite:///{home / 'catalog.db'}"
        open_catalog(url)  # migrated, empty
        db.dispose(url)
    code = ("import sys\nfrom safepoint.cli.main import main\n"
            f"rc = main(['verify', {str(folder)!r}])\n"
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {VERIFY_MUST_NOT_LOAD!r})\n"
            "print(heavy[:5], 'rich.progress' in sys.modules); sys.exit(rc or (3 if heavy else 0))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("SAFEPOINT_CATALOG_URL", "SAFEPOINT_CONFIG", "FORCE_COLOR", "TTY_COMPATIBLE")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**env, "PYTHONPATH": str(REPO), "SAFEPOINT_HOME": str(home)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith(f"{folder}: verified: 1 files verified (4096 bytes)\n"), r.stdout


#: calls that move a file into place; only safepoint/local may make them (safepoint.local.atomic)
RENAMES = {"os.replace", "os.rename", "os.renames", "shutil.move"}


def renames_in(path: Path) -> list[str]:
    """`os.replace`/`os.rename`/`shutil.move` calls, and any `.rename(...)` (Path.rename), with their line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = ast.unparse(node.func)
            if name in RENAMES or node.func.attr == "rename":
                found.append(f"{name} at line {node.lineno}")
    return found


def test_renames_find_a_planted_one(tmp_path):
    p = tmp_path / "m.py"
    p.write_text("import os\nos.replace('a', 'b')\nfrom pathlib import Path\nPath('a').rename('b')\n"
                 "'x'.replace('a', 'b')\n")
    assert renames_in(p) == ["os.replace at line 2", "Path('a').rename at line 4"]


def test_only_safepoint_local_renames_files():
    """Durable writes (temp, fsync, rename) are written once, in safepoint/local (docs/architecture.md)."""
    offenders = [f"{m}: {hit}" for m, p in sorted(project_modules().items())
                 if not m.startswith("safepoint.local.") for hit in renames_in(p)]
    assert not offenders, "\n".join(offenders)


#: what `safepoint ls` of a SQLite catalog must not load: it reads with sqlite3 (catalog.listing) and
#: prints plain columns to a pipe, so it starts in well under 0.3 s (bench/startup.py)
LS_MUST_NOT_LOAD = ("sqlalchemy", "alembic", "prefect", "torch", "rich")


@pytest.mark.parametrize("catalog", ["none yet", "empty", "two checkpoints"])
def test_ls_of_a_sqlite_catalog_loads_no_heavy_module(catalog, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    if catalog != "none yet":
        from safepoint.catalog import db
        from safepoint.catalog.store import open_catalog
        from tests.helpers_catalog import seed

        url = f"sqlite:///{home / 'catalog.db'}"
        cat = open_catalog(url)
        if catalog == "two checkpoints":
            seed(cat, tmp_path, "run-a", 1, tags=("best",))
            seed(cat, tmp_path, "run-a", 2, replicas=())
        db.dispose(url)
    code = ("import sys\nfrom safepoint.cli.main import main\n"
            "rc = main(['ls'])\n"
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {LS_MUST_NOT_LOAD!r})\n"
            "print('HEAVY', heavy[:5]); sys.exit(rc or (3 if heavy else 0))")
    env = {k: v for k, v in os.environ.items()
           if k not in ("SAFEPOINT_CATALOG_URL", "SAFEPOINT_CONFIG", "FORCE_COLOR", "TTY_COMPATIBLE")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**env, "PYTHONPATH": str(REPO), "SAFEPOINT_HOME": str(home)})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split() == ["run", "step", "state", "bytes", "replicas", "local", "parent", "pin/tags"]
    body = [line.split()[:3] for line in lines[1:-1]]
    assert body == ([["run-a", "1", "verified"], ["run-a", "2", "verified"]] if catalog == "two checkpoints" else [])
    if catalog == "two checkpoints":
        assert lines[1].split()[-1] == "best" and "durable0" in lines[1]
