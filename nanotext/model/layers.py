"""Small flax.nnx building blocks whose parameters carry logical axis names.

Shape suffixes: B batch, T length, D d_model, V vocab, F mlp width, H heads, K head dim.
Every parameter is an `nnx.Param` tagged with `out_sharding=(logical names...)`; only
nanotext.sharding turns those names into mesh axes.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from nanotext import sharding


def param(value, axes) -> nnx.Param:
  """A parameter tagged with logical axis names (created unsharded; placement is jit's job)."""
  assert len(axes) == value.ndim, (axes, value.shape)
  return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def init_array(rngs, shape, std, dtype):
  """Normal(0, std) init; std=0 gives zeros."""
  if std == 0:
    return jnp.zeros(shape, dtype)
  return (std * jax.random.normal(rngs.params(), shape)).astype(dtype)


class Linear(nnx.Module):
  """y = x @ W (+ b), with W of shape [in, out] tagged (in_axis, out_axis)."""

  def __init__(self, d_in, d_out, axes, *, std, bias, param_dtype, dtype, rngs):
    self.kernel = param(init_array(rngs, (d_in, d_out), std, param_dtype), axes)
    self.bias = param(jnp.zeros((d_out,), param_dtype), axes[1:]) if bias else None
    self.dtype = dtype

  def __call__(self, x):
    y = x.astype(self.dtype) @ self.kernel.value.astype(self.dtype)
    if self.bias is not None:
      y = y + self.bias.value.astype(self.dtype)
    return y


class Norm(nnx.Module):
  """LayerNorm with scale and bias (GPT-2) or parameter-free RMSNorm (speedrun)."""

  def __init__(self, dim, kind, *, param_dtype, eps=1e-5):
    self.kind, self.eps = kind, eps
    if kind == "layernorm":
      self.scale = param(jnp.ones((dim,), param_dtype), ("embed",))
      self.bias = param(jnp.zeros((dim,), param_dtype), ("embed",))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    if self.kind == "rmsnorm":
      return rms_norm(x32, self.eps).astype(x.dtype)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    return (y * self.scale.value + self.bias.value).astype(x.dtype)


def rms_norm(x, eps=1e-6):
  """Parameter-free RMS normalisation over the last axis."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + eps)).astype(x.dtype)


class Embed(nnx.Module):
  """Token embedding table [V, D]; `attend` gives tied-head logits."""

  def __init__(self, vocab, dim, *, std, param_dtype, dtype, rngs):
    self.embedding = param(init_array(rngs, (vocab, dim), std, param_dtype), ("vocab", "embed"))
    self.dtype = dtype

  def __call__(self, tokens_BT):
    x_BTD = jnp.take(self.embedding.value, tokens_BT, axis=0).astype(self.dtype)
    return sharding.constrain(x_BTD, ("batch", "length", "embed"))

  def attend(self, x_BTD):
    return x_BTD.astype(self.dtype) @ self.embedding.value.astype(self.dtype).T
