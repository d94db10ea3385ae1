"""The textbook kernel, for debugging: dense float32 scores, every mask explicit, softmax."""

import jax
import jax.numpy as jnp
import numpy as np

from nanotext.model.kernels.masks import block_window_mask, live_window_mask, segment_mask


def einsum_attention(q_BTHK, k_BTHK, v_BTHK, *, scale, window=0, segment_ids_BT=None, block=0,
                     runtime_window=None):
  """Causal attention with a token (block = 0) or block window, and document masks;
  `runtime_window` (traced int32, 0 = none) narrows the static `window` at run time."""
  T = q_BTHK.shape[1]
  t, s = np.arange(T)[:, None], np.arange(T)[None, :]
  if window and block:
    mask_TS = block_window_mask(T, window, block)
  else:
    mask_TS = (s <= t) & (t - s < (window or T))
  mask_BHTS = jnp.asarray(mask_TS)[None, None]
  if runtime_window is not None:
    mask_BHTS = mask_BHTS & live_window_mask(t, s, runtime_window, block)
  if segment_ids_BT is not None:
    mask_BHTS = mask_BHTS & segment_mask(segment_ids_BT)
  s_BHTS = jnp.einsum("bqhd,bkhd->bhqk", q_BTHK, k_BTHK,
                      preferred_element_type=jnp.float32) * scale
  p_BHTS = jax.nn.softmax(jnp.where(mask_BHTS, s_BHTS, -jnp.inf), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p_BHTS.astype(v_BTHK.dtype), v_BTHK)
