"""jax.nn.dot_product_attention's own paths: xla everywhere, cuDNN's fused kernel on NVIDIA GPUs."""

import jax
import jax.numpy as jnp
import numpy as np

from nanotext.model.kernels.masks import block_window_mask, live_window_mask, segment_mask


def xla_attention(q_BTHK, k_BTHK, v_BTHK, *, scale, window=0, segment_ids_BT=None, block=0,
                  runtime_window=None, implementation="xla"):
  """jax.nn.dot_product_attention; local_window_size (left, right) counts keys besides the query.

  Block windows have no jax argument: they go in as a dense [1, 1, T, T] mask (small T only), as
  does a `runtime_window` (traced int32, 0 = none, at most `window` when that is > 0)."""
  mask = segment_mask(segment_ids_BT)
  local = (window - 1, 0) if window and not block else None
  if window and block:
    blocks = jnp.asarray(block_window_mask(q_BTHK.shape[1], window, block))[None, None]
    mask = blocks if mask is None else mask & blocks
  if runtime_window is not None:
    T = q_BTHK.shape[1]
    live = live_window_mask(np.arange(T)[:, None], np.arange(T)[None, :], runtime_window, block)
    mask = live[None, None] if mask is None else mask & live[None, None]
  return jax.nn.dot_product_attention(
      q_BTHK, k_BTHK, v_BTHK, mask=mask, scale=scale, is_causal=True,
      local_window_size=local, implementation=implementation)
