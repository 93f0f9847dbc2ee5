"""What validation checks and how strictly: `[validation]` in config.toml, overridable per run.

    [validation]
    norm_jump_factor = 10.0        # flag a tensor whose norm grew or shrank more than x10 since the
                                   # previous verified checkpoint of the run (0 turns it off)
    norm_floor = 1e-6              # norms below this count as this (no infinite jumps from zero)
    norm_jump_rms_floor = 1e-2     # and so do norms whose RMS is below this (zero-initialised biases)
    norm_jump_min_numel = 2        # smaller tensors (step counters) are not compared
    norm_jump_ignore = ["*.step"]  # glob patterns of tensor names never compared
    max_abs_parameter = 1e20       # a float32/bf16 parameter with |x| beyond this is damage, even in
                                   # a run's first checkpoint (a flipped exponent bit; 0 turns it off)
    warn_only = ["dtype"]          # problems reported as warnings: flagged, but not failing; also the
                                   # consistency rules: stale_optimizer, stale_weights, duplicate, torn
    model_key = "model"            # where the model's state sits (default: best of model, state_dict,
                                   # module, top level); optimizer_key and step_key likewise
    device = "meta"                # where the model factory builds the model
    threads = 1                    # torch threads for the stats (0: torch's default); see below
    max_tensor_bytes = 0           # refuse larger tensors (0: no limit); stats_chunk_elems, ...
    sandbox = true                 # read every file in a child process with the limits below
    sandbox_memory_bytes = 2147483648  # memory validation may use (files it maps come on top)
    sandbox_cpu_seconds = 300      # CPU time: this + sandbox_cpu_seconds_per_gib (60) per GiB read
    sandbox_wall_seconds = 600     # wall clock: this + sandbox_wall_seconds_per_gib (120) per GiB read
    opaque_pickle = "report"       # a pickle weights_only refuses (training_args.bin): "report" it as
                                   # not loaded, or "fail" the checkpoint
    unknown_format = "report"      # a file in no known format: "report" (hashed only) or "fail"
    roles = {"ema.*" = "parameter"}  # name globs -> role, ahead of the defaults (safepoint.validation.roles)

    [validation.rules.buffer]      # the rules table per role (safepoint.validation.roles): nonfinite and
    nonfinite = "fail"             # norm_jump, each "fail", "warn" or "off"

    [runs.llama-7b]
    model = "mypkg.models:build"   # model factory for the strict dry-run load of this run
    norm_jump_factor = 5.0         # any [validation] key may be overridden per run

Every flag is failing by default, so a checkpoint with a norm jump is `invalid`; `warn_only` turns
chosen problems into warnings that are shown in the report but leave the checkpoint `verified`.

`threads = 1` by default: the stats are two memory-bound reductions per piece, one core already
streams them at several GB/s, and on a host whose cores are busy (training input pipelines,
uploads) extra OpenMP threads mostly spin at barriers. Measured on a loaded 2-core machine (load
average ~7.7), validating a 4 GiB checkpoint took 1.9-3.6 s wall and 1.4 s CPU with one thread,
9-13 s wall and 6 s CPU with two.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from safepoint.core.errors import UsageError
from safepoint.validation.problems import Limits, Problem
from safepoint.validation.roles import Rules
from safepoint.validation.sandbox import SANDBOX_KEYS, SandboxLimits, sandbox_limits_from
from safepoint.validation.stats import Thresholds

# Problems that can never be downgraded to warnings: unreadable or unsafe bytes.
ALWAYS_FAILING = frozenset({Problem.UNSAFE, Problem.UNLOADABLE, Problem.MALFORMED, Problem.MISSING, Problem.LIMIT,
                            Problem.CHANGED})

_THRESHOLD_KEYS = {"norm_jump_factor": "norm_jump_factor", "norm_floor": "norm_floor",
                   "norm_jump_rms_floor": "rms_floor",
                   "norm_jump_min_numel": "min_numel", "norm_jump_ignore": "ignore",
                   "max_abs_parameter": "max_abs_parameter"}
_LIMIT_KEYS = {f.name for f in fields(Limits)}
_OWN_KEYS = {"model", "model_key", "optimizer_key", "step_key", "check_step", "warn_only", "device", "threads",
             "opaque_pickle", "unknown_format", "rules", "roles"}
REPORT, FAIL = "report", "fail"
KNOWN_KEYS = frozenset(_OWN_KEYS | set(_THRESHOLD_KEYS) | _LIMIT_KEYS | SANDBOX_KEYS)


@dataclass(frozen=True)
class ValidationSettings:
    model: str | None = None                       # factory spec package.module:function
    device: str = "meta"
    model_key: str | tuple[str, ...] | None = None  # None: harness defaults; str: exactly this key
    optimizer_key: str | tuple[str, ...] | None = None
    step_key: str | tuple[str, ...] | None = None
    check_step: bool = True
    threads: int = 1                               # torch intra-op threads while validating (0: leave as is)
    thresholds: Thresholds = field(default_factory=Thresholds)
    warn_only: frozenset[Problem] = frozenset()
    limits: Limits = field(default_factory=Limits)
    sandbox: SandboxLimits = field(default_factory=SandboxLimits)  # limits of safepoint.validation.sandbox
    rules: Rules = field(default_factory=Rules)    # role of each tensor and what non-finite/norm jumps do
    opaque_pickle: str = REPORT                    # refused pickles: reported as not loaded, or failing
    unknown_format: str = REPORT                   # files in no known format: reported, or failing

    def failing(self, problem: Problem) -> bool:
        return problem in ALWAYS_FAILING or problem not in self.warn_only

    @classmethod
    def from_mapping(cls, doc: dict[str, Any], *, where: str = "[validation]") -> ValidationSettings:
        unknown = sorted(set(doc) - KNOWN_KEYS)
        if unknown:
            raise UsageError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(KNOWN_KEYS))}")
        return cls().merged(doc, where=where)

    def merged(self, doc: dict[str, Any], *, where: str) -> ValidationSettings:
        """These settings with the known keys of `doc` applied (unknown keys are ignored here)."""
        def bad(key: str, what: str) -> UsageError:
            return UsageError(f"{where}: {key} must be {what}, got {doc[key]!r}")

        out = self
        th: dict[str, Any] = {}
        for key, attr in _THRESHOLD_KEYS.items():
            if key not in doc:
                continue
            v = doc[key]
            if key == "norm_jump_ignore":
                if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                    raise bad(key, "a list of glob patterns")
                th[attr] = tuple(v)
            elif key == "norm_jump_min_numel":
                if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                    raise bad(key, "a non-negative integer")
                th[attr] = v
            else:
                if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                    raise bad(key, "a non-negative number")
                th[attr] = float(v) if v or key != "norm_jump_factor" else None
        if th:
            out = replace(out, thresholds=replace(out.thresholds, **th))
        lim: dict[str, Any] = {}
        for key in _LIMIT_KEYS & set(doc):
            v = doc[key]
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise bad(key, "a non-negative integer")
            lim[key] = None if key == "max_tensor_bytes" and v == 0 else v
        if lim:
            out = replace(out, limits=replace(out.limits, **lim))
        for key in ("model_key", "optimizer_key", "step_key"):
            if key in doc:
                v = doc[key]
                if isinstance(v, list) and all(isinstance(x, str) for x in v):
                    v = tuple(v)
                elif not isinstance(v, str):
                    raise bad(key, "a string or a list of strings")
                out = replace(out, **{key: v})
        if "model" in doc:
            if not isinstance(doc["model"], str) or ":" not in doc["model"]:
                raise bad("model", "'package.module:function'")
            out = replace(out, model=doc["model"] or None)
        if "device" in doc:
            if not isinstance(doc["device"], str):
                raise bad("device", "a device name such as 'meta' or 'cpu'")
            out = replace(out, device=doc["device"])
        if "threads" in doc:
            if not isinstance(doc["threads"], int) or isinstance(doc["threads"], bool) or doc["threads"] < 0:
                raise bad("threads", "a non-negative integer")
            out = replace(out, threads=doc["threads"])
        if "check_step" in doc:
            if not isinstance(doc["check_step"], bool):
                raise bad("check_step", "true or false")
            out = replace(out, check_step=doc["check_step"])
        if SANDBOX_KEYS & set(doc):
            out = replace(out, sandbox=sandbox_limits_from(out.sandbox, doc, where=where))
        for key in ("opaque_pickle", "unknown_format"):
            if key in doc:
                if doc[key] not in (REPORT, FAIL):
                    raise bad(key, '"report" or "fail"')
                out = replace(out, **{key: doc[key]})
        if "rules" in doc or "roles" in doc:
            out = replace(out, rules=out.rules.merged(doc.get("rules"), doc.get("roles"), where=where))
        if "warn_only" in doc:
            v = doc["warn_only"]
            names = {p.value: p for p in Problem}
            if not isinstance(v, list) or not all(isinstance(x, str) and x in names for x in v):
                raise bad("warn_only", f"a list of problems among {', '.join(sorted(names))}")
            chosen = frozenset(names[x] for x in v)
            if chosen & ALWAYS_FAILING:
                raise UsageError(f"{where}: warn_only cannot include "
                                 f"{', '.join(sorted(p.value for p in chosen & ALWAYS_FAILING))} (always failing)")
            out = replace(out, warn_only=chosen)
        return out

    @classmethod
    def from_config(cls, config: Any, run: str | None = None, *, model: str | None = None) -> ValidationSettings:
        """`[validation]`, then the validation keys of `[runs.RUN]`, then an explicit `model` (e.g. --model)."""
        settings = cls.from_mapping(dict(getattr(config, "validation", {}) or {}))
        if run is not None:
            per_run = {k: v for k, v in (config.runs.get(run) or {}).items() if k in KNOWN_KEYS}
            settings = settings.merged(per_run, where=f"[runs.{run}]")
        if model:
            settings = replace(settings, model=model)
        return settings
