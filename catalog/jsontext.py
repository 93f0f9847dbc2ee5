"""JSON as the catalog stores it, apart from catalog.db so that sqlite3-only writers (catalog.lite) share it."""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["json_dumps"]


def _json_safe(obj: Any) -> Any:
    # PostgreSQL JSONB rejects NaN/Infinity; keep the information as strings.
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def json_dumps(obj: Any) -> str:
    """JSON for the catalog: no NaN/Infinity, and anything unknown (datetime, Path) as str."""
    return json.dumps(_json_safe(obj), default=str, allow_nan=False)
