"""The FP8 head's forward kernel (Pallas; interpreted on CPU): the loss and its gradients equal
to the XLA path it replaces on a GPU, at test size, at the record's widths and under a mesh; when
it applies; what the memory plan holds for it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import mesh as conftest_mesh, opted_in
from nanotext import sharding
from nanotext.model import head_loss
from nanotext.model.kernels import fp8_head, per_device
from nanotext.model.layers import fp8_head_scales, rms_norm


opting_in = opted_in("fp8_head")


def inputs(N, D, V, seed=0):
  """Normalised bf16 rows (as the final norm's), head weights at the record's spread, targets."""
  kx, kw, ky = jax.random.split(jax.random.key(seed), 3)
  x = rms_norm(jax.random.normal(kx, (N, D))).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (D, V)) * 0.5 / np.sqrt(D)
  return x, w, jax.random.randint(ky, (N,), 0, V)


def loss_and_grads(x, w, y, kernel, monkeypatch, argnums=(0, 1)):
  """The record's head (FP8 at scale sqrt(d), soft-cap 15) through the kernel or XLA's path."""
  monkeypatch.setattr(fp8_head, "applies", lambda *shape: kernel)
  D = x.shape[-1]
  scales = fp8_head_scales(D, x.shape[0])
  f = lambda x, w: head_loss.head_loss_sum(x, w, y, softcap=15.0, fp8=scales,
                                           fp8_scale=np.sqrt(D)) / y.size
  return jax.jit(jax.value_and_grad(f, argnums=argnums))(x, w)


@pytest.mark.fast
def test_equals_the_xla_path_values_and_gradients(monkeypatch):
  x, w, y = inputs(256, 128, 384)
  (got, (gx, gw)) = loss_and_grads(x, w, y, True, monkeypatch)
  (want, (wx, ww)) = loss_and_grads(x, w, y, False, monkeypatch)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # The backward pass reads z: equal z gives equal gradients, which shows z is the XLA path's.
  np.testing.assert_array_equal(np.float32(gx), np.float32(wx))
  np.testing.assert_allclose(gw, ww, rtol=1e-6, atol=1e-9)


def test_at_the_records_widths(monkeypatch):
  """d_model 768 and 50,304 head rows, the record's scales: each token's exp-sum is 393 tiles'
  partial sums added, against one reduction over the row (the whole suite's: about 25 s of CPU
  interpreting 393 programs)."""
  x, w, y = inputs(128, 768, 50304, seed=1)
  (got, (gx,)) = loss_and_grads(x, w, y, True, monkeypatch, argnums=(0,))
  (want, (wx,)) = loss_and_grads(x, w, y, False, monkeypatch, argnums=(0,))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # The log-sum-exp summed in another order moves a few of the rows' [768] sums over 50,304
  # terms, each by a bf16 step taken at the row's largest value (a sum that cancels to near
  # zero is many steps of its own size apart).
  gx, wx = np.float32(gx), np.float32(wx)
  assert (gx != wx).mean() < 0.01, (gx != wx).mean()
  top = np.abs(wx).max(-1, keepdims=True).astype(jnp.bfloat16).astype(np.float32)
  step = np.spacing(top) * 2**16  # bf16's step at the row's largest
  assert np.all(np.abs(gx - wx) <= step), np.max(np.abs(gx - wx) / step)


def test_under_a_mesh_runs_per_device(monkeypatch):
  """Tokens split over data and fsdp: each device's kernel on its own rows, the codes whole."""
  m = conftest_mesh(data=2, fsdp=2)
  rules = sharding.parse_rules([["batch", ["data", "fsdp"]]])
  x, w, y = inputs(512, 128, 256, seed=2)
  x, y = x.reshape(4, 128, 128), y.reshape(4, 128)  # 4 rows of 128 tokens, one a device
  x = jax.device_put(x, jax.sharding.NamedSharding(m, jax.sharding.PartitionSpec(("data",
                                                                                "fsdp"))))
  with sharding.use_rules(rules, m):
    got = loss_and_grads(x, w, y, True, monkeypatch)
  want = loss_and_grads(x, w, y, False, monkeypatch)
  for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.float32(g), np.float32(v), rtol=1e-5, atol=1e-7)


@pytest.mark.fast
def test_a_mesh_that_splits_the_head_rows_keeps_xlas_path():
  """Tensor parallelism splits the head's rows: XLA's GEMM computes each device's part, where
  the kernel, per device on its tokens, would compute every row on every device."""
  rules = sharding.parse_rules([["batch", ["data", "fsdp"]], ["vocab", "tensor"]])
  a, b = jnp.zeros((512, 128), jnp.float8_e4m3fn), jnp.zeros((128, 256), jnp.float8_e4m3fn)
  fp8 = (1.0, 1.0, 1.0, 1.0)
  with per_device.building_for("gpu"):
    assert head_loss._uses_kernel(a, b, 15.0, fp8, jnp.bfloat16)
    with sharding.use_rules(rules, conftest_mesh(fsdp=2)):
      assert fp8_head.local_tokens(512) == 256
      assert head_loss._uses_kernel(a, b, 15.0, fp8, jnp.bfloat16)
    with sharding.use_rules(rules, conftest_mesh(fsdp=2, tensor=2)):
      assert fp8_head.local_tokens(512) == 0
      assert not head_loss._uses_kernel(a, b, 15.0, fp8, jnp.bfloat16)


@pytest.mark.fast
def test_applies_only_to_a_gpu_program_it_can_tile():
  assert not fp8_head.applies(4096, 768, 50304)  # this host: XLA's GEMM and fusion
  with per_device.building_for("gpu"):
    assert fp8_head.applies(4096, 768, 50304) and fp8_head.applies(128, 64, 128)
    assert not fp8_head.applies(4000, 768, 50304) and not fp8_head.applies(4096, 768, 50257)
    assert not fp8_head.applies(4096, 96, 50304)


@pytest.mark.fast
def test_the_plan_holds_partial_sums_not_float32_logits():
  """The record's one-GPU slice: 4,096 tokens; XLA's FP8 GEMM writes a float32 [4096, 50304]
  the plan holds in the forward pass; the kernel writes z and [4096, 393] partial sums, so the
  backward's two e5m2 layouts are the head's working set."""
  args = (1, 49152, 50304, 2, True, "gpu")
  assert head_loss.working_bytes(*args) == 4096 * 50304 * 4
  assert head_loss.working_bytes(*args, kernel=True) == 4096 * 50304 * 2
  assert head_loss.takes_kernel(1, 49152, 768, 50304, "bfloat16", 15.0, True, "gpu")
  assert not head_loss.takes_kernel(1, 49152, 768, 50304, "bfloat16", 15.0, True, "tpu")
  assert not head_loss.takes_kernel(1, 49152, 768, 50304, "bfloat16", 0.0, True, "gpu")
  assert not head_loss.takes_kernel(1, 49152, 768, 50304, "float32", 15.0, True, "gpu")
