"""Pallas splash attention (jax's TPU kernel; interpret mode elsewhere), with the record's block
windows as a lazily computed mask."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from nanotext.errors import UserError
from nanotext.model.kernels.per_device import per_device, platform

LANES = 128  # splash tiles must be multiples of the TPU lane width, also in interpret mode


def block_size(T: int, seq_key: str = "train.seq_len") -> int:
  """Largest of 512/256/128 dividing T: splash tiles must be lane-width multiples dividing T."""
  for block in (512, 256, LANES):
    if T % block == 0:
      return block
  raise UserError(f"attention.impl=splash needs {seq_key} to be a multiple of {LANES} "
                  f"(got {T}); use attention.impl=xla or auto")


def _block_local_mask(T: int, window: int, window_block: int):
  """Splash mask of the record's block windows, computed lazily per tile (no [T, T] array)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
  W = max(1, window // window_block)

  class BlockLocalMask(masks._ComputableMask):  # noqa: SLF001 -- splash's lazy-mask base class
    def __init__(self):
      super().__init__(shape=(T, T), mask_function=lambda q, kv: (kv <= q) & (
          q // window_block - kv // window_block < W))

    def __getitem__(self, idx):
      # Splash classifies every (q, kv) tile of the [T, T] grid on the host. Tiles wholly above
      # the diagonal or wholly past the window are all False and those wholly inside all True,
      # known from their corners: at 262,144-token validation rows, computing every tile's mask
      # took 690 s of tracing (benchmarks/RESULTS.md).
      q, kv = idx if len(idx) == 2 else (None, None)
      if isinstance(q, slice) and isinstance(kv, slice) and None not in (
          q.start, q.stop, kv.start, kv.stop) and q.step in (None, 1) and kv.step in (None, 1):
        if kv.start > q.stop - 1 or q.start // window_block - (kv.stop - 1) // window_block >= W:
          return _constant(False, q.stop - q.start, kv.stop - kv.start)
        if kv.stop - 1 <= q.start and (q.stop - 1) // window_block - kv.start // window_block < W:
          return _constant(True, q.stop - q.start, kv.stop - kv.start)
      return super().__getitem__(idx)

    def __eq__(self, other):
      return type(other) is type(self) and (self.shape, self.key) == (other.shape, other.key)

    def __hash__(self):
      return hash((type(self), self.shape, self.key))

  mask = BlockLocalMask()
  mask.key = (window, window_block)
  return mask


@functools.lru_cache(maxsize=8)
def _constant(value: bool, rows: int, cols: int):
  """A read-only all-`value` tile, shared by every tile splash asks for of that shape."""
  tile = np.full((rows, cols), value)
  tile.flags.writeable = False
  return tile


@functools.lru_cache(maxsize=64)
def _kernel(T: int, H: int, window: int, block: int, interpret: bool, window_block=0):
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


def splash_attention(q_BTHK, k_BTHK, v_BTHK, *, scale, window=0, segment_ids_BT=None, block=0):
  """Splash attention, run per device on its batch/head shard when a mesh is active."""
  local = functools.partial(_local, scale=scale, window=window, window_block=block,
                            interpret=platform() != "tpu")
  return per_device(local, q_BTHK, k_BTHK, v_BTHK, segment_ids_BT)


def _local(q_BTHK, k_BTHK, v_BTHK, segment_ids_BT=None, *, scale, window, interpret,
           window_block=0):
  """Pallas splash attention per example (vmapped over batch); `interpret` off TPU (slow)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds
  _, T, H, _ = q_BTHK.shape
  kernel = _kernel(T, H, window, block_size(T), interpret, window_block if window else 0)
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
