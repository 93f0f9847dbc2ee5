"""The catalog stores and reads; it makes no domain decisions and stays light to import.

Split by aggregate (catalog/commits.py, replicas.py, lineage.py, ...) behind the small `Catalog`
facade of catalog/store.py: no catalog module may import the rules, Prefect or torch.
"""

from __future__ import annotations

import inspect

from safepoint.catalog import store
from tests.test_architecture import graph


def test_the_catalog_imports_no_rules_no_prefect_no_torch():
    offenders = sorted(
        f"{m} imports {d}" for m, deps in graph().items() if m.startswith("safepoint.catalog")
        for d in deps if d.startswith("safepoint.rules") or d.split(".")[0] in ("prefect", "prefect_dask", "torch")
    )
    assert not offenders, "\n".join(offenders)


def test_the_facade_only_composes_the_aggregates():
    own = [name for name, _ in inspect.getmembers(store.Catalog) if name in vars(store.Catalog)
           and not name.startswith("__")]
    assert own == [], own
    aggregates = {base.__module__ for base in store.Catalog.__mro__[1:] if base.__module__.startswith("safepoint.")}
    assert len(aggregates) >= 8, aggregates
    assert not hasattr(store.Catalog, "resume_point")
