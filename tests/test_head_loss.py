"""The fused head + soft-cap + cross-entropy against autodiff of the unfused computation, and the
passes it makes over the [tokens, vocab] logits."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from nanotext.model.head_loss import head_loss_sum, takes_kernel
from nanotext.model.layers import fp8_head_scales, fp8_matmul, rms_norm

pytestmark = pytest.mark.fast


def unfused(x, w, y, softcap, fp8, r=1.0):
  """The head and loss as autodiff sees them: logits, soft-cap, optax's cross-entropy; the FP8
  head run at scale r (z = x (r w) in x's dtype, logits z / r)."""
  if fp8:
    x_s, w_s, grad_s = fp8
    z = fp8_matmul(x, w * r, x_s, w_s * r, grad_s / r)
  else:
    z = jnp.dot(x, w.astype(x.dtype))
  logits = z.astype(jnp.float32) / r
  logits = softcap * jnp.tanh(logits / softcap) if softcap else logits
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).sum()


def inputs(dtype, N=256, D=64, V=512):
  kx, kw, ky = jax.random.split(jax.random.key(0), 3)
  x = rms_norm(jax.random.normal(kx, (N, D))).astype(dtype)
  w = jax.random.normal(kw, (D, V)) * 3 / np.sqrt(D)
  return x, w, jax.random.randint(ky, (N,), 0, V)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("softcap", [0.0, 15.0])
@pytest.mark.parametrize("dtype,fp8,r", [("float32", False, 1.0), ("bfloat16", False, 1.0),
                                         ("bfloat16", True, 1.0), ("bfloat16", True, 8.0)])
def test_value_and_gradients_match_autodiff(softcap, dtype, fp8, r):
  x, w, y = inputs(jnp.dtype(dtype))
  scales = fp8_head_scales(x.shape[1], x.shape[0]) if fp8 else None
  # The mean's gradient scale (1 / N), as the train step feeds the FP8 head.
  ours = jax.value_and_grad(lambda x, w: head_loss_sum(x, w, y, softcap=softcap, fp8=scales,
                                                       fp8_scale=r) / x.shape[0],
                            argnums=(0, 1))(x, w)
  want = jax.value_and_grad(lambda x, w: unfused(x, w, y, softcap, scales, r) / x.shape[0],
                            argnums=(0, 1))(x, w)
  tol = 1e-6 if dtype == "float32" else 1e-2  # bf16: z and its gradient rounded alike, sums apart
  np.testing.assert_allclose(ours[0], want[0], rtol=1e-6)
  for a, b in zip(ours[1], want[1]):
    assert a.dtype == b.dtype and rel(a, b) < tol, (rel(a, b), a.dtype)


@pytest.mark.parametrize("softcap", [30.0, 100.0, 1000.0])
def test_a_large_softcap_gives_a_finite_loss(softcap):
  """Soft-capped logits were summed as exp(l) without subtracting the max, safe only for a cap
  below ~88: a logit of 120 under model.logit_softcap=1000 made the loss inf."""
  x = jnp.ones((4, 8), jnp.float32) * 5.0
  w = jnp.zeros((8, 16), jnp.float32).at[:, 3].set(3.0)  # the logit of class 3 is 120
  y = jnp.array([3, 3, 0, 1])
  got = jax.value_and_grad(lambda x, w: head_loss_sum(x, w, y, softcap=softcap),
                           argnums=(0, 1))(x, w)
  want = jax.value_and_grad(lambda x, w: unfused(x, w, y, softcap, None), argnums=(0, 1))(x, w)
  assert np.isfinite(got[0]) and np.allclose(got[0], want[0], rtol=1e-6)
  for a, b in zip(got[1], want[1]):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  # the FP8 kernel sums exp(l) in its epilogue: a cap past the bound takes XLA's path instead
  takes = takes_kernel(1, 1024, 768, 50304, "bfloat16", softcap, True, "gpu")
  assert takes == (softcap <= 64)


def logits_sized_ops(hlo: str, n: int, v: int) -> int:
  """Instructions of the optimised HLO's entry computation whose result is a whole [n, v] array:
  each is one pass over the logits (a fusion, a matmul, a convert the compiler left alone)."""
  entry = hlo[hlo.index("ENTRY"):]
  pattern = re.compile(rf"= [a-z0-9]+\[{n},{v}\]")
  return sum(1 for line in entry.splitlines() if pattern.search(line))


@pytest.mark.parametrize("fp8", [False, True])
def test_fewer_passes_over_the_logits(fp8):
  """Value and gradient of the soft-capped loss: the fused function writes fewer [N, V] arrays
  than autodiff of the unfused one (counted in the compiled CPU program)."""
  N, V = 512, 1024
  x, w, y = inputs(jnp.bfloat16, N=N, V=V)
  scales = fp8_head_scales(x.shape[1], N) if fp8 else None
  def count(fn):
    grad = jax.jit(jax.value_and_grad(fn, argnums=(0, 1)))
    return logits_sized_ops(grad.lower(x, w).compile().as_text(), N, V)
  fused = count(lambda x, w: head_loss_sum(x, w, y, softcap=15.0, fp8=scales))
  plain = count(lambda x, w: unfused(x, w, y, 15.0, scales))
  print(f"[{N}, {V}] arrays written: fused {fused}, autodiff {plain}")
  assert fused < plain


@pytest.mark.parametrize("softcap", [0.0, 15.0])
def test_forward_keeps_one_logits_sized_array(softcap):
  """The eval forward as a fusing compiler sees it (nanotext.fusion, which the memory plan uses):
  only the head's output is [N, V]; a no-op rescale of it once made a second float32 copy that
  the plan counted, refusing eval steps at twice their size."""
  from nanotext.fusion import peak_live
  N, D, V = 512, 64, 1024
  x, w, y = inputs(jnp.float32, N=N, D=D, V=V)
  closed = jax.make_jaxpr(lambda x, w: head_loss_sum(x, w, y, softcap=softcap))(x, w)
  peak = peak_live(closed.jaxpr, lambda a: a.size * a.dtype.itemsize)
  assert N * V * 4 <= peak < 1.1 * N * V * 4


@pytest.mark.parametrize("fp8", [False, True])
def test_sliced_as_a_loop_with_the_unrolled_results(fp8, monkeypatch):
  """Past head_loss.UNROLL slices the training step loops over them (one traced body): value and
  gradients equal to the same slices unrolled (here 4 slices, UNROLL moved below them)."""
  from nanotext.model import head_loss
  x, w, y = inputs(jnp.bfloat16 if fp8 else jnp.float32, N=512)
  scales = fp8_head_scales(x.shape[1], 512) if fp8 else None
  fp8_args = (*scales, 8.0) if fp8 else None
  x, y = x.reshape(2, 256, -1), y.reshape(2, 256)

  def grads(unroll):
    monkeypatch.setattr(head_loss, "UNROLL", unroll)
    loss = lambda x, w: head_loss._fused(x, w, head_loss.weight_operand(w, x.dtype, scales, 8.0),
                                         y, 15.0, fp8_args, 4) / 512
    closed = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    return closed, jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
  (looped_jaxpr, looped), (unrolled_jaxpr, unrolled) = grads(0), grads(4)
  assert "scan" in str(looped_jaxpr) and "scan" not in str(unrolled_jaxpr)
  np.testing.assert_allclose(looped[0], unrolled[0], rtol=1e-6)
  for a, b in zip(looped[1], unrolled[1]):
    assert a.dtype == b.dtype and a.shape == b.shape
    # float32: equal to round-off; bf16 dx: a few entries one bf16 rounding apart
    assert rel(a, b) < (1e-4 if fp8 else 1e-6), rel(a, b)


def test_more_slices_than_unroll_trace_one_loop_body(monkeypatch):
  """speedrun.yml's head at 512 rows of 49,152 tokens per device: 1,536 slices, traced as one
  loop body (abstract shapes: nothing that size is made)."""
  from nanotext.model import head_loss
  B, T, D, V = 512, 49152, 768, 50304
  assert head_loss.slices(B, T, V, "tpu") > head_loss.UNROLL >= head_loss.slices(1, T, V, "gpu")
  x = jax.ShapeDtypeStruct((B, T, D), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((D, V), jnp.float32)
  y = jax.ShapeDtypeStruct((B, T), jnp.int32)
  monkeypatch.setattr(head_loss, "platform", lambda: "tpu")
  closed = jax.make_jaxpr(jax.grad(lambda x, w, y: head_loss_sum(x, w, y, softcap=15.0),
                                   argnums=(0, 1)))(x, w, y)
  text = str(closed)
  assert text.count("scan[") == 2 and text.count("dot_general") < 10
