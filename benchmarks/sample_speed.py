"""Sampling speed, context-sized buffers against one buffer of model.max_seq_len:
`python benchmarks/sample_speed.py CONFIG [key=value ...] [--tokens N] [--repeats R]`.

The model of CONFIG (fresh parameters: speed does not depend on them) samples N tokens after a
4-token prompt, greedily, twice per repeat: as nanotext.generate does (buffers of the next power
of two from 128, generate.bucket) and with every step on the whole max_seq_len buffer (what it did
before). Prints a markdown table: seconds for the N tokens (compiles included, then without) and
tokens per second, medians of the repeats, and whether both drew the same tokens.
"""

import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS


def timed(graphdef, params, max_len: int, tokens: int, bucketed: bool) -> tuple:
  """(seconds with the first pass's compiles, seconds after, the tokens drawn)."""
  from nanotext import generate
  saved = generate.MIN_BUCKET
  generate.MIN_BUCKET = generate.MIN_BUCKET if bucketed else max_len
  try:
    run = lambda: generate.sample(graphdef, params, [1, 2, 3, 4], max_len=max_len,
                                  max_new_tokens=tokens, temperature=0.0, top_k=0, seed=0)
    t0 = time.perf_counter()
    first = run()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    run()
    return cold, time.perf_counter() - t0, first
  finally:
    generate.MIN_BUCKET = saved


def main(argv):
  from flax import nnx
  from nanotext import wiring
  if len(argv) < 2:
    raise SystemExit(__doc__)
  run = wiring.prepare(argv[1], argv[2:])
  params = nnx.state(run.create_model(run.cfg.seed)).to_pure_dict()
  max_len = run.cfg.model.max_seq_len
  rows = {}
  for bucketed in (True, False):
    runs = [timed(run.graphdef, params, max_len, FLAGS.tokens, bucketed)
            for _ in range(FLAGS.repeats)]
    rows[bucketed] = (statistics.median(r[0] for r in runs),
                      statistics.median(r[1] for r in runs), runs[0][2])
  print(f"{FLAGS.tokens} tokens, model.max_seq_len={max_len}, "
        f"attention {run.cfg.attention.impl}, median of {FLAGS.repeats}\n")
  print("| buffers | s, compiles included | s after | tokens/s after |")
  print("| --- | ---: | ---: | ---: |")
  for bucketed, name in ((True, "the context's (generate)"), (False, f"all {max_len}")):
    cold, warm, _ = rows[bucketed]
    print(f"| {name} | {cold:.2f} | {warm:.2f} | {FLAGS.tokens / warm:.1f} |")
  same = rows[True][2] == rows[False][2]
  print(f"\nsame tokens: {same}; after compiling, {rows[False][1] / rows[True][1]:.1f}x faster")


if __name__ == "__main__":  # flags defined only here: tests import benchmarks into one registry
  flags.DEFINE_integer("tokens", 32, "tokens to sample")
  flags.DEFINE_integer("repeats", 3, "timed repeats (medians reported)")
  app.run(main)
