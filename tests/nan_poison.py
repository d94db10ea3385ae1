"""Test helper: make one training step's loss NaN, from outside the train step.

`install(config_path, overrides, step)` reads the inputs that 1-based train `step` will get from
the run's own (deterministic) data pipeline and wraps `nanotext.trainer.loss_fn` so that a batch
equal to them has a NaN loss (and so NaN gradients). The production step carries no hook; this
exercises train.on_nonfinite on a real NaN flowing through the real step. Use it in-process
(undo with the returned function) or as `python tests/nan_poison.py STEP CONFIG [key=value ...]`,
which then runs `python -m nanotext.train CONFIG [key=value ...]` in the same process.
"""

import os
import sys

import jax.numpy as jnp
import numpy as np


def install(path, overrides, step: int):
  """Poison train step `step`; returns a function that restores trainer.loss_fn."""
  from nanotext import trainer, wiring
  run = wiring.prepare(path, list(overrides))
  it = run.train_iter()
  for _ in range(step - 1):
    next(it)
  bad = np.asarray(next(it)["inputs"])
  real = trainer.loss_fn

  def poisoned(graphdef, params, inputs_BT, targets_BT, *args, **kwargs):
    loss = real(graphdef, params, inputs_BT, targets_BT, *args, **kwargs)
    if inputs_BT.shape != bad.shape:
      return loss
    hit = jnp.all(inputs_BT == jnp.asarray(bad))
    return loss * jnp.where(hit, jnp.nan, 1.0).astype(loss.dtype)

  trainer.loss_fn = poisoned
  return lambda: setattr(trainer, "loss_fn", real)


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  step, path, *rest = sys.argv[1:]
  install(path, rest, int(step))
  from nanotext import cli
  from nanotext.train import USAGE, main
  cli.run(main, USAGE, argv=["nanotext.train", path, *rest], jax=True)
