"""Rotary position embeddings: frequencies (full or the speedrun's half-truncated) and rotation."""

import jax.numpy as jnp
import numpy as np


def rope_frequencies(head_dim: int, base: float, truncate: bool,
                     spacing: str = "linspace") -> np.ndarray:
  """Angular frequency per rotated pair (head_dim // 2 of them).

  With `truncate` (the speedrun's half-truncated RoPE) only the first quarter of head_dim (the
  first half of the pairs) rotate and the rest stay at zero. Their frequencies: `linspace`, from
  1 down to 1/base inclusive (the record's (1/base) ** linspace(0, 1, K/4)), or `arange`,
  base ** (-i / (K/4)) for i < K/4, stopping one step short of 1/base (modded-nanogpt-jax).
  """
  pairs = head_dim // 2
  if not truncate:
    return base ** (-np.arange(pairs, dtype=np.float64) * 2 / head_dim)
  quarter = head_dim // 4
  if spacing == "arange":
    freq = float(base) ** (-np.arange(quarter, dtype=np.float64) / quarter)
  else:
    freq = (1.0 / base) ** linspace_f32(quarter).astype(np.float64)
  return np.concatenate([freq, np.zeros(pairs - quarter)])


def linspace_f32(n: int) -> np.ndarray:
  """linspace(0, 1, n) as the record's `torch.linspace(..., dtype=torch.float32)` computes it.

  Its step 1 / (n - 1) is rounded to float32 and each point start + i * step (first half) or
  end - (n - 1 - i) * step (second half) is rounded once. A float64 linspace rounded to float32
  differs in 4 of 32 points at head_dim 128, and the frequencies then in 22 of 32 by up to 4 ulp:
  at position 262,143 (the record's validation rows) the rotary angles were 0.016 rad apart.
  """
  if n == 1:
    return np.zeros(1, np.float32)
  step = np.float64(np.float32(1.0 / (n - 1)))
  i = np.arange(n, dtype=np.float64)
  x = np.where(i < n // 2, i * step, 1.0 - (n - 1 - i) * step)
  return x.astype(np.float32)


def apply_rope(x_BTHK, freq):
  """Rotate the two halves (x1, x2) of each head's vector by position * frequency: (x1 cos + x2
  sin, x2 cos - x1 sin).

  Written on a [..., 2, K/2] view with the halves swapped by a reverse, not split and
  concatenated: the same products and sums (bit-equal eagerly; a compiler may contract them into
  FMAs otherwise, a last-bit difference), but the backward pass is one elementwise function of
  the output gradient, which a GPU compiler fuses into its neighbours; split and concatenate made
  it store both gradient halves of q and k apart (4 extra [T, H, K/2] writes per layer in the
  record's H100 program).
  """
  B, T, H, K = x_BTHK.shape
  t = jnp.arange(T, dtype=jnp.float32)
  theta_TK = t[:, None] * jnp.asarray(freq, jnp.float32)[None, :]
  cos_T2K = jnp.cos(theta_TK)[None, :, None, None, :]
  sign = np.array([1.0, -1.0], np.float32)[:, None]  # exact: sin for x1's row, -sin for x2's
  sin_T2K = jnp.sin(theta_TK)[None, :, None, None, :] * sign
  x = x_BTHK.astype(jnp.float32).reshape(B, T, H, 2, K // 2)
  y = x * cos_T2K + x[..., ::-1, :] * sin_T2K
  return y.reshape(B, T, H, K).astype(x_BTHK.dtype)
