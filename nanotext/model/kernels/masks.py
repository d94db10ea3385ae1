"""Masks the kernels share: documents from end-of-text tokens, the record's block windows."""

import jax.numpy as jnp
import numpy as np


def segment_ids_from_tokens(tokens_BT, eot_id: int):
  """Document id per position: the count of EOT tokens at or before it (EOT opens a document)."""
  return jnp.cumsum(tokens_BT == eot_id, axis=1, dtype=jnp.int32)


def block_window_mask(T: int, window: int, block: int) -> np.ndarray:
  """[T, T] causal block-window mask: query block i sees key blocks i-W+1..i, W = max(1,
  window // block)."""
  t, s = np.arange(T)[:, None], np.arange(T)[None, :]
  return (s <= t) & (t // block - s // block < max(1, window // block))


def segment_mask(segment_ids_BT):
  """Boolean [B, 1, T, T] mask (broadcast over heads): True where query and key share a segment."""
  if segment_ids_BT is None:
    return None
  return segment_ids_BT[:, None, :, None] == segment_ids_BT[:, None, None, :]


def live_window_mask(t, s, window, block: int = 0):
  """Where query positions `t` may see key positions `s` under a traced int32 `window` (0 = no
  window): t - s < window (block = 0), or key block >= query block - W + 1, W = max(1,
  window // block); the same rules as the static masks, for a window given at run time."""
  if block:
    inside = t // block - s // block < jnp.maximum(1, window // block)
  else:
    inside = t - s < window
  return inside | (window <= 0)
