"""Checkpoint save cost: `python benchmarks/checkpoint_save.py CONFIG [key=value ...]`.

Builds the train state of a config exactly as training does (real parameter and optimizer-state
shapes; no data, no training), then times how long the training loop is blocked by one
`checkpoint.save`: with async saves the call returns once the arrays are copied off the devices
and the write goes on in the background; with sync saves (checkpoint.async=false) it returns
when the step is on disk. Prints a markdown table of medians over --repeats saves. The data is
synthetic (data.eot_id=0 unless given, for attention.doc_mask); the checkpoints go to --dir, or
to a temporary folder removed at the end.
"""

import os
import shutil
import statistics
import sys
import tempfile
import time

from absl import flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
USAGE = "usage: python benchmarks/checkpoint_save.py CONFIG [key=value ...] [--repeats N] [--dir D]"


def define_flags() -> None:
  """The script's flags, defined only when it runs: tests import benchmarks into one registry."""
  flags.DEFINE_integer("repeats", 3, "Timed saves per mode (the median is reported).")
  flags.DEFINE_string("dir", "", "Where to write the checkpoints; '' = a temporary folder.")


def time_saves(state, config_dict, out: str, *, async_save: bool, repeats: int) -> dict:
  """Seconds the caller is blocked per save, and seconds until each save is on disk."""
  from nanotext import checkpoint
  manager = checkpoint.make_manager(out, keep=1, async_save=async_save)
  blocked, total = [], []
  for step in range(1, repeats + 1):
    t0 = time.perf_counter()
    checkpoint.save(manager, step, state, {"iterator": {}}, config_dict)
    blocked.append(time.perf_counter() - t0)
    checkpoint.wait(manager)  # untimed for the loop, but it bounds how often one can save
    total.append(time.perf_counter() - t0)
  manager.close()
  return {"blocked": blocked, "total": total}


def main(args) -> None:
  import jax
  from nanotext import wiring
  from nanotext.errors import UserError

  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  if not args:
    raise UserError(f"no CONFIG given; {USAGE}")
  if FLAGS.repeats < 1:
    raise UserError(f"--repeats={FLAGS.repeats}: give at least 1 save per mode")
  path, overrides = args[0], args[1:]
  # Synthetic data has no tokenizer: an end-of-text id for doc_mask configs, the user's if given.
  setup = wiring.prepare(path, ["data.eot_id=0", *overrides, "data.source=synthetic",
                                "data.tokenizer=none"])
  cfg, state = setup.cfg, jax.block_until_ready(setup.init_state())
  nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
  root = FLAGS.dir or tempfile.mkdtemp(prefix="ckpt_bench_")
  results = {}
  try:
    for name, async_save in (("async", True), ("sync", False)):
      out = os.path.join(root, name)
      try:
        results[name] = time_saves(state, cfg.to_dict(), out, async_save=async_save,
                                   repeats=FLAGS.repeats)
      finally:
        shutil.rmtree(out, ignore_errors=True)
  finally:
    if not FLAGS.dir:
      shutil.rmtree(root, ignore_errors=True)
  fmt = lambda xs: f"{statistics.median(xs):.2f} s ({', '.join(f'{x:.2f}' for x in xs)})"
  print(f"| config | {path} {' '.join(overrides)} |")
  print("| --- | --- |")
  print(f"| backend / devices | {jax.default_backend()} x {jax.device_count()} |")
  print(f"| parameters | {setup.num_params:,} |")
  print(f"| train state (params + {cfg.optim.name} state) | {nbytes / 2**30:.2f} GiB |")
  for name in ("async", "sync"):
    print(f"| {name}: loop blocked per save (median) | {fmt(results[name]['blocked'])} |")
    print(f"| {name}: until on disk (median) | {fmt(results[name]['total'])} |")


if __name__ == "__main__":
  from nanotext import cli
  define_flags()
  cli.run(main, USAGE, __doc__.split("\n", 1)[1], jax=True)
