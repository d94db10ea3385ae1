"""Rotary position embeddings: frequencies (full or the speedrun's half-truncated) and rotation."""

import jax.numpy as jnp
import numpy as np

from nanotext.model.kernels.per_device import platform


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


def apply_rope(x_BTHK, freq, offset=0):
  """Rotate the two halves (x1, x2) of each head's vector by position * frequency: (x1 cos + x2
  sin, x2 cos - x1 sin), in float32, in the form the target compiles best (the same products
  and sums either way: bit-equal eagerly, tests/test_model.py). Positions start at `offset`
  (a traced int32 where a sampler's new tokens follow a cached prompt)."""
  rotate = rotate_reversed if platform() == "gpu" else rotate_split
  x32 = x_BTHK.astype(jnp.float32)
  return rotate(x32, angles(x_BTHK.shape[1], freq, offset)).astype(x_BTHK.dtype)


def angles(length: int, freq, offset=0):
  """[length, K / 2] float32 rotation angles: position (from `offset`) times frequency."""
  positions = jnp.arange(length, dtype=jnp.float32)
  if not (isinstance(offset, int) and offset == 0):
    positions = positions + jnp.asarray(offset, jnp.float32)  # exact below 2**24
  return positions[:, None] * jnp.asarray(freq, jnp.float32)[None, :]


def rotate_split(x_BTHK, theta_TK):
  """The halves split and concatenated (CPU and TPU: on a v6e-8 the reversed form's [..., 2, K/2]
  arrays cost speedrun.yml's train step 71.6 ms more in the roofline estimate, 376.8 -> 448.2,
  and 0.27 GiB)."""
  cos, sin = jnp.cos(theta_TK)[None, :, None, :], jnp.sin(theta_TK)[None, :, None, :]
  x1, x2 = jnp.split(x_BTHK, 2, axis=-1)
  return jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=-1)


def rotate_reversed(x_BTHK, theta_TK):
  """A [..., 2, K/2] view with the halves swapped by a reverse (GPU): its backward pass is one
  elementwise function of the output gradient, which XLA's GPU compiler fuses into its
  neighbours, where split and concatenate store q's and k's gradient halves apart (4 extra
  [T, H, K/2] writes per layer in the record's H100 program: 1,117 -> 1,095 launches, 76.6 ->
  75.5 ms estimated)."""
  B, T, H, K = x_BTHK.shape
  cos_T2K = jnp.cos(theta_TK)[None, :, None, None, :]
  sign = np.array([1.0, -1.0], np.float32)[:, None]  # exact: sin for x1's row, -sin for x2's
  sin_T2K = jnp.sin(theta_TK)[None, :, None, None, :] * sign
  x = x_BTHK.reshape(B, T, H, 2, K // 2)
  return (x * cos_T2K + x[..., ::-1, :] * sin_T2K).reshape(B, T, H, K)
