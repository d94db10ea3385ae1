"""Attention alone on CPU: `python benchmarks/attention_cpu.py [ROUNDS]`.

Forward + backward of one layer's causal attention at configs/base.yml's shape (batch 16, 256
tokens, 4 heads of 64, float32): jax.nn.dot_product_attention(implementation="xla") against
nanotext's cpu kernel at three block sizes. Checks agreement, then times 5 calls per variant
per round, variants interleaved, and prints the medians.
"""

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanotext.model.kernels.cpu import cpu_attention  # noqa: E402

B, T, H, K = 16, 256, 4, 64
SCALE = K ** -0.5


def xla(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=SCALE, implementation="xla")


def main(rounds: int) -> None:
  variants = {"xla": xla}
  for bs in (64, 128, 256):
    variants[f"cpu{bs}"] = lambda q, k, v, bs=bs: cpu_attention(q, k, v, scale=SCALE,
                                                                        block=bs)
  rng = np.random.default_rng(0)
  q, k, v, g = (jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32) for _ in range(4))
  fns = {}
  for name, f in variants.items():
    loss = lambda q, k, v, f=f: (f(q, k, v) * g).sum()
    fns[name] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    out, ref = fns[name](q, k, v), fns["xla"](q, k, v)
    err = max(float(jnp.abs(a - b).max()) for a, b in zip(out[1], ref[1]))
    print(f"{name}: loss rel diff {float(abs(out[0] - ref[0]) / abs(ref[0])):.1e}, "
          f"max grad diff {err:.1e}")
  times = {name: [] for name in fns}
  for _ in range(rounds):
    for name, f in fns.items():
      jax.block_until_ready(f(q, k, v))
      t0 = time.perf_counter()
      for _ in range(5):
        out = f(q, k, v)
      jax.block_until_ready(out)
      times[name].append((time.perf_counter() - t0) / 5 * 1e3)
  for name, t in times.items():
    print(f"| {name} | {statistics.median(t):.0f} ms | {', '.join(f'{x:.0f}' for x in t)} |")


USAGE = "usage: python benchmarks/attention_cpu.py [ROUNDS]"


def rounds_arg(argv) -> int:
  """The optional ROUNDS argument (default 5), at least 1; UserError otherwise."""
  from nanotext.errors import UserError
  if len(argv) > 2 or (len(argv) == 2 and not argv[1].lstrip("-").isdigit()):
    raise UserError(f"unexpected argument(s) {' '.join(argv[1:])}; {USAGE}")
  rounds = int(argv[1]) if len(argv) == 2 else 5
  if rounds < 1:
    raise UserError(f"ROUNDS={rounds}: give at least 1")
  return rounds


if __name__ == "__main__":
  import bench_cli
  bench_cli.run(lambda argv: main(rounds_arg(argv)), USAGE, __doc__)
