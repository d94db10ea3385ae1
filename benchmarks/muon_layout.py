"""Where should Muon's Newton-Schulz run? `python benchmarks/muon_layout.py CONFIG [key=value ...]`.

Times the full train step under each `optim.muon_layout` (distributed, replicated, sharded),
interleaved over `--rounds` so that machine noise hits all of them alike, and prints the median
step time of each with its ratio to the fastest.
"""

import os
import statistics
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_step  # noqa: E402

LAYOUTS = ("distributed", "replicated", "sharded")


USAGE = "usage: python benchmarks/muon_layout.py CONFIG [key=value ...] [--rounds R] [--steps N]"


def main(argv):
  import bench_cli
  from nanotext.errors import UserError, fail
  if len(argv) < 2:
    fail(f"no CONFIG given; {USAGE}")
  bench_cli.at_least(1, rounds=flags.FLAGS.rounds, steps=flags.FLAGS.steps)
  times = {k: [] for k in LAYOUTS}
  try:
    for _ in range(flags.FLAGS.rounds):
      for layout in LAYOUTS:
        r = gpu_step.measure(argv[1], argv[2:] + [f"optim.muon_layout={layout}"], steps=flags.FLAGS.steps,
                    repeats=1, warmup=1)
        times[layout].append(r["step_s"])
  except UserError as e:
    fail(str(e))
  med = {k: statistics.median(v) for k, v in times.items()}
  best = min(med.values())
  print(f"| optim.muon_layout | step time (median of {flags.FLAGS.rounds}) | vs fastest | rounds |")
  print("| --- | --- | --- | --- |")
  for k in LAYOUTS:
    rounds = ", ".join(f"{1e3 * t:.0f}" for t in times[k])
    print(f"| {k} | {1e3 * med[k]:.1f} ms | {med[k] / best:.2f}x | {rounds} |")


if __name__ == "__main__":
  gpu_step.define_flags()  # --steps: timed steps per round
  flags.DEFINE_integer("rounds", 3, "Interleaved rounds per layout.")
  import bench_cli
  bench_cli.run(main, USAGE, __doc__)
