"""bf16 attention numerics: the blocked kernel and an online-softmax kernel against float64.

`python benchmarks/attention_numerics.py [--lengths=2048,4096] [--seeds=3]`

The record attends with FlexAttention: bf16 q, k, v; float32 scores and running softmax
statistics, renormalised block by block as each 128-key block arrives (online softmax); the
probabilities rounded to bf16 before they meet v. nanotext's blocked kernel softmaxes each query
block's whole key strip at once in float32, then rounds the probabilities to bf16. This measures
how far each is from the exact answer (float64 from the same bf16 inputs) and from each other, at
the record's shape (6 heads of 128, QK-normed, scale 0.12, block windows of 14 blocks, documents
of ~1,000 tokens). The online kernel here is written for this comparison in plain JAX; it follows
FlexAttention's arithmetic as documented, not its code.
"""

import statistics

from absl import flags

BLOCK, HEADS, K, SCALE = 128, 6, 128, 0.12


def inputs(T: int, seed: int):
  """bf16 q, k, v of unit RMS (QK-norm), v of unit scale, and segment ids of ~1,000-token docs."""
  import jax.numpy as jnp
  import numpy as np
  rng = np.random.default_rng(seed)
  def unit(x):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True))
  q, k, v = (jnp.asarray(unit(rng.normal(size=(1, T, HEADS, K))), jnp.bfloat16) for _ in range(3))
  starts = np.sort(rng.choice(np.arange(1, T), size=max(1, T // 1000), replace=False))
  seg = np.zeros((1, T), np.int32)
  for s in starts:
    seg[:, s:] += 1
  return q, k, v, seg


def mask(T: int, window: int, seg):
  from nanotext.model.kernels.masks import block_window_mask
  return block_window_mask(T, window, BLOCK) & (seg[0][:, None] == seg[0][None, :])


def exact(q, k, v, m):
  """float64 attention of the bf16 inputs: the answer both kernels approximate."""
  import numpy as np
  q, k, v = (np.asarray(x, np.float64)[0] for x in (q, k, v))
  s = np.einsum("qhd,khd->hqk", q, k) * SCALE
  s = np.where(m[None], s, -np.inf)
  p = np.exp(s - s.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("hqk,khd->qhd", p, v)


def online(q, k, v, m):
  """Online softmax over 128-key blocks: float32 scores and statistics, bf16 probabilities into
  the p @ v matmul (float32 accumulation), one bf16 rounding of the normalised output."""
  import jax.numpy as jnp
  T = q.shape[1]
  mx = jnp.full((HEADS, T), -jnp.inf, jnp.float32)
  den = jnp.zeros((HEADS, T), jnp.float32)
  acc = jnp.zeros((HEADS, T, K), jnp.float32)
  for j in range(0, T, BLOCK):
    kb, vb, mb = k[0, j:j + BLOCK], v[0, j:j + BLOCK], jnp.asarray(m[:, j:j + BLOCK])
    s = jnp.einsum("qhd,khd->hqk", q[0], kb, preferred_element_type=jnp.float32) * SCALE
    s = jnp.where(mb[None], s, -jnp.inf)
    new = jnp.maximum(mx, s.max(-1))
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    p = jnp.exp(s - safe[..., None])
    alpha = jnp.exp(jnp.where(jnp.isfinite(mx), mx - safe, -jnp.inf))
    den = den * alpha + p.sum(-1)
    acc = acc * alpha[..., None] + jnp.einsum(
        "hqk,khd->hqd", p.astype(jnp.bfloat16), vb, preferred_element_type=jnp.float32)
    mx = new
  return (acc / den[..., None]).transpose(1, 0, 2).astype(jnp.bfloat16)[None]


def errors(a, b, ref):
  """(max |a - b|, RMS(a - b) / RMS(ref))."""
  import numpy as np
  d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  return float(np.abs(d).max()), float(np.sqrt(np.mean(d * d) / np.mean(np.square(ref))))


USAGE = "usage: python benchmarks/attention_numerics.py [--lengths=2048,4096] [--seeds=3]"


def main(argv):
  import bench_cli
  from nanotext.errors import UserError
  if len(argv) > 1:
    raise UserError(f"unexpected argument '{argv[1]}'; {USAGE}")
  if not all(t.isdigit() and int(t) > 0 for t in flags.FLAGS.lengths):
    raise UserError(f"--lengths={','.join(flags.FLAGS.lengths)}: give positive integers")
  bench_cli.at_least(1, seeds=flags.FLAGS.seeds, window=flags.FLAGS.window)
  import jax.numpy as jnp
  from nanotext.model.kernels.blocked import blocked_attention
  print("| T | pair | max abs difference | relative RMS difference | in bf16 ulps (2^-8) |")
  print("| --- | --- | --- | --- | --- |")
  FLAGS = flags.FLAGS
  for T in map(int, FLAGS.lengths):
    rows = {"blocked vs exact": [], "online vs exact": [], "blocked vs online": []}
    for seed in range(FLAGS.seeds):
      q, k, v, seg = inputs(T, seed)
      m = mask(T, FLAGS.window, seg)
      ref = exact(q, k, v, m)
      blk = blocked_attention(q, k, v, scale=SCALE, window=FLAGS.window, block_windows=True,
                              segment_ids_BT=jnp.asarray(seg), block=BLOCK)
      onl = online(q, k, v, m)
      rows["blocked vs exact"].append(errors(blk, ref[None], ref))
      rows["online vs exact"].append(errors(onl, ref[None], ref))
      rows["blocked vs online"].append(errors(blk, onl, ref))
    for name, errs in rows.items():
      mx = statistics.median(e[0] for e in errs)
      rms = statistics.median(e[1] for e in errs)
      print(f"| {T:,} | {name} | {mx:.2e} | {rms:.2e} | {rms / 2.0 ** -8:.2f} |")


if __name__ == "__main__":
  # Defined here, not at import: the tests import this module beside other benchmarks.
  flags.DEFINE_list("lengths", ["2048", "4096"], "Row lengths T (the float64 reference is dense).")
  flags.DEFINE_integer("seeds", 3, "Random inputs per length (median reported).")
  flags.DEFINE_integer("window", 1792, "Block window in tokens (the record's longest).")
  import bench_cli
  bench_cli.run(main, USAGE, __doc__)
