"""flash_gpu with QK-norm and rotation inside its kernels (Pallas; interpreted on CPU): equal to
the two-kernel path it replaces (kernels/qk_rope.py, then flash_gpu) and to the XLA path, values
and gradients, v mixed with value embeddings, under a mesh, in the record's layers, and its
lowering to two Triton kernels for CUDA."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import SPEEDRUN, TRITON, cuda_mlir, mesh as conftest_mesh, opted_in
from test_flash_gpu import TILES, dense_mask, docs, errors
from test_qk_rope import assert_gradients_near, lm_loss_and_grads, xla_path

from nanotext import sharding, wiring
from nanotext.model.kernels import flash_gpu, flash_gpu_programs, qk_rope
from nanotext.model.kernels.dispatch import dot_product_attention, qkv_attention
from nanotext.model.layers import scaled_sum
from nanotext.model.rope import rope_frequencies


opting_in = opted_in("flash_gpu_qkv")
EPS, BLOCK = 1e-6, 128


def mix(v, lam, ve):
  """The record's value-embedding mix: lambdas[0] v (+ lambdas[1] ve)."""
  if lam is None:
    return v
  return scaled_sum((lam[0],), (v,)) if ve is None else scaled_sum((lam[0], lam[1]), (v, ve))


def inputs(shape, dtype, seed=0):
  """qkv [B, T, 3, H, K], lambdas, a value embedding and an output gradient."""
  B, T, _, H, K = shape
  keys = jax.random.split(jax.random.key(seed), 3)
  qkv = (3 * jax.random.normal(keys[0], shape, jnp.float32)).astype(dtype)
  ve = jax.random.normal(keys[1], (B, T, H, K), jnp.float32).astype(dtype)
  g = jax.random.normal(keys[2], (B, T, H, K), jnp.float32).astype(dtype)
  return qkv, jnp.array([0.7, 0.4], jnp.float32), ve, g


def vjp_of(f, qkv, lam, ve, g):
  """[f's output, and its gradient with respect to qkv, lam and ve (those given)]."""
  args = [a for a in (qkv, lam, ve) if a is not None]
  def apply(*a):
    a = list(a)
    return f(a.pop(0), a.pop(0) if lam is not None else None, a.pop(0) if ve is not None else None)
  out, vjp = jax.vjp(apply, *args)
  return [out, *vjp(g)]


def ours(freq, tiles=TILES):
  """Output and gradients with the norm, rotation and mix in the kernels."""
  def run(qkv, lam, ve, g, seg, window):
    f = lambda qkv, lam, ve: flash_gpu.flash_gpu_qkv_attention(
        qkv, freq, EPS, lam, ve, scale=0.12, window=window, segment_ids_BT=seg, block=BLOCK,
        tiles=tiles)
    return vjp_of(f, qkv, lam, ve, g)
  return jax.jit(run)


def reference(freq, kernel):
  """The same through a norm-and-rotation path (`kernel`: qk_rope's kernels, else XLA's), then
  the mix, then attention (flash_gpu with the same tiles, or einsum)."""
  def run(qkv, lam, ve, g, seg, window):
    def f(qkv, lam, ve):
      q, k, v = qk_rope.norm_rope(qkv, freq, EPS) if kernel else xla_path(qkv, freq, EPS)
      v = mix(v, lam, ve)
      if kernel:
        return flash_gpu.flash_gpu_attention(q, k, v, scale=0.12, window=window,
                                             segment_ids_BT=seg, block=BLOCK, tiles=TILES)
      return dot_product_attention(q, k, v, impl="einsum", scale=0.12, segment_ids_BT=seg,
                                   block=BLOCK, runtime_window=window)
    return vjp_of(f, qkv, lam, ve, g)
  return jax.jit(run)


@pytest.mark.fast
@pytest.mark.parametrize("window,block", [(0, 0), (100, 0), (256, 128), (96, 32)])
def test_a_programs_mask_is_the_records(window, block):
  """What one program masks token by token (kernels/flash_gpu_programs.py): causal, within
  documents, token or block windows; a window of 0 is none."""
  seg = docs(512, 3)
  t = jnp.arange(512, dtype=jnp.int32)
  for b in range(seg.shape[0]):
    got = flash_gpu_programs.visible(t, t, jnp.asarray(seg[b]), jnp.asarray(seg[b]),
                                     jnp.int32(window), block)
    np.testing.assert_array_equal(got, dense_mask(seg, window, block)[b])


@pytest.mark.parametrize("truncate", [True, False])
def test_equals_the_two_kernel_path_and_the_xla_path_in_float32(truncate):
  """float32, 512 tokens with documents, block windows of 1 to 3 blocks and none: the norm,
  rotation and value mix inside the attention kernels give what the separate kernel and the XLA
  path give, gradients of the lambdas and the value embedding included."""
  shape = (2, 512, 3, 2, 64)
  freq = rope_frequencies(64, 1024, truncate)
  qkv, lam, ve, g = inputs(shape, jnp.float32)
  mine, two, xla = ours(freq), reference(freq, True), reference(freq, False)
  # the mix of the record's first and last layers, of its middle ones, of a model without (each
  # its own compile: the full rotation at the record's mix only)
  mixes = [(lam, ve), (lam[:1], None), (None, None), (lam, ve)] if truncate else [(lam, ve)] * 2
  for seed, (window, (l, e)) in enumerate(zip((128, 256, 384, 0), mixes)):
    seg = jnp.asarray(docs(512, seed, edges=seed % 2 == 0))
    args = (qkv, l, e, g, seg, jnp.int32(window))
    got = mine(*args)
    assert len(got) == 2 + (l is not None) + (e is not None)
    assert max(errors(got, two(*args))) < 2e-5, window
    assert max(errors(got, xla(*args))) < 2e-5, window


def test_is_as_close_to_float32_as_the_two_kernel_path_in_bf16_at_the_records_head_dim():
  """bf16, head_dim 128 with the half-truncated rotation, 6 heads, the value embedding mixed in:
  output and gradients as far from the float32 computation as the two-kernel path's (measured
  0.36-0.48% in norm, both), and apart from those by a fraction of it (0.004-0.15%): float32
  sums taken in another order (q k^T as two halves, the mix fused) that round to another bf16
  here and there, not another arithmetic."""
  shape = (1, 256, 3, 6, 128)
  freq = rope_frequencies(128, 1024, True)
  qkv, lam, ve, g = inputs(shape, jnp.bfloat16, seed=1)
  args = (qkv, lam, ve, g, jnp.asarray(docs(256, 1))[:1], jnp.int32(128))
  wide = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args]
  got, two, exact = ours(freq)(*args), reference(freq, True)(*args), \
      reference(freq, False)(*wide)
  rel = lambda x, t: np.linalg.norm(np.float32(x) - np.float32(t)) / np.linalg.norm(t)
  for x, y, t in zip(got, two, exact):
    assert x.dtype == y.dtype and x.shape == y.shape
    assert rel(x, t) <= 1.05 * rel(y, t), (x.shape, rel(x, t), rel(y, t))
    assert rel(x, y) <= 0.5 * rel(y, t), (x.shape, rel(x, y), rel(y, t))


def test_under_a_mesh_runs_per_device():
  """Batch over fsdp and heads over tensor: each device's kernels on their own heads, the mix
  and its lambdas' gradient outside them as XLA partitions it."""
  m = conftest_mesh(fsdp=2, tensor=2)
  rules = sharding.parse_rules([["batch", ["data", "fsdp"]], ["act_heads", "tensor"]])
  shape = (2, 256, 3, 4, 32)
  freq = rope_frequencies(32, 1024, True)
  qkv, lam, ve, g = inputs(shape, jnp.float32, seed=2)
  put = lambda x, *spec: jax.device_put(x, jax.sharding.NamedSharding(
      m, jax.sharding.PartitionSpec(*spec)))
  qkv = put(qkv, "fsdp", None, None, "tensor", None)
  ve, g = (put(x, "fsdp", None, "tensor", None) for x in (ve, g))
  seg = put(jnp.asarray(docs(256, 5)), "fsdp", None)
  args = (qkv, lam, ve, g, seg, jnp.int32(128))
  with sharding.use_rules(rules, m):
    got = ours(freq)(*args)
  assert max(errors(got, reference(freq, False)(*args))) < 2e-5
  assert got[1].sharding.spec[:4] == ("fsdp", None, None, "tensor")  # the qkv gradient


@pytest.mark.parametrize("residual", [False, True])
def test_the_records_layers_train_the_same_through_it(monkeypatch, residual):
  """The speedrun model (merged QKV, QK-norm, half-truncated rotation, value embeddings) in
  float32 through flash_gpu: loss and every parameter's gradient with the norm, rotation and mix
  inside the attention kernels equal those with the XLA path before them. With a value residual
  (its bf16 mix is not the kernels') the layers keep the XLA path."""
  run = wiring.prepare(SPEEDRUN, [
      "model.num_layers=4", "model.d_model=128", "model.num_heads=2", "model.head_dim=64",
      "model.mlp_dim=256", "model.vocab_size=256", "model.align=0", "model.embed_rows=256",
      "train.seq_len=256", "train.batch_size=2", "model.fp8_head=false", "model.dtype=float32",
      "model.zero_init_head=false", "model.zero_init_proj=false", "attention.impl=flash_gpu",
      "attention.window=256", "attention.window_block=128", f"model.value_residual={residual}"],
      devices=jax.devices()[:1])
  model = run.create_model(0)
  graphdef, params = nnx.split(model, nnx.Param)
  tokens = jax.random.randint(jax.random.key(3), (2, 257), 0, 256)
  calls = []
  real = flash_gpu.flash_gpu_qkv_attention
  monkeypatch.setattr(flash_gpu, "flash_gpu_qkv_attention",
                      lambda *a, **kw: calls.append(1) or real(*a, **kw))

  def loss_and_grads(in_kernel):
    monkeypatch.setattr(qk_rope, "applies", lambda T, K: in_kernel)

    return lm_loss_and_grads(graphdef, params, tokens)

  (l_got, g_got), (l_want, g_want) = loss_and_grads(True), loss_and_grads(False)
  assert len(calls) == (0 if residual else 4), "which layers took the kernels' norm and mix"
  assert float(l_got) == pytest.approx(float(l_want), rel=1e-6)
  # Sums in another order, and the bf16 the recipe keeps (the tables' rows) round them; a
  # wrong rotation, norm or gradient route is off by whole percents at least.
  assert_gradients_near(g_got, g_want, peak=1e-2, norm=1e-3)


@pytest.mark.fast
@pytest.mark.gpu_compile
def test_lowers_to_two_triton_kernels_for_cuda(monkeypatch):
  """Built for CUDA from this CPU host (jax.export): forward and backward, value embedding
  mixed in, are flash_gpu's two Triton kernels: no QK-norm kernel of its own, no concatenation
  or placement of q's, k's and v's gradients."""
  from nanotext.model.kernels import per_device
  monkeypatch.setattr(flash_gpu, "platform", lambda: "gpu")
  monkeypatch.setattr(per_device, "_target", ["gpu"])
  T = 1024
  freq = rope_frequencies(128, 1024, True)
  ve = jnp.ones((1, T, 2, 128), jnp.bfloat16)
  loss = lambda x, lam: qkv_attention(x, freq, EPS, lam, ve, scale=0.12, window=256,
                                      block=128).astype(jnp.float32).sum()
  text = cuda_mlir(jax.value_and_grad(loss, argnums=(0, 1)),
                   jax.ShapeDtypeStruct((1, T, 3, 2, 128), jnp.bfloat16),
                   jax.ShapeDtypeStruct((2,), jnp.float32))
  assert text.count(f"custom_call @{TRITON}") == 2
  for name in ("flash_gpu_forward", "flash_gpu_backward"):
    assert f'name = "{name}"' in text
  assert "qk_norm_rope" not in text
  assert not re.search(r"concatenate[^\n]*-> tensor<[^>]*bf16>", text)  # (the tables' are ints)
  assert "dynamic_update_slice" not in text
