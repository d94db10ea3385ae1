"""The causal self-attention layer, and the checks of the config's attention section.

The kernels live in model/kernels/, one per file; model/kernels/dispatch.py picks one.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nanotext import config, sharding
from nanotext.errors import UserError
from nanotext.model import kv_cache
from nanotext.model.kernels import qk_rope
from nanotext.model.kernels.dispatch import IMPLS, dot_product_attention, qkv_attention
from nanotext.model.kernels.per_device import opted_in
from nanotext.model.layers import (Linear, StackedLinear, init_array, matmul, param, proj_std,
                                   rms_norm, scaled_sum, weight_std)
from nanotext.model.rope import apply_rope, rope_frequencies


def check_config(a) -> None:
  """The attention section: kernel choice, sliding-window pattern and schedule keys."""
  config.check_choices("attention", a, {"impl": IMPLS})
  pattern = a.window_pattern
  if pattern and set(pattern) - set("LS"):
    raise UserError(f"attention.window_pattern={pattern!r} may hold only the letters L (long "
                    "window) and S (short window), one per layer, or be ''")
  if (pattern or a.window_schedule) and not a.window:
    raise UserError("attention.window_pattern / attention.window_schedule need attention.window > 0"
                    " (the long window in tokens)")
  if a.block_windows and (a.window_block <= 0 or a.window % a.window_block):
    raise UserError(f"attention.block_windows=true needs attention.window={a.window} to be a "
                    f"multiple of attention.window_block={a.window_block}")
  if not a.window_schedule:
    return
  if a.window_block <= 0:
    raise UserError(f"attention.window_block={a.window_block} must be positive")
  for key in ("window_start", "window"):
    value = a[key]
    if value <= 0 or value % a.window_block:
      raise UserError(f"attention.{key}={value} must be a positive multiple of "
                      f"attention.window_block={a.window_block}")
  if a.window_start > a.window:
    raise UserError(f"attention.window_start={a.window_start} exceeds attention.window="
                    f"{a.window} (the schedule grows from the first to the second)")


# Logical axes of q, k, v and the heads' outputs [B, T, H, K].
QKV_AXES = ("batch", "act_length", "act_heads", "act_kv")


def at_start(pos) -> bool:
  """Whether a cached chunk starts the context (a static 0): a prompt, run by the model's kernel."""
  return isinstance(pos, int) and pos == 0


class CausalSelfAttention(nnx.Module):
  """Multi-head causal self-attention with optional RoPE and QK-norm."""

  def __init__(self, cfg, attn_cfg, *, impl: str, rngs):
    d, h, k = cfg.d_model, cfg.num_heads, cfg.head_dim
    lin = dict(bias=cfg.bias, param_dtype=cfg.param_dtype, dtype=cfg.dtype, rngs=rngs,
               dist=cfg.init_dist)
    std = weight_std(cfg, d)
    self.merged_qkv, self.fused_qkv = cfg.merged_qkv, cfg.fused_qkv
    if cfg.fused_qkv:  # one [3*H*K, D] matrix stored [out, in] (modded-nanogpt-jax: c_qkv)
      self.qkv = param(init_array(rngs, (3 * h * k, d), std, cfg.param_dtype, cfg.init_dist),
                       ("heads", "embed"), "matrix")
    elif cfg.merged_qkv:  # one [3, D, H*K] parameter (record: qkv_w), one matmul
      self.qkv = StackedLinear(3, d, h * k, ("embed", "heads"), std=std, **lin)
    else:
      self.q = Linear(d, h * k, ("embed", "heads"), std=std, **lin)
      self.k = Linear(d, h * k, ("embed", "heads"), std=std, **lin)
      self.v = Linear(d, h * k, ("embed", "heads"), std=std, **lin)
    # v <- lambdas[0] * v + lambdas[1] * ve (value embeddings; record init 0.5, 0.5).
    self.v_lambdas = param(jnp.array([0.5, 0.5], cfg.param_dtype), (None,), "scalar") \
        if cfg.value_embeds else None
    # Value residual: v <- (1 - lam) v + lam v1, v1 the first attention layer's v (init 0.5).
    self.v_residual = param(jnp.array([0.5], cfg.param_dtype), (None,), "scalar") \
        if cfg.value_residual else None
    self.o = Linear(h * k, d, ("heads", "embed"), std=proj_std(cfg, h * k), **lin)
    self.num_heads, self.head_dim, self.dtype = h, k, cfg.dtype
    self.scale = cfg.attn_scale or 1.0 / np.sqrt(k)
    # A learned softmax scale (modded-nanogpt-jax: init 0.12) multiplies q; the kernel scales by 1.
    self.scale_param = param(jnp.array([self.scale], cfg.param_dtype), (None,), "scalar") \
        if cfg.attn_scale_learned else None
    self.qk_norm, self.qk_eps = cfg.qk_norm, cfg.norm_eps or 1e-6
    self.rope = (cfg.rope_base, cfg.rope_truncate, cfg.rope_freqs) \
        if cfg.positions == "rope" else None
    self.impl, self.window = impl, attn_cfg.window
    self.block = attn_cfg.window_block if attn_cfg.block_windows else 0  # record's block mask

  def __call__(self, x_BTD, segment_ids_BT=None, window=None, ve_BTD=None, v1_BTHK=None,
               runtime_window=None, kv=None):
    """(attention output [B, T, D], v1, kv) for x [B, T, D]. `window` (static int) overrides
    attention.window for a schedule; `ve_BTD` is this layer's value embedding (model.value_embeds;
    None for middle layers); `v1_BTHK`, with model.value_residual, the first layer's v (None in
    the first layer, whose own v becomes v1); `runtime_window` (traced int32, 0 = none) the window
    applied at run time, `window` then being its static bound; `kv` (sampling) this layer's
    kv_cache.KV, returned with x's keys and values written (None without one)."""
    B, T, _ = x_BTD.shape
    window = self.window if window is None else window
    shape = (B, T, self.num_heads, self.head_dim)
    qkv = None  # q, k, v side by side [B, T, 3 * H * K], where one matmul makes them
    if self.fused_qkv:
      qkv = matmul(x_BTD.astype(self.dtype), self.qkv.get_value().astype(self.dtype).T)
    elif self.merged_qkv:
      qkv = self.qkv(x_BTD)
    freq = rope_frequencies(self.head_dim, *self.rope) if self.rope is not None else None
    ve_BTHK = None if ve_BTD is None else ve_BTD.reshape(shape)
    # QK-norm and rotation in one pass each way (a GPU kernel), reading q and k in place, or
    # opted in, inside the attention kernels themselves with the value embedding's mix
    # (flash_gpu: no pass of their own; 1.55x slower on an H200, per_device.OWN_KERNELS)
    fused = self.qk_norm and freq is not None and qkv is not None and \
        qk_rope.applies(T, self.head_dim) and (kv is None or at_start(kv.pos))
    if fused and self.impl == "flash_gpu" and opted_in("flash_gpu_qkv") and \
        self.scale_param is None and self.v_residual is None and kv is None:
      lambdas = None if self.v_lambdas is None else self.v_lambdas.get_value()
      with jax.named_scope("attention_kernel"):
        out_BTHK = qkv_attention(qkv.reshape(B, T, 3, *shape[2:]), freq, self.qk_eps, lambdas,
                                 ve_BTHK, scale=self.scale, window=window,
                                 segment_ids_BT=segment_ids_BT, block=self.block,
                                 runtime_window=runtime_window)
      return self._out(out_BTHK), v1_BTHK, None
    q, k, v, v1_BTHK, scale = self._qkv(x_BTD, qkv, ve_BTHK, v1_BTHK, freq, fused,
                                        0 if kv is None else kv.pos)
    with jax.named_scope("attention_kernel"):
      if kv is not None:
        kv = kv_cache.write(kv, k, v, segment_ids_BT)
      if kv is None or at_start(kv.pos):  # training, or a prompt: the chunk is the whole context
        out_BTHK = dot_product_attention(q, k, v, impl=self.impl, scale=scale, window=window,
                                         segment_ids_BT=segment_ids_BT, block=self.block,
                                         runtime_window=runtime_window)
      else:
        out_BTHK = kv_cache.attend(q, kv, segment_ids_BT, scale=scale, window=window,
                                   block=self.block)
    return self._out(out_BTHK), v1_BTHK, kv

  def _qkv(self, x_BTD, qkv, ve_BTHK, v1_BTHK, freq, fused: bool, offset):
    """(q, k, v, v1, softmax scale) [B, T, H, K] as the kernels take them: projected, v mixed
    with v1 and the value embedding, q and k normed and rotated from position `offset`."""
    B, T, _ = x_BTD.shape
    shape = (B, T, self.num_heads, self.head_dim)
    if fused:
      q, k, v = qk_rope.norm_rope(qkv.reshape(B, T, 3, *shape[2:]), freq, self.qk_eps)
    elif qkv is not None:  # split, not slices: its gradient is one concatenate
      q, k, v = jnp.split(qkv, 3, axis=-1)
    else:
      q, k, v = self.q(x_BTD), self.k(x_BTD), self.v(x_BTD)
    q, k, v = (sharding.constrain(a.reshape(shape), QKV_AXES) for a in (q, k, v))
    if self.v_residual is not None:
      v1_BTHK = v if v1_BTHK is None else v1_BTHK
      lam = self.v_residual.get_value().astype(v.dtype)[0]
      v = (1 - lam) * v + lam * v1_BTHK
    if self.v_lambdas is not None:
      lam = self.v_lambdas.get_value()
      # Layers without a value embedding still scale v by lambdas[0], as the record does.
      v = scaled_sum((lam[0],), (v,)) if ve_BTHK is None else \
          scaled_sum((lam[0], lam[1]), (v, ve_BTHK))
    if not fused:  # the XLA path: CPU, TPU, and shapes the kernel does not take
      if self.qk_norm:
        q, k = rms_norm(q, self.qk_eps), rms_norm(k, self.qk_eps)
      if freq is not None:
        q, k = apply_rope(q, freq, offset), apply_rope(k, freq, offset)
    scale = self.scale
    if self.scale_param is not None:
      q, scale = q * self.scale_param.get_value().astype(q.dtype)[0], 1.0
    return q, k, v, v1_BTHK, scale

  def _out(self, out_BTHK):
    """The output projection of the heads' outputs."""
    B, T = out_BTHK.shape[:2]
    return self.o(sharding.constrain(out_BTHK, QKV_AXES).reshape(B, T, -1))
