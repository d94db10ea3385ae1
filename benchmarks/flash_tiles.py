"""flash_gpu's tile sizes at the record's shape: `python benchmarks/flash_tiles.py [ROUNDS]
[--small] [--wide]` (made for a GPU; --small runs a tiny shape, interpreted, anywhere).

One layer's attention, forward + backward, at the record's per-GPU work: one 49,152-token row,
6 heads of 128 (--wide: speedrun.yml's 4 heads of 256), bf16, documents of about 1,000 tokens,
the final block window (1792 tokens in 128-token blocks) and the first one (128). Each variant
of `flash_gpu.Tiles` is checked against the default (its gradients), then timed in rounds,
variants interleaved; the table gives each one's median and its ratio to the default's median.
"""

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanotext.model.kernels import flash_gpu  # noqa: E402

T_ = flash_gpu.Tiles
VARIANTS = {
    "default": T_(),
    "warps8": T_(num_warps=8),
    "stages3": T_(num_stages=3),
    "bwd 128x64": T_(block_q_bwd=128),
    "bwd 128x64 stages3": T_(block_q_bwd=128, num_stages=3),
    "fwd 128x128": T_(block_k=128),
    "bwd 128x128": T_(block_q_bwd=128, block_k_bwd=128),
}
# At head_dim 256 the default is 8 warps; smaller tiles keep 4 warps' registers in bounds.
WIDE = {
    "default": T_(),
    "warps4": T_(num_warps=4),
    "warps4 fwd 64x64": T_(num_warps=4, block_q=64),
    "warps4 bwd 32x64": T_(num_warps=4, block_q_bwd=32),
    "warps4 bwd 64x32": T_(num_warps=4, block_k_bwd=32),
    "stages1": T_(num_stages=1),
    "fwd 64x64": T_(block_q=64),
}


def main(rounds: int, small: bool, wide: bool = False) -> None:
  B, T, H, K = (1, 1024, 1, 32) if small else (1, 49152, 6, 128)
  if wide:
    H, K = (1, 64) if small else (4, 256)
  variants = WIDE if wide else VARIANTS
  keys = jax.random.split(jax.random.key(0), 5)
  q, k, v, g = (jax.random.normal(key, (B, T, H, K), jnp.bfloat16) for key in keys[:4])
  seg = jnp.cumsum(jax.random.uniform(keys[4], (B, T)) < 1 / 1000, axis=1).astype(jnp.int32)
  rows = []
  for window in (1792, 128):
    fns, ref = {}, None
    for name, tiles in variants.items():
      def loss(q, k, v, tiles=tiles):
        out = flash_gpu.flash_gpu_attention(q, k, v, scale=K ** -0.5, window=window,
                                            segment_ids_BT=seg, block=128, tiles=tiles)
        return (out.astype(jnp.float32) * g).sum()
      fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
      try:
        got = jax.block_until_ready(fn(q, k, v))
      except Exception as e:  # a tile Triton cannot build (shared memory, registers)
        rows.append((window, name, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}",
                     ""))
        continue
      ref = ref or got  # "default" is first
      err = max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max() /
                      (jnp.abs(b.astype(jnp.float32)).max() + 1e-30))
                for a, b in zip(got[1], ref[1]))
      fns[name] = (fn, err)
    times = {name: [] for name in fns}
    for _ in range(rounds):
      for name, (fn, _) in fns.items():
        t0 = time.perf_counter()
        for _ in range(5):
          out = fn(q, k, v)
        jax.block_until_ready(out)
        times[name].append((time.perf_counter() - t0) / 5)
    base = statistics.median(times["default"])
    for name, (_, err) in fns.items():
      med = statistics.median(times[name])
      rows.append((window, name, f"{1e3 * med:.2f} ms ({med / base:.2f})", f"{err:.1e}"))
  print("| window | tiles | fwd+bwd median (/ default) | gradients' max diff / max, vs default |\n"
        "| --- | --- | --- | --- |")
  for row in rows:
    print("| " + " | ".join(str(x) for x in row) + " |")


USAGE = "usage: python benchmarks/flash_tiles.py [ROUNDS] [--small] [--wide]"


def cli_main(argv) -> None:
  """main() from the command line: ROUNDS checked; the record's shape refused on the CPU (it
  would run for hours in interpret mode), --small runs anywhere."""
  from absl import flags
  from nanotext.errors import UserError
  if len(argv) > 2 or (len(argv) == 2 and not argv[1].lstrip("-").isdigit()):
    raise UserError(f"unexpected argument(s) {' '.join(argv[1:])}; {USAGE}")
  rounds = int(argv[1]) if len(argv) == 2 else 5
  if rounds < 1:
    raise UserError(f"ROUNDS={rounds}: give at least 1")
  small = flags.FLAGS.small
  if not small and jax.default_backend() == "cpu":
    raise UserError("the record's shape is made for a GPU; on the CPU (interpret mode) it runs "
                    "for hours: pass --small for a tiny shape")
  main(rounds, small, flags.FLAGS.wide)


if __name__ == "__main__":
  from absl import flags
  import bench_cli
  flags.DEFINE_bool("small", False, "A tiny shape, interpreted: runs anywhere.")
  flags.DEFINE_bool("wide", False, "speedrun.yml's 4 heads of 256.")
  bench_cli.run(cli_main, USAGE, __doc__)
