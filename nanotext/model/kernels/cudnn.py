"""cuDNN's fused flash attention through jax.nn.dot_product_attention (NVIDIA GPUs only)."""

import functools

import jax
import jax.numpy as jnp

from nanotext.errors import UserError
from nanotext.model.kernels.per_device import platform
from nanotext.model.kernels.xla import xla_attention


@functools.lru_cache(maxsize=None)
def problem(head_dim: int, seq_len: int):
  """None if a cuDNN flash-attention training step traces for these shapes, else the reason."""
  # The shape/dtype/version checks of jax's cuDNN path run at trace time, so an abstract trace of
  # forward + backward (bfloat16, as `cudnn_attention` feeds it) finds unsupported cases without
  # compiling.
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


def cudnn_attention(q_BTHK, k_BTHK, v_BTHK, *, scale, window=0, segment_ids_BT=None):
  """cuDNN flash attention; float32 inputs run in bfloat16 and the output is cast back.

  cuDNN's fused kernel takes only fp16/bf16 (head_dim a multiple of 8, <= 128, or 256 on Hopper),
  so float32 models get bf16 attention here: expect ~1e-2 relative differences from xla. Document
  masks go through the public `mask=` argument, which jax turns into an additive [B, 1, T, T] bias:
  correct, but it is read by the kernel (memory O(B T^2), and T must be even for training).
  """
  backend = platform()  # the target's: a CPU host compiling for a GPU builds the GPU program
  if backend != "gpu":
    raise UserError(f"attention.impl=cudnn needs an NVIDIA GPU with cuDNN, but the backend is "
                    f"{backend}; use attention.impl=xla or auto")
  dtype = q_BTHK.dtype
  if dtype not in (jnp.bfloat16, jnp.float16):
    q_BTHK, k_BTHK, v_BTHK = (x.astype(jnp.bfloat16) for x in (q_BTHK, k_BTHK, v_BTHK))
  out_BTHK = xla_attention(q_BTHK, k_BTHK, v_BTHK, scale=scale, window=window,
                           segment_ids_BT=segment_ids_BT, implementation="cudnn")
  return out_BTHK.astype(dtype)
