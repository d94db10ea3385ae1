"""The CPU attention kernel agrees with the xla kernel and the explicit reference, forward and
backward, for every mask (causal, window, documents) and for blocks that do not divide T."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_attention import MASKS, SCALE, forward_and_grads, inputs, kernel, max_errors, reference
from nanotext.model.kernels.cpu import cpu_attention, key_range


@pytest.mark.parametrize("window,docs", MASKS)
@pytest.mark.parametrize("T,block", [(64, 16), (64, 24), (64, 64), (40, 128)])
def test_cpu_kernel_matches_xla_and_reference(T, block, window, docs):
  q, k, v, g, seg = inputs(T)
  kw = dict(scale=SCALE, window=window, segment_ids_BT=seg if docs else None)
  cpu = lambda q, k, v, **a: cpu_attention(q, k, v, block=block, **a)
  got = forward_and_grads(cpu, q, k, v, g, **kw)
  assert max(max_errors(got, forward_and_grads(reference, q, k, v, g, **kw))) < 2e-5
  assert max(max_errors(got, forward_and_grads(kernel("xla"), q, k, v, g, **kw))) < 2e-5


@pytest.mark.fast
def test_dispatch_and_bfloat16():
  q, k, v, g, seg = inputs(64)
  want = kernel("xla")(q, k, v, scale=SCALE, window=16, segment_ids_BT=seg)
  got = kernel("cpu")(q, k, v, scale=SCALE, window=16, segment_ids_BT=seg)
  np.testing.assert_allclose(got, want, atol=2e-5)
  bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  out = kernel("cpu")(*bf, scale=SCALE)
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(out.astype(jnp.float32), kernel("xla")(*bf, scale=SCALE).astype(
      jnp.float32), atol=3e-2)


@pytest.mark.fast
def test_blocks_skip_unseen_keys():
  assert key_range(0, 128, 0) == (0, 128)
  assert key_range(128, 256, 0) == (0, 256)  # causal: keys up to the block's last query
  assert key_range(256, 384, 100) == (157, 384)  # window: from the first query's oldest key
  # A jitted step holds no [T, T] score tensor: the largest is [B, H, 128, 256] at T = 256.
  q = jnp.zeros((1, 256, 1, 8))
  hlo = jax.jit(lambda q: cpu_attention(q, q, q, scale=1.0)).lower(q).as_text()
  assert "1x1x256x256" not in hlo and "1x1x128x256" in hlo
