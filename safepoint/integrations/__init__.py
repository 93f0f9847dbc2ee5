"""One line in a training script: seal each checkpoint a trainer writes, as it is written.

- `safepoint.integrations.huggingface.SafepointCallback`: a `transformers.TrainerCallback`
  (extra `huggingface`);
- `safepoint.integrations.lightning.SafepointCheckpointIO`: a Lightning `CheckpointIO` that writes
  each checkpoint into its own `step-N/` folder and seals it (extra `lightning`);
- `safepoint.integrations.dcp`: `save(...)` and `seal_finished(...)` for torchtitan and `dcp.save` users,
  `async_save(...)` and `seal_when_saved(...)` for `dcp.async_save` (FSDP2 state included);
- `safepoint.integrations.accelerate.save_state(...)`: `Accelerator.save_state` into `step-N/`, sealed;
- `safepoint.integrations.keep_local`: the `keep_local=N` retention of the HF callback and the Lightning
  plugin (older local folders go once a newer checkpoint is verified and they have a verified replica).
- `safepoint.integrations.mlflow` (`link`, `export`) and `safepoint.integrations.wandb` (`export`):
  references to the verified checkpoints in the tracker (safepoint.ops.export; extras `mlflow`, `wandb`).

Sealing is `safepoint.commit` (hash, fsync, manifest, marker). Each optionally emits the
`safepoint.checkpoint.committed` event so a Prefect deployment ingests it at once; otherwise
`safepoint watch` finds the marker. The core never imports any trainer library: each module imports
its own, and this package imports none of them.
"""
