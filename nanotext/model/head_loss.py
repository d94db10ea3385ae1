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
the e5m2-rounded gradient at the scales of layers.fp8_head_scales, float32 accumulation. The
head then runs in the record's scale r = sqrt(d): z = x (r W) rounded to the model dtype, logits
from z / r in float32, so z and its gradient are rounded on the record's grid and their FP8 codes
are the record's (rounding z / r instead moved 1.3% of the gradient's e5m2 codes;
tests/test_record_training.py).
"""

import functools

import jax
import jax.numpy as jnp

from nanotext.model.layers import E4M3, E5M2, _dequantize, _dot32, _quantize


def head_loss_sum(x_ND, w_DV, targets_N, *, softcap: float = 0.0, fp8=None, fp8_scale=1.0):
  """Sum over N tokens of cross-entropy(softcap(x @ w), target) in float32.

  `fp8`: (x_s, w_s, grad_s) for an FP8 matmul run at scale `fp8_scale` (the module docstring's
  r), or None for x @ w in x's dtype. `softcap` c > 0: logits c * tanh(z / c); 0: the plain
  logits.
  """
  fp8 = None if fp8 is None else (*fp8, float(fp8_scale))
  return _fused(x_ND, w_DV, targets_N, float(softcap), fp8)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _fused(x_ND, w_DV, targets_N, softcap, fp8):
  return _forward(x_ND, w_DV, targets_N, softcap, fp8)[0]


def _matmul(x_ND, w_DV, fp8):
  """(z [N, V] in x's dtype, the operands as the backward pass needs them)."""
  dt = x_ND.dtype
  if fp8 is None:
    a, b = x_ND, w_DV.astype(dt)
    return jnp.dot(a, b, preferred_element_type=dt), (a, b)
  x_s, w_s, _, r = fp8
  x8, w8 = _quantize(x_ND, x_s, E4M3), _quantize(w_DV * r, w_s * r, E4M3)
  return _dot32(_dequantize(x8, x_s), _dequantize(w8, w_s * r)).astype(dt), (x8, w8)


def _capped(z_NV, softcap, fp8):
  """(logits, tanh(z / c)) in float32 from the head output z (tanh None without a soft-cap)."""
  z = z_NV.astype(jnp.float32)
  z = z / fp8[3] if fp8 else z  # no op where there is no scale: z stays the head's output
  if not softcap:
    return z, None
  t = jnp.tanh(z / softcap)
  return softcap * t, t


def _forward(x_ND, w_DV, targets_N, softcap, fp8):
  z_NV, operands = _matmul(x_ND, w_DV, fp8)
  l_NV, _ = _capped(z_NV, softcap, fp8)
  if softcap:  # |l| <= c: exp cannot overflow, one reduction gives the log-sum-exp
    lse_N = jnp.log(jnp.sum(jnp.exp(l_NV), axis=-1))
  else:
    top_N = jax.lax.stop_gradient(jnp.max(l_NV, axis=-1))
    lse_N = top_N + jnp.log(jnp.sum(jnp.exp(l_NV - top_N[:, None]), axis=-1))
  # The target's logit capped on its own: the [N, V] logits then have one reader (the exp-sum),
  # so nothing but z of that size need be kept (XLA fuses; nanotext.memory counts readers).
  picked_N, _ = _capped(jnp.take_along_axis(z_NV, targets_N[:, None], axis=-1)[:, 0], softcap, fp8)
  like = (jnp.zeros((0,), x_ND.dtype), jnp.zeros((0,), w_DV.dtype))
  return jnp.sum(lse_N - picked_N), (operands, z_NV, lse_N, targets_N, like)


def _fused_fwd(x_ND, w_DV, targets_N, softcap, fp8):
  return _forward(x_ND, w_DV, targets_N, softcap, fp8)


def _fused_bwd(softcap, fp8, res, g):
  (a, b), z_NV, lse_N, targets_N, (x_like, w_like) = res
  l_NV, t_NV = _capped(z_NV, softcap, fp8)
  hit_NV = jnp.arange(l_NV.shape[-1])[None, :] == targets_N[:, None]
  dl_NV = g * (jnp.exp(l_NV - lse_N[:, None]) - hit_NV)
  # (1 - t)(1 + t), not 1 - t^2: exact where the cap saturates (|t| near 1), as autodiff's tanh
  dz_NV = dl_NV * ((1 - t_NV) * (1 + t_NV)) if softcap else dl_NV
  if fp8 is None:
    dz = dz_NV.astype(x_like.dtype)  # as autodiff rounds the gradient of z (x's dtype)
    dx = jnp.dot(dz, b.T, preferred_element_type=x_like.dtype)
    dw = jnp.dot(a.T, dz, preferred_element_type=x_like.dtype)
  else:
    x_s, w_s, grad_s, r = fp8  # z = z' r: its gradient is dz' / r, the weights' r dW_r
    g_NV = _dequantize(_quantize((dz_NV / r).astype(x_like.dtype), grad_s / r, E5M2), grad_s / r)
    dx = _dot32(g_NV, _dequantize(b, w_s * r).T)
    dw = _dot32(_dequantize(a, x_s).T, g_NV) * r
  return dx.astype(x_like.dtype), dw.astype(w_like.dtype), None


_fused.defvjp(_fused_fwd, _fused_bwd)
