"""Compile time against depth, unrolled vs model.scan_layers:
`python benchmarks/scan_compile.py [CONFIG] [key=value ...] [--depths 4,12,48] [--repeats 3]`.

Builds each run as training does (wiring.prepare), then times tracing + lowering and XLA's
compilation of the train step (trainer.make_train_step) on abstract state and batch, so nothing
is allocated. Each measurement runs in a fresh process (nothing cached or held over), stopped
after --timeout seconds; depths and the two ways are interleaved so machine noise hits them
alike. Prints a markdown table of medians. Defaults: configs/base.yml at d_model 128.
"""

import json
import os
import statistics
import subprocess
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The script's flags, defined only when it runs: tests import benchmarks into one registry."""
  flags.DEFINE_list("depths", ["4", "12", "48"], "model.num_layers values to time.")
  flags.DEFINE_integer("repeats", 3, "Timed compilations per depth and way (median).")
  flags.DEFINE_float("timeout", 300, "Seconds one measurement may take (then stopped).")


TINY_WIDTH = ["model.d_model=128", "model.num_heads=2", "model.head_dim=64",
              "model.vocab_size=512", "model.align=0", "train.batch_size=8", "train.seq_len=128",
              "data.source=synthetic", "data.tokenizer=none", "data.eot_id=0"]


def compile_times(path, overrides) -> tuple:
  """(lower_s, compile_s) of one fresh train step of the config."""
  import jax
  import numpy as np
  from nanotext import trainer, wiring
  run = wiring.prepare(path, overrides, devices=jax.devices()[:1])
  t = run.cfg.train
  batch = {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), np.int32,
                                   sharding=run.batch_sharding) for k in ("inputs", "targets")}
  t0 = time.perf_counter()
  lowered = trainer.make_train_step(run).lower(run.abstract_state(), batch)
  t1 = time.perf_counter()
  lowered.compile()
  return t1 - t0, time.perf_counter() - t1


def measure(path, overrides, timeout: float):
  """compile_times in a fresh process (nothing cached or held over); None past `timeout` s."""
  code = ("import sys, json; sys.path.insert(0, sys.argv[1]); import scan_compile as s; "
          "print(json.dumps(s.compile_times(sys.argv[2], sys.argv[3:])))")
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    out = subprocess.run([sys.executable, "-c", code, here, path, *overrides], timeout=timeout,
                         capture_output=True, text=True)
  except subprocess.TimeoutExpired:
    return None
  if out.returncode:  # the child's traceback: its last line, without the exception's name
    from nanotext.errors import UserError
    last = (out.stderr.strip().splitlines() or ["no output"])[-1]
    raise UserError(last.split("UserError: ", 1)[-1])
  return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


USAGE = ("usage: python benchmarks/scan_compile.py [CONFIG] [key=value ...] [--depths 4,12,48] "
         "[--repeats 3]")


def main(argv):
  import bench_cli
  from nanotext import wiring
  from nanotext.errors import UserError, fail
  path = argv[1] if len(argv) > 1 else os.path.join(bench_cli.REPO, "configs", "base.yml")
  extra = TINY_WIDTH + argv[2:]
  if not all(d.isdigit() and int(d) > 0 for d in FLAGS.depths):
    raise UserError(f"--depths={','.join(FLAGS.depths)}: give positive integers")
  bench_cli.at_least(1, repeats=FLAGS.repeats)
  if FLAGS.timeout <= 0:
    raise UserError(f"--timeout={FLAGS.timeout}: give a number of seconds above 0")
  bench_cli.existing_file(path, "CONFIG")
  wiring.load(path, extra)  # its keys and values, before any process compiles
  depths = [int(d) for d in FLAGS.depths]
  times = {(d, s): [] for d in depths for s in (False, True)}
  try:
    for _ in range(FLAGS.repeats):
      for d in depths:
        for scan in (False, True):
          if None in times[(d, scan)]:
            continue  # timed out once: not again
          t = measure(path, extra + [f"model.num_layers={d}",
                                     f"model.scan_layers={str(scan).lower()}"], FLAGS.timeout)
          times[(d, scan)].append(t)
          print(f"layers={d} scan={scan}: {t}", file=sys.stderr, flush=True)
  except UserError as e:
    fail(str(e))
  print(f"Train-step compile time, medians of {FLAGS.repeats} fresh processes (lower = trace + "
        f"lower; compile = XLA; > {FLAGS.timeout:.0f} s: stopped):\n")
  print("| layers | unrolled: lower + compile (s) | scanned: lower + compile (s) "
        "| unrolled / scanned |")
  print("| --- | --- | --- | --- |")
  for d in depths:
    u, s = cell(times[(d, False)]), cell(times[(d, True)])
    ratio = "?" if s[1] is None else f"> {FLAGS.timeout / s[1]:.0f}x" if u[1] is None \
        else f"{u[1] / s[1]:.1f}x"
    print(f"| {d} | {u[0]} | {s[0]} | {ratio} |")


def cell(runs) -> tuple:
  """(text, total seconds or None when a run timed out) of one table cell."""
  if None in runs:
    return f"> {FLAGS.timeout:.0f} (stopped)", None
  lower, comp = (statistics.median(t[k] for t in runs) for k in (0, 1))
  return f"{lower:.2f} + {comp:.2f} = {lower + comp:.2f}", lower + comp


if __name__ == "__main__":
  define_flags()
  import bench_cli
  bench_cli.run(main, USAGE, __doc__)
