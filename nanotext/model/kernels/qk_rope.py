"""QK-norm and rotary embeddings of q and k in one pass each way, for NVIDIA GPUs in Pallas
(Triton lowering; interpret mode elsewhere).

Left to XLA, rms_norm then apply_rope (model/layers.py, model/rope.py) on q and k take two
passes forward (the norm's statistics, then norm and rotation) and two backward (the norm's
row sum, then the rest), plus a concatenation of the gradients: at the record's shape on an
H100 about 1.7 GB of traffic a layer as the HLO counts it, where these kernels move about 1.0
(forward: q and k read and written; backward: their gradients and q and k read, the whole QKV
gradient written; benchmarks/RESULTS.md). A head's 128 values fit one program's registers, so
here one kernel reads a tile of q and k and writes them normalised and rotated, and one kernel
does the backward pass. The arithmetic is the XLA path's, roundings included: the norm's output is
rounded to the model dtype before the rotation, and so is its gradient on the way back.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from nanotext import sharding
from nanotext.model import rope
from nanotext.model.kernels.per_device import platform

TILE = 64  # tokens per program: a [64, head_dim] tile of q and one of k


def applies(seq_len: int, head_dim: int) -> bool:
  """Whether the program being built takes this kernel: on a GPU, rows a multiple of TILE long,
  head_dim a power of two from 16 to 256 (elsewhere the XLA path compiles well: CPU and TPU)."""
  return (platform() == "gpu" and seq_len % TILE == 0 and 16 <= head_dim <= 256
          and head_dim & (head_dim - 1) == 0)


def norm_rope(qkv_BT3HK, freq, eps: float):
  """(rope(rms_norm(q)), rope(rms_norm(k)), v) [B, T, H, K] in the model dtype from the merged
  projection's output viewed [B, T, 3, H, K] (q, k, v), per device under a mesh; `freq` the
  [K / 2] angular frequencies of model/rope.py (zero for pairs that do not rotate). The kernels
  read q and k where the projection wrote them and write the gradient of all three in place:
  no copy made or kept, no concatenation."""
  theta_TK = rope.angles(qkv_BT3HK.shape[1], freq)  # the XLA path's angles, so its cos and sin
  tables = (lax.stop_gradient(jnp.cos(theta_TK)), lax.stop_gradient(jnp.sin(theta_TK)))
  local = functools.partial(_norm_rope, eps=float(eps), interpret=platform() != "gpu")
  return sharding.per_device(
      local, (qkv_BT3HK,) + tables, (("batch", None, None, "act_heads", None), (None, None),
                                     (None, None)),
      ("batch", None, "act_heads", None), out_shape=qkv_BT3HK.shape[:2] + qkv_BT3HK.shape[3:])


def halves(ref, rows=slice(None)):
  """Rows of a [tile, K] block as its two halves, in float32."""
  half = ref.shape[-1] // 2
  return ref[rows, :half].astype(jnp.float32), ref[rows, half:].astype(jnp.float32)


def _rsqrt_ms(x1, x2, eps):
  """1 / sqrt(mean(x^2) + eps) per row, over both halves."""
  n = 2 * x1.shape[-1]
  return lax.rsqrt((jnp.sum(x1 * x1, axis=1) + jnp.sum(x2 * x2, axis=1)) / n + eps)


def norm_rotate(x1, x2, c, s, eps, dtype):
  """rope(rms_norm(x)) of a tile's float32 halves, as halves in float32 holding `dtype` values:
  the norm's output rounded to `dtype` before the rotation (the XLA path's roundings). For
  kernels that read q and k raw (this one; kernels/flash_gpu.py)."""
  r = _rsqrt_ms(x1, x2, eps)[:, None]
  rounded = lambda v: v.astype(dtype).astype(jnp.float32)
  n1, n2 = rounded(x1 * r), rounded(x2 * r)
  return rounded(n1 * c + n2 * s), rounded(n2 * c - n1 * s)


def norm_rotate_grad(g1, g2, x1, x2, c, s, eps, dtype):
  """The gradient through norm_rotate of raw halves x1, x2 from its output's g1, g2 (float32
  holding `dtype` values), as float32 halves: the rotation transposed, rounded to `dtype` as
  autodiff's cotangent is, then the norm's backward."""
  rounded = lambda v: v.astype(dtype).astype(jnp.float32)
  dn1, dn2 = rounded(g1 * c - g2 * s), rounded(g1 * s + g2 * c)
  r = _rsqrt_ms(x1, x2, eps)[:, None]
  # d/dx of x r(x): dn r - x r^3 sum(dn x) / K
  coef = r * r * r * (jnp.sum(dn1 * x1, axis=1) + jnp.sum(dn2 * x2, axis=1))[:, None] / (
      2 * x1.shape[-1])
  return dn1 * r - x1 * coef, dn2 * r - x2 * coef


def _forward_kernel(cos_ref, sin_ref, q_ref, k_ref, qo_ref, ko_ref, *, eps):
  c, s = cos_ref[...], sin_ref[...]
  half = c.shape[-1]
  for x_ref, o_ref in ((q_ref, qo_ref), (k_ref, ko_ref)):
    o1, o2 = norm_rotate(*halves(x_ref), c, s, eps, o_ref.dtype)
    o_ref[:, :half] = o1.astype(o_ref.dtype)
    o_ref[:, half:] = o2.astype(o_ref.dtype)


def _backward_kernel(cos_ref, sin_ref, x_ref, gq_ref, gk_ref, gv_ref, d_ref, *, eps, heads):
  """One [tile, K] block of the gradient of qkv: q's or k's through the norm and rotation, v's
  as it came (the program's part: q, k or v by its head index)."""
  part = pl.program_id(2) // heads

  @pl.when(part == 2)
  def _():
    d_ref[...] = gv_ref[...]

  for j, g_ref in ((0, gq_ref), (1, gk_ref)):
    @pl.when(part == j)
    def _():
      c, s = cos_ref[...], sin_ref[...]
      half = c.shape[-1]
      d1, d2 = norm_rotate_grad(*halves(g_ref), *halves(x_ref), c, s, eps, d_ref.dtype)
      d_ref[:, :half] = d1.astype(d_ref.dtype)
      d_ref[:, half:] = d2.astype(d_ref.dtype)


def _params():
  return plgpu.CompilerParams(num_warps=4, num_stages=2)


def _forward(qkv, cos, sin, eps, interpret):
  """q and k normalised and rotated, [B, T, H, K] each, over a (tiles, B, H) grid."""
  B, T, _, H, K = qkv.shape
  table = pl.BlockSpec((TILE, K // 2), lambda i, b, h: (i, 0))
  part = lambda j: pl.BlockSpec((None, TILE, None, None, K), lambda i, b, h: (b, i, j, h, 0))
  rows = pl.BlockSpec((None, TILE, None, K), lambda i, b, h: (b, i, h, 0))
  return pl.pallas_call(
      functools.partial(_forward_kernel, eps=eps), grid=(T // TILE, B, H),
      in_specs=[table, table, part(0), part(1)], out_specs=[rows, rows],
      out_shape=[jax.ShapeDtypeStruct((B, T, H, K), qkv.dtype)] * 2, interpret=interpret,
      name="qk_norm_rope", compiler_params=_params())(cos, sin, qkv, qkv)


def _backward(qkv, cos, sin, gq, gk, gv, eps, interpret):
  """The gradient of qkv [B, T, 3, H, K] over a (tiles, B, 3 H) grid, each part written where it
  lies in qkv (no concatenation after)."""
  B, T, _, H, K = qkv.shape
  table = pl.BlockSpec((TILE, K // 2), lambda i, b, h: (i, 0))
  at = pl.BlockSpec((None, TILE, None, None, K), lambda i, b, h: (b, i, h // H, h % H, 0))
  rows = pl.BlockSpec((None, TILE, None, K), lambda i, b, h: (b, i, h % H, 0))
  return pl.pallas_call(
      functools.partial(_backward_kernel, eps=eps, heads=H), grid=(T // TILE, B, 3 * H),
      in_specs=[table, table, at, rows, rows, rows], out_specs=at,
      out_shape=jax.ShapeDtypeStruct(qkv.shape, qkv.dtype), interpret=interpret,
      name="qk_norm_rope_backward", compiler_params=_params())(cos, sin, qkv, gq, gk, gv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _norm_rope(qkv, cos, sin, eps, interpret):
  return (*_forward(qkv, cos, sin, eps, interpret), qkv[:, :, 2])


def _norm_rope_fwd(qkv, cos, sin, eps, interpret):
  return _norm_rope(qkv, cos, sin, eps, interpret), (qkv, cos, sin)


def _norm_rope_bwd(eps, interpret, res, g):
  qkv, cos, sin = res
  return _backward(qkv, cos, sin, *g, eps, interpret), jnp.zeros_like(cos), jnp.zeros_like(sin)


_norm_rope.defvjp(_norm_rope_fwd, _norm_rope_bwd)
