"""The lm head, its soft-cap and the cross-entropy as one function with its own gradient.

Left to autodiff, logits -> soft-cap -> log-softmax -> target pick makes several elementwise
passes over the [tokens, vocab] logits each way (a max, a shifted exp-sum, the soft-cap's tanh
and its derivative, the softmax minus the one-hot, dtype converts); at one 49,152-token row and
50,304 head rows each pass moves gigabytes. Here the forward pass is the head's matmul plus ONE
fused pass (soft-capped logits lie in [-c, c], so exp needs no running max: the log-sum-exp is a
single reduction) and the backward pass is ONE fused pass making the logits' gradient
(softmax - one-hot, times the soft-cap's derivative 1 - (l / c)^2, times the incoming scale)
before the two matmuls. The head output z (the matmul's, in the model dtype, as the record's
`out_dtype=bfloat16`) is kept for the backward pass, not the float32 logits; under
train.loss_chunk the chunk's scan step is rematerialised instead (model/loss.py).

With an FP8 head (model.fp8_head) the three matmuls are layers.fp8_matmul's: e4m3 operands and
the e5m2-rounded gradient at the scales of layers.fp8_head_scales, float32 accumulation.
"""

import functools

import jax
import jax.numpy as jnp

from nanotext.model.layers import E4M3, E5M2, _dequantize, _dot32, _quantize


def head_loss_sum(x_ND, w_DV, targets_N, *, softcap: float = 0.0, fp8=None):
  """Sum over N tokens of cross-entropy(softcap(x @ w), target) in float32.

  `fp8`: (x_s, w_s, grad_s) for an FP8 matmul, or None for x @ w in x's dtype. `softcap` c > 0:
  logits c * tanh(z / c); 0: the plain logits.
  """
  return _fused(x_ND, w_DV, targets_N, float(softcap), None if fp8 is None else tuple(fp8))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused(x_ND, w_DV, targets_N, softcap, fp8):
  return _forward(x_ND, w_DV, targets_N, softcap, fp8)[0]


def _matmul(x_ND, w_DV, fp8):
  """(z [N, V] in x's dtype, the operands as the backward pass needs them)."""
  dt = x_ND.dtype
  if fp8 is None:
    a, b = x_ND, w_DV.astype(dt)
    return jnp.dot(a, b, preferred_element_type=dt), (a, b)
  x_s, w_s, _ = fp8
  x8, w8 = _quantize(x_ND, x_s, E4M3), _quantize(w_DV, w_s, E4M3)
  return _dot32(_dequantize(x8, x_s), _dequantize(w8, w_s)).astype(dt), (x8, w8)


def _capped(z_NV, softcap):
  z = z_NV.astype(jnp.float32)
  return softcap * jnp.tanh(z / softcap) if softcap else z


def _forward(x_ND, w_DV, targets_N, softcap, fp8):
  z_NV, operands = _matmul(x_ND, w_DV, fp8)
  l_NV = _capped(z_NV, softcap)
  if softcap:  # |l| <= c: exp cannot overflow, one reduction gives the log-sum-exp
    lse_N = jnp.log(jnp.sum(jnp.exp(l_NV), axis=-1))
  else:
    top_N = jax.lax.stop_gradient(jnp.max(l_NV, axis=-1))
    lse_N = top_N + jnp.log(jnp.sum(jnp.exp(l_NV - top_N[:, None]), axis=-1))
  picked_N = jnp.take_along_axis(l_NV, targets_N[:, None], axis=-1)[:, 0]
  like = (jnp.zeros((0,), x_ND.dtype), jnp.zeros((0,), w_DV.dtype))
  return jnp.sum(lse_N - picked_N), (operands, z_NV, lse_N, targets_N, like)


def _fused_fwd(x_ND, w_DV, targets_N, softcap, fp8):
  return _forward(x_ND, w_DV, targets_N, softcap, fp8)


def _fused_bwd(softcap, fp8, res, g):
  (a, b), z_NV, lse_N, targets_N, (x_like, w_like) = res
  l_NV = _capped(z_NV, softcap)
  hit_NV = jnp.arange(l_NV.shape[-1])[None, :] == targets_N[:, None]
  dl_NV = g * (jnp.exp(l_NV - lse_N[:, None]) - hit_NV)
  dz_NV = dl_NV * (1 - jnp.square(l_NV / softcap)) if softcap else dl_NV
  if fp8 is None:
    dz = dz_NV.astype(x_like.dtype)  # as autodiff rounds the gradient of z (x's dtype)
    dx = jnp.dot(dz, b.T, preferred_element_type=x_like.dtype)
    dw = jnp.dot(a.T, dz, preferred_element_type=x_like.dtype)
  else:
    x_s, w_s, grad_s = fp8
    g_NV = _dequantize(_quantize(dz_NV.astype(x_like.dtype), grad_s, E5M2), grad_s)
    dx = _dot32(g_NV, _dequantize(b, w_s).T)
    dw = _dot32(_dequantize(a, x_s).T, g_NV)
  return dx.astype(x_like.dtype), dw.astype(w_like.dtype), None


_fused.defvjp(_fused_fwd, _fused_bwd)
