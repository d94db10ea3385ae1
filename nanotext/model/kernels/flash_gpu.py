"""Block-sparse flash attention for NVIDIA GPUs in Pallas (Triton lowering; interpret mode
elsewhere), for the record's mask: causal, sliding windows (token or block-granular) and
documents, with the window a runtime input if need be.

Block tables (kernels/block_tables.py), computed each call from the segment ids and the window,
give every query tile the range of key tiles that can hold a key it may see, and every key tile
the range of query tiles that may see one of its keys; each kernel loops over exactly that range
(a dynamic trip count) and masks token by token inside it. Work is O(T x window) and nothing
[T, T] exists, forward or backward. The forward is an online softmax over key tiles that saves
each query's logsumexp; the backward is one kernel that recomputes the probabilities from it:
half its programs write a query tile's dq (over key tiles), half a key tile's dk and dv (over
query tiles), so no tile is written twice, and the programs running at once read the same
tiles of q, k, v and the output gradient (one read from memory where two kernels read twice).

`flash_gpu_qkv_attention` takes q and k raw from the merged QKV projection's output and
normalises and rotates them in the kernels as they load a tile (QK-norm and rotary embeddings,
kernels/qk_rope.py's arithmetic, roundings included), and writes their gradients through the
norm and rotation straight into the gradient of the projection's output: no pass of its own over
q and k either way. Tiles are then held as two halves and their products summed.

Tiles are `block_q` x `block_k` tokens; T must be a multiple of both, head_dim a power of two.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from nanotext import sharding
from nanotext.model import rope as rotary
from nanotext.model.kernels import qk_rope
from nanotext.model.kernels.block_tables import key_tiles, query_tiles
from nanotext.model.kernels.per_device import platform

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
  cfg = _config(q_BTHK.shape, scale, block, tiles, 0.0)
  return _attention(cfg, None, (q_BTHK, k_BTHK, v_BTHK), (),
                    *_mask(segment_ids_BT, window, q_BTHK.shape), ())


def flash_gpu_qkv_attention(qkv_BT3HK, mix, mix_args, freq, eps: float, *, scale: float,
                            window=0, segment_ids_BT=None, block: int = 0,
                            tiles: Tiles = Tiles()):
  """flash_gpu_attention of rope(rms_norm(q)), rope(rms_norm(k)) (rotary frequencies `freq`,
  model/rope.py) and v = mix(qkv[:, :, 2], *mix_args) (value embeddings and residual: any
  function of arrays), q and k read where the merged projection wrote them, [B, T, 3, H, K];
  the norm and rotation happen in the kernels. The gradient of qkv is one array: q's and k's
  written by the backward kernel, v's placed in it."""
  shape = qkv_BT3HK.shape[:2] + qkv_BT3HK.shape[3:]
  theta_TK = rotary.angles(shape[1], freq)  # the XLA path's angles, so its cos and sin
  tables = tuple(lax.stop_gradient(f(theta_TK)) for f in (jnp.cos, jnp.sin))
  cfg = _config(shape, scale, block, tiles, eps)
  return _attention(cfg, mix, (qkv_BT3HK,), tuple(mix_args),
                    *_mask(segment_ids_BT, window, shape), tables)


@dataclasses.dataclass(frozen=True)
class _Config:
  scale: float
  window_block: int
  tiles: Tiles
  interpret: bool
  eps: float  # QK-norm's epsilon where the kernels normalise and rotate q and k


def _config(shape_BTHK, scale, block, tiles, eps) -> _Config:
  if problem(shape_BTHK[1], shape_BTHK[-1], tiles):
    raise ValueError(f"flash_gpu: {problem(shape_BTHK[1], shape_BTHK[-1], tiles)}")
  return _Config(float(scale), block, tiles, platform() != "gpu", float(eps))


def _mask(segment_ids_BT, window, shape_BTHK):
  """(segment ids [B, T] int32, window [1] int32): no documents is one document."""
  if segment_ids_BT is None:
    segment_ids_BT = jnp.zeros(shape_BTHK[:2], jnp.int32)
  return segment_ids_BT.astype(jnp.int32), jnp.asarray(window, jnp.int32).reshape(1)


def _tables(seg_BT, window, cfg: _Config):
  """Block tables of the forward kernel and of the backward's dq and dk/dv programs."""
  t, w, b = cfg.tiles, window[0], cfg.window_block
  return (key_tiles(seg_BT, w, block_q=t.block_q, block_k=t.block_k, window_block=b),
          key_tiles(seg_BT, w, block_q=t.block_q_bwd, block_k=t.block_k_bwd, window_block=b),
          query_tiles(seg_BT, w, block_q=t.block_q_bwd, block_k=t.block_k_bwd, window_block=b))


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


def _qk(ref, rows, rope, eps):
  """Rows of a q or k block as attention uses them: (the rows,) as stored, or with `rope` (the
  cos and sin tables' refs) its two halves normalised and rotated, in the block's dtype."""
  if not rope:
    return (ref[rows, :],)
  cos, sin = rope
  halves = qk_rope.norm_rotate(*qk_rope.halves(ref, rows), cos[rows, :], sin[rows, :], eps,
                               ref.dtype)
  return tuple(h.astype(ref.dtype) for h in halves)


def _scores(q, k):
  """q k^T, float32, from _qk's parts (the sum of the halves' products where split)."""
  return sum(_dot(a, b, (1, 1)) for a, b in zip(q, k))


def _store_grad(d_ref, x_ref, rows, grads, rope, eps):
  """Write a q or k tile's gradient (float32 parts, as _qk split it): as it is, or through the
  norm and rotation of the raw rows in x_ref, rounded first to the dtype the two kernels'
  path would have stored it in."""
  dtype = d_ref.dtype
  if not rope:
    d_ref[rows, :] = grads[0].astype(dtype)
    return
  cos, sin = rope
  g1, g2 = (g.astype(dtype).astype(jnp.float32) for g in grads)
  d1, d2 = qk_rope.norm_rotate_grad(g1, g2, *qk_rope.halves(x_ref, rows), cos[rows, :],
                                    sin[rows, :], eps, dtype)
  half = d1.shape[-1]
  d_ref[rows, :half] = d1.astype(dtype)
  d_ref[rows, half:] = d2.astype(dtype)


def _forward_kernel(win_ref, lo_ref, hi_ref, seg_ref, q_ref, k_ref, v_ref, rope, o_ref,
                    lse_ref, *, cfg: _Config):
  """One query tile: online softmax over its key tiles lo..hi; output and logsumexp."""
  bq, bk = cfg.tiles.block_q, cfg.tiles.block_k
  w = win_ref[0]
  rows = pl.ds(pl.program_id(0) * bq, bq)
  t = pl.program_id(0) * bq + jnp.arange(bq, dtype=jnp.int32)
  q, seg_q = _qk(q_ref, rows, rope, cfg.eps), seg_ref[rows]

  def body(j, carry):
    o, m, l = carry
    keys = pl.ds(j * bk, bk)
    k, v = _qk(k_ref, keys, rope, cfg.eps), v_ref[keys, :]
    s = _scores(q, k) * cfg.scale
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

  init = (jnp.zeros((bq, v_ref.shape[-1]), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  o, m, l = lax.fori_loop(lo_ref[0], hi_ref[0] + 1, body, init)
  o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def _backward_kernel(win_ref, key_lo_ref, key_hi_ref, query_lo_ref, query_hi_ref, seg_ref, q_ref,
                     k_ref, v_ref, do_ref, lse_ref, delta_ref, rope, *outs, cfg: _Config,
                     heads: int):
  """Program (i, b, h): for h < heads query tile i's dq over its key tiles, else key tile i's
  dk and dv over the query tiles that may see it. `outs`: dq, dk, dv, or (the qkv gradient,
  its q or k part by h, and dv)."""
  dq_ref, dk_ref, dv_ref = outs if len(outs) == 3 else (outs[0], outs[0], outs[1])
  bq, bk = cfg.tiles.block_q_bwd, cfg.tiles.block_k_bwd
  T, w, i = seg_ref.shape[0], win_ref[0], pl.program_id(0)
  rows_of = lambda r: pl.ds(r * bq, bq)
  cols_of = lambda c: pl.ds(c * bk, bk)
  positions = lambda start, n: start + jnp.arange(n, dtype=jnp.int32)

  @pl.when((pl.program_id(2) < heads) & (i < T // bq))
  def _():
    rows = rows_of(i)
    q, do, seg_q = _qk(q_ref, rows, rope, cfg.eps), do_ref[rows, :], seg_ref[rows]
    lse, delta = lse_ref[rows], delta_ref[rows]

    def body(j, dq):
      k, v = _qk(k_ref, cols_of(j), rope, cfg.eps), v_ref[cols_of(j), :]
      seen = _visible(positions(i * bq, bq), positions(j * bk, bk), seg_q, seg_ref[cols_of(j)],
                      w, cfg.window_block)
      p = jnp.where(seen, jnp.exp(_scores(q, k) * cfg.scale - lse[:, None]), 0.0)
      ds = p * (_dot(do, v, (1, 1)) - delta[:, None])
      return tuple(a + _dot(ds.astype(part.dtype), part) for a, part in zip(dq, k))

    zeros = tuple(jnp.zeros((bq, part.shape[-1]), jnp.float32) for part in q)
    dq = lax.fori_loop(key_lo_ref[0], key_hi_ref[0] + 1, body, zeros)
    _store_grad(dq_ref, q_ref, rows, [a * cfg.scale for a in dq], rope, cfg.eps)

  @pl.when((pl.program_id(2) >= heads) & (i < T // bk))
  def _():
    cols = cols_of(i)
    k, v, seg_k = _qk(k_ref, cols, rope, cfg.eps), v_ref[cols, :], seg_ref[cols]

    def body(r, carry):
      dk, dv = carry
      q, do = _qk(q_ref, rows_of(r), rope, cfg.eps), do_ref[rows_of(r), :]
      seen = _visible(positions(r * bq, bq), positions(i * bk, bk), seg_ref[rows_of(r)], seg_k,
                      w, cfg.window_block)
      p = jnp.where(seen, jnp.exp(_scores(q, k) * cfg.scale - lse_ref[rows_of(r)][:, None]),
                    0.0)
      dv = dv + _dot(p.astype(do.dtype), do, (0, 0))
      ds = p * (_dot(do, v, (1, 1)) - delta_ref[rows_of(r)][:, None])
      return tuple(a + _dot(ds.astype(part.dtype), part, (0, 0)) for a, part in zip(dk, q)), dv

    zeros = tuple(jnp.zeros((bk, part.shape[-1]), jnp.float32) for part in k)
    dk, dv = lax.fori_loop(query_lo_ref[0], query_hi_ref[0] + 1, body,
                           (zeros, jnp.zeros((bk, v_ref.shape[-1]), jnp.float32)))
    _store_grad(dk_ref, k_ref, cols, [a * cfg.scale for a in dk], rope, cfg.eps)
    dv_ref[cols, :] = dv.astype(dv_ref.dtype)


def _whole(x, part=None):
  """The whole rows [T, K] of one batch row and head (program (i, b, h): head h mod H) of x
  [B, T, H, K], or of qkv [B, T, 3, H, K]'s part `part` (None: h // H, q for the first H
  programs and k for the next)."""
  H, T, K = x.shape[-2], x.shape[1], x.shape[-1]
  if x.ndim == 4:
    return pl.BlockSpec((None, T, None, K), lambda i, b, h: (b, 0, h % H, 0))
  at = (lambda h: h // H) if part is None else (lambda h: part)
  return pl.BlockSpec((None, T, None, None, K), lambda i, b, h: (b, 0, at(h), h % H, 0))


def _entry(n: int):
  """Program (i, b, h)'s entry of a [B, n] block table (the last for i past it)."""
  return pl.BlockSpec((None, 1), lambda i, b, h: (b, jnp.minimum(i, n - 1)))


def _common(T: int, K: int, H: int, rope):
  """Specs of the window, segment ids [B, T], per-row statistics [B, H, T] and rope tables."""
  return dict(window=pl.BlockSpec((1,), lambda i, b, h: (0,)),
              seg=pl.BlockSpec((None, T), lambda i, b, h: (b, 0)),
              stat=pl.BlockSpec((None, None, T), lambda i, b, h: (b, h % H, 0)),
              rope=tuple(pl.BlockSpec((T, K // 2), lambda i, b, h: (0, 0)) for _ in rope))


def _call(kernel, cfg: _Config, grid, in_specs, out_specs, out_shape, name, head_dim: int,
          stages: int = 0, **kw):
  """pallas_call with the Triton settings (interpreted off GPU); `stages` overrides the tiles'."""
  warps = cfg.tiles.num_warps or (4 if head_dim <= 128 else 8)
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg, **kw), grid=grid, in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape, interpret=cfg.interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=warps,
                                           num_stages=stages or cfg.tiles.num_stages))


# Logical axes of the kernels' operands under a mesh (each runs per device: sharding.per_device)
ROWS, QKV = ("batch", None, "act_heads", None), ("batch", None, None, "act_heads", None)
STAT, ROW = ("batch", "act_heads", None), ("batch", None)


def _axes(*arrays):
  """Logical axes of each operand: by rank (rows, qkv, statistics or tables, window)."""
  by_rank = {5: QKV, 4: ROWS, 3: STAT, 2: ROW, 1: (None,)}
  return tuple(by_rank[a.ndim] for a in arrays)


def _forward(cfg: _Config, q, k, v, seg, window, rope, table):
  """(output [B, T, H, K], logsumexp [B, H, T] float32)."""
  B, T, H, _ = v.shape
  bq = cfg.tiles.block_q

  def local(q, k, v, seg, window, lo, hi, *rope):
    rows, _, heads, K = v.shape  # this device's batch rows and heads
    sp = _common(T, K, heads, rope)
    return _call(
        _forward_kernel, cfg, (T // bq, rows, heads),
        [sp["window"], _entry(T // bq), _entry(T // bq), sp["seg"], _whole(q, 0), _whole(k, 1),
         _whole(v), sp["rope"]],
        [pl.BlockSpec((None, bq, None, K), lambda i, b, h: (b, i, h, 0)),
         pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        [jax.ShapeDtypeStruct(v.shape, v.dtype),
         jax.ShapeDtypeStruct((rows, heads, T), jnp.float32)],
        "flash_gpu_forward", K)(window, lo, hi, seg, q, k, v, rope)

  args = (q, k, v, seg, window, *table)
  rope_axes = ((None, None),) * len(rope)
  return sharding.per_device(local, args + tuple(rope), _axes(*args) + rope_axes, [ROWS, STAT],
                             out_shape=[v.shape, (B, H, T)])


def _backward(cfg: _Config, q, k, v, do, lse, delta, seg, window, rope, tables):
  """(dq, dk, dv), or (the gradient of qkv with q's and k's parts, dv) where q and k are qkv."""
  T, t = v.shape[1], cfg.tiles
  fused = q.ndim == 5

  def local(q, k, v, do, lse, delta, seg, window, key_lo, key_hi, query_lo, query_hi, *rope):
    rows, _, heads, K = v.shape  # this device's batch rows and heads
    sp = _common(T, K, heads, rope)
    nq, nk = T // t.block_q_bwd, T // t.block_k_bwd
    outs = [q, v] if fused else [q, k, v]
    return _call(
        _backward_kernel, cfg, (max(nq, nk), rows, 2 * heads),
        [sp["window"], _entry(nq), _entry(nq), _entry(nk), _entry(nk), sp["seg"], _whole(q, 0),
         _whole(k, 1), _whole(v), _whole(do), sp["stat"], sp["stat"], sp["rope"]],
        [_whole(x) for x in outs], [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in outs],
        "flash_gpu_backward", K, heads=heads,
        # float32 tiles of both branches staged twice: 241 KiB of shared memory, over an H100's
        # 227 (shakespeare.yml)
        stages=1 if v.dtype.itemsize > 2 else 0)(window, key_lo, key_hi, query_lo, query_hi,
                                                  seg, q, k, v, do, lse, delta, rope)

  args = (q, k, v, do, lse, delta, seg, window, *tables[0], *tables[1])
  rope_axes = ((None, None),) * len(rope)
  outs = [q, v] if fused else [q, k, v]
  return sharding.per_device(local, args + tuple(rope), _axes(*args) + rope_axes,
                             list(_axes(*outs)), out_shape=[x.shape for x in outs])


def _sources(mix, x, mix_args):
  """The kernels' q, k and v: the arrays given, or qkv twice and v mixed from its part."""
  if mix is None:
    return x
  return x[0], x[0], mix(x[0][:, :, 2], *mix_args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(cfg, mix, x, mix_args, seg, window, rope):
  """Attention of x = (q, k, v), or with `mix`, x = (qkv,) (see flash_gpu_qkv_attention)."""
  return _attention_fwd(cfg, mix, x, mix_args, seg, window, rope)[0]


def _attention_fwd(cfg, mix, x, mix_args, seg, window, rope):
  q, k, v = _sources(mix, x, mix_args)
  tables = _tables(seg, window, cfg)
  out, lse = _forward(cfg, q, k, v, seg, window, rope, tables[0])
  return out, (x, mix_args, v, seg, window, rope, tables[1:], out, lse)


def _attention_bwd(cfg, mix, res, do):
  x, mix_args, v, seg, window, rope, tables, out, lse = res
  q, k = (x[0], x[0]) if mix is not None else x[:2]
  # delta_t = sum_k do_tk o_tk = sum_s p_ts dp_ts: the softmax gradient's row term.
  delta = jnp.einsum("bthk,bthk->bht", do.astype(jnp.float32), out.astype(jnp.float32))
  grads = _backward(cfg, q, k, v, do, lse, delta, seg, window, rope, tables)
  if mix is None:
    dx, dargs = tuple(grads), ()
  else:  # v's gradient through the mix, placed in the qkv gradient (in place)
    d_qkv, dv = grads
    _, vjp = jax.vjp(mix, x[0][:, :, 2], *mix_args)
    dv_raw, *dargs = vjp(dv)
    d_qkv = lax.dynamic_update_index_in_dim(d_qkv, dv_raw, 2, axis=2)  # not a scatter
    dx, dargs = (sharding.constrain(d_qkv, QKV),), tuple(dargs)
  return dx, dargs, None, None, tuple(None for _ in rope)


_attention.defvjp(_attention_fwd, _attention_bwd)
