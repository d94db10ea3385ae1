"""Causal self-attention, rotary embeddings, and the one dispatch point for attention kernels."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nanotext import sharding
from nanotext.errors import UserError
from nanotext.model.layers import Linear, rms_norm

IMPLS = ("auto", "xla", "cudnn", "splash")


def resolve_impl(impl: str, backend: str) -> str:
  """The concrete kernel for `attention.impl` on this backend."""
  if impl == "auto":
    return "xla"  # the speedrun issue teaches auto to pick cudnn on GPU and splash on TPU
  if impl in ("cudnn", "splash"):
    raise UserError(f"attention.impl={impl} is not available in this version of nanotext; "
                    "use attention.impl=xla or auto")
  if impl not in IMPLS:
    raise UserError(f"attention.impl={impl!r} is not one of {', '.join(IMPLS)}")
  return impl


def dot_product_attention(q_BTHK, k_BTHK, v_BTHK, *, impl: str, scale: float, window: int = 0):
  """Causal (optionally sliding-window) attention through the selected kernel."""
  local = (window - 1, 0) if window else None
  out = jax.nn.dot_product_attention(
      q_BTHK, k_BTHK, v_BTHK, scale=scale, is_causal=True, local_window_size=local,
      implementation=impl)
  return out


def rope_frequencies(head_dim: int, base: float, truncate: bool) -> np.ndarray:
  """Angular frequency per rotated pair (head_dim // 2 of them).

  With `truncate` (the speedrun's half-truncated RoPE) only the first half of the pairs rotate,
  with frequencies spaced geometrically from 1 down to 1/base; the rest stay at zero.
  """
  pairs = head_dim // 2
  if not truncate:
    return base ** (-np.arange(pairs, dtype=np.float64) * 2 / head_dim)
  quarter = head_dim // 4
  freq = (1.0 / base) ** np.linspace(0.0, 1.0, quarter)
  return np.concatenate([freq, np.zeros(pairs - quarter)])


def apply_rope(x_BTHK, freq):
  """Rotate the two halves of each head's vector by position * frequency."""
  t = jnp.arange(x_BTHK.shape[1], dtype=jnp.float32)
  theta_TK = t[:, None] * jnp.asarray(freq, jnp.float32)[None, :]
  cos, sin = jnp.cos(theta_TK)[None, :, None, :], jnp.sin(theta_TK)[None, :, None, :]
  x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
  y = jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=-1)
  return y.astype(x_BTHK.dtype)


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention with optional RoPE and QK-norm."""

  def __init__(self, cfg, attn_cfg, *, impl: str, rngs):
    d, h, k = cfg.d_model, cfg.num_heads, cfg.head_dim
    lin = dict(bias=cfg.bias, param_dtype=cfg.param_dtype, dtype=cfg.dtype, rngs=rngs)
    std = cfg.init_std or 0.5 / np.sqrt(d)
    self.q = Linear(d, h * k, ("embed", "heads"), std=std, **lin)
    self.k = Linear(d, h * k, ("embed", "heads"), std=std, **lin)
    self.v = Linear(d, h * k, ("embed", "heads"), std=std, **lin)
    proj_std = 0.0 if cfg.zero_init_proj else (cfg.init_std or 0.5 / np.sqrt(h * k)) / np.sqrt(
        2 * cfg.num_layers)
    self.o = Linear(h * k, d, ("heads", "embed"), std=proj_std, **lin)
    self.num_heads, self.head_dim = h, k
    self.scale = cfg.attn_scale or 1.0 / np.sqrt(k)
    self.qk_norm = cfg.qk_norm
    self.rope = (cfg.rope_base, cfg.rope_truncate) if cfg.positions == "rope" else None
    self.impl, self.window = impl, attn_cfg.window

  def __call__(self, x_BTD):
    B, T, _ = x_BTD.shape
    shape = (B, T, self.num_heads, self.head_dim)
    names = ("batch", "length", "heads", "kv")
    q = sharding.constrain(self.q(x_BTD).reshape(shape), names)
    k = sharding.constrain(self.k(x_BTD).reshape(shape), names)
    v = sharding.constrain(self.v(x_BTD).reshape(shape), names)
    if self.qk_norm:
      q, k = rms_norm(q), rms_norm(k)
    if self.rope is not None:
      freq = rope_frequencies(self.head_dim, *self.rope)
      q, k = apply_rope(q, freq), apply_rope(k, freq)
    with jax.named_scope("attention_kernel"):
      out_BTHK = dot_product_attention(q, k, v, impl=self.impl, scale=self.scale,
                                       window=self.window)
    out_BTHK = sharding.constrain(out_BTHK, names)
    return self.o(out_BTHK.reshape(B, T, -1))
