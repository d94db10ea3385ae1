"""The GPU tier: what only an NVIDIA GPU can show (`JAX_PLATFORMS=cuda,cpu pytest -m gpu`).

Every test here is marked `gpu` and skipped on other backends (tests/conftest.py); their logic
has CPU tests elsewhere (test_head_loss.py, test_speedrun_model.py, test_attention*.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nanotext.model.head_loss import head_loss_sum
from nanotext.model.layers import fp8_head_scales, rms_norm

pytestmark = pytest.mark.gpu


def head_inputs(N=4096, D=768, V=50304):
  kx, kw, ky = jax.random.split(jax.random.key(0), 3)
  x = rms_norm(jax.random.normal(kx, (N, D))).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (D, V)) * 3 / np.sqrt(D)
  return x, w, jax.random.randint(ky, (N,), 0, V)


def on_gpu_and_cpu(fn, *args):
  """jax.value_and_grad of `fn` over every argument, once on the GPU and once on the CPU. The
  CPU's is traced as for the CPU (per_device.building_for): with no mesh to say where it runs,
  the trace would take the default backend's GPU kernels and fail to lower them there."""
  from nanotext.model.kernels.per_device import building_for
  vg = lambda: jax.value_and_grad(fn, argnums=tuple(range(len(args))))  # a trace each
  cpu_dev = jax.devices("cpu")[0]
  gpu = jax.jit(vg())(*args)
  with building_for("cpu"):
    return gpu, jax.jit(vg(), device=cpu_dev)(*jax.device_put(args, cpu_dev))


def hopper_or_skip():
  if "H100" not in jax.devices()[0].device_kind and "H200" not in jax.devices()[0].device_kind:
    pytest.skip("FP8 GEMMs need a Hopper GPU")


def assert_fp8_head_agrees(got, want):
  """(loss, (dx, dw)) of two FP8 head computations: the loss to 1e-4; under 1% of dx's entries
  off by more than 1% of its largest, dw within 10% of its largest (FP8 codes round apart)."""
  np.testing.assert_allclose(got[0], want[0], rtol=1e-4)
  (dx, dx_want), (dw, dw_want) = ((np.asarray(a, np.float32), np.asarray(b, np.float32))
                                  for a, b in zip(got[1], want[1]))
  assert np.mean(np.abs(dx - dx_want) > 1e-2 * np.abs(dx_want).max()) < 1e-2
  assert np.abs(dw - dw_want).max() < 0.1 * np.abs(dw_want).max()


def test_fp8_head_compiles_to_fp8_gemms():
  """The FP8 head's forward is kernels/fp8_head.py's Triton GEMM, and XLA rewrites the
  dequantise -> dot pattern of both backward matmuls into cuBLASLt FP8 GEMMs (H100 and newer;
  an older GPU has no FP8 GEMM)."""
  hopper_or_skip()
  x, w, y = head_inputs()
  scales = fp8_head_scales(x.shape[1], 1)
  fn = jax.jit(jax.grad(lambda x, w: head_loss_sum(x, w, y, softcap=15.0, fp8=scales),
                        argnums=(0, 1)))
  hlo = fn.lower(x, w).compile().as_text()
  assert hlo.count("__cublas$lt$matmul$f8") >= 2, hlo.count("__cublas$lt$matmul$f8")
  assert 'name = "fp8_head_gemm"' in hlo


def test_fp8_head_kernel_agrees_with_xlas_gemm_on_the_gpu():
  """kernels/fp8_head.py compiled by Triton at the record's slice (4,096 tokens, 768 wide, 50,304
  head rows) against XLA's cuBLASLt GEMM and fusion on the same GPU, both at the run's default
  precision: the loss and both gradients. cuBLASLt's forward sums with fast accumulation, the
  kernel as Triton does (passed on an H200, 2026-12-04): a few bf16 z a step apart, which an
  e5m2 rounding of the output gradient can turn into larger moves in a few entries, as the
  record-row test allows. A wrong scale, tile or index moves most. The kernel is opt-in."""
  hopper_or_skip()
  from nanotext.model.kernels.per_device import opting_in
  x, w, y = head_inputs()
  scales = fp8_head_scales(x.shape[1], 1)
  loss = lambda x, w: head_loss_sum(x, w, y, softcap=15.0, fp8=scales, fp8_scale=np.sqrt(768))
  vg = lambda: jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))  # a trace each
  with jax.default_matmul_precision("default"):
    with opting_in("fp8_head"):
      kernel = vg()(x, w)
    xla = vg()(x, w)
  assert_fp8_head_agrees(kernel, xla)


def test_relu2_mlp_kernels_agree_with_xlas_gemms_on_the_gpu():
  """kernels/relu2_mlp.py compiled by Triton at the record's MLP (one 49,152-token row, 768 x
  3,072) against cuBLAS's GEMMs and XLA's fusions on the same GPU: the output and the three
  gradients, a few bf16 roundings apart at most (each side sums its K blocks in its own order;
  passed on an H200, 2026-12-04). A wrong tile, index or epilogue moves most. Opt-in kernels."""
  from nanotext.model import layers
  from nanotext.model.kernels.per_device import opting_in
  kx, k1, k2, kg = jax.random.split(jax.random.key(1), 4)
  x = rms_norm(jax.random.normal(kx, (1, 49152, 768))).astype(jnp.bfloat16)
  w1 = (jax.random.normal(k1, (768, 3072)) * 0.5 / np.sqrt(768)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(k2, (3072, 768)) * 0.5 / np.sqrt(3072)).astype(jnp.bfloat16)
  dy = jax.random.normal(kg, x.shape).astype(jnp.bfloat16)
  fn = jax.jit(lambda x, w1, w2, dy: (lambda y, vjp: (y, *vjp(dy)))(
      *jax.vjp(layers.relu2_mlp, x, w1, w2)))
  with opting_in("relu2_mlp"):
    assert 'name = "relu2_grad_gemm"' in fn.lower(x, w1, w2, dy).compile().as_text()
    got = fn(x, w1, w2, dy)
  xla = jax.jit(lambda x, w1, w2, dy: (lambda y, vjp: (y, *vjp(dy)))(*jax.vjp(
      lambda x, w1, w2: jnp.square(jax.nn.relu(x @ w1)) @ w2, x, w1, w2)))(x, w1, w2, dy)
  for a, b in zip(got, xla):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.mean(a != b) < 0.02 and np.abs(a - b).max() <= 0.01 * np.abs(b).max()


def test_fused_head_loss_agrees_with_the_cpu():
  """The same loss and gradients on the GPU as on the CPU (float32 matmuls at 'highest')."""
  x, w, y = head_inputs(N=1024, V=8192)
  gpu, cpu = on_gpu_and_cpu(
      lambda x, w: head_loss_sum(x.astype(jnp.float32), w, y, softcap=15.0), x, w)
  np.testing.assert_allclose(gpu[0], cpu[0], rtol=1e-5)
  for a, b in zip(gpu[1], cpu[1]):
    rtol = 1e-2 if a.dtype == jnp.bfloat16 else 1e-3  # one bf16 ulp is 2^-7 = 0.8%
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("precision", ["highest", "default"])
def test_fp8_head_agrees_with_the_cpu_at_the_record_row(precision):
  """The FP8 head as cuBLASLt FP8 GEMMs against the same code on the CPU (float32 sums of the
  FP8 codes' products) at the record's one 49,152-token row: the loss and both gradients. At
  conftest's `highest` every GEMM sums exactly; at `default`, as a run compiles it, the forward
  GEMM takes cuBLASLt's fast accumulation (the record's use_fast_accum=True) and the backward
  ones do not (layers._dot32).

  The GEMMs sum in another order, so a few bf16 logits come out a unit in the last place apart,
  and the output gradient's e5m2 rounding (2 mantissa bits) can then fall the other way in a
  large entry, which moves that token's dx. On an H200 at `highest`: loss 1.7e-5 apart; 0.10%
  of dx's entries more than 1% of its largest apart (the worst 12%); dw at most 3.5% of its
  largest. Both passed on an H200 on 2026-12-04 while the forward was kernels/fp8_head.py's
  Pallas GEMM (now opt-in); `default` with cuBLASLt's forward has not run on a GPU yet. A wrong
  scale or saturation would move most entries.
  """
  x, w, y = head_inputs(N=49152, V=8192)
  with jax.default_matmul_precision(precision):
    gpu, cpu = on_gpu_and_cpu(
        lambda x, w: head_loss_sum(x, w, y, softcap=15.0, fp8=fp8_head_scales(x.shape[1], 1)),
        x, w)
  assert_fp8_head_agrees(gpu, cpu)


def test_embedding_backward_is_one_scatter():
  """The token and value tables' gradients: one float32 scatter on the GPU too."""
  from types import SimpleNamespace
  from nanotext.model.layers import lookup
  ids = jax.random.randint(jax.random.key(0), (1, 4096), 0, 50257)
  tables = [jnp.zeros((50257, 768), jnp.bfloat16) for _ in range(4)]
  def loss(tables):
    embeds = [SimpleNamespace(embedding=SimpleNamespace(get_value=lambda t=t: t),
                              dtype=jnp.bfloat16) for t in tables]
    return sum(x.astype(jnp.float32).sum() for x in lookup(embeds, ids))
  hlo = jax.jit(jax.grad(loss)).lower(tables).compile().as_text()
  assert hlo.count(" scatter(") + hlo.count("scatter-fusion") >= 1
  assert hlo.count(" scatter(") <= 1


def test_cudnn_attention_agrees_with_xla():
  from nanotext.model.attention import dot_product_attention
  q, k, v = (jax.random.normal(jax.random.key(i), (2, 1024, 4, 128), jnp.bfloat16)
             for i in range(3))
  out = {impl: dot_product_attention(q, k, v, impl=impl, scale=0.12, window=256)
         for impl in ("cudnn", "xla")}
  np.testing.assert_allclose(np.asarray(out["cudnn"], np.float32),
                             np.asarray(out["xla"], np.float32), atol=2e-2)


def flash_against_einsum(window, block, B=1, T=4096, H=6, K=128):
  """[(name, flash_gpu, einsum)] for the output and the three gradients, float32 arrays; bf16
  inputs, documents (one starting on a 128-token edge)."""
  from nanotext.model.kernels.dispatch import dot_product_attention
  q, k, v, g = (jax.random.normal(jax.random.key(i), (B, T, H, K), jnp.bfloat16)
                for i in range(4))
  eot = jax.random.uniform(jax.random.key(9), (B, T)) < 6 / T
  seg = jnp.cumsum(eot.at[:, T // 4].set(True), axis=1).astype(jnp.int32)
  def run(q, k, v, g, impl):
    f = lambda q, k, v: dot_product_attention(q, k, v, impl=impl, scale=0.12, window=window,
                                              segment_ids_BT=seg, block=block)
    out, vjp = jax.vjp(f, q, k, v)
    return (out, *vjp(g))
  run = jax.jit(run, static_argnums=4)
  got, want = run(q, k, v, g, "flash_gpu"), run(q, k, v, g, "einsum")
  return [(n, np.asarray(a, np.float32), np.asarray(b, np.float32))
          for n, a, b in zip(("out", "dq", "dk", "dv"), got, want)]


@pytest.mark.parametrize("window,block", [(1792, 128), (384, 0), (0, 0)])
def test_flash_gpu_on_the_gpu_agrees_with_einsum(window, block):
  """The Triton-compiled block-sparse kernel (interpreted everywhere else) at the record's head
  width: outputs and the three gradients against the einsum kernel."""
  for name, a, b in flash_against_einsum(window, block):
    assert np.isfinite(a).all(), name
    np.testing.assert_allclose(a, b, atol=2e-2 * np.abs(b).max(), err_msg=name)


def test_flash_gpu_with_the_norm_rotation_and_mix_inside_on_the_gpu():
  """flash_gpu_qkv_attention compiled by Triton at the record's head width (6 heads of 128,
  8,192 tokens with documents, a 1,792-token block window, the value embedding mixed into v):
  output and gradients as far from the float32 computation (on the CPU) as the two-kernel path
  on the same GPU, and apart from it by a fraction of that; the CPU test's criterion
  (test_flash_qkv.py), here on the arithmetic Triton compiles."""
  from test_flash_qkv import inputs, reference, vjp_of
  from nanotext.model.kernels import flash_gpu
  from nanotext.model.rope import rope_frequencies
  freq = rope_frequencies(128, 1024, True)
  qkv, lam, ve, g = inputs((1, 8192, 3, 6, 128), jnp.bfloat16, seed=1)
  eot = jax.random.uniform(jax.random.key(9), (1, 8192)) < 6 / 8192
  seg = jnp.cumsum(eot.at[:, 2048].set(True), axis=1).astype(jnp.int32)
  args = (qkv, lam, ve, g, seg, jnp.int32(1792))

  def ours(qkv, lam, ve, g, seg, window):
    f = lambda qkv, lam, ve: flash_gpu.flash_gpu_qkv_attention(
        qkv, freq, 1e-6, lam, ve, scale=0.12, window=window, segment_ids_BT=seg, block=128)
    return vjp_of(f, qkv, lam, ve, g)
  cpu = jax.devices("cpu")[0]
  wide = jax.device_put([a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
                         for a in args], cpu)
  got, two = jax.jit(ours)(*args), reference(freq, True)(*args)
  exact = reference(freq, False)(*wide)  # on the CPU, where the inputs are
  rel = lambda x, t: np.linalg.norm(np.float32(x) - np.float32(t)) / np.linalg.norm(t)
  for x, y, t in zip(got, two, exact):
    assert np.isfinite(np.float32(x)).all()
    assert rel(x, t) <= 1.05 * rel(y, t), (x.shape, rel(x, t), rel(y, t))
    assert rel(x, y) <= 0.5 * rel(y, t), (x.shape, rel(x, y), rel(y, t))


def test_qk_rope_kernel_on_the_gpu_agrees_with_the_xla_path():
  """kernels/qk_rope.py compiled by Triton at the record's shape: q and k normalised and rotated,
  and the gradient of the whole QKV output, against the XLA path on the CPU with the norm's
  bf16 rounding made explicit (`lax.reduce_precision`, which autodiff applies to the cotangent
  too). Left implicit, XLA may skip it (`xla_allow_excess_precision`): the CPU's fusions do at
  this shape under jax 0.10.2, 16% of q's entries a bf16 step or more from the rounded
  arithmetic, and the first version of this test failed on that (2026-11-28, an H200). Apart
  in under 1 element in 1,000, and everywhere within 2 bf16 steps at the largest entry of its
  head's row: on the H200, 2e-5 of the entries apart, 1 step of the row's largest (2 in one
  gradient entry of 28 million); the worst at their own magnitude were sums cancelling to near
  zero (7.8e-8 against 1.0e-7 in a row up to 2.6). A wrong table, rounding or index is apart
  in a tenth of the entries or more."""
  from test_qk_rope import steps_apart, xla_path  # the CPU tests' rounded reference

  from nanotext.model.kernels import qk_rope
  from nanotext.model.rope import rope_frequencies
  qkv = (3 * jax.random.normal(jax.random.key(0), (1, 49152, 3, 6, 128))).astype(jnp.bfloat16)
  freq = rope_frequencies(128, 1024, True)
  gs = [jax.random.normal(jax.random.key(i + 1), (1, 49152, 6, 128)) for i in range(3)]
  xla = lambda x: xla_path(x, freq)

  def run(fn, device=None):
    loss = lambda x, *gs: sum(jnp.sum(o.astype(jnp.float32) * g) for o, g in zip(fn(x), gs))
    args = jax.device_put((qkv, *gs), device)
    return jax.jit(fn, device=device)(args[0]), jax.jit(jax.grad(loss), device=device)(*args)
  assert qk_rope.applies(49152, 128)  # the GPU program takes the kernel
  got = run(lambda x: qk_rope.norm_rope(x, freq, 1e-6))
  want = run(xla, jax.devices("cpu")[0])
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    apart = steps_apart(g, w)  # bf16 steps at the largest entry of the head's row
    assert (apart > 0).mean() < 1e-3 and apart.max() <= 2, ((apart > 0).mean(), apart.max())
