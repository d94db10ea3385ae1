"""Shared pieces of the converters: reading a run, flat parameter names (their outputs are
written whole or not at all by nanotext.outputs)."""

import os

import jax

from nanotext.errors import UserError
from nanotext.trees import stack_blocks, unstack_blocks
from nanotext import rundir


def load_run(run: str, step: int = -1):
  """(config, step, params as numpy) of a run directory's newest (or given) checkpoint."""
  from nanotext import checkpoint, config
  rundir.check_run_dir(run, "--run")
  cfg = config.load(os.path.join(run, "config.yml"))
  step, params = checkpoint.latest_params(run, step)
  return cfg, step, jax.device_get(params)


def per_layer(cfg, flat: dict) -> dict:
  """Flat params of a model.scan_layers run under the unrolled model's names (one layer each);
  other runs' params unchanged."""
  return unstack_blocks(flat) if cfg.model.scan_layers else flat


def stacked(cfg, flat: dict) -> dict:
  """Inverse of `per_layer`: unrolled 'blocks.{i}.*' names stacked for a model.scan_layers run."""
  return stack_blocks(flat, cfg.model.num_layers) if cfg.model.scan_layers else flat


def require(cfg, wanted: dict, why: str) -> None:
  """Refuse the first config key whose value differs from `wanted[key]`, naming it."""
  from nanotext import config
  for key, value in wanted.items():
    have = config.get(cfg, key)
    ok = value(have) if callable(value) else have == value
    if not ok:
      want = "" if callable(value) else f" (needs {value!r})"
      raise UserError(f"{why}: {key}={have!r} is not supported{want}")
