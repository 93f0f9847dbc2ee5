"""Strict dry-run load of a checkpoint against the user's model (and optimizer), on the meta device.

`--model package.module:factory` (CLI), the flow's `model` parameter, or `model = "..."` under
`[runs.NAME]` in config.toml name a factory that builds the model, and optionally its optimizer:
it returns a `nn.Module`, or `(model, optimizer)`, or `{"model": ..., "optimizer": ...}`. It is
called inside `torch.device("meta")` (or with `device="meta"` when it takes a `device` argument), so
building a 70B model costs no memory; a factory may still build on the CPU.

Validation streams the checkpoint once and hands this module what it found: every tensor's name,
shape and dtype, and the plain values (param groups, step). The checks are pure functions of that:

- the model's state (under "model", "state_dict", "module" or the top level, by best match, or the
  configured `model_key`) against `model.state_dict()`: missing and unexpected keys (with a rename
  hint), shape and dtype mismatches; then the model's own `load_state_dict(strict=True)` on meta
  tensors, which also runs any custom loading hooks;
- the optimizer state against the optimizer's parameter groups: group count and sizes,
  hyperparameter keys, state for parameters no group lists, state tensors whose shape is not their
  parameter's;
- the step recorded in the checkpoint ("step", "global_step", ... or `step_key`) against the catalog's.

A PEFT adapter checkpoint (`adapter_model.safetensors` beside `adapter_config.json`, as HF `Trainer`
saves a `PeftModel`) holds the adapter's tensors only: the factory's base model is wrapped with the
saved adapter config (or the factory returns the `PeftModel` itself), the checkpoint's tensors are
compared with the adapter's keys, then loaded as PEFT loads them (`set_peft_model_state_dict`): any
key left unused or adapter weight left unset fails; the optimizer state is compared with the
adapter's trainable parameters (the base model's are frozen, so they have none).
"""

from __future__ import annotations

import copy
import importlib
import inspect
import re
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from safepoint.core.errors import UsageError
from safepoint.validation.problems import Problem, one_line

__all__ = [
    "DEFAULT_MODEL_KEYS", "DEFAULT_OPTIMIZER_KEYS", "DEFAULT_STEP_KEYS", "Found", "Harness", "HarnessError", "Issue",
    "OptimizerLayout", "TensorSpec", "adapter_harness", "build_harness", "check", "load_factory",
]

DEFAULT_MODEL_KEYS: tuple[str, ...] = ("model", "state_dict", "module", "")
DEFAULT_OPTIMIZER_KEYS: tuple[str, ...] = ("optimizer", "optim", "opt", "optimizer_state_dict", "optimizer_states.0")
DEFAULT_STEP_KEYS: tuple[str, ...] = ("step", "global_step", "iteration", "iter")
# Optimizer state kept per row/column rather than per element (torch.optim.Adafactor): not param-shaped.
FACTORED_STATE_KEYS = frozenset({"row_var", "col_var"})
MAX_ISSUES_PER_KIND = 50


class HarnessError(UsageError):
    """The model factory cannot be imported, called, or returned something that is not a model."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.dtype} {list(self.shape)}"


@dataclass(frozen=True)
class OptimizerLayout:
    """What the factory's optimizer expects: parameter names per group (state_dict index order)."""

    kind: str
    groups: tuple[tuple[str, ...], ...]
    hyper: tuple[frozenset[str], ...]
    params: dict[str, TensorSpec] = field(hash=False)


@dataclass
class Harness:
    spec: str
    model: nn.Module
    expected: dict[str, TensorSpec]
    optimizer: OptimizerLayout | None = None
    adapter: dict[str, TensorSpec] | None = None   # a PEFT adapter's trainable parameters, by name


@dataclass(frozen=True)
class Found:
    """What a checkpoint holds, by flattened name: tensors (shape, dtype) and plain values."""

    tensors: dict[str, TensorSpec]
    values: dict[str, Any]
    duplicates: dict[str, list[str]] = field(default_factory=dict)  # name -> files, when in several


@dataclass(frozen=True)
class Issue:
    problem: Problem
    tensor: str | None
    message: str


@dataclass
class CheckResult:
    issues: list[Issue] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------ factory

def load_factory(spec: str) -> Callable[..., Any]:
    """Resolve `package.module:factory` (the attribute may be dotted: `mod:Class.build`)."""
    module_name, sep, attr = (spec or "").partition(":")
    if not sep or not module_name or not attr:
        raise HarnessError(f"model factory must be package.module:function, got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:
        raise HarnessError(f"model factory {spec!r}: cannot import {module_name!r} ({one_line(e)})") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise HarnessError(f"model factory {spec!r}: {module_name!r} has no attribute {attr!r}") from None
    if not callable(obj):
        raise HarnessError(f"model factory {spec!r} is not callable")
    return obj


def _takes_device(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "device" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


_T = torch.Tensor
_INIT_METHODS = frozenset({_T.normal_, _T.uniform_, _T.bernoulli_, _T.cauchy_, _T.exponential_, _T.geometric_,
                           _T.log_normal_, _T.random_, _T.zero_, _T.fill_})


class _SkipInitOnMeta(TorchFunctionMode):
    """Initializers (torch.nn.init.*, Tensor.normal_/uniform_/zero_/...) do nothing on meta tensors.

    Meta tensors have no data, so skipping them changes nothing; running them costs seconds, because
    torch implements several of them on meta with Python references that import torch._dynamo.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        t = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        if isinstance(t, torch.Tensor) and t.is_meta and (
                func in _INIT_METHODS or getattr(func, "__module__", None) == "torch.nn.init"):
            return t
        return func(*args, **kwargs)


@contextmanager
def _cheap_construction() -> Iterator[None]:
    """Build a model and optimizer on meta without importing torch._dynamo (2-4 s on a busy 2-core host).

    Nothing here is ever compiled, but torch imports dynamo the first time an optimizer is built
    (`Optimizer.add_param_group` is wrapped in `torch._disable_dynamo`, which imports dynamo lazily)
    and the first time some initializers run on meta. For the factory call only, initializers on
    meta tensors are skipped and add_param_group is called unwrapped; both are restored after.
    """
    opt_cls = torch.optim.Optimizer
    wrapped = opt_cls.__dict__.get("add_param_group")
    raw = getattr(wrapped, "__wrapped__", None) if "torch._dynamo" not in sys.modules else None
    if raw is not None:
        opt_cls.add_param_group = raw  # type: ignore[method-assign]
    try:
        with _SkipInitOnMeta():
            yield
    finally:
        if raw is not None:
            opt_cls.add_param_group = wrapped  # type: ignore[method-assign]


def build_harness(spec: str, device: str = "meta") -> Harness:
    """Call the factory (on `device`, meta by default) and record what its model and optimizer expect."""
    factory = load_factory(spec)
    try:
        with torch.device(device), _cheap_construction():
            built = factory(device=device) if _takes_device(factory) else factory()
    except Exception as e:
        raise HarnessError(f"model factory {spec!r} failed: {one_line(e)}") from None
    if isinstance(built, dict):
        model, optimizer = built.get("model"), built.get("optimizer")
    elif isinstance(built, (tuple, list)):
        model, optimizer = (list(built) + [None, None])[:2]
    else:
        model, optimizer = built, None
    if not isinstance(model, nn.Module):
        raise HarnessError(f"model factory {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise HarnessError(f"model factory {spec!r} returned {type(optimizer).__name__} as optimizer, "
                           "not a torch.optim.Optimizer")
    expected = {k: TensorSpec(tuple(int(d) for d in v.shape), _dtype_name(v.dtype))
                for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    layout = optimizer_layout(model, optimizer) if optimizer is not None else None
    return Harness(spec, model, expected, layout)


def optimizer_layout(model: nn.Module, optimizer: torch.optim.Optimizer) -> OptimizerLayout:
    names = {id(p): n for n, p in model.named_parameters()}
    seen: set[int] = set()
    groups, hyper, params = [], [], {}
    for group in optimizer.param_groups:
        g = []
        for p in group["params"]:
            if id(p) in seen:
                continue
            seen.add(id(p))
            name = names.get(id(p), f"<parameter {len(seen) - 1} outside the model>")
            g.append(name)
            params[name] = TensorSpec(tuple(int(d) for d in p.shape), _dtype_name(p.dtype))
        groups.append(tuple(g))
        hyper.append(frozenset(k for k in group if k != "params"))
    return OptimizerLayout(type(optimizer).__name__, tuple(groups), tuple(hyper), params)


# ------------------------------------------------------------------------------------------ checks

def _keys(setting: str | Iterable[str] | None, default: tuple[str, ...]) -> tuple[tuple[str, ...], bool]:
    """(candidates, strict): a configured string is used as is; a list is tried in order."""
    if setting is None:
        return default, False
    if isinstance(setting, str):
        return (setting,), True
    return tuple(setting), False


def _under(names: Iterable[str], prefix: str) -> dict[str, str]:
    """{name without prefix: full name} for the names under `prefix` ("" is everything)."""
    if not prefix:
        return {n: n for n in names}
    p = prefix + "."
    return {n[len(p):]: n for n in names if n.startswith(p)}


def resolve_model_prefix(names: Iterable[str], expected: Iterable[str], candidates: tuple[str, ...],
                         exclude: str | None = None) -> str:
    """The candidate under which the checkpoint's names best match the model's keys (first wins ties)."""
    names = [n for n in names if not (exclude and (n == exclude or n.startswith(exclude + ".")))]
    want = set(expected)
    best, best_hits = None, 0
    for c in candidates:
        hits = len(want & set(_under(names, c)))
        if hits > best_hits:
            best, best_hits = c, hits
    if best is not None:
        return best
    for c in candidates:  # nothing matches: the first candidate the checkpoint has at all
        if c and _under(names, c):
            return c
    return ""


def _common_suffix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(reversed(a.split(".")), reversed(b.split("."))):
        if x != y:
            break
        n += 1
    return n


def _capped(issues: list[Issue]) -> list[Issue]:
    out: list[Issue] = []
    counts: dict[Problem, int] = {}
    for i in issues:
        counts[i.problem] = counts.get(i.problem, 0) + 1
        if counts[i.problem] <= MAX_ISSUES_PER_KIND:
            out.append(i)
    for problem, n in counts.items():
        if n > MAX_ISSUES_PER_KIND:
            out.append(Issue(problem, None, f"... and {n - MAX_ISSUES_PER_KIND} more {problem} problems"))
    return out


def check_state(expected: dict[str, TensorSpec], found: dict[str, TensorSpec], prefix: str) -> list[Issue]:
    """Missing/unexpected keys (with a rename hint), shape and dtype mismatches. Pure."""
    def full(k: str) -> str:
        return f"{prefix}.{k}" if prefix else k

    where = f"under {prefix!r}" if prefix else "at the top level"
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    by_spec: dict[TensorSpec, list[str]] = {}
    for k in unexpected:
        by_spec.setdefault(found[k], []).append(k)
    issues: list[Issue] = []
    for k in missing:
        hint = ""
        cands = by_spec.get(expected[k], [])
        if cands:
            scored = sorted(cands, key=lambda u: -_common_suffix(k, u))
            if len(scored) == 1 or _common_suffix(k, scored[0]) > _common_suffix(k, scored[1]):
                hint = f"; the checkpoint has {full(scored[0])!r} with that shape and dtype (renamed?)"
        issues.append(Issue(Problem.MISSING_KEY, full(k), f"{full(k)}: missing; the model expects {expected[k]} "
                            f"{where}{hint}"))
    for k in unexpected:
        issues.append(Issue(Problem.UNEXPECTED_KEY, full(k), f"{full(k)}: unexpected; the model has no such key "
                            f"({found[k]} in the checkpoint)"))
    for k in sorted(set(expected) & set(found)):
        e, f = expected[k], found[k]
        if e.shape != f.shape:
            issues.append(Issue(Problem.SHAPE, full(k), f"{full(k)}: shape {list(f.shape)} in the checkpoint, the "
                                f"model expects {list(e.shape)}"))
        elif e.dtype != f.dtype:
            issues.append(Issue(Problem.DTYPE, full(k), f"{full(k)}: dtype {f.dtype} in the checkpoint, the model "
                                f"expects {e.dtype}"))
    return issues


def dry_run_load(model: nn.Module, found: dict[str, TensorSpec]) -> Issue | None:
    """The model's own load_state_dict(strict=True) on meta tensors of the checkpoint's shapes/dtypes."""
    sd = {}
    for k, spec in found.items():
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            return None  # a dtype torch does not have (e.g. safetensors F4): nothing to dry-run
        sd[k] = torch.empty(spec.shape, dtype=dtype, device="meta")
    try:
        model.load_state_dict(sd, strict=True, assign=True)
    except Exception as e:
        return Issue(Problem.LOAD, None, f"{type(model).__name__}.load_state_dict refused the checkpoint "
                     f"(dry run on meta tensors): {one_line(e)}")
    return None


@dataclass
class FoundOptimizer:
    prefix: str
    groups: list[dict[str, Any]]          # index -> {hyperparameter: value}, with "params" as given
    state: dict[str, dict[str, Any]]      # param id (as text) -> {state key: TensorSpec or value}
    orphans: list[str]                    # state names whose parameter id no group lists


def find_optimizer(found: Found, candidates: tuple[str, ...]) -> FoundOptimizer | None:
    names = list(found.tensors) + list(found.values)
    prefix = next((c for c in candidates if any(n.startswith(f"{c}.state.") or n.startswith(f"{c}.param_groups.")
                                                for n in names)), None)
    if prefix is None:
        return None
    groups: dict[int, dict[str, Any]] = {}
    pat = re.compile(rf"^{re.escape(prefix)}\.param_groups\.(\d+)\.(.+)$")
    for n in names:
        m = pat.match(n)
        if m:
            groups.setdefault(int(m.group(1)), {})[m.group(2)] = found.values.get(n, found.tensors.get(n))
    group_list = [groups[i] for i in sorted(groups)]
    ids = {str(p) for g in group_list for p in (g.get("params") or []) if isinstance(g.get("params"), list)}
    state: dict[str, dict[str, Any]] = {}
    orphans: list[str] = []
    p = f"{prefix}.state."
    for n in names:
        if not n.startswith(p):
            continue
        rest = n[len(p):]
        pid, _, key = rest.rpartition(".")
        if pid not in ids:
            head, _, tail = rest.partition(".")
            pid, key = (head, tail) if head in ids else (pid, key)
        if pid not in ids:
            orphans.append(n)
            continue
        state.setdefault(pid, {})[key] = found.tensors.get(n, found.values.get(n))
    return FoundOptimizer(prefix, group_list, state, sorted(orphans))


def check_optimizer(layout: OptimizerLayout | None, opt: FoundOptimizer | None, model_expected: dict[str, TensorSpec],
                    candidates: tuple[str, ...]) -> list[Issue]:
    """Optimizer state against the parameter groups. Pure."""
    if opt is None:
        if layout is None:
            return []
        return [Issue(Problem.OPTIMIZER, None, f"the factory builds a {layout.kind} optimizer but the checkpoint holds "
                      f"no optimizer state (looked under {', '.join(repr(c) for c in candidates)})")]
    P = opt.prefix
    issues: list[Issue] = []
    for n in opt.orphans:
        issues.append(Issue(Problem.OPTIMIZER, n, f"{n}: state for a parameter no param group lists"))
    ck_groups = [[str(x) for x in g.get("params") or []] for g in opt.groups]
    for i, g in enumerate(opt.groups):
        if not isinstance(g.get("params"), list):
            issues.append(Issue(Problem.OPTIMIZER, f"{P}.param_groups.{i}.params",
                                f"{P}.param_groups.{i}: no 'params' list"))
    # Parameter name (and so expected shape) of each id in the checkpoint.
    spec_of: dict[str, tuple[str, TensorSpec]] = {}
    if layout is not None:
        if len(ck_groups) != len(layout.groups):
            issues.append(Issue(Problem.OPTIMIZER, f"{P}.param_groups",
                                f"{P}.param_groups: {len(ck_groups)} groups in the checkpoint, the factory's "
                                f"{layout.kind} has {len(layout.groups)}"))
        for i, (ck, exp) in enumerate(zip(ck_groups, layout.groups)):
            if len(ck) != len(exp):
                issues.append(Issue(Problem.OPTIMIZER, f"{P}.param_groups.{i}.params",
                                    f"{P}.param_groups.{i}: {len(ck)} parameters in the checkpoint, the factory's "
                                    f"{layout.kind} has {len(exp)}"))
            missing = sorted(layout.hyper[i] - set(opt.groups[i]) - {"params"})
            if missing:
                issues.append(Issue(Problem.OPTIMIZER, f"{P}.param_groups.{i}",
                                    f"{P}.param_groups.{i}: no {', '.join(missing)} (the factory's {layout.kind} "
                                    "needs them: another optimizer type?)"))
        if len(ck_groups) == len(layout.groups) and all(len(a) == len(b) for a, b in zip(ck_groups, layout.groups)):
            for ck, exp in zip(ck_groups, layout.groups):
                for pid, pname in zip(ck, exp):
                    spec_of[pid] = (pname, layout.params[pname])
    else:
        for pid in {p for g in ck_groups for p in g}:  # FQN-keyed optimizer state (DCP get_state_dict)
            if pid in model_expected:
                spec_of[pid] = (pid, model_expected[pid])
    for pid, entries in sorted(opt.state.items()):
        shapes = {k: v for k, v in entries.items() if isinstance(v, TensorSpec) and _numel(v.shape) > 1
                  and k not in FACTORED_STATE_KEYS}
        if pid in spec_of:
            pname, pspec = spec_of[pid]
            for k, v in sorted(shapes.items()):
                if v.shape != pspec.shape:
                    n = f"{P}.state.{pid}.{k}"
                    issues.append(Issue(Problem.OPTIMIZER, n, f"{n}: shape {list(v.shape)}, but its parameter "
                                        f"{pname} is {list(pspec.shape)}"))
        elif len({v.shape for v in shapes.values()}) > 1:
            n = f"{P}.state.{pid}"
            desc = ", ".join(f"{k} {list(v.shape)}" for k, v in sorted(shapes.items()))
            issues.append(Issue(Problem.OPTIMIZER, n,
                                f"{n}: state tensors of one parameter disagree on shape ({desc})"))
    return issues


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_step(values: dict[str, Any], step: int | None, candidates: tuple[str, ...]) -> tuple[list[Issue], Any]:
    """([issue] if the checkpoint's recorded step differs from `step`, (key, value) found or None). Pure."""
    for key in candidates:
        value = values.get(key)
        if value is None or isinstance(value, (str, bytes, list, tuple, dict)):
            continue
        try:
            recorded = int(value)
        except (TypeError, ValueError, OverflowError):
            return [Issue(Problem.STEP, key, f"{key}: {value!r} is not a step number")], (key, value)
        if isinstance(value, bool) or recorded != value:
            return [Issue(Problem.STEP, key, f"{key}: {value!r} is not a whole step number")], (key, value)
        if step is not None and recorded != step:
            return [Issue(Problem.STEP, key, f"{key}: the checkpoint records step {recorded}, the catalog says "
                          f"step {step}")], (key, recorded)
        return [], (key, recorded)
    return [], None


# ------------------------------------------------------------------------------------------ adapters

#: the files PEFT's `save_pretrained` writes (HF `Trainer` saving a `PeftModel`)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def _spec(t: torch.Tensor) -> TensorSpec:
    return TensorSpec(tuple(int(d) for d in t.shape), _dtype_name(t.dtype))


class AdapterMismatch(ValueError):
    """The saved adapter config cannot be applied to the factory's model: a verdict on the checkpoint."""


def adapter_harness(harness: Harness, config: dict[str, Any]) -> Harness:
    """The harness of a PEFT adapter checkpoint: the factory's model wrapped with the saved adapter config
    (unless it is a `PeftModel` already), expecting the adapter's tensors as PEFT saves them."""
    try:
        from peft import PeftConfig, PeftModel, get_peft_model
        from peft.utils import get_peft_model_state_dict
    except ImportError:
        raise HarnessError("an adapter checkpoint (adapter_config.json) needs peft for the strict load: "
                           "pip install peft") from None
    model = copy.deepcopy(harness.model)  # wrapping injects layers in place; the load below assigns tensors
    if not isinstance(model, PeftModel):
        try:
            fields = {k: v for k, v in config.items() if k not in ("base_model_name_or_path", "revision")}
            fields["inference_mode"] = False  # saved as True; training made the adapter trainable
            peft_config = PeftConfig.from_peft_type(**fields)
            with torch.device(next(model.parameters()).device), _cheap_construction():
                model = get_peft_model(model, peft_config)
        except Exception as e:
            raise AdapterMismatch(f"{ADAPTER_CONFIG}: the adapter does not fit the model of {harness.spec!r}: "
                                  f"{one_line(e)}") from None
    expected = {k: _spec(v) for k, v in get_peft_model_state_dict(model).items() if isinstance(v, torch.Tensor)}
    trainable = {n: _spec(p) for n, p in model.named_parameters() if p.requires_grad}
    return Harness(harness.spec, model, expected, harness.optimizer, trainable)


def adapter_view(found: Found, origin: dict[str, str]) -> tuple[Found, dict[str, str]]:
    """What the harness compares in an adapter checkpoint: the adapter file's tensors, and the optimizer
    state HF keeps at the top level of `optimizer.pt`, under `optimizer.` (RNG state and the rest left out). Pure."""
    def base(rel: str) -> str:
        return rel.rsplit("/", 1)[-1]

    def top_level_optimizer(name: str) -> bool:
        return name.startswith(("state.", "param_groups."))

    tensors: dict[str, TensorSpec] = {}
    where: dict[str, str] = {}
    for name, spec in found.tensors.items():
        file = origin.get(name, "")
        if base(file) in ADAPTER_WEIGHTS:
            tensors[name], where[name] = spec, file
        elif base(file).startswith("optimizer.") and top_level_optimizer(name):
            tensors[f"optimizer.{name}"], where[f"optimizer.{name}"] = spec, file
    values = {(f"optimizer.{k}" if top_level_optimizer(k) else k): v for k, v in found.values.items()}
    return Found(tensors, values, {k: v for k, v in found.duplicates.items() if k in tensors}), where


def dry_run_adapter_load(model: nn.Module, found: dict[str, TensorSpec]) -> Issue | None:
    """PEFT's own load (`set_peft_model_state_dict`) of meta tensors: a key it cannot place, or an adapter
    weight it leaves unset, fails."""
    from peft.utils import set_peft_model_state_dict

    sd = {}
    for k, spec in found.items():
        dtype = getattr(torch, spec.dtype, None)
        if not isinstance(dtype, torch.dtype):
            return None
        sd[k] = torch.empty(spec.shape, dtype=dtype, device="meta")
    try:
        result = set_peft_model_state_dict(model, sd, low_cpu_mem_usage=True)  # assigned: meta in, nothing copied
    except Exception as e:
        return Issue(Problem.LOAD, None, f"set_peft_model_state_dict refused the adapter (dry run on meta "
                     f"tensors): {one_line(e)}")
    adapter_names = set(getattr(model, "peft_config", {}) or {"default"})
    unset = [k for k in result.missing_keys if any(f".{a}." in k or k.endswith(f".{a}") for a in adapter_names)]
    if result.unexpected_keys or unset:
        what = [f"{len(result.unexpected_keys)} key(s) it cannot place ({', '.join(result.unexpected_keys[:3])})"] \
            if result.unexpected_keys else []
        what += [f"{len(unset)} adapter weight(s) unset ({', '.join(unset[:3])})"] if unset else []
        return Issue(Problem.LOAD, None, f"set_peft_model_state_dict: {'; '.join(what)}")
    return None


def check_adapter_optimizer(trainable: dict[str, TensorSpec], opt: FoundOptimizer | None) -> list[Issue]:
    """The optimizer state of an adapter run: one entry per trainable adapter parameter, each of its shape.

    HF's Trainer groups parameters by weight decay, so the state's order is not the model's: the shapes
    are compared as a multiset. Pure."""
    if opt is None:
        return []
    P = opt.prefix
    ids = [str(x) for g in opt.groups for x in (g.get("params") or []) if isinstance(g.get("params"), list)]
    issues: list[Issue] = []
    if len(set(ids)) != len(trainable):
        issues.append(Issue(Problem.OPTIMIZER, f"{P}.param_groups",
                            f"{P}.param_groups: {len(set(ids))} parameters in the checkpoint, the adapter trains "
                            f"{len(trainable)}"))
    want = sorted(s.shape for s in trainable.values())
    have = []
    for pid, entries in sorted(opt.state.items()):
        shapes = {v.shape for k, v in entries.items() if isinstance(v, TensorSpec) and _numel(v.shape) > 1
                  and k not in FACTORED_STATE_KEYS}
        if len(shapes) > 1:
            issues.append(Issue(Problem.OPTIMIZER, f"{P}.state.{pid}",
                                f"{P}.state.{pid}: state tensors of one parameter disagree on shape"))
        have.extend(shapes)
    for shape in sorted(set(have)):
        if have.count(shape) > want.count(shape):
            issues.append(Issue(Problem.OPTIMIZER, f"{P}.state",
                                f"{P}.state: {have.count(shape)} parameter(s) with state of shape {list(shape)}, "
                                f"the adapter trains {want.count(shape)} of that shape"))
    return issues


def check(harness: Harness, found: Found, *, step: int | None = None, model_key: Any = None,
          optimizer_key: Any = None, step_key: Any = None, check_step_: bool = True,
          adapter_config: dict[str, Any] | None = None) -> CheckResult:
    """Every harness check over what validation found; issues and what was compared (info).

    `adapter_config`: the checkpoint is a PEFT adapter saved with this `adapter_config.json`."""
    if adapter_config is not None:
        try:
            harness = adapter_harness(harness, adapter_config)
        except AdapterMismatch as e:
            return CheckResult([Issue(Problem.LOAD, None, str(e))], {"model": harness.spec})
    result = CheckResult(info={"model": harness.spec})
    opt_keys, _ = _keys(optimizer_key, DEFAULT_OPTIMIZER_KEYS)
    opt = find_optimizer(found, opt_keys)
    model_keys, strict = _keys(model_key, DEFAULT_MODEL_KEYS)
    prefix = model_keys[0] if strict else resolve_model_prefix(
        found.tensors, harness.expected, model_keys, exclude=opt.prefix if opt else None)
    under = _under(found.tensors, prefix)
    if opt is not None and not prefix:
        under = {k: v for k, v in under.items() if not k.startswith(opt.prefix + ".")}
    state_found = {k: found.tensors[n] for k, n in under.items()}
    issues = check_state(harness.expected, state_found, prefix)
    for n in sorted(under.values()):
        if n in found.duplicates:
            issues.append(Issue(Problem.UNEXPECTED_KEY, n, f"{n}: found in {len(found.duplicates[n])} files "
                                f"({', '.join(found.duplicates[n])}); the model expects one copy"))
    if not issues:
        load_issue = dry_run_load(harness.model, state_found) if harness.adapter is None \
            else dry_run_adapter_load(harness.model, state_found)
        if load_issue:
            issues.append(load_issue)
    if harness.adapter is None or harness.optimizer is not None:
        issues += check_optimizer(harness.optimizer, opt, harness.expected, opt_keys)
    else:
        issues += check_adapter_optimizer(harness.adapter, opt)
    if check_step_:
        step_issues, recorded = check_step(found.values, step, _keys(step_key, DEFAULT_STEP_KEYS)[0])
        issues += step_issues
        result.info["step"] = {"catalog": step, "checkpoint": recorded[1] if recorded else None,
                               "key": recorded[0] if recorded else None}
    result.info.update({
        "model_key": prefix, "model_tensors": len(harness.expected), "optimizer_key": opt.prefix if opt else None,
        "optimizer": harness.optimizer.kind if harness.optimizer else None,
    })
    if harness.adapter is not None:
        result.info["adapter"] = {"peft_type": (adapter_config or {}).get("peft_type"),
                                  "trainable": len(harness.adapter)}
    result.issues = _capped(issues)
    return result
