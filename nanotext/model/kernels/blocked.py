"""Blocked attention in plain XLA: each query block meets only its window's key blocks.

Memory and work grow with T x W (W = window), not T^2, so one document-masked row of 48K tokens
fits where a dense [T, T] mask cannot. Runs on every backend (no custom kernel). The sequence is
cut into `block`-token query blocks; block i is scored against key blocks i - nw + 1 .. i, gathered
into a [nw, block] strip, masked token by token (causal, document, token window) and softmaxed in
float32. Query blocks are processed `C` at a time under `lax.map`, each chunk rematerialised in the
backward pass, so the live score tensor is one chunk's [B, C, H, block, nw * block] whatever T is.
"""

import jax
import jax.numpy as jnp
import numpy as np

from nanotext.model.kernels.masks import live_window_mask

BLOCK = 128                # query/key block: the record's FlexAttention BLOCK_SIZE
CHUNK_ELEMENTS = 2 ** 24   # score entries per chunk (64 MiB in float32) bound the live scores


def key_blocks(T: int, window: int, block: int, block_windows: bool) -> int:
  """Key blocks each query block reads: all (causal), W (block windows) or enough for the window."""
  nb = -(-T // block)
  if not window or window >= T:
    return nb
  if block_windows:  # the record's block mask: own block plus W - 1 earlier ones, at least one
    return min(nb, max(1, window // block))
  return min(nb, -(-(window - 1) // block) + 1)  # keys t - window + 1 .. t span this many blocks


def blocked_attention(q_BTHK, k_BTHK, v_BTHK, *, scale: float, window: int = 0,
                      block_windows: bool = False, segment_ids_BT=None, block: int = BLOCK,
                      chunk_elements: int = CHUNK_ELEMENTS, runtime_window=None):
  """Causal attention; `window` in tokens (block_windows: in whole `block`-token key blocks).

  Token windows: a query at t sees keys t - window < s <= t. Block windows: a query in block i
  sees key blocks i - window // block + 1 .. i (at least its own), token-causal inside.
  `segment_ids_BT` [B, T] keeps attention inside documents. `runtime_window` (traced int32,
  0 = none) is the window actually applied, by the same rules; the static `window` is then its
  bound (0 = none) and sets the strip width, so one program serves every window up to it.
  """
  B, T, H, K = q_BTHK.shape
  nw = key_blocks(T, window, block, block_windows)
  token_window = window if window and window < T and not block_windows else 0
  nb = -(-T // block)
  per_block = B * H * block * nw * block
  n_chunks = -(-nb // max(1, min(nb, chunk_elements // per_block)))
  C = -(-nb // n_chunks)  # query blocks per chunk; padding is under n_chunks blocks
  Tp = n_chunks * C * block
  # Padding goes at the end: padded keys come after every real query, so causality hides them.
  pad_T = lambda x, value=0: jnp.pad(x, ((0, 0), (0, Tp - T)) + ((0, 0),) * (x.ndim - 2),
                                     constant_values=value)
  seg_BT = jnp.zeros((B, T), jnp.int32) if segment_ids_BT is None else segment_ids_BT
  seg_BT = pad_T(seg_BT.astype(jnp.int32), -1)
  q_BNCbHK = pad_T(q_BTHK).reshape(B, n_chunks, C, block, H, K)
  # nw - 1 empty blocks in front of the keys, so every query block has nw key blocks to read.
  front = lambda x, value=0: jnp.pad(x.reshape((B, Tp // block, block) + x.shape[2:]),
                                     ((0, 0), (nw - 1, 0)) + ((0, 0),) * (x.ndim - 1),
                                     constant_values=value)
  k_BPbHK, v_BPbHK = front(pad_T(k_BTHK)), front(pad_T(v_BTHK))
  seg_BPb = front(seg_BT, -2)
  seg_q_BNCb = seg_BT.reshape(B, n_chunks, C, block)
  strip_CW = np.arange(C)[:, None] + np.arange(nw)[None, :]  # padded key block of (query block, j)
  offs = np.arange(block)

  def chunk(args):
    q_BCbHK, seg_q_BCb, c = args
    first = c * C  # first query block of this chunk
    take = lambda x: jnp.take(jax.lax.dynamic_slice_in_dim(x, first, C + nw - 1, axis=1),
                              strip_CW, axis=1)
    k_BCWbHK, v_BCWbHK, seg_k_BCWb = take(k_BPbHK), take(v_BPbHK), take(seg_BPb)
    s_BCHqWb = jnp.einsum("bcqhk,bcwshk->bchqws", q_BCbHK, k_BCWbHK,
                          preferred_element_type=jnp.float32) * scale
    t_Cq = (first + np.arange(C))[:, None] * block + offs  # query positions
    s_CWb = (first + strip_CW - (nw - 1))[..., None] * block + offs  # key positions (< 0: pad)
    t, s = t_Cq[:, :, None, None], s_CWb[:, None, :, :]
    mask_CqWb = (s >= 0) & (s <= t)
    if token_window:
      mask_CqWb &= t - s < token_window
    if runtime_window is not None:
      live_block = block if block_windows else 0
      mask_CqWb = mask_CqWb & live_window_mask(t, s, runtime_window, live_block)
    mask_BCqWb = mask_CqWb & (seg_q_BCb[:, :, :, None, None] == seg_k_BCWb[:, :, None, :, :])
    s_BCHqWb = jnp.where(mask_BCqWb[:, :, None], s_BCHqWb, -jnp.inf)
    p = jax.nn.softmax(s_BCHqWb.reshape(B, C, H, block, nw * block), axis=-1)
    p_BCHqWb = p.reshape(s_BCHqWb.shape).astype(v_BCWbHK.dtype)
    return jnp.einsum("bchqws,bcwshk->bcqhk", p_BCHqWb, v_BCWbHK,
                      preferred_element_type=jnp.float32).astype(q_BTHK.dtype)

  xs = (jnp.moveaxis(q_BNCbHK, 1, 0), jnp.moveaxis(seg_q_BNCb, 1, 0),
        jnp.arange(n_chunks, dtype=jnp.int32))
  # Rematerialised per chunk: the backward pass keeps no [T, W] probabilities between chunks.
  out_NBCbHK = jax.lax.map(jax.checkpoint(chunk), xs)
  return jnp.moveaxis(out_NBCbHK, 0, 1).reshape(B, Tp, H, K)[:, :T]
