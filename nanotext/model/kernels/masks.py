"""Masks shared by the kernels: documents from end-of-text tokens, and the record's block windows."""

import jax.numpy as jnp
import numpy as np


def segment_ids_from_tokens(tokens_BT, eot_id: int):
  """Document id per position: the count of EOT tokens at or before it (EOT opens a document)."""
  return jnp.cumsum(tokens_BT == eot_id, axis=1, dtype=jnp.int32)


def block_window_mask(T: int, window: int, block: int) -> np.ndarray:
  """[T, T] causal block-window mask: key block >= query block - W + 1, W = max(1, window//block)."""
  t, s = np.arange(T)[:, None], np.arange(T)[None, :]
  return (s <= t) & (t // block - s // block < max(1, window // block))


def segment_mask(segment_ids_BT):
  """Boolean [B, 1, T, T] mask (broadcast over heads): True where query and key share a segment."""
  if segment_ids_BT is None:
    return None
  return segment_ids_BT[:, None, :, None] == segment_ids_BT[:, None, None, :]
