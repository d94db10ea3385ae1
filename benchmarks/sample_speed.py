"""Sampling speed: the key-value cache, context-sized buffers, one buffer of model.max_seq_len:
`python benchmarks/sample_speed.py CONFIG [key=value ...] [--tokens N] [--prompt P] [--repeats R]
[--modes cache,bucket,whole]`.

The model of CONFIG (fresh parameters: speed does not depend on them) samples N tokens after a
P-token prompt, greedily, twice per repeat in each mode: `cache` as nanotext.generate does (the
prompt once, then each token alone against the cached keys and values), `bucket` every token
running the whole context in a buffer of the next power of two from 128 (generate.bucket; what
generate did before the cache), `whole` every token on the whole max_seq_len buffer (before
that). Prints a markdown table: seconds for the N tokens (compiles included, then without) and
tokens per second, medians of the repeats, and whether every mode drew the same tokens.
"""

import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLAGS = flags.FLAGS
MODES = ("cache", "bucket", "whole")


def timed(graphdef, params, max_len: int, prompt: list, tokens: int, mode: str) -> tuple:
  """(seconds with the first pass's compiles, seconds after, the tokens drawn)."""
  from nanotext import generate
  saved = generate.MIN_BUCKET
  generate.MIN_BUCKET = max_len if mode == "whole" else generate.MIN_BUCKET
  try:
    run = lambda: generate.sample(graphdef, params, prompt, max_len=max_len,
                                  max_new_tokens=tokens, temperature=0.0, top_k=0, seed=0,
                                  cache=mode == "cache")
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
  modes = FLAGS.modes.split(",")
  if not modes or set(modes) - set(MODES):
    raise SystemExit(f"--modes={FLAGS.modes}: a comma-separated subset of {','.join(MODES)}")
  run = wiring.prepare(argv[1], argv[2:])
  params = nnx.state(run.create_model(run.cfg.seed)).to_pure_dict()
  max_len = run.cfg.model.max_seq_len
  prompt = [1 + i % 200 for i in range(FLAGS.prompt)]
  rows = {}
  for mode in modes:
    runs = [timed(run.graphdef, params, max_len, prompt, FLAGS.tokens, mode)
            for _ in range(FLAGS.repeats)]
    rows[mode] = (statistics.median(r[0] for r in runs),
                  statistics.median(r[1] for r in runs), runs[0][2])
  print(f"{FLAGS.tokens} tokens after a {FLAGS.prompt}-token prompt, model.max_seq_len="
        f"{max_len}, attention {run.cfg.attention.impl}, median of {FLAGS.repeats}\n")
  print("| mode | s, compiles included | s after | tokens/s after | x the first mode |")
  print("| --- | ---: | ---: | ---: | ---: |")
  for mode in modes:
    cold, warm, _ = rows[mode]
    ratio = warm / rows[modes[0]][1]
    print(f"| {mode} | {cold:.2f} | {warm:.2f} | {FLAGS.tokens / warm:.1f} | {ratio:.1f} |")
  same = all(rows[m][2] == rows[modes[0]][2] for m in modes)
  print(f"\nsame tokens in every mode: {same}")


if __name__ == "__main__":  # flags defined only here: tests import benchmarks into one registry
  flags.DEFINE_integer("tokens", 32, "tokens to sample")
  flags.DEFINE_integer("prompt", 4, "prompt tokens")
  flags.DEFINE_integer("repeats", 3, "timed repeats (medians reported)")
  flags.DEFINE_string("modes", "cache,bucket", "comma-separated: cache, bucket, whole")
  app.run(main)
