"""The CPU attention kernel: query blocks that skip the keys no query of the block may see.

`jax.nn.dot_product_attention(implementation="xla")` builds the whole [T, T] score matrix,
masks it and runs a separate softmax. On CPU that elementwise work, not the matmuls, dominates
attention. Here each block of queries scores only the keys up to its last query (and from its
first query's window start): at T = 256 in blocks of 128 that is 3/4 of the scores, at T = 1024
9/16. The causal and window masks are compile-time constants added as a bias, and the softmax is
written out with its max held constant for the gradient (softmax does not depend on it), which
leaves XLA fewer, simpler elementwise passes. Selected by `attention.impl=cpu`, and by `auto` on
CPU, where it measured faster than xla (benchmarks/RESULTS.md); it agrees with the xla kernel
forward and backward (tests/test_cpu_attention.py). Unlike kernels/blocked.py (windows
in T x W memory for long sequences, chunked and rematerialised) it keeps every block's scores
live and unrolls the blocks: the cheaper choice for the short sequences a CPU trains on.
"""

import jax
import jax.numpy as jnp
import numpy as np

from nanotext.model.kernels.masks import live_window_mask

BLOCK = 128  # queries per block; 64 measured about the same at T = 256, with twice the ops
NEG = -1e30  # masked score: exp underflows to exactly 0; finite, so no inf - inf = nan


def key_range(start: int, stop: int, window: int) -> tuple:
  """Keys [lo, hi) that queries [start, stop) may see: causal, and within `window` if > 0."""
  lo = max(0, start - window + 1) if window else 0
  return lo, stop


def static_bias(start: int, stop: int, lo: int, window: int) -> np.ndarray:
  """[Q, K] float32 bias of one block: 0 where query t may see key s, NEG elsewhere."""
  t = np.arange(start, stop)[:, None]
  s = np.arange(lo, stop)[None, :]
  ok = s <= t
  if window:
    ok &= t - s < window
  return np.where(ok, 0.0, NEG).astype(np.float32)


def cpu_attention(q_BTHK, k_BTHK, v_BTHK, *, scale: float, window: int = 0,
                  segment_ids_BT=None, block: int = BLOCK, runtime_window=None):
  """Causal (optionally windowed, document-masked) attention; same contract as the xla kernel.

  `runtime_window` (traced int32, 0 = none) masks at run time inside the keys that the static
  `window` (its bound; 0 = none) lets each block score."""
  T = q_BTHK.shape[1]
  q_BTHK = q_BTHK * jnp.asarray(scale, q_BTHK.dtype)  # scale T*K values, not T*T scores
  outs = []
  for start in range(0, T, block):
    stop = min(T, start + block)
    lo, hi = key_range(start, stop, window)
    s_BHQS = jnp.einsum("bqhk,bshk->bhqs", q_BTHK[:, start:stop], k_BTHK[:, lo:hi],
                        preferred_element_type=jnp.float32)
    s_BHQS = s_BHQS + static_bias(start, stop, lo, window)
    if segment_ids_BT is not None:
      same_BQS = segment_ids_BT[:, start:stop, None] == segment_ids_BT[:, None, lo:hi]
      s_BHQS = jnp.where(same_BQS[:, None], s_BHQS, NEG)
    if runtime_window is not None:
      live_QS = live_window_mask(np.arange(start, stop)[:, None], np.arange(lo, hi)[None, :],
                                 runtime_window)
      s_BHQS = jnp.where(live_QS, s_BHQS, NEG)
    m_BHQ1 = jax.lax.stop_gradient(s_BHQS.max(axis=-1, keepdims=True))
    e_BHQS = jnp.exp(s_BHQS - m_BHQ1)
    p_BHQS = e_BHQS / e_BHQS.sum(axis=-1, keepdims=True)
    outs.append(jnp.einsum("bhqs,bshk->bqhk", p_BHQS.astype(v_BTHK.dtype), v_BTHK[:, lo:hi]))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
