"""Small flax.nnx building blocks whose parameters carry logical axis names.

Shape suffixes: B batch, T length, D d_model, V vocab, F mlp width, H heads, K head dim.
Every parameter is an `nnx.Param` tagged with `out_sharding=(logical names...)`; only
nanotext.sharding turns those names into mesh axes.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nanotext import sharding
from nanotext.model import draws
from nanotext.model.kernels import relu2_mlp as relu2_kernels
from nanotext.model.kernels.per_device import platform


ROLES = ("matrix", "embed", "head", "scalar")  # optimizer groups: nanotext.optim reads `role`


def param(value, axes, role: str) -> nnx.Param:
  """A parameter tagged with logical axis names and its optimizer role (one of ROLES).

  Created unsharded (placement is jit's job). The role is said where the parameter is made,
  never guessed from its shape or axis names: a 2-D bias is still a scalar-group parameter.
  """
  assert len(axes) == value.ndim, (axes, value.shape)
  assert role in ROLES, role
  return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False, role=role)


def weight_std(model_cfg, fan_in: int) -> float:
  """Init std of a linear weight: model.init_std, or 0.5 / sqrt(fan_in) when it is 0 (auto)."""
  return model_cfg.init_std or 0.5 / float(np.sqrt(fan_in))


def proj_std(model_cfg, fan_in: int) -> float:
  """Init std of an output projection: zero, or weight_std shrunk by sqrt(2 * layers) (GPT-2)."""
  if model_cfg.zero_init_proj:
    return 0.0
  return weight_std(model_cfg, fan_in) / float(np.sqrt(2 * model_cfg.num_layers))


def init_array(rngs, shape, std, dtype, dist: str = "normal"):
  """Normal(0, std) or uniform(+-sqrt(3) std) (same std, the record's) init; std=0 gives zeros."""
  if std == 0:
    return jnp.zeros(shape, dtype)
  return draws.draw(rngs, shape, std, dtype, dist)


def matmul(x, w):
  """x [..., in] @ w [in, out] in x's dtype (`dot`: float32 math rounded once on CPU)."""
  if x.dtype.itemsize != 2 or platform() != "cpu":
    return x @ w
  return dot(x, w, (((x.ndim - 1,), (0,)), ((), ())))


def dot(x, y, dims):
  """lax.dot_general in x's dtype. On CPU a 16-bit product runs as float32 math rounded once:
  jax 0.11's CPU backend summed the weight gradient of a 16-bit x [B, T, in] (a dot over batch
  and time) in bf16, 2-3% off float64 (benchmarks/RESULTS.md, "Under jax 0.11.2"). A program
  built for a GPU or TPU (per_device.platform) is the plain dot."""
  if x.dtype.itemsize != 2 or platform() != "cpu":
    return jax.lax.dot_general(x, y, dims)
  return jax.lax.dot_general(x, y, dims, preferred_element_type=jnp.float32).astype(x.dtype)


@jax.custom_vjp
def relu2_mlp(x_BTD, w1_DF, w2_FD):
  """relu(x @ w1)^2 @ w2 in x's dtype, the squared ReLU inside kernels/relu2_mlp.py's GEMMs:
  the speedrun MLP on a GPU (gpt.MLP), the XLA path's arithmetic."""
  (a_BTF,) = relu2_kernels.up(x_BTD, w1_DF, keep_h=False)  # no backward pass: no h kept
  return matmul(a_BTF, w2_FD)


def _relu2_mlp_fwd(x_BTD, w1_DF, w2_FD):
  h_BTF, a_BTF = relu2_kernels.up(x_BTD, w1_DF)
  return matmul(a_BTF, w2_FD), (x_BTD, w1_DF, w2_FD, h_BTF, a_BTF)


def _relu2_mlp_bwd(res, dy_BTD):
  x_BTD, w1_DF, w2_FD, h_BTF, a_BTF = res
  dh_BTF = relu2_kernels.grad_h(dy_BTD, w2_FD, h_BTF)
  tokens = (((0, 1), (0, 1)), ((), ()))  # a weight's gradient: summed over batch and time
  return (dot(dh_BTF, w1_DF, (((2,), (1,)), ((), ()))), dot(x_BTD, dh_BTF, tokens),
          dot(a_BTF, dy_BTD, tokens))


relu2_mlp.defvjp(_relu2_mlp_fwd, _relu2_mlp_bwd)


class Linear(nnx.Module):
  """y = x @ W (+ b), with W of shape [in, out] tagged (in_axis, out_axis)."""

  def __init__(self, d_in, d_out, axes, *, std, bias, param_dtype, dtype, rngs, role="matrix",
               dist="normal"):
    self.kernel = param(init_array(rngs, (d_in, d_out), std, param_dtype, dist), axes, role)
    self.bias = param(jnp.zeros((d_out,), param_dtype), axes[1:], "scalar") if bias else None
    self.dtype = dtype

  def __call__(self, x):
    y = matmul(x.astype(self.dtype), self.kernel.get_value().astype(self.dtype))
    if self.bias is not None:
      y = y + self.bias.get_value().astype(self.dtype)
    return y


class StackedLinear(nnx.Module):
  """n projections of one input in one [n, in, out] parameter (merged QKV): the n outputs side by
  side, [..., n * out]."""

  def __init__(self, n, d_in, d_out, axes, *, std, bias, param_dtype, dtype, rngs, dist="normal"):
    # The stack axis is unsharded (None): Muon treats such a parameter as n separate matrices.
    self.kernel = param(init_array(rngs, (n, d_in, d_out), std, param_dtype, dist),
                        (None,) + tuple(axes), "matrix")
    self.bias = param(jnp.zeros((n, d_out), param_dtype), (None, axes[1]), "scalar") \
        if bias else None
    self.dtype = dtype

  def __call__(self, x):
    # One [in, n * out] matmul whose output splits along its last axis: an [n, ..., out] result
    # put the stack axis outermost, and a GPU transposed each layer's output to get there (and
    # its gradient back), about 4 ms of a record step.
    n, d_in, d_out = self.kernel.get_value().shape
    w = self.kernel.get_value().astype(self.dtype).transpose(1, 0, 2).reshape(d_in, n * d_out)
    y = matmul(x.astype(self.dtype), w)
    if self.bias is not None:
      y = y + self.bias.get_value().astype(self.dtype).reshape(n * d_out)
    return y


class Norm(nnx.Module):
  """LayerNorm with scale and bias (GPT-2) or parameter-free RMSNorm (speedrun)."""

  def __init__(self, dim, kind, *, param_dtype, eps=1e-5):
    self.kind, self.eps = kind, eps
    if kind == "layernorm":
      self.scale = param(jnp.ones((dim,), param_dtype), ("embed",), "scalar")
      self.bias = param(jnp.zeros((dim,), param_dtype), ("embed",), "scalar")

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    if self.kind == "rmsnorm":
      return rms_norm(x32, self.eps).astype(x.dtype)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale.get_value() + self.bias.get_value()).astype(x.dtype)


def scaled_sum(weights, terms):
  """sum(w * t) in float32, rounded once to the first term's dtype: the record's float32
  scalars times bf16 activations, as its compiled (fused) PyTorch computes them."""
  total = sum(jnp.asarray(w, jnp.float32) * t.astype(jnp.float32) for w, t in zip(weights, terms))
  return total.astype(terms[0].dtype)


def rms_norm(x, eps=1e-6):
  """Parameter-free RMS normalisation over the last axis."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)).astype(x.dtype)


class Embed(nnx.Module):
  """Token embedding table [V, D]; `attend` gives tied-head logits. `role`: its optimizer group
  ("head" for a table that is also the head: it trains at the head's lr)."""

  def __init__(self, vocab, dim, *, std, param_dtype, dtype, rngs, role="embed"):
    self.embedding = param(init_array(rngs, (vocab, dim), std, param_dtype), ("vocab", "embed"),
                           role)
    self.dtype = dtype

  def __call__(self, tokens_BT):
    return lookup((self,), tokens_BT)[0]

  def attend(self, x_BTD):
    return matmul(x_BTD.astype(self.dtype), self.embedding.get_value().astype(self.dtype).T)


def lookup(embeds, tokens_BT) -> tuple:
  """Each Embed's rows at the same token ids, [B, T, D] each in its dtype (model.dtype).

  The token embedding and the value embeddings share their ids: the forward pass gathers from
  each table, the backward pass sums every table's gradient in one float32 scatter-add (not one
  per table, and not in a bf16 table's own dtype, where the frequent tokens' sums of tens of
  thousands of rows lose 5-8% at a 49,152-token row), rounding once to each table's dtype.
  """
  tables = tuple(e.embedding.get_value() for e in embeds)
  rows = _shared_lookup(tables, tokens_BT)
  return tuple(sharding.constrain(x.astype(e.dtype), ("batch", "act_length", "act_embed"))
               for x, e in zip(rows, embeds))


@jax.custom_vjp
def _shared_lookup(tables, ids_BT):
  return tuple(jnp.take(t, ids_BT, axis=0) for t in tables)


def _shared_lookup_fwd(tables, ids_BT):
  return _shared_lookup(tables, ids_BT), (tables, ids_BT)  # the tables are live params anyway


def _shared_lookup_bwd(res, grads):
  tables, ids_BT = res
  if len({t.shape for t in tables}) > 1:  # tables of different shapes: one scatter each
    sums = [jnp.zeros(t.shape, jnp.float32).at[ids_BT].add(g.astype(jnp.float32))
            for t, g in zip(tables, grads)]
  else:  # one scatter of [n, B, T, D] updates into [n, V, D]
    g_NBTD = jnp.stack([g.astype(jnp.float32) for g in grads])
    acc_NVD = sharding.constrain(jnp.zeros((len(tables),) + tables[0].shape, jnp.float32),
                                 (None, "vocab", "embed"))
    sums = sharding.constrain(acc_NVD.at[:, ids_BT].add(g_NBTD), (None, "vocab", "embed"))
  return tuple(s.astype(t.dtype) for s, t in zip(sums, tables)), None


_shared_lookup.defvjp(_shared_lookup_fwd, _shared_lookup_bwd)


# FP8 matmul (modded-nanogpt's FP8 lm head). Per-tensor scales are static, so no amax pass over the
# [tokens, vocab] gradient is needed. Values are divided by their scale, saturated to the format's
# largest finite value (float8_e4m3fn has no inf: an overflow would be NaN) and rounded to FP8.
# Each dot then takes the FP8 values dequantised in float32 (`q.astype(float32) * scale`, the
# scales float32 as the record's torch._scaled_mm takes them) and accumulates in float32: the
# pattern XLA's GPU compiler rewrites into one scaled FP8 GEMM on FP8 hardware (H100 and newer).
# Elsewhere (CPU, older GPUs) the same code runs a float32 matmul of FP8 values: the numerics, not
# the speed.
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def _quantize(x, scale, q_dtype):
  """x / scale rounded to FP8, saturating at the format's largest finite value."""
  big = float(jnp.finfo(q_dtype).max)
  return jnp.clip(x.astype(jnp.float32) / scale, -big, big).astype(q_dtype)


def _dequantize(q, scale):
  """FP8 codes times their float32 scale, in float32 (exact up to the scale's rounding)."""
  return q.astype(jnp.float32) * jnp.float32(scale)


def _dot32(a, b, exact: bool = False):
  """a @ b summed in float32. `exact` on a GPU: an FP8 GEMM without cuBLASLt's fast
  accumulation, which XLA takes at the default precision (the record's backward GEMMs pass
  `use_fast_accum=False`, its forward True); elsewhere the same program either way."""
  precision = jax.lax.Precision.HIGHEST if exact and platform() == "gpu" else None
  return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def fp8_matmul(x_ND, w_DV, x_s: float, w_s: float, grad_s: float):
  """x @ w with both operands in float8_e4m3fn (scales x_s, w_s), output in x's dtype.

  The backward pass rounds the output gradient to float8_e5m2 (scale grad_s), as the record;
  the input gradient comes out in x's dtype, the weight gradient in w's (both summed in float32).
  """
  return _fp8_fwd(x_ND, w_DV, x_s, w_s, grad_s)[0]


def _fp8_fwd(x_ND, w_DV, x_s, w_s, grad_s):
  x8, w8 = _quantize(x_ND, x_s, E4M3), _quantize(w_DV, w_s, E4M3)
  out = _dot32(_dequantize(x8, x_s), _dequantize(w8, w_s)).astype(x_ND.dtype)
  # FP8 residuals: the backward pass reuses the rounded operands (a quarter of f32's memory).
  return out, (x8, w8, jnp.zeros((0,), x_ND.dtype), jnp.zeros((0,), w_DV.dtype))


def _fp8_bwd(x_s, w_s, grad_s, res, g_NV):
  x8, w8, x_like, w_like = res
  g = _dequantize(_quantize(g_NV, grad_s, E5M2), grad_s)
  dx = _dot32(g, _dequantize(w8, w_s).T, exact=True).astype(x_like.dtype)
  dw = _dot32(_dequantize(x8, x_s).T, g, exact=True)
  return dx, dw.astype(w_like.dtype)


fp8_matmul.defvjp(_fp8_fwd, _fp8_bwd)


def fp8_head_scales(d_model: int, loss_denominator: int) -> tuple:
  """(x_s, w_s, grad_s) of the record's head, carried over to nanotext's parameterisation.

  The record (train_gpt.py 587b45fb, `CastedLinear(..., x_s=(model_dim**0.5)/448, w_s=24/448,
  grad_s=1/448)`) computes z = x W, logits 30 * sigmoid(z / (7.5 sqrt(d))) and the loss summed
  over its one row per GPU, so its head sees the per-token gradient dL/dz. nanotext computes
  z' = x W', 15 * tanh(z' / 15) (the same up to a constant when z' = z / sqrt(d)), and divides
  the summed token loss by `loss_denominator`: the rows of the micro-batch for
  train.loss_reduction=row_sum, its tokens for mean (model.loss.cross_entropy says which). So
  W' = W / sqrt(d) and dL/dz' = sqrt(d) / loss_denominator * dL/dz, giving x_s = sqrt(d) / 448
  (an RMS-normalised row has |x_i| <= sqrt(d)), w_s = 24 / (448 sqrt(d)) and grad_s =
  sqrt(d) / (448 loss_denominator): the record's FP8 codes, whatever the reduction, row length,
  rows per step, micro-batching or loss chunking.
  """
  r = float(np.sqrt(d_model))
  return r / 448.0, 24.0 / (448.0 * r), r / (448.0 * loss_denominator)
