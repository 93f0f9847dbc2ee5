"""What each tensor of a checkpoint is for, and what validation does about it: one rules table.

A NaN in a weight or an Adam moment means the run is broken; an `inf` in Lightning's
`ModelCheckpoint.kth_value` or in a `-inf` attention-mask buffer is what a correct run writes. So every
tensor gets a role from where it sits (its file and its dotted name), and the rules table says, per
role, whether non-finite values fail the checkpoint or are reported, and whether the norm-jump audit
compares it at all:

    role              non-finite   norm jump   why
    parameter         fail         fail        a broken weight is a broken model
    optimizer_state   fail         off         NaN moments poison the next step; Adam's moments start at
                                               zero and grow >10x between early checkpoints of a good run
    buffer            warn         off         attention masks hold -inf; running stats are not trained
    trainer_metadata  warn         off         callbacks and loops keep inf sentinels (kth_value, best score)
    rng_state         warn         off         bytes of a generator, not numbers
    unknown           fail         fail        nothing says it is harmless

`[validation.rules]` changes any cell (`[validation.rules.buffer] nonfinite = "fail"`), and
`[validation] roles = {"ema.*" = "parameter"}` assigns roles to names by glob, ahead of the defaults.
Pure functions: the role of a name never depends on its values.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from safepoint.core.errors import UsageError

__all__ = ["DEFAULT_RULES", "Role", "Rule", "Rules", "role_of"]


class Role(str, Enum):
    PARAMETER = "parameter"
    BUFFER = "buffer"
    OPTIMIZER_STATE = "optimizer_state"
    TRAINER_METADATA = "trainer_metadata"
    RNG_STATE = "rng_state"
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        return self.value


FAIL, WARN, OFF = "fail", "warn", "off"
ACTIONS = (FAIL, WARN, OFF)


@dataclass(frozen=True)
class Rule:
    nonfinite: str = FAIL   # NaN/Inf values: fail the checkpoint, warn (reported, verified), or off
    norm_jump: str = FAIL   # norm-jump audit against the previous verified checkpoint: fail, warn or off


DEFAULT_RULES: dict[Role, Rule] = {
    Role.PARAMETER: Rule(FAIL, FAIL),
    Role.OPTIMIZER_STATE: Rule(FAIL, OFF),
    Role.BUFFER: Rule(WARN, OFF),
    Role.TRAINER_METADATA: Rule(WARN, OFF),
    Role.RNG_STATE: Rule(WARN, OFF),
    Role.UNKNOWN: Rule(FAIL, FAIL),
}

# ------------------------------------------------------------------------------------ where a name sits

# First segment of a dotted name -> role (torch.save dicts, Lightning .ckpt, torchtitan DCP, Accelerate).
_TOP_KEYS: dict[str, Role] = {
    **dict.fromkeys(("model", "state_dict", "module", "model_state_dict", "ema", "model_ema"), Role.PARAMETER),
    **dict.fromkeys(("optimizer", "optim", "opt", "optimizer_state_dict", "optimizer_states", "optimizers"),
                    Role.OPTIMIZER_STATE),
    **dict.fromkeys(("lr_scheduler", "lr_schedulers", "scheduler", "schedulers", "callbacks", "loops", "train_state",
                     "trainer_state", "dataloader", "hyper_parameters", "hparams", "scaler", "grad_scaler",
                     "amp_scaler", "loss_scaler", "epoch", "global_step", "step", "iteration"),
                    Role.TRAINER_METADATA),
    **dict.fromkeys(("rng", "rng_state", "rng_states", "random_state", "random_states", "torch_manual_seed",
                     "torch_cuda_manual_seed", "cpu", "cuda", "numpy", "python", "xla", "npu", "mps"),
                    Role.RNG_STATE),
}
# Containers under which the first segment is the role (Lightning keeps the model under `state_dict`).
_PARAM_PREFIXES = ("model.", "state_dict.", "module.", "model_state_dict.", "ema.", "model_ema.")

# Files whose whole content has one role, by base name (HF Trainer, Accelerate).
_FILE_ROLES: tuple[tuple[str, Role], ...] = (
    ("optimizer*.pt", Role.OPTIMIZER_STATE), ("optimizer*.bin", Role.OPTIMIZER_STATE),
    ("optimizer*.pth", Role.OPTIMIZER_STATE),
    ("scheduler*.pt", Role.TRAINER_METADATA), ("scheduler*.bin", Role.TRAINER_METADATA),
    ("scaler*.pt", Role.TRAINER_METADATA), ("scaler*.bin", Role.TRAINER_METADATA),
    ("rng_state*.pth", Role.RNG_STATE), ("random_states_*.pkl", Role.RNG_STATE),
    ("custom_checkpoint_*.pkl", Role.UNKNOWN),
)

# Buffers models register that are not trained (masks hold -inf by design, running stats, rotary tables).
BUFFER_PATTERNS: tuple[str, ...] = (
    "*running_mean", "*running_var", "*num_batches_tracked", "*mask", "*masked_bias", "*causal_mask",
    "*attn.bias_mask", "*inv_freq", "*position_ids", "*rope*cache*", "*freqs_cis", "*_cos_cached", "*_sin_cached",
)
# Per-parameter optimizer state: `...state.<param>.<moment>` (torch.optim state_dict, flattened DCP too).
_MOMENT = re.compile(r"(^|\.)state\.(.+\.)?(exp_avg|exp_avg_sq|max_exp_avg_sq|momentum_buffer|square_avg|"
                     r"acc_delta|sum|mu|eta|ax|prev|step_size|exp_inf|row_var|col_var|variance|step)$")


def _base(file: str) -> str:
    return file.rsplit("/", 1)[-1]


def role_of(file: str, name: str, overrides: tuple[tuple[str, Role], ...] = ()) -> Role:
    """The role of tensor `name` (dotted, as validation names it) found in `file` (relative path)."""
    for pattern, role in overrides:
        if fnmatch.fnmatchcase(name, pattern):
            return role
    base = _base(file)
    for pattern, role in _FILE_ROLES:
        if fnmatch.fnmatchcase(base, pattern):
            return role
    top = name.split(".", 1)[0]
    role = _TOP_KEYS.get(top)
    if role is Role.PARAMETER or (role is None and _MOMENT.search(name) is None):
        # A model's own tensors: in a model container, a weights file, or at the top level of a file
        # that holds nothing else (safetensors, torch.save(model.state_dict()), torchtitan's DCP).
        if any(fnmatch.fnmatchcase(name, p) for p in BUFFER_PATTERNS):
            return Role.BUFFER
        return Role.PARAMETER
    if role is None:
        return Role.OPTIMIZER_STATE
    return role


# ------------------------------------------------------------------------------------ the table

@dataclass(frozen=True)
class Rules:
    """The rules table and the name->role overrides, as configured."""

    table: tuple[tuple[Role, Rule], ...] = tuple(DEFAULT_RULES.items())
    overrides: tuple[tuple[str, Role], ...] = ()

    def rule(self, role: Role) -> Rule:
        return dict(self.table).get(role, DEFAULT_RULES[Role.UNKNOWN])

    def role(self, file: str, name: str) -> Role:
        return role_of(file, name, self.overrides)

    def to_dict(self) -> dict[str, Any]:
        return {str(r): {"nonfinite": rule.nonfinite, "norm_jump": rule.norm_jump} for r, rule in self.table}

    def merged(self, rules: Any, roles: Any, *, where: str) -> Rules:
        """These rules with `[validation.rules]` (role -> {nonfinite, norm_jump}) and `roles` (glob -> role)."""
        names = {r.value: r for r in Role}
        table = dict(self.table)
        if rules is not None:
            if not isinstance(rules, dict):
                raise UsageError(f"{where}: rules must be a table of roles, got {rules!r}")
            for key, doc in rules.items():
                if key not in names:
                    raise UsageError(f"{where}: rules.{key}: unknown role; roles: {', '.join(names)}")
                if not isinstance(doc, dict) or set(doc) - {"nonfinite", "norm_jump"}:
                    raise UsageError(f"{where}: rules.{key} takes nonfinite and norm_jump, got {doc!r}")
                for cell, action in doc.items():
                    if action not in ACTIONS:
                        raise UsageError(f"{where}: rules.{key}.{cell} must be one of {', '.join(ACTIONS)}, "
                                         f"got {action!r}")
                table[names[key]] = replace(table[names[key]], **doc)
        overrides = self.overrides
        if roles is not None:
            if not isinstance(roles, dict) or not all(isinstance(k, str) and v in names for k, v in roles.items()):
                raise UsageError(f"{where}: roles must map name globs to one of {', '.join(names)}, got {roles!r}")
            overrides = tuple((k, names[v]) for k, v in roles.items()) + overrides
        return Rules(tuple(table.items()), overrides)
