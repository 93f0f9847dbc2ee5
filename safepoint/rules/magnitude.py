"""An absolute bound on parameters: a finite blow-up that no earlier checkpoint is there to compare with. Pure.

The norm audit compares with the checkpoint before; the first checkpoint of a run has none, and one
flipped exponent bit turns a weight of 0.02 into ~7e36, finite, so no NaN/Inf check sees it either.
No trained float32 or bfloat16 parameter comes near 1e20 (activations and optimizer moments are not
bounded here: Adam's second moment of a large gradient may be large, and float16 cannot hold such
values anyway), so a parameter with |x| above the bound is damage, with or without a baseline.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["BOUNDED_DTYPES", "DEFAULT_MAX_ABS_PARAMETER", "OutOfBound", "out_of_bound"]

DEFAULT_MAX_ABS_PARAMETER = 1e20
BOUNDED_DTYPES = frozenset({"float32", "bfloat16", "float64"})


@dataclass(frozen=True)
class OutOfBound:
    file: str
    name: str
    max_abs: float
    limit: float

    @property
    def message(self) -> str:
        return (f"{self.name}: |x| reaches {self.max_abs:.3g}, beyond the bound {self.limit:.3g} for parameters "
                "(max_abs_parameter in [validation]): a finite blow-up or a flipped exponent bit")


def out_of_bound(rows: Iterable[Mapping[str, Any]], limit: float | None) -> list[OutOfBound]:
    """The parameter rows (`role` == "parameter", a bounded dtype) whose finite max |x| exceeds `limit`.

    rows: dicts with file, name, dtype, max_abs and role; `limit` None or 0 turns the rule off."""
    if not limit:
        return []
    return [OutOfBound(str(r["file"]), str(r["name"]), float(r["max_abs"]), limit) for r in rows
            if r.get("role") == "parameter" and r.get("dtype") in BOUNDED_DTYPES
            and r.get("max_abs") is not None and float(r["max_abs"]) > limit]
