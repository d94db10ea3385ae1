"""What one program of flash_gpu's kernels does (kernels/flash_gpu.py builds the calls): the
forward's query tile, and the backward's query tile (dq) or key tile (dk, dv), as two kernels or
as the two halves of one.

Refs are one batch row and head's whole rows ([T, K], or [T, 3, K] of the merged projection's
output) sliced by tile here. With `rope` (cos and sin refs) q and k are read raw, normalised
and rotated as each tile is loaded (kernels/qk_rope.py's arithmetic) and held as two halves; with
`coef` v is a float32 sum of scaled sources rounded once (the value-embedding mix, as
layers.scaled_sum computes it), and the backward writes each source's gradient and each
coefficient's partial sums.
"""

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from nanotext.model.kernels import qk_rope

NEG = -1e30  # masked score: finite, so a tile with every key masked yields no inf - inf = nan


@dataclasses.dataclass(frozen=True)
class Tiles:
  """Tile sizes of the forward and of the two backward kernels, and their Triton settings."""
  block_q: int = 128  # the record's window block
  block_k: int = 64
  block_q_bwd: int = 64
  block_k_bwd: int = 64
  num_warps: int = 0  # 0: 4 for head_dim <= 128, else 8 (4 was 1.8x faster than 8 at 128, H100)
  num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class Config:
  """The kernels' static settings."""
  scale: float
  window_block: int
  tiles: Tiles
  interpret: bool
  eps: float  # QK-norm's epsilon where the kernels normalise and rotate q and k


def visible(t, s, seg_t, seg_s, window, window_block: int):
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


def _v(values, coef, rows):
  """Rows of v: as stored, or with `coef` sum_i coef_i source_i in float32 rounded once."""
  if not coef:
    return values[0][rows, :]
  total = sum(coef[0][i] * src[rows, :].astype(jnp.float32) for i, src in enumerate(values))
  return total.astype(values[0].dtype)


def _scores(q, k):
  """q k^T, float32, from _qk's parts (the sum of the halves' products where split)."""
  return sum(_dot(a, b, (1, 1)) for a, b in zip(q, k))


def _write(dest, rows, cols, value):
  """Store `value` at rows x cols of a gradient destination: a ref, or (ref, part) of a
  [T, 3, K] block."""
  if isinstance(dest, tuple):
    dest[0][rows, dest[1], cols] = value.astype(dest[0].dtype)
  else:
    dest[rows, cols] = value.astype(dest.dtype)


def _store_grad(dest, x_ref, rows, grads, rope, eps):
  """Write a q or k tile's gradient (float32 parts, as _qk split it): as it is, or through the
  norm and rotation of the raw rows in x_ref, rounded first to the dtype the two kernels'
  path would have stored it in."""
  dtype = (dest[0] if isinstance(dest, tuple) else dest).dtype
  if not rope:
    _write(dest, rows, slice(None), grads[0])
    return
  cos, sin = rope
  g1, g2 = (g.astype(dtype).astype(jnp.float32) for g in grads)
  d1, d2 = qk_rope.norm_rotate_grad(g1, g2, *qk_rope.halves(x_ref, rows), cos[rows, :],
                                    sin[rows, :], eps, dtype)
  half = d1.shape[-1]
  _write(dest, rows, slice(None, half), d1)
  _write(dest, rows, slice(half, None), d2)


def _delta(do, o):
  """sum_k do_tk o_tk per row, float32: the softmax gradient's row term."""
  return jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=1)


def forward(win_ref, lo_ref, hi_ref, seg_ref, q_ref, k_ref, values, coef, rope, o_ref, lse_ref,
            *, cfg: Config):
  """One query tile: online softmax over its key tiles lo..hi; output and logsumexp."""
  bq, bk = cfg.tiles.block_q, cfg.tiles.block_k
  w = win_ref[0]
  rows = pl.ds(pl.program_id(0) * bq, bq)
  t = pl.program_id(0) * bq + jnp.arange(bq, dtype=jnp.int32)
  q, seg_q = _qk(q_ref, rows, rope, cfg.eps), seg_ref[rows]

  def body(j, carry):
    o, m, l = carry
    keys = pl.ds(j * bk, bk)
    k, v = _qk(k_ref, keys, rope, cfg.eps), _v(values, coef, keys)
    s = _scores(q, k) * cfg.scale
    seen = visible(t, j * bk + jnp.arange(bk, dtype=jnp.int32), seg_q, seg_ref[keys], w,
                   cfg.window_block)
    s = jnp.where(seen, s, NEG)
    m_next = jnp.maximum(m, s.max(axis=1))
    # Rows whose earlier tiles were all masked carry garbage with m = NEG; the first real score
    # makes this factor exactly 0. Every query sees itself, in the last tile at the latest.
    shrink = jnp.exp(m - m_next)
    p = jnp.exp(s - m_next[:, None])
    o = o * shrink[:, None] + _dot(p.astype(v.dtype), v)
    return o, m_next, l * shrink + p.sum(axis=1)

  init = (jnp.zeros((bq, o_ref.shape[-1]), jnp.float32), jnp.full((bq,), -jnp.inf, jnp.float32),
          jnp.zeros((bq,), jnp.float32))
  o, m, l = lax.fori_loop(lo_ref[0], hi_ref[0] + 1, body, init)
  o_ref[...] = (o / l[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m + jnp.log(l)


def backward(win_ref, key_lo_ref, key_hi_ref, query_lo_ref, query_hi_ref, seg_ref, q_ref, k_ref,
             values, coef, rope, do_ref, o_ref, lse_ref, out, *, cfg: Config, heads: int):
  """Program (i, b, h) of the one backward kernel: for h < heads query tile i's dq over its key
  tiles, else key tile i's dk and dv over the query tiles that may see it. `out`: refs of the
  gradients, "q", "k" and "v", or "qkv" [T, 3, K] for the three; with `coef`, "sources" (the
  gradient of each v source after the first) and "coef" ([n sources, key tiles]: each
  coefficient's gradient, summed by tile). Each query's softmax row term, delta = sum_k do o
  (= sum_s p dp), is computed from the output gradient and the output where a tile of them is
  read."""
  dests = [(out["qkv"], n) for n in range(3)] if "qkv" in out else [out[x] for x in "qkv"]
  T, i = seg_ref.shape[0], pl.program_id(0)
  refs = (win_ref[0], seg_ref, q_ref, k_ref, values, coef, rope, do_ref, lse_ref,
          lambda rows, do: _delta(do, o_ref[rows, :]))

  @pl.when((pl.program_id(2) < heads) & (i < T // cfg.tiles.block_q_bwd))
  def _():
    _dq_tile(i, key_lo_ref[0], key_hi_ref[0], *refs, dests[0], cfg)

  @pl.when((pl.program_id(2) >= heads) & (i < T // cfg.tiles.block_k_bwd))
  def _():
    _dkv_tile(i, query_lo_ref[0], query_hi_ref[0], *refs, dests[1:], out, cfg)


def backward_dq(win_ref, lo_ref, hi_ref, seg_ref, q_ref, k_ref, values, do_ref, lse_ref,
                delta_ref, dq_ref, *, cfg: Config):
  """Program (i, b, h) of the dq kernel: query tile i's dq over its key tiles lo..hi, with
  each query's row term delta given."""
  _dq_tile(pl.program_id(0), lo_ref[0], hi_ref[0], win_ref[0], seg_ref, q_ref, k_ref, values,
           (), (), do_ref, lse_ref, lambda rows, do: delta_ref[rows], dq_ref, cfg)


def backward_dkv(win_ref, lo_ref, hi_ref, seg_ref, q_ref, k_ref, values, do_ref, lse_ref,
                 delta_ref, dk_ref, dv_ref, *, cfg: Config):
  """Program (i, b, h) of the dk/dv kernel: key tile i's dk and dv over the query tiles lo..hi
  that may see it, with each query's row term delta given."""
  _dkv_tile(pl.program_id(0), lo_ref[0], hi_ref[0], win_ref[0], seg_ref, q_ref, k_ref, values,
            (), (), do_ref, lse_ref, lambda rows, do: delta_ref[rows], (dk_ref, dv_ref), {},
            cfg)


def _positions(start, n):
  """Token positions start..start + n - 1, int32."""
  return start + jnp.arange(n, dtype=jnp.int32)


def _dq_tile(i, lo, hi, w, seg_ref, q_ref, k_ref, values, coef, rope, do_ref, lse_ref, delta_of,
             dest, cfg: Config):
  """Query tile i's dq over key tiles lo..hi, written to `dest`."""
  bq, bk = cfg.tiles.block_q_bwd, cfg.tiles.block_k_bwd
  rows = pl.ds(i * bq, bq)
  q, do, seg_q = _qk(q_ref, rows, rope, cfg.eps), do_ref[rows, :], seg_ref[rows]
  lse, delta = lse_ref[rows], delta_of(rows, do)

  def body(j, dq):
    keys = pl.ds(j * bk, bk)
    k, v = _qk(k_ref, keys, rope, cfg.eps), _v(values, coef, keys)
    seen = visible(_positions(i * bq, bq), _positions(j * bk, bk), seg_q, seg_ref[keys], w,
                   cfg.window_block)
    p = jnp.where(seen, jnp.exp(_scores(q, k) * cfg.scale - lse[:, None]), 0.0)
    ds = p * (_dot(do, v, (1, 1)) - delta[:, None])
    return tuple(a + _dot(ds.astype(part.dtype), part) for a, part in zip(dq, k))

  zeros = tuple(jnp.zeros((bq, part.shape[-1]), jnp.float32) for part in q)
  dq = lax.fori_loop(lo, hi + 1, body, zeros)
  _store_grad(dest, q_ref, rows, [a * cfg.scale for a in dq], rope, cfg.eps)


def _dkv_tile(i, lo, hi, w, seg_ref, q_ref, k_ref, values, coef, rope, do_ref, lse_ref, delta_of,
              dests, out, cfg: Config):
  """Key tile i's dk and dv over query tiles lo..hi, written to dests (dk's, dv's); with
  `coef`, the sources' gradients and the coefficients' partial sums to out's."""
  bq, bk = cfg.tiles.block_q_bwd, cfg.tiles.block_k_bwd
  cols = pl.ds(i * bk, bk)
  k, v, seg_k = _qk(k_ref, cols, rope, cfg.eps), _v(values, coef, cols), seg_ref[cols]

  def body(r, carry):
    dk, dv = carry
    rows = pl.ds(r * bq, bq)
    q, do = _qk(q_ref, rows, rope, cfg.eps), do_ref[rows, :]
    seen = visible(_positions(r * bq, bq), _positions(i * bk, bk), seg_ref[rows], seg_k, w,
                   cfg.window_block)
    p = jnp.where(seen, jnp.exp(_scores(q, k) * cfg.scale - lse_ref[rows][:, None]), 0.0)
    dv = dv + _dot(p.astype(do.dtype), do, (0, 0))
    ds = p * (_dot(do, v, (1, 1)) - delta_of(rows, do)[:, None])
    return tuple(a + _dot(ds.astype(part.dtype), part, (0, 0)) for a, part in zip(dk, q)), dv

  zeros = tuple(jnp.zeros((bk, part.shape[-1]), jnp.float32) for part in k)
  dk, dv = lax.fori_loop(lo, hi + 1, body, (zeros, jnp.zeros((bk, v.shape[-1]), jnp.float32)))
  _store_grad(dests[0], k_ref, cols, [a * cfg.scale for a in dk], rope, cfg.eps)
  if not coef:
    _write(dests[1], cols, slice(None), dv)
    return
  # v = sum_i c_i s_i rounded once: each source's gradient c_i dv, rounded as autodiff's, and
  # c_i's this tile's sum of dv s_i (dv first rounded to v's dtype, as the two kernels' path)
  dv = dv.astype(v.dtype).astype(jnp.float32)
  for n, (src, dest) in enumerate(zip(values, [dests[1], *out["sources"]])):
    _write(dest, cols, slice(None), coef[0][n] * dv)
    # one axis at a time: jax 0.11's Triton lowering of a two-axis sum fails
    out["coef"][pl.ds(n, 1), pl.ds(i, 1)] = jnp.sum(jnp.sum(
        dv * src[cols, :].astype(jnp.float32), axis=1, keepdims=True), axis=0, keepdims=True)
