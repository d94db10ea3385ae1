"""A key-value cache for sampling: each attention layer's keys and values kept, so a new token
runs alone against them instead of the whole context again."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from nanotext.model.kernels.masks import live_window_mask


class KV(NamedTuple):
  """One attention layer's cache: keys and values [B, S, H, K] (as the kernels take them: normed,
  rotated, value-mixed), `docs` [B, S] int32, the document each position lies in (a token sees
  only keys of its own; kernels/masks.segment_ids_from_tokens, all 0 without document masks), and
  `pos`, the position of the chunk being run (a static 0 for a prompt, which then attends within
  itself through the model's kernel; traced after it; None between calls)."""
  k: jax.Array
  v: jax.Array
  docs: jax.Array
  pos: Any = None


def empty(model, batch: int, length: int) -> list:
  """Zeroed caches of `length` positions, one per block (None for an MLP-only block): host
  arrays, which jit places as it places the prompt's token buffer, on the devices of the
  parameters' shardings (a run's closing sample) or on one (generate)."""
  caches = []
  for block in blocks_of(model):
    attn = block.attn
    if attn is None:
      caches.append(None)
      continue
    zeros = lambda: np.zeros((batch, length, attn.num_heads, attn.head_dim), attn.dtype)
    caches.append(KV(zeros(), zeros(), np.zeros((batch, length), np.int32)))
  return caches


def row_bytes(model, length: int) -> int:
  """Bytes of one row of the caches `empty` makes for `length` positions."""
  return sum(length * (2 * b.attn.num_heads * b.attn.head_dim * np.dtype(b.attn.dtype).itemsize
                       + 4) for b in blocks_of(model) if b.attn is not None)


def blocks_of(model) -> list:
  """The model's blocks, one per layer (a scanned stack counts num_layers times)."""
  if model.scan_layers:
    return [model.blocks] * jax.tree.leaves(model.blocks)[0].shape[0]
  return list(model.blocks)


def at(caches: list, pos) -> list:
  """The caches with the next chunk's position set."""
  return [None if c is None else c._replace(pos=pos) for c in caches]


def chunk_docs(segment_ids_BT, T: int):
  """A chunk's document ids [B, T] (int32; 0 where it has no segment ids, one document)."""
  return jnp.zeros((1, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT


def write(kv: KV, k_BTHK, v_BTHK, segment_ids_BT=None) -> KV:
  """The cache with a chunk's keys, values and document ids stored from its position on."""
  put = lambda cache, new: jax.lax.dynamic_update_slice_in_dim(
      cache, jnp.broadcast_to(new, cache.shape[:1] + new.shape[1:]).astype(cache.dtype), kv.pos,
      axis=1)
  docs = chunk_docs(segment_ids_BT, k_BTHK.shape[1])
  return kv._replace(k=put(kv.k, k_BTHK), v=put(kv.v, v_BTHK), docs=put(kv.docs, docs))


def attend(q_BTHK, kv: KV, segment_ids_BT=None, *, scale: float, window: int = 0,
           block: int = 0):
  """Attention of a chunk's queries (positions pos, pos + 1, ...) over a written cache: each sees
  the keys at or before its position inside its window (block-granular with `block`) and its
  document, the rules of the training kernels' masks."""
  T, S = q_BTHK.shape[1], kv.k.shape[1]
  t = kv.pos + jnp.arange(T)[:, None]
  s = jnp.arange(S)[None, :]
  mask = (s <= t) & live_window_mask(t, s, window, block)
  same_doc_BTS = chunk_docs(segment_ids_BT, T)[:, :, None] == kv.docs[:, None, :]
  return jax.nn.dot_product_attention(q_BTHK, kv.k, kv.v, mask=(mask & same_doc_BTS)[:, None],
                                      scale=scale, implementation="xla")
