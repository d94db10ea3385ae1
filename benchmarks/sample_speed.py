"""Sampling speed: the key-value cache, context-sized buffers, one buffer of model.max_seq_len,
and several samples drawn together: `python benchmarks/sample_speed.py CONFIG [key=value ...]
[--tokens N] [--prompt P] [--repeats R] [--modes cache,bucket,whole] [--samples S]`.

The model of CONFIG (fresh parameters: speed does not depend on them) samples N tokens after a
P-token prompt, greedily, twice per repeat in each mode: `cache` as nanotext.generate does (the
prompt once, then each token alone against the cached keys and values), `bucket` every token
running the whole context in a buffer of the next power of two from 128 (generate.bucket; what
generate did before the cache), `whole` every token on the whole max_seq_len buffer (before
that). Prints a markdown table: seconds for the N tokens (compiles included, then without) and
tokens per second, medians of the repeats, and whether every mode drew the same tokens. With
--samples S > 1, a second table: S samples at temperature 1 (seeds 0..S-1) drawn one after
another (what generate num_samples=S did) and as the rows of one batch (what it does), with the
cache, and whether both drew the same tokens.
"""

import os
import statistics
import sys
import time

from absl import flags

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


def timed_samples(graphdef, params, max_len: int, prompt: list, tokens: int, n: int) -> dict:
  """{way: (seconds with compiles, seconds after, the samples)} for n samples drawn one by one
  and as one batch."""
  from nanotext import generate
  kw = dict(max_len=max_len, max_new_tokens=tokens, temperature=1.0, top_k=0)
  ways = {"one by one": lambda: [generate.sample(graphdef, params, prompt, seed=i, **kw)
                                 for i in range(n)],
          "one batch": lambda: [list(r) for r in zip(*generate.stream_rows(
              graphdef, params, prompt, seeds=range(n), **kw))]}
  out = {}
  for way, draw in ways.items():
    t0 = time.perf_counter()
    first = draw()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    draw()
    out[way] = (cold, time.perf_counter() - t0, first)
  return out


USAGE = ("usage: python benchmarks/sample_speed.py CONFIG [key=value ...] [--tokens N] "
         "[--prompt P] [--repeats R] [--modes cache,bucket,whole] [--samples S]")


def main(argv):
  from flax import nnx
  from nanotext import wiring
  import bench_cli
  from nanotext.errors import UserError
  if len(argv) < 2:
    raise UserError(f"no CONFIG given; {USAGE}")
  modes = FLAGS.modes.split(",")
  if not modes or set(modes) - set(MODES):
    raise UserError(f"--modes={FLAGS.modes}: a comma-separated subset of {','.join(MODES)}")
  bench_cli.at_least(1, tokens=FLAGS.tokens, prompt=FLAGS.prompt, repeats=FLAGS.repeats,
                     samples=FLAGS.samples)
  run = wiring.prepare(argv[1], argv[2:])
  params = nnx.to_pure_dict(nnx.state(run.create_model(run.cfg.seed)))
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
  print(f"| mode | s, compiles included | s after | tokens/s after | time / {modes[0]}'s |")
  print("| --- | ---: | ---: | ---: | ---: |")
  for mode in modes:
    cold, warm, _ = rows[mode]
    ratio = warm / rows[modes[0]][1]
    print(f"| {mode} | {cold:.2f} | {warm:.2f} | {FLAGS.tokens / warm:.1f} | {ratio:.1f} |")
  same = all(rows[m][2] == rows[modes[0]][2] for m in modes)
  print(f"\nsame tokens in every mode: {same}")
  if FLAGS.samples > 1:
    runs = [timed_samples(run.graphdef, params, max_len, prompt, FLAGS.tokens, FLAGS.samples)
            for _ in range(FLAGS.repeats)]
    print(f"\n{FLAGS.samples} samples of {FLAGS.tokens} tokens at temperature 1, with the "
          f"cache, median of {FLAGS.repeats}\n")
    print("| samples drawn | s, compiles included | s after | tokens/s after | "
          "speed-up over one by one |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = statistics.median(r["one by one"][1] for r in runs)
    for way in runs[0]:
      cold = statistics.median(r[way][0] for r in runs)
      warm = statistics.median(r[way][1] for r in runs)
      print(f"| {way} | {cold:.2f} | {warm:.2f} | {FLAGS.samples * FLAGS.tokens / warm:.1f} | "
            f"{base / warm:.1f} |")
    same = runs[0]["one by one"][2] == runs[0]["one batch"][2]
    print(f"\nsame tokens both ways: {same}")


if __name__ == "__main__":  # flags defined only here: tests import benchmarks into one registry
  flags.DEFINE_integer("tokens", 32, "tokens to sample")
  flags.DEFINE_integer("prompt", 4, "prompt tokens")
  flags.DEFINE_integer("repeats", 3, "timed repeats (medians reported)")
  flags.DEFINE_string("modes", "cache,bucket", "comma-separated: cache, bucket, whole")
  flags.DEFINE_integer("samples", 1, "> 1: also time that many samples one by one and batched")
  import bench_cli
  bench_cli.run(main, USAGE, __doc__)
