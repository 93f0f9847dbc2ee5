"""The validation report for people, rendered from what the catalog stored (pure functions).

One source, three views: the Prefect artifacts of the validate task (markdown, and a table of
tensors) and `safepoint show RUN STEP` in the terminal (safepoint.cli.validation_cmds). Every failure
names its tensor (or file) and says why, in the words the validator wrote.
"""

from __future__ import annotations

import math
import re
from typing import Any

__all__ = ["MAX_TABLE_ROWS", "artifact_key", "consistency_line", "finding_rows", "markdown", "tensor_rows"]

MAX_TABLE_ROWS = 1000


def artifact_key(kind: str, run: str, step: int) -> str:
    """A Prefect artifact key (lowercase letters, digits and dashes) for one checkpoint."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{kind}-{run}-{step}".lower()).strip("-")


def finding_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Failures first, then warnings: severity, problem, tensor, file, why."""
    rows = []
    for severity, key in (("fail", "findings"), ("warn", "warnings")):
        for f in doc.get(key) or []:
            rows.append({"severity": severity, "problem": f.get("problem"), "tensor": f.get("tensor") or "",
                         "file": f.get("file") or "", "why": f.get("message") or ""})
    return rows


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.6g}"
    return str(x)


def tensor_rows(doc: dict[str, Any], stats: list[dict[str, Any]], limit: int = MAX_TABLE_ROWS) -> list[dict[str, Any]]:
    """Per-tensor stats with each tensor's file, role and verdict; flagged tensors first, then by name; at
    most `limit`. File and role are "-" for stats recorded before the catalog kept them."""
    verdict: dict[str, str] = {}
    for r in finding_rows(doc):
        if r["tensor"]:
            verdict.setdefault(r["tensor"], f"{r['severity']}: {r['problem']}")
    rows = [{
        "tensor": s["name"], "file": s.get("file") or "-", "role": s.get("role") or "-",
        "verdict": verdict.get(s["name"], verdict.get(s["name"].split(":", 1)[-1], "ok")),
        "dtype": s.get("dtype"), "shape": "x".join(str(d) for d in s.get("shape") or []) or "scalar",
        "norm": _fmt(s.get("norm")), "max_abs": _fmt(s.get("max_abs")),
        "nan": int(s.get("nan_count") or 0), "inf": int(s.get("inf_count") or 0),
    } for s in stats]
    rows.sort(key=lambda r: (r["verdict"] == "ok", r["tensor"]))
    return rows[:limit]


def consistency_line(doc: dict[str, Any]) -> str | None:
    """What the consistency rules compared and found (safepoint.rules.consistency), in one line;
    None for a report written before they existed."""
    c = (doc.get("checks") or {}).get("consistency")
    if c is None:
        return None
    counters = (doc.get("checks") or {}).get("counters") or {}
    shown = ", ".join(f"{k} {_fmt(v)}" for k, v in counters.items() if v is not None)
    where = f"against {c['against']}" if c.get("against") else "no earlier verified checkpoint (step counters only)"
    found = c.get("findings") or []
    what = (", ".join(f"{f['rule']} ({f['steps'][0]} -> {f['steps'][1]})" for f in found) if found
            else "nothing stale, duplicated or torn")
    return f"{where}: {what}" + (f"; counters: {shown}" if shown else "")


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _checks_lines(doc: dict[str, Any]) -> list[str]:
    checks = doc.get("checks") or {}
    lines = []
    h = checks.get("harness")
    if h:
        step = h.get("step") or {}
        lines.append(f"| strict load | `{h.get('model')}`: model state under "
                     f"`{h.get('model_key') or '(top level)'}` ({h.get('model_tensors')} tensors expected), "
                     f"optimizer {h.get('optimizer') or '-'} under `{h.get('optimizer_key') or '-'}` |")
        if step:
            lines.append(f"| step | checkpoint `{step.get('key') or '-'}` = {_fmt(step.get('checkpoint'))}, "
                         f"catalog {_fmt(step.get('catalog'))} |")
    else:
        lines.append("| strict load | no model factory configured (--model or [runs.RUN] model) |")
    a = checks.get("audit")
    if a:
        lines.append(f"| norm audit | against {a.get('against')}: {a.get('compared')} tensors compared, "
                     f"{a.get('flagged')} beyond x{_fmt(a.get('norm_jump_factor'))} |")
    else:
        lines.append("| norm audit | no earlier verified checkpoint of this run to compare with |")
    c = consistency_line(doc)
    if c:
        lines.append(f"| consistency | {_cell(c)} |")
    return lines


def markdown(run: str, step: int, state: str, doc: dict[str, Any], stats: list[dict[str, Any]] | None = None) -> str:
    """The report as markdown (the Prefect artifact)."""
    stats = stats or []
    nbytes = doc.get("bytes_checked")
    lines = [f"# Validation of {run} step {step}: **{state}**", "", _cell(doc.get("summary", "")), "",
             "| check | result |", "|---|---|",
             f"| tensors | {doc.get('tensors', len(stats))} read and audited (NaN/Inf, norm, max abs)"
             + (f", {nbytes / 2**30:.2f} GiB" if isinstance(nbytes, int) else "") + " |",
             *_checks_lines(doc), ""]
    rows = finding_rows(doc)
    fails = [r for r in rows if r["severity"] == "fail"]
    warns = [r for r in rows if r["severity"] == "warn"]
    for title, group in ((f"Failures ({len(fails)})", fails), (f"Warnings ({len(warns)})", warns)):
        if not group:
            continue
        lines += [f"## {title}", "", "| tensor | problem | file | why |", "|---|---|---|---|"]
        lines += [f"| `{_cell(r['tensor'])}` | {r['problem']} | `{_cell(r['file'])}` | {_cell(r['why'])} |"
                  if r["tensor"] else f"| - | {r['problem']} | `{_cell(r['file'])}` | {_cell(r['why'])} |"
                  for r in group[:MAX_TABLE_ROWS]]
        lines.append("")
    files = doc.get("files") or {}
    if files:
        lines += ["## Files", "", "| file | status |", "|---|---|"]
        notes = doc.get("not_loaded") or {}
        lines += [f"| `{_cell(f)}` | {_cell(notes.get(f, s)) if s == 'not loaded' else s} |"
                  for f, s in sorted(files.items())]
        lines += [f"| `{_cell(f)}` | {_cell(why)} |" for f, why in sorted(notes.items()) if f not in files]
        lines.append("")
    if len(stats) > MAX_TABLE_ROWS:
        lines.append(f"The tensor table shows {MAX_TABLE_ROWS} of {len(stats)} tensors (flagged ones first).")
    return "\n".join(lines) + "\n"
