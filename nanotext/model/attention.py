"""Causal self-attention, rotary embeddings, and the one dispatch point for attention kernels."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nanotext import config, sharding
from nanotext.errors import UserError
from nanotext.model.blocked_attention import blocked_attention
from nanotext.model.cpu_attention import cpu_attention
from nanotext.model.flash_attention import flash_attention, problem as flash_problem
from nanotext.model.layers import (Linear, StackedLinear, init_array, param, proj_std, rms_norm,
                                   scaled_sum, weight_std)
from nanotext.model.rope import apply_rope, rope_frequencies

IMPLS = ("auto", "xla", "cudnn", "splash", "flash", "blocked", "cpu", "einsum")
SPLASH_LANES = 128  # splash tiles must be multiples of the TPU lane width, also in interpret mode
# Above this length a dense [T, T] mask/score per head is the cost that matters: `auto` takes the
# blocked kernel for windowed attention (at 4096, f32 scores are 64 MiB per head and example).
DENSE_MAX_T = 4096


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


def resolve_impl(impl: str, backend: str, *, head_dim: int = 0, seq_len: int = 0,
                 window: int = 0, block_windows: bool = False) -> str:
  """The concrete kernel for `attention.impl` on this backend (the one place that decides).

  `head_dim` and `seq_len` (0 = unknown) let `auto` check that the kernel accepts the model's
  shapes: on TPU it is splash when the sequence length tiles into 128-wide blocks; elsewhere,
  windowed attention (`window` > 0) is blocked when the windows are block-granular (cuDNN and
  jax's xla path have no such mask) or the sequence is longer than DENSE_MAX_T; otherwise on CPU
  up to DENSE_MAX_T tokens the cpu kernel (faster there than xla's full score matrix), on GPU cudnn when a trial trace of
  cuDNN flash attention succeeds, else xla.
  """
  if impl not in IMPLS:
    raise UserError(f"attention.impl={impl!r} is not one of {', '.join(IMPLS)}")
  if impl == "auto":
    if backend == "tpu" and seq_len % SPLASH_LANES == 0:
      return "splash"
    if window and (block_windows or seq_len > DENSE_MAX_T):
      return "blocked"
    if backend == "cpu" and seq_len <= DENSE_MAX_T:  # it unrolls T / 128 query blocks
      return "cpu"
    if backend == "gpu" and _cudnn_problem(head_dim, seq_len) is None:
      return "cudnn"
    return "xla"
  if impl in ("cudnn", "cpu") and block_windows and window:
    raise UserError(f"attention.impl={impl} cannot express block-granular windows "
                    "(attention.block_windows=true); use attention.impl=blocked or auto")
  if impl == "cudnn":
    if backend != "gpu":
      raise UserError(f"attention.impl=cudnn needs an NVIDIA GPU with cuDNN, but the backend is "
                      f"{backend}; use attention.impl=xla or auto")
    problem = _cudnn_problem(head_dim, seq_len)
    if problem is not None:
      raise UserError(f"attention.impl=cudnn is not usable on backend {backend} "
                      f"(head_dim={head_dim or 'unknown'}, seq_len={seq_len or 'unknown'}): "
                      f"{problem}; use attention.impl=xla or auto")
  if impl == "splash" and seq_len:
    _splash_block(seq_len)  # raises UserError early for a sequence length splash cannot tile
  if impl == "flash" and (problem := flash_problem(seq_len, head_dim, window)):
    raise UserError(f"attention.impl=flash {problem}; use attention.impl=splash, blocked or auto")
  return impl


@functools.lru_cache(maxsize=None)
def _cudnn_problem(head_dim: int, seq_len: int):
  """None if a cuDNN flash-attention training step traces for these shapes, else the reason."""
  # The shape/dtype/version checks of jax's cuDNN path run at trace time, so an abstract trace of
  # forward + backward (bfloat16, as `_cudnn` feeds it) finds unsupported cases without compiling.
  T, K = seq_len or 128, head_dim or 64
  x = jax.ShapeDtypeStruct((1, T, 1, K), jnp.bfloat16)
  def loss(q, k, v):
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    return out.astype(jnp.float32).sum()
  try:
    jax.eval_shape(jax.grad(loss, argnums=(0, 1, 2)), x, x, x)
  except Exception as e:  # noqa: BLE001 -- any failure means "not this kernel"; the reason is kept
    return f"{type(e).__name__}: {e}"
  return None


def segment_ids_from_tokens(tokens_BT, eot_id: int):
  """Document id per position: the count of EOT tokens at or before it (EOT opens a document)."""
  return jnp.cumsum(tokens_BT == eot_id, axis=1, dtype=jnp.int32)


def dot_product_attention(q_BTHK, k_BTHK, v_BTHK, *, impl: str, scale: float, window: int = 0,
                          segment_ids_BT=None, block: int = 0):
  """Causal attention, optionally windowed and/or document-masked, through the selected kernel.

  A query at t sees keys s <= t, also only keys with the same segment id when `segment_ids_BT`
  [B, T] is given, and with `window` > 0: keys t - window < s (block = 0, token-exact), or, with
  `block` > 0, keys in blocks t // block - W + 1 .. t // block, W = max(1, window // block) (the
  record's block mask). `window` must be a static Python int: it shapes the kernel's mask (and
  splash's block-sparsity tables), so every distinct window in a schedule is its own compiled
  program, to be compiled ahead rather than traced as an array.
  """
  if not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window < 0:
    raise TypeError(f"window must be a static non-negative Python int, got {window!r}")
  T = q_BTHK.shape[1]
  window = 0 if window >= T else int(window)  # a window covering the whole sequence is plain causal
  if impl == "auto":
    impl = resolve_impl(impl, jax.default_backend(), head_dim=q_BTHK.shape[-1], seq_len=T,
                        window=window, block_windows=bool(block))
  if impl == "blocked":
    return blocked_attention(q_BTHK, k_BTHK, v_BTHK, scale=scale, window=window,
                             block_windows=bool(block), segment_ids_BT=segment_ids_BT,
                             **({"block": block} if block else {}))
  if impl == "xla":
    return _xla(q_BTHK, k_BTHK, v_BTHK, scale, window, segment_ids_BT, "xla", block)
  if impl == "cpu":
    if block and window:
      resolve_impl("cpu", "cpu", window=window, block_windows=True)  # raises the UserError
    return cpu_attention(q_BTHK, k_BTHK, v_BTHK, scale=scale, window=window,
                         segment_ids_BT=segment_ids_BT)
  if impl == "cudnn":
    if block and window:
      resolve_impl("cudnn", "gpu", window=window, block_windows=True)  # raises the UserError
    return _cudnn(q_BTHK, k_BTHK, v_BTHK, scale, window, segment_ids_BT)
  if impl == "splash":
    return _splash(q_BTHK, k_BTHK, v_BTHK, scale, window, segment_ids_BT, block)
  if impl == "flash":
    resolve_impl("flash", _platform(), head_dim=q_BTHK.shape[-1], seq_len=T, window=window)
    return _flash(q_BTHK, k_BTHK, v_BTHK, scale, segment_ids_BT)
  if impl == "einsum":
    return _einsum(q_BTHK, k_BTHK, v_BTHK, scale, window, segment_ids_BT, block)
  raise UserError(f"attention.impl={impl!r} is not one of {', '.join(IMPLS)}")


def block_window_mask(T: int, window: int, block: int) -> np.ndarray:
  """[T, T] causal block-window mask: key block >= query block - W + 1, W = max(1, window//block)."""
  t, s = np.arange(T)[:, None], np.arange(T)[None, :]
  return (s <= t) & (t // block - s // block < max(1, window // block))


def _segment_mask(segment_ids_BT):
  """Boolean [B, 1, T, T] mask (broadcast over heads): True where query and key share a segment."""
  if segment_ids_BT is None:
    return None
  return segment_ids_BT[:, None, :, None] == segment_ids_BT[:, None, None, :]


def _einsum(q_BTHK, k_BTHK, v_BTHK, scale, window, segment_ids_BT, block=0):
  """The textbook path, for debugging: dense float32 scores, every mask explicit, softmax."""
  T = q_BTHK.shape[1]
  t, s = np.arange(T)[:, None], np.arange(T)[None, :]
  if window and block:
    mask_TS = block_window_mask(T, window, block)
  else:
    mask_TS = (s <= t) & (t - s < (window or T))
  mask_BHTS = jnp.asarray(mask_TS)[None, None]
  if segment_ids_BT is not None:
    mask_BHTS = mask_BHTS & _segment_mask(segment_ids_BT)
  s_BHTS = jnp.einsum("bqhd,bkhd->bhqk", q_BTHK, k_BTHK,
                      preferred_element_type=jnp.float32) * scale
  p_BHTS = jax.nn.softmax(jnp.where(mask_BHTS, s_BHTS, -jnp.inf), axis=-1)
  return jnp.einsum("bhqk,bkhd->bqhd", p_BHTS.astype(v_BTHK.dtype), v_BTHK)


def _xla(q_BTHK, k_BTHK, v_BTHK, scale, window, segment_ids_BT, implementation, block=0):
  """jax.nn.dot_product_attention; local_window_size (left, right) counts keys besides the query.

  Block windows have no jax argument: they go in as a dense [1, 1, T, T] mask (small T only)."""
  mask = _segment_mask(segment_ids_BT)
  local = (window - 1, 0) if window and not block else None
  if window and block:
    blocks = jnp.asarray(block_window_mask(q_BTHK.shape[1], window, block))[None, None]
    mask = blocks if mask is None else mask & blocks
  return jax.nn.dot_product_attention(
      q_BTHK, k_BTHK, v_BTHK, mask=mask, scale=scale, is_causal=True,
      local_window_size=local, implementation=implementation)


def _cudnn(q_BTHK, k_BTHK, v_BTHK, scale, window, segment_ids_BT):
  """cuDNN flash attention; float32 inputs run in bfloat16 and the output is cast back.

  cuDNN's fused kernel takes only fp16/bf16 (head_dim a multiple of 8, <= 128, or 256 on Hopper),
  so float32 models get bf16 attention here: expect ~1e-2 relative differences from xla. Document
  masks go through the public `mask=` argument, which jax turns into an additive [B, 1, T, T] bias:
  correct, but it is read by the kernel (memory O(B T^2), and T must be even for training).
  """
  backend = jax.default_backend()
  if backend != "gpu":
    raise UserError(f"attention.impl=cudnn needs an NVIDIA GPU with cuDNN, but the backend is "
                    f"{backend}; use attention.impl=xla or auto")
  dtype = q_BTHK.dtype
  if dtype not in (jnp.bfloat16, jnp.float16):
    q_BTHK, k_BTHK, v_BTHK = (x.astype(jnp.bfloat16) for x in (q_BTHK, k_BTHK, v_BTHK))
  out_BTHK = _xla(q_BTHK, k_BTHK, v_BTHK, scale, window, segment_ids_BT, "cudnn")
  return out_BTHK.astype(dtype)


def _splash_block(T: int) -> int:
  """Largest of 512/256/128 dividing T: splash tiles must be lane-width multiples dividing T."""
  for block in (512, 256, SPLASH_LANES):
    if T % block == 0:
      return block
  raise UserError(f"attention.impl=splash needs train.seq_len to be a multiple of {SPLASH_LANES} "
                  f"(got {T}); use attention.impl=xla or auto")


def _block_local_mask(T: int, window: int, window_block: int):
  """Splash mask of the record's block windows, computed lazily per tile (no [T, T] array)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
  W = max(1, window // window_block)

  class BlockLocalMask(masks._ComputableMask):  # noqa: SLF001 -- splash's lazy-mask base class
    def __init__(self):
      super().__init__(shape=(T, T), mask_function=lambda q, kv: (kv <= q) & (
          q // window_block - kv // window_block < W))

    def __eq__(self, other):
      return type(other) is type(self) and (self.shape, self.key) == (other.shape, other.key)

    def __hash__(self):
      return hash((type(self), self.shape, self.key))

  mask = BlockLocalMask()
  mask.key = (window, window_block)
  return mask


@functools.lru_cache(maxsize=64)
def _splash_kernel(T: int, H: int, window: int, block: int, interpret: bool, window_block=0):
  """A splash kernel for [H, T, K] inputs; cached, as building its block tables is numpy work."""
  from jax.experimental.pallas.ops.tpu import splash_attention as splash
  if window and window_block:
    head_mask = _block_local_mask(T, window, window_block)
  elif window:
    head_mask = splash.LocalMask((T, T), window_size=(window - 1, 0), offset=0)
  else:
    head_mask = splash.CausalMask((T, T))
  sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                            block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                            block_q_dq=block, block_kv_dq=block)
  # Concrete tables even when first built inside a trace: the cache outlives that trace.
  with jax.ensure_compile_time_eval():
    return splash.make_splash_mha_single_device(
        splash.MultiHeadMask([head_mask] * H), block_sizes=sizes, interpret=interpret)


def _platform() -> str:
  """The platform the program is built for: the active mesh's devices, else the default backend.

  Pallas kernels are Mosaic or interpreted by this, never by the host's default backend alone: a
  CPU host compiling for a TPU topology must get the TPU kernel."""
  active = sharding.active()
  return jax.default_backend() if active is None else active[1].devices.flat[0].platform


def _per_device(local, q_BTHK, k_BTHK, v_BTHK, segment_ids_BT):
  """`local(q, k, v[, segment ids])` per device on its batch/head shard when a mesh is active."""
  args = (q_BTHK, k_BTHK, v_BTHK) + (() if segment_ids_BT is None else (segment_ids_BT,))
  # A Pallas kernel is opaque to the SPMD partitioner (it would gather everything onto every
  # device), so it runs per device: batch and heads split as the rules say, the sequence whole.
  names = ("batch", None, "act_heads", None)
  in_axes = (names,) * 3 + (() if segment_ids_BT is None else (("batch", None),))
  return sharding.per_device(local, args, in_axes, names)


def _flash(q_BTHK, k_BTHK, v_BTHK, scale, segment_ids_BT):
  """Pallas flash attention (model/flash_attention.py), per device under a mesh."""
  local = functools.partial(flash_attention, scale=scale, interpret=_platform() != "tpu")
  return _per_device(local, q_BTHK, k_BTHK, v_BTHK, segment_ids_BT)


def _splash(q_BTHK, k_BTHK, v_BTHK, scale, window, segment_ids_BT, block=0):
  """Splash attention, run per device on its batch/head shard when a mesh is active."""
  local = functools.partial(_splash_local, scale=scale, window=window, window_block=block,
                            interpret=_platform() != "tpu")
  return _per_device(local, q_BTHK, k_BTHK, v_BTHK, segment_ids_BT)


def _splash_local(q_BTHK, k_BTHK, v_BTHK, segment_ids_BT=None, *, scale, window, interpret,
                  window_block=0):
  """Pallas splash attention per example (vmapped over batch); `interpret` off TPU (slow)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds
  _, T, H, _ = q_BTHK.shape
  kernel = _splash_kernel(T, H, window, _splash_block(T), interpret,
                          window_block if window else 0)
  # Splash applies no softmax scale of its own, so fold it into q.
  q_BHTK = jnp.swapaxes(q_BTHK * jnp.asarray(scale, q_BTHK.dtype), 1, 2)
  k_BHTK, v_BHTK = jnp.swapaxes(k_BTHK, 1, 2), jnp.swapaxes(v_BTHK, 1, 2)
  if segment_ids_BT is None:
    out_BHTK = jax.vmap(kernel)(q_BHTK, k_BHTK, v_BHTK)
  else:
    def one(q_HTK, k_HTK, v_HTK, seg_T):
      return kernel(q_HTK, k_HTK, v_HTK, segment_ids=SegmentIds(q=seg_T, kv=seg_T))
    out_BHTK = jax.vmap(one)(q_BHTK, k_BHTK, v_BHTK, segment_ids_BT.astype(jnp.int32))
  return jnp.swapaxes(out_BHTK, 1, 2)


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

  def __call__(self, x_BTD, segment_ids_BT=None, window=None, ve_BTD=None, v1_BTHK=None):
    """(attention output [B, T, D], v1) for x [B, T, D]. `window` (static int) overrides
    attention.window for a schedule; `ve_BTD` is this layer's value embedding (model.value_embeds;
    None for middle layers); `v1_BTHK`, with model.value_residual, the first layer's v (None in
    the first layer, whose own v becomes v1)."""
    B, T, _ = x_BTD.shape
    shape = (B, T, self.num_heads, self.head_dim)
    names = ("batch", "act_length", "act_heads", "act_kv")
    if self.fused_qkv:
      x = x_BTD.astype(self.dtype)
      q, k, v = jnp.split(x @ self.qkv.value.astype(self.dtype).T, 3, axis=-1)
    elif self.merged_qkv:
      q, k, v = self.qkv(x_BTD)
    else:
      q, k, v = self.q(x_BTD), self.k(x_BTD), self.v(x_BTD)
    q, k, v = (sharding.constrain(a.reshape(shape), names) for a in (q, k, v))
    if self.v_residual is not None:
      v1_BTHK = v if v1_BTHK is None else v1_BTHK
      lam = self.v_residual.value.astype(v.dtype)[0]
      v = (1 - lam) * v + lam * v1_BTHK
    if self.v_lambdas is not None:
      lam = self.v_lambdas.value
      # Layers without a value embedding still scale v by lambdas[0], as the record does.
      v = scaled_sum((lam[0],), (v,)) if ve_BTD is None else \
          scaled_sum((lam[0], lam[1]), (v, ve_BTD.reshape(shape)))
    if self.qk_norm:
      q, k = rms_norm(q, self.qk_eps), rms_norm(k, self.qk_eps)
    if self.rope is not None:
      freq = rope_frequencies(self.head_dim, *self.rope)
      q, k = apply_rope(q, freq), apply_rope(k, freq)
    scale = self.scale
    if self.scale_param is not None:
      q, scale = q * self.scale_param.value.astype(q.dtype)[0], 1.0
    with jax.named_scope("attention_kernel"):
      out_BTHK = dot_product_attention(q, k, v, impl=self.impl, scale=scale,
                                       window=self.window if window is None else window,
                                       segment_ids_BT=segment_ids_BT, block=self.block)
    out_BTHK = sharding.constrain(out_BTHK, names)
    return self.o(out_BTHK.reshape(B, T, -1)), v1_BTHK
