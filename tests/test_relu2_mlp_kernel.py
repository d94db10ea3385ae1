"""The squared ReLU inside the MLP's GEMMs (kernels/relu2_mlp.py, Pallas; interpreted on CPU): the
MLP's output and gradients equal to the XLA path it replaces on a GPU, at test size, at the record's
widths, under a mesh and under remat; when it applies."""

import jax
import ml_collections
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import mesh as conftest_mesh, opted_in
from nanotext import sharding
from nanotext.model import Keys, gpt, layers
from nanotext.model.kernels import per_device
from nanotext.model.kernels import relu2_mlp as kernels


opting_in = opted_in("relu2_mlp")


def inputs(B, T, D, F, seed=0):
  """Normalised bf16 rows (as the MLP's norm gives them), weights at the record's init spread."""
  kx, k1, k2, kg = jax.random.split(jax.random.key(seed), 4)
  x = layers.rms_norm(jax.random.normal(kx, (B, T, D))).astype(jnp.bfloat16)
  w1 = (jax.random.normal(k1, (D, F)) * 0.5 / np.sqrt(D)).astype(jnp.bfloat16)
  w2 = (jax.random.normal(k2, (F, D)) * 0.5 / np.sqrt(F)).astype(jnp.bfloat16)
  return x, w1, w2, jax.random.normal(kg, (B, T, D)).astype(jnp.bfloat16)


def xla_mlp(x, w1, w2):
  """gpt.MLP's XLA path for relu2, no bias."""
  h = sharding.constrain(layers.matmul(x, w1), ("batch", "act_length", "act_mlp"))
  return layers.matmul(jnp.square(jax.nn.relu(h)), w2)


def out_and_grads(fn, x, w1, w2, dy):
  y, vjp = jax.vjp(fn, x, w1, w2)
  return [np.float32(a) for a in (y, *vjp(dy))]


def assert_rounding_apart(got, want, share=1e-3):
  """Equal but for a few entries a rounding apart: the kernels sum their K blocks of 64 in
  float32 in another order than XLA's dot, which moves a bf16 rounding of h or da now and then
  (at the record's widths, measured: 0.015% of h; then 0.19% of the output, 0.51% of dx, 0.10%
  of dw1, 0.04% of dw2 differ, by at most 0.36% of the array's largest entry). A rounding is
  counted in bf16 steps at that entry, not as a share of it: one step is 0.39-0.78% of a value by
  where it sits in its binade, so a bound of 0.5% failed a single flip (seed 3's output: 1.0
  step, 0.515%); two steps allow the flip of h and that of the output."""
  assert (got != want).mean() <= share, (got != want).mean()
  top = np.max(np.abs(want))
  step = np.spacing(np.float32(jnp.bfloat16(top))) * 2**16  # bf16's step at the largest entry
  assert np.max(np.abs(got - want)) <= 2 * step, (np.max(np.abs(got - want)), top)


@pytest.mark.fast
def test_equals_the_xla_path_values_and_gradients():
  x, w1, w2, dy = inputs(2, 128, 128, 384)
  got = out_and_grads(jax.jit(layers.relu2_mlp), x, w1, w2, dy)
  want = out_and_grads(jax.jit(xla_mlp), x, w1, w2, dy)
  np.testing.assert_array_equal(got[0], want[0])  # h and relu(h)^2 as XLA rounds them
  for g, w in zip(got[1:], want[1:]):
    assert_rounding_apart(g, w)
  # Without a backward pass the kernel writes relu(h)^2 alone; the output is the same.
  np.testing.assert_array_equal(np.float32(jax.jit(layers.relu2_mlp)(x, w1, w2)), want[0])
  assert len(jax.jit(lambda *a: kernels.up(*a, keep_h=False))(x, w1)) == 1


def test_at_the_records_widths():
  """d_model 768 and mlp 3,072 (the record's), 256 tokens: each tile sums 12 K blocks."""
  x, w1, w2, dy = inputs(1, 256, 768, 3072, seed=1)
  got = out_and_grads(jax.jit(layers.relu2_mlp), x, w1, w2, dy)
  want = out_and_grads(jax.jit(xla_mlp), x, w1, w2, dy)
  for g, w in zip(got, want):
    assert_rounding_apart(g, w, share=0.01)


def test_under_a_mesh_runs_per_device():
  """Tokens over data and fsdp, the MLP's columns over tensor: each device's kernels on its own
  rows and columns, the weights' other axis gathered."""
  m = conftest_mesh(data=2, fsdp=2, tensor=2)
  rules = sharding.parse_rules([["batch", ["data", "fsdp"]], ["act_mlp", "tensor"],
                                ["mlp", "tensor"], ["embed", "fsdp"]])
  x, w1, w2, dy = inputs(4, 128, 128, 512, seed=2)
  with sharding.use_rules(rules, m):
    assert kernels.local_sizes(x, 512) == (128, 128, 256)
    got = out_and_grads(jax.jit(layers.relu2_mlp), x, w1, w2, dy)
    want = out_and_grads(jax.jit(xla_mlp), x, w1, w2, dy)  # its partial sums added alike
  np.testing.assert_array_equal(got[0], want[0])
  for g, w in zip(got[1:], want[1:]):
    assert_rounding_apart(g, w)


@pytest.mark.parametrize("policy", ["full", "dots"])
def test_under_remat_the_gradients_are_the_same(policy):
  x, w1, w2, dy = inputs(1, 128, 128, 256, seed=3)
  plain = out_and_grads(jax.jit(layers.relu2_mlp), x, w1, w2, dy)
  remat = jax.checkpoint(layers.relu2_mlp, policy=gpt.REMAT_POLICIES[policy])
  for g, w in zip(out_and_grads(jax.jit(remat), x, w1, w2, dy), plain):
    np.testing.assert_array_equal(g, w)


@pytest.mark.fast
def test_applies_only_to_a_bf16_gpu_program_it_can_tile():
  x = jnp.zeros((2, 1024, 768), jnp.bfloat16)
  assert not kernels.applies(x, 3072)  # this host: XLA's GEMMs and fusions
  with per_device.building_for("gpu"):
    assert kernels.applies(x, 3072) and kernels.applies(x[:, :64], 128)
    assert not kernels.applies(x.astype(jnp.float32), 3072)
    assert not kernels.applies(x[:, :63], 3072) and not kernels.applies(x, 3000)
    assert not kernels.applies(x[..., :96], 3072)


@pytest.mark.fast
def test_the_model_takes_it_for_relu2_without_bias_or_remat_dots():
  """gpt.MLP on a GPU: relu2 through the kernels; GELU, a bias or remat=dots (which would
  recompute the kernel's GEMM) through XLA's path."""
  base = dict(d_model=128, mlp_dim=256, mlp_act="relu2", bias=False, remat="none",
              dtype="bfloat16", param_dtype="float32", init_std=0.0, zero_init_proj=False,
              num_layers=2, init_dist="normal")
  x = jnp.ones((1, 128, 128), jnp.bfloat16)

  def kernel_calls(**change):
    cfg = ml_collections.ConfigDict(dict(base, **change))
    mlp = gpt.MLP(cfg, rngs=Keys(jax.random.key(0)))
    with per_device.building_for("gpu"):
      return str(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(mlp(x))))(x)).count("pallas_call")
  assert kernel_calls() == 2  # up (h and relu(h)^2) and the gradient
  assert kernel_calls(mlp_act="gelu") == kernel_calls(bias=True) == 0
  assert kernel_calls(remat="dots") == 0 and kernel_calls(remat="full") == 2
