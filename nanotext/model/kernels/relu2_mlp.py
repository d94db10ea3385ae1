"""The squared ReLU of the speedrun's MLP inside the GEMMs around it, for NVIDIA GPUs in Pallas
(Triton lowering; interpret mode elsewhere).

Left to XLA, the up-projection is a cuBLAS GEMM writing h, then a fusion reads h and writes
a = relu(h)^2; in the backward pass the down-projection's input-gradient GEMM writes da and a
fusion reads da and h to write dh = select(h > 0, da * 2 relu(h), 0): at the record's shape 1.4
GiB a layer moved besides the GEMMs each step, 5.4 ms of its roofline estimate. Here `up` writes h
and a from each float32 [BM, BN] tile, and `grad_h` reads h in its epilogue and writes dh: the
arithmetic of the XLA path (each GEMM's output rounded to bfloat16 first, the activation and
its derivative in bfloat16). Kernel names end in `_gemm`: the roofline prices them as GEMMs of
their first two operands (nanotext/hlo.py). On an H200 (2026-12-04) they were slower than
cuBLAS's GEMMs and XLA's fusions (14.6 ms a record step for the two), so a run takes them only
opted in (per_device.OWN_KERNELS); on CPU they are interpreted and equal the XLA path
(tests/test_relu2_mlp_kernel.py).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from nanotext import sharding
from nanotext.model.kernels.per_device import opted_in, platform

BM, BN, BK = 128, 128, 64  # tokens and MLP columns a program writes; the contraction's step
TOKENS, COLUMNS = ("batch", "act_length"), "act_mlp"  # the logical axes it runs per device over


def applies(x_BTD, mlp: int) -> bool:
  """Whether the program being built takes the kernels for this MLP input: on a GPU where opted
  in (per_device.OWN_KERNELS), bfloat16, where each device's slice tiles (elsewhere XLA's GEMMs
  and fusions)."""
  return (platform() == "gpu" and opted_in("relu2_mlp") and x_BTD.dtype == jnp.bfloat16
          and tiles(*local_sizes(x_BTD, mlp)))


def tiles(tokens: int, d_model: int, mlp: int) -> bool:
  """Every size a multiple of its tile."""
  return tokens > 0 and tokens % BM == 0 and mlp % BN == 0 and d_model % BK == 0


def local_sizes(x_BTD, mlp: int) -> tuple:
  """(tokens, d_model, MLP columns) of one device's kernel under the active mesh, as
  sharding.per_device splits them."""
  B, T, D = x_BTD.shape
  local = sharding.active_local
  return local(B, TOKENS[:1]) * local(T, TOKENS[1:]), D, local(mlp, (COLUMNS,))


def up(x_BTD, w_DF, keep_h: bool = True):
  """(h, relu(h)^2), each [B, T, F] bfloat16, for h = x @ w, per device under a mesh; with
  keep_h=False (no backward pass to feed) only (relu(h)^2,)."""
  B, T, _ = x_BTD.shape
  out = (B, T, w_DF.shape[1])
  fn = functools.partial(_flat, functools.partial(_up, keep_h=keep_h),
                         interpret=platform() != "gpu")
  return sharding.per_device(fn, (x_BTD, w_DF), (TOKENS + (None,), (None, COLUMNS)),
                             TOKENS + (COLUMNS,), out_shape=out)


def grad_h(dy_BTD, w_FD, h_BTF):
  """dh = select(h > 0, (dy @ w.T) * 2 relu(h), 0), [B, T, F] bfloat16: the gradient reaching
  h through relu(h)^2 @ w, per device under a mesh."""
  fn = functools.partial(_flat, _grad_h, interpret=platform() != "gpu")
  return sharding.per_device(fn, (dy_BTD, w_FD, h_BTF),
                             (TOKENS + (None,), (COLUMNS, None), TOKENS + (COLUMNS,)),
                             TOKENS + (COLUMNS,), out_shape=h_BTF.shape)


def _flat(kernel, x_BTD, *rest, interpret):
  """One device's kernel on its [b * t, ...] rows, its outputs back as [b, t, ...]."""
  b, t, _ = x_BTD.shape
  flat = lambda a: a.reshape(b * t, a.shape[-1]) if a.ndim == 3 else a
  out = kernel(*map(flat, (x_BTD,) + rest), interpret=interpret)
  return jax.tree.map(lambda a: a.reshape(b, t, a.shape[-1]), out)


def _up_kernel(x_ref, w_ref, *out_refs):
  def step(i, acc):
    k = pl.ds(i * BK, BK)
    return acc + jnp.dot(x_ref[:, k], w_ref[k, :], preferred_element_type=jnp.float32)
  acc = jax.lax.fori_loop(0, x_ref.shape[1] // BK, step, jnp.zeros((BM, BN), jnp.float32))
  *h_ref, a_ref = out_refs
  h = acc.astype(a_ref.dtype)
  if h_ref:
    h_ref[0][...] = h
  r = jnp.maximum(h, 0)
  a_ref[...] = r * r


def _grad_h_kernel(dy_ref, w_ref, h_ref, dh_ref):
  def step(i, acc):
    k = pl.ds(i * BK, BK)
    return acc + jax.lax.dot_general(dy_ref[:, k], w_ref[:, k], (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)  # dy @ w.T
  acc = jax.lax.fori_loop(0, dy_ref.shape[1] // BK, step, jnp.zeros((BM, BN), jnp.float32))
  da = acc.astype(dh_ref.dtype)
  h = h_ref[...]
  # jax's derivatives of square and relu: g * (2 * r), kept where h > 0.
  dh_ref[...] = jnp.where(h > 0, da * (2 * jnp.maximum(h, 0)), jnp.zeros_like(da))


_PARAMS = dict(num_warps=8, num_stages=3)
# The grid's first axis runs fastest on a GPU (blockIdx.x): the MLP's columns, so the programs
# running at once share a few [BM, D] token tiles and all of the weight (4.5 MiB at the record's
# widths, in L2), instead of each sweeping every token tile of a [49152, 768] input (72 MiB,
# more than an H100's 50 MiB L2) once per column tile.


def _up(x_ND, w_DF, *, keep_h, interpret):
  (N, D), F = x_ND.shape, w_DF.shape[1]
  n = 1 + keep_h
  return pl.pallas_call(
      _up_kernel, grid=(F // BN, N // BM),
      in_specs=[pl.BlockSpec((BM, D), lambda j, i: (i, 0)),
                pl.BlockSpec((D, BN), lambda j, i: (0, j))],
      out_specs=[pl.BlockSpec((BM, BN), lambda j, i: (i, j))] * n,
      out_shape=[jax.ShapeDtypeStruct((N, F), x_ND.dtype)] * n,
      interpret=interpret, name="relu2_up_gemm",
      compiler_params=plgpu.CompilerParams(**_PARAMS))(x_ND, w_DF)


def _grad_h(dy_ND, w_FD, h_NF, *, interpret):
  (N, D), F = dy_ND.shape, w_FD.shape[0]
  return pl.pallas_call(
      _grad_h_kernel, grid=(F // BN, N // BM),
      in_specs=[pl.BlockSpec((BM, D), lambda j, i: (i, 0)),
                pl.BlockSpec((BN, D), lambda j, i: (j, 0)),
                pl.BlockSpec((BM, BN), lambda j, i: (i, j))],
      out_specs=pl.BlockSpec((BM, BN), lambda j, i: (i, j)),
      out_shape=jax.ShapeDtypeStruct((N, F), h_NF.dtype),
      interpret=interpret, name="relu2_grad_gemm",
      compiler_params=plgpu.CompilerParams(**_PARAMS))(dy_ND, w_FD, h_NF)
