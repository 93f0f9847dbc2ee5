"""The norm trend of a run: parameter and optimizer-moment norms of every validated step, by role.

Seeing norms drift is how people spot a slowly diverging run or a corrupted optimizer state. The
catalog keeps each tensor's L2 norm (and role) from every validation; this module folds them into
one number per series and step (the global L2 norm, sqrt of the sum of squares), with the steps
judged invalid, corrupt or stale marked. Three views read it: `safepoint plot` (a PNG or SVG, with
matplotlib, the `plot` extra), the ingest flow's Prefect artifact (markdown) and tests.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safepoint.core.errors import UsageError
from safepoint.core.states import CheckpointState as CS

if TYPE_CHECKING:
    from safepoint.catalog.store import Catalog

__all__ = ["PARAMETERS", "Point", "Trend", "markdown", "render", "run_trend", "series_of"]

PARAMETERS = "parameters"
#: consistency rules (safepoint.rules.consistency) that mark a step "stale" on the plot
STALE_RULES = frozenset({"stale_optimizer", "stale_weights", "duplicate", "torn"})
#: a checkpoint's state that marks its step on the plot
MARKED_STATES = {CS.INVALID: "invalid", CS.CORRUPT: "corrupt"}


@dataclass(frozen=True)
class Point:
    """One checkpoint of the run: its state, what marks it, and the norm of each series (None: no
    finite value, e.g. a NaN weight)."""

    step: int
    state: str
    marks: tuple[str, ...] = ()
    norms: dict[str, float | None] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Trend:
    run: str
    points: tuple[Point, ...]

    @property
    def series(self) -> list[str]:
        """Parameters first, then optimizer moments by name."""
        names = {s for p in self.points for s in p.norms}
        return sorted(names, key=lambda s: (s != PARAMETERS, s))

    def rows(self) -> list[dict[str, Any]]:
        """One row per step: step, state, marks, then each series' norm (a table artifact, JSON)."""
        return [{"step": p.step, "state": p.state, "marks": ", ".join(p.marks),
                 **{s: p.norms.get(s) for s in self.series}} for p in self.points]


def _moment(name: str) -> str:
    """The optimizer series of a tensor: its last dotted part (exp_avg, exp_avg_sq, momentum_buffer)."""
    return "optimizer " + name.replace(":", ".").rsplit(".", 1)[-1]


def series_of(stats: Iterable[dict[str, Any]]) -> dict[str, float | None]:
    """Per-series global L2 norms of one validation's tensor stats. Pure.

    `parameters`: every tensor of role parameter. `optimizer <kind>`: the optimizer state's tensors
    (role optimizer_state) grouped by their last name part; 0-d scalars (Adam's `step`) are left out:
    they are counters, not moments. A series with a non-finite tensor is None: NaN is not a point.
    """
    sums: dict[str, float] = {}
    broken: set[str] = set()
    for s in stats:
        role = s.get("role")
        if role == "parameter":
            key = PARAMETERS
        elif role == "optimizer_state" and list(s.get("shape") or []) != []:
            key = _moment(str(s.get("name") or ""))
        else:
            continue
        norm = s.get("norm")
        if norm is None or not math.isfinite(norm) or s.get("nan_count") or s.get("inf_count"):
            broken.add(key)
            sums.setdefault(key, 0.0)
            continue
        sums[key] = sums.get(key, 0.0) + float(norm) ** 2
    return {k: (None if k in broken else math.sqrt(v)) for k, v in sums.items()}


def _stale(report: dict[str, Any]) -> bool:
    found = ((report.get("checks") or {}).get("consistency") or {}).get("findings") or []
    problems = [f.get("problem") for key in ("findings", "warnings") for f in report.get(key) or []]
    return any(f.get("rule") in STALE_RULES for f in found) or any(p in STALE_RULES for p in problems)


def run_trend(catalog: Catalog, run: str, *, last: int | None = None) -> Trend:
    """Every checkpoint of `run` (or its `last` newest) with its norms, from its latest validation, and
    marks; a run with no checkpoint is a usage error. One stats query per checkpoint: the ingest's
    artifact asks for the last few only."""
    views = sorted(catalog.list_checkpoints(run), key=lambda v: v.step)
    if not views:
        raise UsageError(f"no checkpoints of run {run!r} in the catalog")
    points = []
    for v in views[-last:] if last else views:
        marks = [MARKED_STATES[v.state]] if v.state in MARKED_STATES else []
        norms: dict[str, float | None] = {}
        val = catalog.latest_validation(v.id)
        if val is not None:
            norms = series_of(catalog.tensor_stats(val.id))
            if _stale(val.report or {}):
                marks.append("stale")
        points.append(Point(v.step, str(v.state), tuple(marks), norms))
    return Trend(run, tuple(sorted(points, key=lambda p: p.step)))


_BARS = "▁▂▃▄▅▆▇█"


def _spark(values: list[float | None]) -> str:
    finite = [v for v in values if v is not None]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = (hi - lo) or 1.0
    return "".join("·" if v is None else _BARS[min(7, int((v - lo) / span * 7.999))] for v in values)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def markdown(trend: Trend, *, last: int = 50) -> str:
    """The trend as markdown (the ingest flow's artifact): a sparkline per series, then a table of the
    last `last` steps, marked steps in bold."""
    pts = trend.points[-last:]
    series = trend.series
    lines = [f"# Norms of {trend.run}", "",
             f"Global L2 norm per step and role over {len(trend.points)} checkpoints"
             + (f" (the last {len(pts)} shown)" if len(pts) < len(trend.points) else "") + ".", ""]
    if series:
        lines += ["| series | trend | first | last |", "|---|---|---|---|"]
        for s in series:
            vals = [p.norms.get(s) for p in pts]
            lines.append(f"| {s} | `{_spark(vals)}` | {_num(vals[0])} | {_num(vals[-1])} |")
        lines.append("")
    lines += ["| step | state | " + " | ".join(series) + " |", "|---|---|" + "---|" * len(series)]
    for p in pts:
        extra = [m for m in p.marks if m != p.state]
        state = f"**{p.state}**" + (f" ({', '.join(extra)})" if extra else "") if p.marks else p.state
        lines.append(f"| {p.step} | {state} | " + " | ".join(_num(p.norms.get(s)) for s in series) + " |")
    return "\n".join(lines) + "\n"


_MARK_STYLE = {"invalid": ("tab:red", "--"), "corrupt": ("black", ":"), "stale": ("tab:orange", "-.")}


def render(trend: Trend, out: str | Path) -> Path:
    """Draw the trend into `out` (.png or .svg): parameter norms on top, optimizer moments below (log
    scale: Adam's second moment is orders of magnitude below the first), a vertical line at every
    marked step. matplotlib is the `plot` extra; without it, a usage error that says so."""
    out = Path(out)
    if out.suffix.lower() not in (".png", ".svg"):
        raise UsageError(f"--out must end in .png or .svg, got {out.name!r}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("plotting needs matplotlib: pip install 'safepoint[plot]'") from None
    series = trend.series
    moments = [s for s in series if s != PARAMETERS]
    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True, constrained_layout=True)
    panels = ((axes[0], [PARAMETERS] if PARAMETERS in series else [], "parameter norm (L2)", False),
              (axes[1], moments, "optimizer moment norm (L2)", True))
    good = [p for p in trend.points if not p.marks]
    for ax, names, label, log in panels:
        for name in names:
            xs = [p.step for p in good if p.norms.get(name) is not None]
            ys = [p.norms[name] for p in good if p.norms.get(name) is not None]
            (line,) = ax.plot(xs, ys, marker="o", markersize=3, label=name)
            bad = [p for p in trend.points if p.marks and p.norms.get(name) is not None]
            if bad:
                ax.scatter([p.step for p in bad], [p.norms[name] for p in bad], marker="X", s=60,
                           color=line.get_color(), edgecolors="tab:red", zorder=3)
        if log and names:
            ax.set_yscale("log")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if not names:
            ax.text(0.5, 0.5, "no tensors of this role recorded", ha="center", va="center", transform=ax.transAxes)
    seen: set[str] = set()
    for p in trend.points:
        for mark in p.marks:
            color, style = _MARK_STYLE.get(mark, ("tab:red", "--"))
            for ax in axes:
                ax.axvline(p.step, color=color, linestyle=style, linewidth=1.2, alpha=0.8,
                           label=None if mark in seen or ax is not axes[0] else f"{mark} step")
            seen.add(mark)
        if p.marks:  # say which, where lines of two marks overlap
            axes[0].annotate(", ".join(p.marks), xy=(p.step, 0.98), xycoords=("data", "axes fraction"),
                             xytext=(-4, 0), textcoords="offset points", rotation=90, fontsize=8, ha="right",
                             va="top", color=_MARK_STYLE.get(p.marks[0], ("tab:red",))[0])
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize="small")
    axes[1].set_xlabel("step")
    n_marked = sum(1 for p in trend.points if p.marks)
    axes[0].set_title(f"{trend.run}: {len(good)} good steps" + (f", {n_marked} marked" if n_marked else ""))
    out.parent.mkdir(parents=True, exist_ok=True)
    with plt.rc_context({"svg.fonttype": "none"}):  # SVG text stays text: searchable, selectable
        fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
