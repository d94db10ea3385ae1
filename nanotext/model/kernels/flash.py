"""Pallas flash attention: the TPU kernel that ships with jax, causal and document-masked.

`jax.experimental.pallas.ops.tpu.flash_attention` walks [128, 128] tiles of q and k with an
online softmax and saves the logsumexp for its own backward kernels. It masks causally and by
segment ids, and takes an additive [B, H, T, T] bias, but has no sliding window: a dense bias
would cost the T^2 memory the kernel exists to avoid, so the dispatch refuses flash with
`attention.window` (splash and blocked have windows). Keys are tiled in 128-token blocks, so T
must be a multiple of 128; a head_dim above 128 must be a multiple of 128.

The kernel has no `interpret` argument. Off TPU it runs under `force_tpu_interpret_mode`, which
only reaches the pallas_calls traced inside it. Its bf16 dots take the default matmul precision,
and Mosaic refuses a bf16 dot at `jax_default_matmul_precision=highest` ("Bad lhs type"), so the
kernel is traced at the default precision whatever the process set. The backward kernels are
traced later, when the gradient is transposed, so `_traced_within` wraps the kernel in a
custom_vjp whose backward rule re-enters both settings.
"""

import contextlib

import functools

import jax
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash

from nanotext.model.kernels.per_device import per_device, platform

LANES = 128  # key tiles (and the segment-id broadcast) are this wide


def problem(seq_len: int, head_dim: int, window: int = 0, seq_key: str = "train.seq_len"):
  """None if the kernel can run this (0 = unknown), else why not, for a UserError. `window` is
  one the kernel would apply: 0 where every window covers the rows (effective_windows)."""
  if window:
    return (f"cannot express sliding windows shorter than the rows (a window of {window} tokens, "
            "attention.window or a short one of attention.window_pattern; jax's Pallas flash "
            "kernel masks only causally and by document)")
  if seq_len % LANES:
    return f"cannot tile {seq_key}={seq_len}: it is not a multiple of {LANES}"
  if head_dim > LANES and head_dim % LANES:
    return f"cannot tile model.head_dim={head_dim}: above {LANES} it must be a multiple of it"
  return None


def flash_attention(q_BTHK, k_BTHK, v_BTHK, *, scale: float, segment_ids_BT=None):
  """Causal (optionally document-masked) attention, per device under a mesh."""
  local = functools.partial(_local, scale=scale, interpret=platform() != "tpu")
  return per_device(local, q_BTHK, k_BTHK, v_BTHK, segment_ids_BT)


def _local(q_BTHK, k_BTHK, v_BTHK, segment_ids_BT=None, *, scale: float, interpret: bool):
  """Causal (optionally document-masked) attention through the Pallas kernel."""
  q_BHTK, k_BHTK, v_BHTK = (x.swapaxes(1, 2) for x in (q_BTHK, k_BTHK, v_BTHK))
  args = (q_BHTK, k_BHTK, v_BHTK) + (() if segment_ids_BT is None else (segment_ids_BT,))
  fn = _traced_within(functools.partial(_kernel, scale=scale), len(args), interpret)
  return fn(*args).swapaxes(1, 2)


def _kernel(q_BHTK, k_BHTK, v_BHTK, segment_ids_BT=None, *, scale):
  """The jax kernel on [B, H, T, K] inputs, with its default 128-wide tiles."""
  segments = None
  if segment_ids_BT is not None:
    seg_BT = segment_ids_BT.astype("int32")
    segments = pallas_flash.SegmentIds(q=seg_BT, kv=seg_BT)
  return pallas_flash.flash_attention(q_BHTK, k_BHTK, v_BHTK, segment_ids=segments, causal=True,
                                      sm_scale=float(scale))


# The same HLO interpreter that splash's `interpret=True` selects: the mode's value is or-ed
# with pallas_call's own `interpret` argument (TPU's simulator, InterpretParams, is ~2x slower).
_MODE = True


@contextlib.contextmanager
def _settings(interpret: bool):
  """The default matmul precision, and the interpret mode off TPU."""
  with contextlib.ExitStack() as stack:
    stack.enter_context(jax.default_matmul_precision("default"))
    if interpret:
      stack.enter_context(pltpu.force_tpu_interpret_mode(_MODE))
    yield


def _traced_within(fn, n_args: int, interpret: bool):
  """`fn(q, k, v, [segment ids])` with forward and backward kernels traced under `_settings`."""
  @jax.custom_vjp
  def run(*args):
    with _settings(interpret):
      return fn(*args)

  def fwd(q, k, v, *segments):
    with _settings(interpret):
      out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, *segments), q, k, v)
    return out, vjp

  def bwd(vjp, g):
    with _settings(interpret):
      return (*vjp(g), *(None,) * (n_args - 3))  # no cotangent for segment ids

  run.defvjp(fwd, bwd)
  return run
