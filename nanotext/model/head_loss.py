"""The lm head, its soft-cap and the cross-entropy as one function with its own gradient.

Left to autodiff, logits -> soft-cap -> log-softmax -> target pick makes several elementwise
passes over the [tokens, vocab] logits each way (a max, a shifted exp-sum, the soft-cap's tanh
and its derivative, the softmax minus the one-hot, dtype converts); at one 49,152-token row and
50,304 head rows each pass moves gigabytes. Here the forward pass is the head's matmul plus ONE
fused pass (soft-capped logits lie in [-c, c], so for c up to 64 exp needs no running max: the
log-sum-exp is a single reduction) and the backward pass is ONE fused pass making the logits'
gradient (softmax - one-hot, times the soft-cap's derivative 1 - (l / c)^2, times the incoming
scale) before the two matmuls. The head output z (the matmul's, in the model dtype, as the record's
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
import math

import jax
import jax.numpy as jnp

from nanotext import sharding
from nanotext.model.kernels import fp8_head
from nanotext.model.kernels.per_device import platform
from nanotext.model.layers import (E4M3, E5M2, _dequantize, _dot32, _quantize, fp8_head_scales,
                                   fp8_matmul)

# The head works through the positions in slices whose float32 logits stay under this size per
# device, every row at once (so each device keeps its own rows): the FP8 GEMM writes float32
# (cuBLASLt's FP8 output here), so whole logits at one 49,152-token row and 50,304 head rows
# were a 9.2 GiB transient beside the kept head output, and the allocator's packing around it
# cost as much again (tests/test_gpu_compile.py; benchmarks/RESULTS.md). A TPU takes larger
# slices: each unrolled slice cost its compile about 10 s of CPU.
SLICE_BYTES = {"tpu": 4 * 2**30}
DEFAULT_SLICE_BYTES = 2**30


def slices(rows: int, length: int, vocab: int, backend: str = "") -> int:
  """How many equal slices of the `length` positions the head takes one after another on
  `backend`, `rows` rows per device: the fewest whose float32 [rows, slice, vocab] logits fit
  its SLICE_BYTES (one for every row the CPU configs run)."""
  want = math.ceil(rows * length * vocab * 4 / SLICE_BYTES.get(backend, DEFAULT_SLICE_BYTES))
  return next(k for k in range(max(1, want), length + 1) if length % k == 0)


def working_bytes(rows: int, length: int, vocab: int, itemsize: int, fp8: bool,
                  backend: str, kernel: bool = False) -> int:
  """What the head's training step holds at once beside the head output z it keeps for the
  backward pass: one slice's float32 FP8 GEMM output in the forward pass (with `kernel`,
  kernels/fp8_head.py's, its partial exp-sums), or in the backward pass one slice's output
  gradient as its two GEMMs read it (FP8: e5m2 in both layouts, else the model dtype).
  nanotext.memory adds it to the kept activations."""
  m = rows * length // slices(rows, length, vocab, backend)
  # Without FP8 the GEMM writes z itself, which is kept.
  forward = 0 if not fp8 else m * (vocab // fp8_head.BV if kernel else vocab) * 4
  return max(forward, m * vocab * (2 if fp8 else itemsize))


def takes_kernel(rows: int, length: int, d_model: int, vocab: int, dtype, softcap: float,
                 fp8: bool, backend: str) -> bool:
  """Whether a train step on `backend`, `rows` rows of `length` per device, runs the head's FP8
  forward as kernels/fp8_head.py's (the test _uses_kernel makes of each slice while tracing)."""
  m = rows * length // slices(rows, length, vocab, backend)
  return (_kernel_head(fp8, softcap, dtype) and backend == "gpu"
          and fp8_head.tiles(m, d_model, vocab))


def _kernel_head(fp8, softcap, dtype) -> bool:
  """An FP8, soft-capped (at most fp8_head.UNSHIFTED_CAP), bfloat16 head: what
  kernels/fp8_head.py computes."""
  return bool(fp8 and 0 < softcap <= fp8_head.UNSHIFTED_CAP and jnp.dtype(dtype) == jnp.bfloat16)


def head_loss_sum(x_BTD, w_DV, targets_BT, *, softcap: float = 0.0, fp8=None, fp8_scale=1.0,
                  b_DV=None):
  """Sum over every token of cross-entropy(softcap(x @ w), target) in float32, for x [B, T, D]
  (or [N, D]) and targets [B, T] (or [N]).

  `fp8`: (x_s, w_s, grad_s) for an FP8 matmul run at scale `fp8_scale` (the module docstring's
  r), or None for x @ w in x's dtype. `softcap` c > 0: logits c * tanh(z / c); 0: the plain
  logits. `b_DV`: weight_operand(w_DV, x's dtype, fp8, fp8_scale) made once by a caller that
  reads the weight many times (model/loss.py's chunks); None: made inside the fused head, the
  program the unchunked step has always compiled to (its memory plan counts no extra [D, V]).
  """
  if x_BTD.ndim == 2:  # [N, D]: one row of N tokens
    x_BTD, targets_BT = x_BTD[None], targets_BT[None]
  fp8 = None if fp8 is None else (*fp8, float(fp8_scale))
  B, T, _ = x_BTD.shape
  rows = B // sharding.active_count(("batch",))
  k = slices(max(1, rows), T, w_DV.shape[1], platform())
  return _fused(x_BTD, w_DV, b_DV, targets_BT, float(softcap), fp8, k)


def weight_operand(w_DV, dtype, fp8=None, fp8_scale=1.0, gather: bool = False):
  """The head matmul's weight operand as the forward and backward passes read it: w's e4m3 codes
  at scale w_s * r (`fp8` and r = `fp8_scale` as head_loss_sum's), or w in the model dtype
  `dtype`. Not differentiated: w's gradient comes from _fused_bwd, straight through the rounding.
  `gather`: made on w's FSDP shards and gathered whole (model/loss.py's chunks, once a step)."""
  return jax.lax.stop_gradient(_made(w_DV, dtype, fp8, fp8_scale, gather))


def _made(w_DV, dtype, fp8, fp8_scale, gather):
  """weight_operand's array (inside _fused, where nothing differentiates it)."""
  if fp8 is None:
    b_DV = w_DV.astype(dtype)
  else:
    _, w_s, _ = fp8
    r = float(fp8_scale)
    b_DV = _quantize(w_DV * r, w_s * r, E4M3)
    # On a GPU FSDP gathers the codes, not dequantized float32 weights: cuBLASLt's FP8 GEMM must
    # see the dequantize at its input.
    gather = gather or platform() == "gpu"
  if gather:  # pinned to w's shards first: else XLA may gather float32 w and quantize that
    b_DV = sharding.constrain(sharding.constrain(b_DV, ("embed", "vocab")), (None, "vocab"))
  return b_DV


def fp8_logits(x_BTD, w_DV, loss_denominator: int = 0):
  """Float32 logits before the soft-cap of the unfused FP8 head (model.logits at train):
  layers.fp8_matmul at the scales of layers.fp8_head_scales (`loss_denominator` as theirs; 0 =
  these tokens), run in the record's scale r = sqrt(D) as _fused is (the module docstring)."""
  B, T, D = x_BTD.shape
  # Its weights r times these, its z r times z': the output and its gradient are rounded to the
  # model dtype on the record's grid, so their FP8 codes are the record's (rounding z' = z / r
  # instead changed 1.3% of the gradient's e5m2 codes: head gradients 1.5% from the record's,
  # now 1e-4; tests/test_record_training.py).
  r = float(math.sqrt(D))
  x_s, w_s, grad_s = fp8_head_scales(D, loss_denominator or B * T)
  z_NV = fp8_matmul(x_BTD.reshape(B * T, D), w_DV * r, x_s, w_s * r, grad_s / r)
  return (z_NV.astype(jnp.float32) / r).reshape(B, T, -1)


def _cut(x_BT_, k: int, i: int):
  """Positions i * T / k ... of every row, flattened to [rows * T / k, ...]."""
  t = x_BT_.shape[1] // k
  piece = x_BT_[:, i * t:(i + 1) * t]
  return piece.reshape(-1, *piece.shape[2:])


# Up to this many slices the training step unrolls them, each ordered after the last by a barrier
# (every shipped config: at most 12); more run as a loop, one compiled body (1,536 unrolled
# slices of speedrun.yml at 4,096 rows took the memory plan 10 s of tracing per candidate).
UNROLL = 16


def _stack(v, k: int):
  """[B, T, ...] -> [k, B, T / k, ...]: slice i of _cut as one loop step, rows on their devices."""
  B, T = v.shape[:2]
  return sharding.constrain(v.reshape(B, k, T // k, *v.shape[2:]).swapaxes(0, 1),
                            (None, "batch", "act_length") + (("act_embed",) if v.ndim == 3 else ()))


def _flat(v_Bt_):
  """One loop step's [B, T / k, ...] flattened to _cut's [B * T / k, ...]."""
  return v_Bt_.reshape(-1, *v_Bt_.shape[2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _fused(x_BTD, w_DV, b_DV, targets_BT, softcap, fp8, k):
  """The loss alone (evaluation): the slices as a loop, one compiled body whatever their number
  (unrolled, 64 slices of a 262,144-token validation row kept a TPU compiling for minutes).
  `b_DV`: weight_operand's of w_DV, which the matmuls read (w_DV gives the gradient its dtype)."""
  b_DV = _operand(w_DV, b_DV, x_BTD.dtype, fp8)
  if k == 1:
    return _forward(x_BTD, w_DV, b_DV, targets_BT, softcap, fp8, k)[0]
  return _looped_forward(x_BTD, w_DV, b_DV, targets_BT, softcap, fp8, k, keep=False)[0]


def _operand(w_DV, b_DV, dt, fp8):
  """The weight operand given to _fused, or made of w_DV there (weight_operand) where None."""
  if b_DV is not None:
    return b_DV
  return _made(w_DV, dt, None if fp8 is None else fp8[:3], fp8[3] if fp8 else 1.0, False)


def _x_operand(x_ND, fp8):
  """x as the forward and backward matmuls read it: its e4m3 codes, or x itself."""
  return x_ND if fp8 is None else _quantize(x_ND, fp8[0], E4M3)


def _product(a_ND, b_DV, fp8, dt):
  """z [N, V] in the model dtype `dt` from x's and w's operands (_x_operand, weight_operand)."""
  if fp8 is None:
    return jnp.dot(a_ND, b_DV, preferred_element_type=dt)
  x_s, w_s, _, r = fp8
  z = _dot32(_dequantize(a_ND, x_s), _dequantize(b_DV, w_s * r))
  if dt == jnp.bfloat16:  # rounded as the record's out_dtype: kept even where XLA may skip a
    z = jax.lax.reduce_precision(z, exponent_bits=8, mantissa_bits=7)  # f32->bf16->f32 trip
  return z.astype(dt)


def _capped(z_NV, softcap, fp8):
  """(logits, tanh(z / c)) in float32 from the head output z (tanh None without a soft-cap)."""
  z = z_NV.astype(jnp.float32)
  z = z / fp8[3] if fp8 else z  # no op where there is no scale: z stays the head's output
  if not softcap:
    return z, None
  t = jnp.tanh(z / softcap)
  return softcap * t, t


def _slice_loss(a_MD, b_DV, y_M, softcap, fp8, dt):
  """(summed loss, z, log-sum-exp) of one slice of tokens."""
  if _uses_kernel(a_MD, b_DV, softcap, fp8, dt):  # z and the exp-sum in one kernel (a GPU's)
    x_s, w_s, _, r = fp8
    z_MV, sum_M = fp8_head.forward(a_MD, b_DV, x_s * w_s * r, r, softcap)
    lse_M = jnp.log(sum_M)
  else:
    z_MV = _product(a_MD, b_DV, fp8, dt)
    lse_M = _lse(_capped(z_MV, softcap, fp8)[0], softcap)
  # The target's logit capped on its own: the [M, V] logits then have one reader (the exp-sum),
  # so nothing but z of that size need be kept (XLA fuses; nanotext.memory counts readers).
  picked_M, _ = _capped(jnp.take_along_axis(z_MV, y_M[:, None], axis=-1)[:, 0], softcap, fp8)
  return jnp.sum(lse_M - picked_M), z_MV, lse_M


def _uses_kernel(a_MD, b_DV, softcap, fp8, dt) -> bool:
  """Whether the slice's FP8 forward runs as kernels/fp8_head.py's GEMM with the exp-sum inside
  (a soft-capped bfloat16 head on a GPU, tile-aligned sizes), not XLA's GEMM and fusion."""
  return _kernel_head(fp8, softcap, dt) and fp8_head.applies(
      fp8_head.local_tokens(a_MD.shape[0]), a_MD.shape[1], b_DV.shape[1])


def _lse(l_MV, softcap):
  """The log-sum-exp of each row of the float32 logits."""
  if 0 < softcap <= fp8_head.UNSHIFTED_CAP:  # |l| <= c: exp cannot overflow, one reduction
    lse_M = jnp.log(jnp.sum(jnp.exp(l_MV), axis=-1))
  else:
    top_M = jax.lax.stop_gradient(jnp.max(l_MV, axis=-1))
    lse_M = top_M + jnp.log(jnp.sum(jnp.exp(l_MV - top_M[:, None]), axis=-1))
  return lse_M


def _forward(x_BTD, w_DV, b, targets_BT, softcap, fp8, k):
  """The loss and the backward pass's residuals, the k slices unrolled one after another (or
  beyond UNROLL, _looped_forward's loop)."""
  if k > UNROLL:
    return _looped_forward(x_BTD, w_DV, b, targets_BT, softcap, fp8, k)
  a = [_x_operand(_cut(x_BTD, k, i), fp8) for i in range(k)]
  ys = [_cut(targets_BT, k, i) for i in range(k)]
  zs, lses, total = [], [], jnp.zeros([], jnp.float32)
  for i in range(k):  # one slice's float32 logits at a time
    if i:  # ordered: slice i's matmul waits for slice i - 1's sum (else XLA may run them all first)
      total, a[i] = jax.lax.optimization_barrier((total, a[i]))
    loss, z_MV, lse_M = _slice_loss(a[i], b, ys[i], softcap, fp8, x_BTD.dtype)
    total = total + loss
    zs.append(z_MV)
    lses.append(lse_M)
  B, T, _ = x_BTD.shape
  like = (jnp.zeros((0, B, T // k), x_BTD.dtype), jnp.zeros((0,), w_DV.dtype))  # shapes, 0 bytes
  return total, ((tuple(a), b), tuple(zs), tuple(lses), tuple(ys), like)


def _looped_forward(x_BTD, w_DV, b, targets_BT, softcap, fp8, k, keep=True):
  """_forward's loss and residuals with the slices as a loop: the kept z and log-sum-exp come
  out stacked [k, ...], as many bytes as the unrolled slices keep (`keep=False`: the loss and
  None, nothing kept: evaluation)."""
  D = x_BTD.shape[-1]
  a, ys = _stack(_x_operand(x_BTD, fp8), k), _stack(targets_BT, k)

  def body(total, xs):
    a_BtD, y_Bt = xs
    loss, z_MV, lse_M = _slice_loss(a_BtD.reshape(-1, D), b, _flat(y_Bt), softcap, fp8,
                                    x_BTD.dtype)
    return total + loss, ((z_MV, lse_M) if keep else None)
  total, kept = jax.lax.scan(body, jnp.zeros([], jnp.float32), (a, ys))
  if not keep:
    return total, None
  B, T, _ = x_BTD.shape
  like = (jnp.zeros((0, B, T // k), x_BTD.dtype), jnp.zeros((0,), w_DV.dtype))  # shapes, 0 bytes
  return total, ((a, b), *kept, ys, like)


def _fused_fwd(x_BTD, w_DV, b_DV, targets_BT, softcap, fp8, k):
  return _forward(x_BTD, w_DV, _operand(w_DV, b_DV, x_BTD.dtype, fp8), targets_BT, softcap, fp8,
                  k)


def _slice_grads(z_MV, lse_M, y_M, a_MD, b, g, softcap, fp8, dt):
  """(dx [M, D] in `dt`, this slice's float32 part of dW) from one slice's kept z and
  log-sum-exp."""
  l_MV, t_MV = _capped(z_MV, softcap, fp8)
  hit_MV = jnp.arange(l_MV.shape[-1])[None, :] == y_M[:, None]
  dl_MV = g * (jnp.exp(l_MV - lse_M[:, None]) - hit_MV)
  # (1 - t)(1 + t), not 1 - t^2: exact where the cap saturates (|t| near 1), as autodiff's tanh
  dz_MV = dl_MV * ((1 - t_MV) * (1 + t_MV)) if softcap else dl_MV
  if fp8 is None:
    dz = dz_MV.astype(dt)  # as autodiff rounds the gradient of z (x's dtype)
    return (jnp.dot(dz, b.T, preferred_element_type=dt),
            jnp.dot(a_MD.T, dz, preferred_element_type=jnp.float32))
  x_s, w_s, grad_s, r = fp8  # z = z' r: its gradient is dz' / r, the weights' r dW_r
  g_MV = _dequantize(_quantize((dz_MV / r).astype(dt), grad_s / r, E5M2), grad_s / r)
  return (_dot32(g_MV, _dequantize(b, w_s * r).T, exact=True).astype(dt),
          _dot32(_dequantize(a_MD, x_s * r).T, g_MV, exact=True))


def _fused_bwd(softcap, fp8, k, res, g):
  (a, b), zs, lses, ys, (x_like, w_like) = res
  _, B, t = x_like.shape
  dt = x_like.dtype
  if k > UNROLL:  # _looped_forward's stacked residuals, a loop again
    D = a.shape[-1]

    def body(dw, xs):
      a_BtD, z_MV, lse_M, y_Bt = xs
      dx, part = _slice_grads(z_MV, lse_M, _flat(y_Bt), a_BtD.reshape(-1, D), b, g, softcap,
                              fp8, dt)
      return dw + part, dx.reshape(B, t, D)
    dw, dx_kBtD = jax.lax.scan(body, jnp.zeros(b.shape, jnp.float32), (a, zs, lses, ys))
    return dx_kBtD.swapaxes(0, 1).reshape(B, k * t, D), dw.astype(w_like.dtype), None, None
  D = a[0].shape[-1]
  # On GPU and TPU a barrier keeps XLA from merging the soft-cap below with the forward's and
  # keeping float32 logits for it: the backward reads the head output z, half their size. The
  # CPU compiler keeps z either way; there the barrier would only move float rounding.
  barrier = jax.lax.optimization_barrier if platform() != "cpu" else lambda z: z
  dxs, dw = [], 0.0
  for i, (z_MV, lse_M) in enumerate(zip(zs, lses)):
    if i:  # ordered, as the forward's slices
      dw, z_MV = jax.lax.optimization_barrier((dw, z_MV))
    else:
      z_MV = barrier(z_MV)
    dx, part = _slice_grads(z_MV, lse_M, ys[i], a[i], b, g, softcap, fp8, dt)
    dxs.append(dx)
    dw = dw + part
  # Each slice's [B * T / k, D] back in its rows' positions.
  dx = jnp.concatenate([d.reshape(B, t, D) for d in dxs], axis=1)
  return dx.astype(dt), dw.astype(w_like.dtype), None, None


_fused.defvjp(_fused_fwd, _fused_bwd)
