"""Block tables of the block-sparse flash kernel (kernels/flash_gpu.py), computed from the data.

For each query tile, the first and last key tile that can hold a key one of its queries may see;
for each key tile, the first and last query tile that may see one of its keys. A query at t sees
keys s <= t of its own document and, with a window w > 0, keys t - w < s (token windows) or keys
in window blocks t // b - W + 1 .. t // b, W = max(1, w // b) (block windows, b = window_block:
the record's mask). The earliest key any query of a tile may see is that of its first query,
since window starts and document starts never decrease along the row; the latest query any key
of a tile may reach is that of its last key. So a kernel looping over these ranges skips only
tiles without a visible key. The window may be a traced int32 (0 = none): the tables are O(T)
integer work per row, recomputed every step.
"""

import jax
import jax.numpy as jnp


def document_bounds(segment_ids_BT):
  """(first, last) position of each position's document, int32 [B, T]; document ids must never
  decrease along a row (they count end-of-text tokens, kernels/masks.segment_ids_from_tokens)."""
  B, T = segment_ids_BT.shape
  pos = jnp.arange(T, dtype=jnp.int32)
  change = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]  # a document starts at t + 1
  edge = jnp.ones((B, 1), bool)
  starts = jnp.concatenate([edge, change], axis=1)
  ends = jnp.concatenate([change, edge], axis=1)
  first = jax.lax.cummax(jnp.where(starts, pos, 0), axis=1)
  last = jax.lax.cummin(jnp.where(ends, pos, T - 1), axis=1, reverse=True)
  return first, last


def key_tiles(segment_ids_BT, window, *, block_q: int, block_k: int,
              window_block: int = 0):
  """(first, last) key tile that each query tile of `block_q` tokens reads, int32 [B, T / block_q]
  (`segment_ids_BT` all equal: no documents)."""
  T = segment_ids_BT.shape[1]
  t0 = jnp.arange(0, T, block_q, dtype=jnp.int32)  # first query of each tile
  first = document_bounds(segment_ids_BT)[0][:, t0]
  w = jnp.asarray(window, jnp.int32)
  if window_block:
    reach = (t0 // window_block - jnp.maximum(1, w // window_block) + 1) * window_block
  else:
    reach = t0 - w + 1
  first = jnp.maximum(first, jnp.where(w > 0, reach, 0))
  last = t0 + block_q - 1
  return jnp.broadcast_arrays(first // block_k, last // block_k)


def query_tiles(segment_ids_BT, window, *, block_q: int, block_k: int,
                window_block: int = 0):
  """(first, last) query tile of `block_q` tokens that may see a key of each key tile of
  `block_k`, int32 [B, T / block_k]."""
  T = segment_ids_BT.shape[1]
  s0 = jnp.arange(0, T, block_k, dtype=jnp.int32)
  s1 = s0 + block_k - 1  # last key of each tile
  last = document_bounds(segment_ids_BT)[1][:, s1]
  w = jnp.asarray(window, jnp.int32)
  if window_block:
    reach = (s1 // window_block + jnp.maximum(1, w // window_block)) * window_block - 1
  else:
    reach = s1 + w - 1
  last = jnp.minimum(last, jnp.where(w > 0, reach, T - 1))
  return jnp.broadcast_arrays(s0 // block_q, last // block_q)
