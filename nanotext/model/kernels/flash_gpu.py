"""Block-sparse flash attention for NVIDIA GPUs in Pallas (Triton lowering; interpret mode
elsewhere), for the record's mask: causal, sliding windows (token or block-granular) and
documents, with the window a runtime input if need be.

Block tables (kernels/block_tables.py), computed each call from the segment ids and the window,
give every query tile the range of key tiles that can hold a key it may see, and every key tile
the range of query tiles that may see one of its keys; each kernel loops over exactly that range
(a dynamic trip count) and masks token by token inside it. Work is O(T x window) and nothing
[T, T] exists, forward or backward. The forward is an online softmax over key tiles that saves
each query's logsumexp; the backward recomputes the probabilities from it in two kernels: dq
(key tiles per query tile) and dk, dv (query tiles per key tile), so no tile is written twice.

Tiles are `block_q` x `block_k` tokens; T must be a multiple of both, head_dim a power of two.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from nanotext.model.kernels.block_tables import key_tiles, query_tiles
from nanotext.model.kernels.per_device import per_device, platform

TILE = 128  # default tile: the record's window block
NEG = -1e30  # masked score: finite, so a tile with every key masked yields no inf - inf = nan


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Tile sizes of the forward and of the two backward kernels, and their Triton settings."""
  block_q: int = TILE
  block_k: int = 64
  block_q_bwd: int = 64
  block_k_bwd: int = 64
  num_warps: int = 0  # 0: 4 for head_dim <= 128, else 8 (4 was 1.8x faster than 8 at 128, H100)
  num_stages: int = 2


def problem(seq_len: int, head_dim: int, tiles: Tiles = Tiles()):
  """None if the kernel can run this (0 = unknown), else why not, for a UserError."""
  step = max(tiles.block_q, tiles.block_k, tiles.block_q_bwd, tiles.block_k_bwd)
  if seq_len and seq_len % step:
    return f"cannot tile train.seq_len={seq_len}: it is not a multiple of {step}"
  if head_dim and (head_dim < 16 or head_dim & (head_dim - 1) or head_dim > 256):
    return f"cannot tile model.head_dim={head_dim}: it must be a power of two from 16 to 256"
  return None


def flash_gpu_attention(q_BTHK, k_BTHK, v_BTHK, *, scale: float, window=0, segment_ids_BT=None,
                        block: int = 0, tiles: Tiles = Tiles()):
  """Causal attention within documents (`segment_ids_BT` [B, T], ids never decreasing along a
  row) and a window (int or traced int32; 0 = none) of tokens, or with `block` > 0 of whole
  `block`-token blocks (the record's block mask); per device under a mesh."""
  if problem(q_BTHK.shape[1], q_BTHK.shape[-1], tiles):
    raise ValueError(f"flash_gpu: {problem(q_BTHK.shape[1], q_BTHK.shape[-1], tiles)}")
  interpret = platform() != "gpu"
  local = functools.partial(_local, scale=float(scale), window_block=block, tiles=tiles,
                            interpret=interpret)
  if segment_ids_BT is None:
    segment_ids_BT = jnp.zeros(q_BTHK.shape[:2], jnp.int32)
  return per_device(local, q_BTHK, k_BTHK, v_BTHK, segment_ids_BT,
                    jnp.asarray(window, jnp.int32))


def _local(q_BTHK, k_BTHK, v_BTHK, seg_BT, window, *, scale, window_block, tiles, interpret):
  """The kernels on one device's [B, T, H, K] shard; block tables from its segment ids."""
  seg_BT = seg_BT.astype(jnp.int32)
  t = tiles
  tables = (key_tiles(seg_BT, window, block_q=t.block_q, block_k=t.block_k,
                      window_block=window_block),
            key_tiles(seg_BT, window, block_q=t.block_q_bwd, block_k=t.block_k_bwd,
                      window_block=window_block),
            query_tiles(seg_BT, window, block_q=t.block_q_bwd, block_k=t.block_k_bwd,
                        window_block=window_block))
  cfg = _Config(scale, window_block, tiles, interpret)
  return _attention(q_BTHK, k_BTHK, v_BTHK, seg_BT, window.reshape(1), tables, cfg)


@dataclasses.dataclass(frozen=True)
class _Config:
  scale: float
  window_block: int
  tiles: Tiles
  interpret: bool


def _visible(t, s, seg_t, seg_s, window, window_block: int):
  """[len(t), len(s)]: query positions t may see key positions s (causal, document, window)."""
  ok = (s[None, :] <= t[:, None]) & (seg_t[:, None] == seg_s[None, :])
  if window_block:  # positions are non-negative: lax.div is floor division here
    reach = jnp.maximum(1, lax.div(window, window_block))
    inside = lax.div(t, window_block)[:, None] - lax.div(s, window_block)[None, :] < reach
  else:
    inside = t[:, None] - s[None, :] < window
  return ok & (inside | (window <= 0))


def _dot(a, b, contract=(1, 0)):
  """float32-accumulated a @ b over a's axis contract[0] and b's axis contract[1]."""
  return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                         preferred_element_type=jnp.float32)


def _forward_kernel(win_ref, lo_ref, hi_ref, seg_q_ref, seg_ref, q_ref, k_ref, v_ref,
                    o_ref, lse_ref, *, cfg: _Config):
  """One query tile: online softmax over its key tiles lo..hi; output and logsumexp."""
  bq, bk = cfg.tiles.block_q, cfg.tiles.block_k
  w = win_ref[0]
  t = pl.program_id(0) * bq + jnp.arange(bq, dtype=jnp.int32)
  q, seg_q = q_ref[...], seg_q_ref[...]

  def body(j, carry):
    o, m, l = carry
    keys = pl.ds(j * bk, bk)
    k, v = k_ref[keys, :], v_ref[keys, :]
    s = _dot(q, k, (1, 1)) * cfg.scale
    seen = _visible(t, j * bk + jnp.arange(bk, dtype=jnp.int32), seg_q, seg_ref[keys], w,
                    cfg.window_block)
    s = jnp.where(seen, s, NEG)
    m_next = jnp.maximum(m, s.max(axis=1))
    # Rows whose earlier tiles were all masked carry garbage with m = NEG; the first real score
    # makes this factor exactly 0. Every query sees itself, in the last tile at the latest.
    shrink = jnp.exp(m - m_next)
    p = jnp.exp(s - m_next[:, None])
    o = o * shrink[:, None] + _dot(p.astype(v.dtype), v)
    return o, m_next, l * shrink + p.sum(axis=1)

  K = q.shape[-1]
  init = (jnp.zeros((bq, K), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  o, m, l = lax.fori_loop(lo_ref[0], hi_ref[0] + 1, body, init)
  o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def _dq_kernel(win_ref, lo_ref, hi_ref, seg_q_ref, seg_ref, q_ref, k_ref, v_ref, do_ref,
               lse_ref, delta_ref, dq_ref, *, cfg: _Config):
  """One query tile's dq, over its key tiles lo..hi."""
  bq, bk = cfg.tiles.block_q_bwd, cfg.tiles.block_k_bwd
  w = win_ref[0]
  t = pl.program_id(0) * bq + jnp.arange(bq, dtype=jnp.int32)
  q, do, seg_q = q_ref[...], do_ref[...], seg_q_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]

  def body(j, dq):
    keys = pl.ds(j * bk, bk)
    k, v = k_ref[keys, :], v_ref[keys, :]
    seen = _visible(t, j * bk + jnp.arange(bk, dtype=jnp.int32), seg_q, seg_ref[keys], w,
                    cfg.window_block)
    p = jnp.where(seen, jnp.exp(_dot(q, k, (1, 1)) * cfg.scale - lse[:, None]), 0.0)
    ds = p * (_dot(do, v, (1, 1)) - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  dq = lax.fori_loop(lo_ref[0], hi_ref[0] + 1, body,
                     jnp.zeros((bq, q.shape[-1]), jnp.float32))
  dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(win_ref, lo_ref, hi_ref, seg_k_ref, seg_ref, q_ref, k_ref, v_ref, do_ref,
                lse_ref, delta_ref, dk_ref, dv_ref, *, cfg: _Config):
  """One key tile's dk and dv, over the query tiles lo..hi that may see it."""
  bq, bk = cfg.tiles.block_q_bwd, cfg.tiles.block_k_bwd
  w = win_ref[0]
  s_pos = pl.program_id(0) * bk + jnp.arange(bk, dtype=jnp.int32)
  k, v, seg_k = k_ref[...], v_ref[...], seg_k_ref[...]

  def body(i, carry):
    dk, dv = carry
    rows = pl.ds(i * bq, bq)
    q, do = q_ref[rows, :], do_ref[rows, :]
    seen = _visible(i * bq + jnp.arange(bq, dtype=jnp.int32), s_pos, seg_ref[rows], seg_k, w,
                    cfg.window_block)
    p = jnp.where(seen, jnp.exp(_dot(q, k, (1, 1)) * cfg.scale - lse_ref[rows][:, None]), 0.0)
    dv = dv + _dot(p.astype(do.dtype), do, (0, 0))
    ds = p * (_dot(do, v, (1, 1)) - delta_ref[rows][:, None])
    return dk + _dot(ds.astype(q.dtype), q, (0, 0)), dv

  zeros = jnp.zeros((bk, k.shape[-1]), jnp.float32)
  dk, dv = lax.fori_loop(lo_ref[0], hi_ref[0] + 1, body, (zeros, zeros))
  dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(T, K, tile):
  """BlockSpecs over a (tiles, B, H) grid: the window, a tile's table entries, its segment ids
  and [tile, K] rows, all segment ids and all [T, K] rows, and [tile] per-row statistics."""
  return dict(
      window=pl.BlockSpec((1,), lambda i, b, h: (0,)),
      entry=pl.BlockSpec((None, 1), lambda i, b, h: (b, i)),
      seg_tile=pl.BlockSpec((None, tile), lambda i, b, h: (b, i)),
      seg_all=pl.BlockSpec((None, T), lambda i, b, h: (b, 0)),
      rows_tile=pl.BlockSpec((None, tile, None, K), lambda i, b, h: (b, i, h, 0)),
      rows_all=pl.BlockSpec((None, T, None, K), lambda i, b, h: (b, 0, h, 0)),
      stat_tile=pl.BlockSpec((None, None, tile), lambda i, b, h: (b, h, i)),
      stat_all=pl.BlockSpec((None, None, T), lambda i, b, h: (b, h, 0)))


def _call(kernel, cfg: _Config, grid, in_specs, out_specs, out_shape, name, head_dim: int):
  """pallas_call with the Triton settings (interpreted off GPU)."""
  warps = cfg.tiles.num_warps or (4 if head_dim <= 128 else 8)
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg), grid=grid, in_specs=in_specs, out_specs=out_specs,
      out_shape=out_shape, interpret=cfg.interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=cfg.tiles.num_stages))


def _forward(q, k, v, seg, window, tables, cfg: _Config):
  B, T, H, K = q.shape
  bq = cfg.tiles.block_q
  sp = _specs(T, K, bq)
  lo, hi = tables[0]
  return _call(
      _forward_kernel, cfg, (T // bq, B, H),
      [sp["window"], sp["entry"], sp["entry"], sp["seg_tile"], sp["seg_all"], sp["rows_tile"],
       sp["rows_all"], sp["rows_all"]],
      [sp["rows_tile"], sp["stat_tile"]],
      [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((B, H, T), jnp.float32)],
      "flash_gpu_forward", K)(window, lo, hi, seg, seg, q, k, v)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, seg, window, tables, cfg: _Config):
  return _forward(q, k, v, seg, window, tables, cfg)[0]


def _attention_fwd(q, k, v, seg, window, tables, cfg):
  out, lse = _forward(q, k, v, seg, window, tables, cfg)
  return out, (q, k, v, seg, window, tables, out, lse)


def _attention_bwd(cfg, res, do):
  q, k, v, seg, window, tables, out, lse = res
  B, T, H, K = q.shape
  t = cfg.tiles
  # delta_t = sum_k do_tk o_tk = sum_s p_ts dp_ts: the softmax gradient's row term.
  delta = jnp.einsum("bthk,bthk->bht", do.astype(jnp.float32), out.astype(jnp.float32))
  sq = _specs(T, K, t.block_q_bwd)
  (key_lo, key_hi), (query_lo, query_hi) = tables[1], tables[2]
  dq = _call(
      _dq_kernel, cfg, (T // t.block_q_bwd, B, H),
      [sq["window"], sq["entry"], sq["entry"], sq["seg_tile"], sq["seg_all"], sq["rows_tile"],
       sq["rows_all"], sq["rows_all"], sq["rows_tile"], sq["stat_tile"], sq["stat_tile"]],
      sq["rows_tile"], jax.ShapeDtypeStruct(q.shape, q.dtype),
      "flash_gpu_dq", K)(window, key_lo, key_hi, seg, seg, q, k, v, do, lse, delta)
  sk = _specs(T, K, t.block_k_bwd)
  dk, dv = _call(
      _dkv_kernel, cfg, (T // t.block_k_bwd, B, H),
      [sk["window"], sk["entry"], sk["entry"], sk["seg_tile"], sk["seg_all"], sk["rows_all"],
       sk["rows_tile"], sk["rows_tile"], sk["rows_all"], sk["stat_all"], sk["stat_all"]],
      [sk["rows_tile"], sk["rows_tile"]],
      [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      "flash_gpu_dkv", K)(window, query_lo, query_hi, seg, seg, q, k, v, do, lse, delta)
  no_tables = jax.tree.map(lambda _: None, tables)
  return dq, dk, dv, None, None, no_tables


_attention.defvjp(_attention_fwd, _attention_bwd)
