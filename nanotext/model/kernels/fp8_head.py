"""The FP8 head's forward GEMM with the loss's exp-sum in its epilogue, for NVIDIA GPUs in Pallas
(Triton lowering; interpret mode elsewhere).

Left to XLA, the head's e4m3 GEMM is a cuBLASLt call that writes float32 (with the record's
float32 scales its rewriter fuses no bfloat16 output convert), and a fusion reads those float32
logits back to write the kept bfloat16 z and sum the soft-capped exponentials: at the record's
shape 9.9 GB written and read again each step (benchmarks/RESULTS.md). Here one program computes
a [BM, BV] tile of z in float32 registers, writes it as bfloat16 and sums exp(softcap(z)) over
its BV columns; the loss adds each token's V / BV partial sums. The arithmetic is the XLA path's
(model/head_loss.py): z rounded to bfloat16 first, the soft-cap and exp taken from the rounded z.
The kernel's name ends in `_gemm`: the roofline prices it as a GEMM of its first two operands
(nanotext/hlo.py). On an H200 (2026-12-04) it agreed with cuBLASLt's GEMM (tests/test_gpu.py)
but took 17.7 ms a record step where cuBLASLt's GEMM and XLA's two fusions took 10.6, so a run
takes it only opted in (per_device.OWN_KERNELS); on CPU it is interpreted and equals the XLA
path (tests/test_fp8_head_kernel.py).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from nanotext import sharding
from nanotext.model.kernels.per_device import opted_in, platform

BM, BV, BK = 128, 128, 64  # tokens and head rows a program writes; the contraction's step


# Soft-capped logits lie in [-c, c]: up to this c a sum of exp(logit) over any vocabulary (up to
# 2**31 entries: e**64 * 2**31 < 3.4e38) is finite in float32 without subtracting the row's max,
# so the exp-sum is one pass (the epilogue's, head_loss._lse's); past it the loss subtracts the
# max first, as without a cap, and a head takes XLA's path, not this kernel.
UNSHIFTED_CAP = 64.0


def applies(tokens: int, d_model: int, vocab: int) -> bool:
  """Whether the program being built takes the kernel for a head slice of `tokens` tokens per
  device: on a GPU where opted in (per_device.OWN_KERNELS), where it tiles (elsewhere, and for
  other shapes, XLA's GEMM and fusion)."""
  return platform() == "gpu" and opted_in("fp8_head") and tiles(tokens, d_model, vocab)


def tiles(tokens: int, d_model: int, vocab: int) -> bool:
  """Every size a multiple of its tile."""
  return tokens > 0 and tokens % BM == 0 and vocab % BV == 0 and d_model % BK == 0


def local_tokens(tokens: int) -> int:
  """A slice's tokens per device under the active mesh, as sharding.per_device splits them; 0
  where the mesh splits the head's rows (tensor parallelism): each device would compute every
  head row of its tokens, which XLA's path splits."""
  if sharding.active_count(("vocab",)) > 1:
    return 0
  return sharding.active_local(tokens, ("batch",))


def forward(a8_ND, b8_DV, scale: float, r: float, softcap: float):
  """(z [N, V] bfloat16, sum over V of exp(softcap * tanh(z / r / softcap)) [N] float32) for
  e4m3 codes a and b with z = scale * (a @ b), per device under a mesh (tokens split as
  "batch", the head's codes whole)."""
  if not 0 < softcap <= UNSHIFTED_CAP:
    raise ValueError(f"fp8_head: softcap={softcap} is not in (0, {UNSHIFTED_CAP}]")
  local = functools.partial(_forward, scale=float(scale), r=float(r), softcap=float(softcap),
                            interpret=platform() != "gpu")
  N, V = a8_ND.shape[0], b8_DV.shape[1]
  z_NV, parts_NP = sharding.per_device(local, (a8_ND, b8_DV), (("batch", None), (None, None)),
                                       ("batch", None), out_shape=(N, V))
  return z_NV, jnp.sum(parts_NP, axis=1)


def _kernel(a_ref, b_ref, z_ref, s_ref, *, scale, r, softcap):
  def step(i, acc):
    a = a_ref[:, pl.ds(i * BK, BK)]
    b = b_ref[pl.ds(i * BK, BK), :]
    return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)
  acc = jax.lax.fori_loop(0, a_ref.shape[1] // BK, step, jnp.zeros((BM, BV), jnp.float32))
  z = (acc * scale).astype(z_ref.dtype)
  z_ref[...] = z
  t = jnp.tanh(z.astype(jnp.float32) / r / softcap)
  s_ref[...] = jnp.sum(jnp.exp(softcap * t), axis=1)


def _forward(a8_ND, b8_DV, *, scale, r, softcap, interpret):
  """The kernel over an (N / BM, V / BV) grid: z and each tile's row sums [N, V / BV]."""
  (N, D), V = a8_ND.shape, b8_DV.shape[1]
  return pl.pallas_call(
      functools.partial(_kernel, scale=scale, r=r, softcap=softcap), grid=(N // BM, V // BV),
      in_specs=[pl.BlockSpec((BM, D), lambda i, j: (i, 0)),
                pl.BlockSpec((D, BV), lambda i, j: (0, j))],
      out_specs=[pl.BlockSpec((BM, BV), lambda i, j: (i, j)),
                 pl.BlockSpec((BM, None), lambda i, j: (i, j))],
      out_shape=[jax.ShapeDtypeStruct((N, V), jnp.bfloat16),
                 jax.ShapeDtypeStruct((N, V // BV), jnp.float32)],
      interpret=interpret, name="fp8_head_gemm",
      compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=3))(a8_ND, b8_DV)
