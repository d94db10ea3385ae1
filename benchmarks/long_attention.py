"""Long-row attention: blocked (O(T x W)) vs dense (O(T^2)), forward + backward, on this backend.

`python benchmarks/long_attention.py [--lengths=1024,4096,8192,49152] [--window=1792]
[--impls=blocked,xla]`

One row of the record's attention shape (6 heads of 128, bf16 off: float32 on CPU), the record's
final long window in 128-token blocks, documents of ~1,000 tokens. For each length: compiled
temporaries (XLA memory analysis) and the median wall time of jit(grad) over --repeats runs.
A dense run whose temporaries exceed --dense_max_gib is compiled but not run; one whose
estimate exceeds 4x that is not compiled either (XLA's compiler would need that memory).
"""

import statistics
import time

from absl import flags


def define_flags() -> None:
  """The script's flags; defined only when it runs (tests import this module beside other
  benchmarks, some with a --repeats of their own)."""
  flags.DEFINE_list("lengths", ["1024", "4096", "8192", "49152"], "Row lengths T.")
  flags.DEFINE_integer("window", 1792, "Window in tokens (whole 128-token blocks).")
  flags.DEFINE_integer("heads", 6, "Attention heads.")
  flags.DEFINE_integer("repeats", 3, "Timed runs per point (median).")
  flags.DEFINE_float("dense_max_gib", 8.0, "Run dense only below this many GiB.")
  flags.DEFINE_list("impls", ["blocked", "xla"], "Kernels: blocked and/or xla (dense).")


def point(T: int, impl: str, window: int, heads: int, repeats: int, max_gib: float) -> dict:
  """Compile fwd+bwd of one row at length T with `impl`; time it when it fits."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from nanotext.model.kernels.dispatch import dot_product_attention
  shape = (1, T, heads, 128)
  dense_gib = 3 * 4 * heads * T * T / 2**30  # float32 scores, probabilities and their gradient
  if impl == "xla" and dense_gib > 4 * max_gib:  # XLA's compiler itself would need that memory
    return {"T": T, "impl": impl, "compile_s": None, "temp_gib": None, "step_ms": None,
            "skipped": f"not compiled (about {dense_gib:,.0f} GiB)"}
  def loss(q, k, v, seg):
    return dot_product_attention(q, k, v, impl=impl, scale=0.12, window=window,
                                 segment_ids_BT=seg, block=128).sum()
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  x = jax.ShapeDtypeStruct(shape, jnp.float32)
  seg_spec = jax.ShapeDtypeStruct((1, T), jnp.int32)
  t0 = time.perf_counter()
  compiled = grad.lower(x, x, x, seg_spec).compile()
  row = {"T": T, "impl": impl, "compile_s": time.perf_counter() - t0,
         "temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30, "step_ms": None}
  if row["temp_gib"] > max_gib:
    return row
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, shape, jnp.float32) for kk in keys)
  seg = jnp.asarray(np.cumsum(np.random.default_rng(0).random(T) < 1e-3)[None], jnp.int32)
  jax.block_until_ready(compiled(q, k, v, seg))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v, seg))
    times.append(time.perf_counter() - t0)
  row["step_ms"] = 1e3 * statistics.median(times)
  return row


USAGE = ("usage: python benchmarks/long_attention.py [--lengths=1024,4096,8192,49152] "
         "[--window=1792] [--impls=blocked,xla]")


def main(argv):
  from nanotext.errors import fail
  F = flags.FLAGS
  if len(argv) > 1:
    fail(f"unexpected arguments: {' '.join(argv[1:])}")
  try:
    lengths = [int(t) for t in F.lengths]
  except ValueError:
    fail(f"--lengths must be integers, got {','.join(F.lengths)}")
  if set(F.impls) - {"blocked", "xla"}:
    fail(f"--impls takes blocked and/or xla, got {','.join(F.impls)}")
  if any(t <= 0 or t % 128 for t in lengths) or F.window % 128 or F.window <= 0:
    fail("--lengths and --window must be positive multiples of 128")
  if min(F.heads, F.repeats) < 1 or F.dense_max_gib <= 0:
    fail("--heads and --repeats must be at least 1, --dense_max_gib above 0")
  print("| T | impl | temporaries (GiB) | fwd+bwd (ms) | compile (s) |")
  print("| --- | --- | --- | --- | --- |")
  for T in lengths:
    for impl in F.impls:
      r = point(T, impl, F.window, F.heads, F.repeats, F.dense_max_gib)
      name = "blocked" if impl == "blocked" else "dense (xla)"
      if "skipped" in r:
        print(f"| {T:,} | {name} | {r['skipped']} | | |", flush=True)
        continue
      ms = f"{r['step_ms']:.0f}" if r["step_ms"] is not None else "not run (too big)"
      print(f"| {T:,} | {name} | {r['temp_gib']:.3f} | {ms} | {r['compile_s']:.1f} |",
            flush=True)


if __name__ == "__main__":
  define_flags()
  import bench_cli
  bench_cli.run(main, USAGE, __doc__)
