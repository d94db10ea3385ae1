"""Measure this machine's matmul peak: `python benchmarks/peak_flops.py [--dtype float32]`.

The number is what `metrics.peak_flops` should be on a backend without a spec-sheet value (CPU):
the best FLOP/s of a jitted square matmul over a few sizes, median of repeats, on one device.
"""

import statistics
import time

from absl import flags

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The script's flags, defined only when it runs: tests import benchmarks into one registry."""
  flags.DEFINE_string("dtype", "float32", "float32 or bfloat16")
  flags.DEFINE_integer("repeats", 5, "Timed repeats per size.")


def matmul_flops(n: int, dtype, repeats: int) -> float:
  """Median FLOP/s of an n x n x n matmul."""
  import jax
  import jax.numpy as jnp
  a = jax.random.normal(jax.random.key(0), (n, n), dtype)
  b = jax.random.normal(jax.random.key(1), (n, n), dtype)
  f = jax.jit(lambda x, y: x @ y)
  f(a, b).block_until_ready()
  reps = max(1, int(2e10 / (2 * n ** 3)))  # about 20 GFLOP per timing
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(reps):
      out = f(a, b)
    out.block_until_ready()
    times.append((time.perf_counter() - t0) / reps)
  del jnp
  return 2 * n ** 3 / statistics.median(times)


USAGE = "usage: python benchmarks/peak_flops.py [--dtype float32|bfloat16] [--repeats N]"


def main(argv):
  import bench_cli
  from nanotext.errors import UserError
  if len(argv) > 1:
    raise UserError(f"unexpected argument '{argv[1]}'; {USAGE}")
  bench_cli.at_least(1, repeats=FLAGS.repeats)
  if FLAGS.dtype not in ("float32", "bfloat16"):
    raise UserError(f"--dtype={FLAGS.dtype}: choose float32 or bfloat16")
  import jax
  import jax.numpy as jnp
  dtype = jnp.dtype(FLAGS.dtype)
  print(f"| backend | {jax.default_backend()} ({jax.devices()[0].device_kind}) |")
  print("| matmul size | GFLOP/s |")
  print("| --- | --- |")
  best = 0.0
  for n in (512, 1024, 2048):
    f = matmul_flops(n, dtype, FLAGS.repeats)
    best = max(best, f)
    print(f"| {n} x {n} x {n} {dtype.name} | {f / 1e9:,.1f} |")
  print(f"| best | {best / 1e9:,.1f} |")


if __name__ == "__main__":
  define_flags()
  import bench_cli
  bench_cli.run(main, USAGE, __doc__)
