"""Attention kernels: masks, the xla / splash / cudnn dispatch, and `auto` resolution (CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE, mesh as conftest_mesh

from nanotext.errors import UserError
from nanotext.model.kernels import cudnn, splash
from nanotext.model.kernels.dispatch import config_impl, dot_product_attention, resolve_impl
from nanotext.model.kernels.masks import segment_ids_from_tokens

B, H, K = 2, 2, 32
SCALE = 0.7 / np.sqrt(K)  # not 1/sqrt(K), so a kernel that applies its own default scale fails

# (window, documents?) -- causal, sliding window, document-causal, and both.
MASKS = [(0, False), (16, False), (0, True), (16, True)]


def inputs(T, seed=0):
  """Random q, k, v [B, T, H, K], an output cotangent, and segment ids with 2-4 documents."""
  keys = jax.random.split(jax.random.key(seed), 4)
  q, k, v, g = (jax.random.normal(kk, (B, T, H, K), jnp.float32) for kk in keys)
  rng = np.random.RandomState(seed)
  tokens = rng.randint(1, 50, (B, T))
  tokens[0, [0, T // 3, T // 2]] = 0  # example 0 starts with EOT: documents 1..3
  tokens[1, [T // 4, T - 5]] = 0      # example 1 does not: documents 0..2
  return q, k, v, g, segment_ids_from_tokens(jnp.asarray(tokens), 0)


def reference(q_BTHK, k_BTHK, v_BTHK, *, scale, window=0, segment_ids_BT=None):
  """Softmax of explicitly masked float32 scores; no kernel, no window normalisation."""
  T = q_BTHK.shape[1]
  s_BHTS = jnp.einsum("bthk,bshk->bhts", q_BTHK, k_BTHK, precision="highest") * scale
  t, s = np.arange(T)[:, None], np.arange(T)[None, :]
  mask_TS = (s <= t) & ((t - s < window) if window else True)
  mask_BHTS = jnp.broadcast_to(mask_TS, (B, 1, T, T))
  if segment_ids_BT is not None:
    mask_BHTS = mask_BHTS & (segment_ids_BT[:, None, :, None] == segment_ids_BT[:, None, None, :])
  p_BHTS = jax.nn.softmax(jnp.where(mask_BHTS, s_BHTS, -jnp.inf), axis=-1)
  return jnp.einsum("bhts,bshk->bthk", p_BHTS, v_BTHK, precision="highest")


def forward_and_grads(fn, q, k, v, g, **kw):
  """fn's output and d(sum(out * g))/d(q, k, v), as one compiled program (run op by op, a
  kernel's loop over blocks compiles each op of each block as a program of its own)."""
  arrays = {name: kw.pop(name) for name in ["segment_ids_BT"]  # jit inputs, where given
            if kw.get(name) is not None}

  def both(q, k, v, g, arrays):
    f = lambda q, k, v: fn(q, k, v, **arrays, **kw)
    return f(q, k, v), jax.grad(lambda *a: jnp.sum(f(*a) * g), argnums=(0, 1, 2))(q, k, v)
  return jax.jit(both)(q, k, v, g, arrays)


def max_errors(a, b):
  """Max abs difference of the outputs and of each gradient."""
  (oa, ga), (ob, gb) = a, b
  return [float(jnp.max(jnp.abs(x - y))) for x, y in zip((oa, *ga), (ob, *gb))]


def kernel(impl):
  """dot_product_attention bound to one impl, with the reference's keyword names."""
  return lambda q, k, v, **kw: dot_product_attention(q, k, v, impl=impl, **kw)


@pytest.mark.parametrize("window,docs", MASKS)
def test_xla_matches_reference(window, docs):
  q, k, v, g, seg = inputs(64)
  kw = dict(scale=SCALE, window=window, segment_ids_BT=seg if docs else None)
  errs = max_errors(forward_and_grads(kernel("xla"), q, k, v, g, **kw),
                    forward_and_grads(reference, q, k, v, g, **kw))
  assert max(errs) < 1e-5, errs


# Splash (interpret mode) against xla. Tolerance 5e-5 absolute: splash is a flash kernel (online
# softmax over kv blocks, backward recomputing probabilities from the saved logsumexp, q pre-scaled
# before the dot product), so its float32 round-off differs from xla's one-shot softmax; observed
# max errors are <= 5e-7 forward and <= 2e-6 for gradients of O(1) size (10x+ headroom).
SPLASH_TOL = 5e-5


@pytest.mark.parametrize("window,docs", MASKS)
def test_splash_matches_xla(window, docs):
  q, k, v, g, seg = inputs(128, seed=1)
  kw = dict(scale=SCALE, window=window, segment_ids_BT=seg if docs else None)
  errs = max_errors(forward_and_grads(kernel("splash"), q, k, v, g, **kw),
                    forward_and_grads(kernel("xla"), q, k, v, g, **kw))
  assert max(errs) < SPLASH_TOL, errs


def test_splash_multi_block(monkeypatch):
  """T=256 in 128-wide blocks: the block-sparse tables skip and partially mask whole tiles."""
  monkeypatch.setattr(splash, "block_size", lambda T: 128)
  q, k, v, g, seg = inputs(256, seed=2)
  kw = dict(scale=SCALE, window=40, segment_ids_BT=seg)
  errs = max_errors(forward_and_grads(kernel("splash"), q, k, v, g, **kw),
                    forward_and_grads(reference, q, k, v, g, **kw))
  assert max(errs) < SPLASH_TOL, errs


def test_splash_rejects_untileable_length():
  q, k, v, _, _ = inputs(64)
  with pytest.raises(UserError, match="attention.impl=splash"):
    dot_product_attention(q, k, v, impl="splash", scale=SCALE)
  with pytest.raises(UserError, match="multiple of 128"):
    resolve_impl("splash", "cpu", seq_len=200)


@pytest.mark.parametrize("impl,backend", [("splash", "gpu"), ("flash", "gpu"), ("flash_gpu", "tpu")])
def test_a_kernel_for_the_other_accelerator_is_refused(impl, backend):
  """compile --topology=h100 with attention.impl=splash said 'fits' for a program that runs the
  kernel in Pallas's interpreter; on CPU the interpreter is the tests' path and stays."""
  with pytest.raises(UserError, match=f"attention.impl={impl} is a .* kernel: on a "
                                      f"{backend.upper()} it runs in Pallas's interpreter"):
    resolve_impl(impl, backend, head_dim=128, seq_len=1024)
  assert resolve_impl(impl, "cpu", head_dim=128, seq_len=1024) == impl


def test_window_at_least_T_is_causal():
  q, k, v, g, _ = inputs(64)
  causal = forward_and_grads(kernel("xla"), q, k, v, g, scale=SCALE)
  for window in (64, 1000):
    assert max(max_errors(forward_and_grads(kernel("xla"), q, k, v, g, scale=SCALE,
                                            window=window), causal)) == 0.0
    assert max(max_errors(forward_and_grads(reference, q, k, v, g, scale=SCALE, window=window),
                          causal)) < 1e-5


@pytest.mark.fast
def test_single_document_equals_no_documents():
  q, k, v, _, _ = inputs(64)
  one_doc = jnp.zeros((B, 64), jnp.int32)
  a = dot_product_attention(q, k, v, impl="xla", scale=SCALE, segment_ids_BT=one_doc)
  b = dot_product_attention(q, k, v, impl="xla", scale=SCALE)
  np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.fast
def test_window_must_be_static():
  q, k, v, _, _ = inputs(64)
  with pytest.raises(TypeError, match="static"):
    jax.jit(lambda w: dot_product_attention(q, k, v, impl="xla", scale=SCALE, window=w))(8)


@pytest.mark.fast
def test_segment_ids_from_tokens():
  eot = 0
  tokens = jnp.array([[0, 5, 6, 0, 7, 0],
                      [4, 5, 0, 0, 6, 7]])
  expected = [[1, 1, 1, 2, 2, 3],
              [0, 0, 1, 2, 2, 2]]
  ids = segment_ids_from_tokens(tokens, eot)
  assert ids.dtype == jnp.int32
  np.testing.assert_array_equal(ids, expected)


@pytest.mark.fast
def test_cudnn_on_cpu_is_a_user_error():
  with pytest.raises(UserError, match=r"attention\.impl=cudnn.*cpu"):
    resolve_impl("cudnn", "cpu")
  q, k, v, _, _ = inputs(64)
  with pytest.raises(UserError, match=r"attention\.impl=cudnn.*cpu"):
    dot_product_attention(q, k, v, impl="cudnn", scale=SCALE)


@pytest.mark.fast
def test_auto_resolution():
  assert resolve_impl("auto", "cpu") == "cpu"  # faster than xla's full scores on CPU
  assert resolve_impl("auto", jax.default_backend()) == "cpu"
  assert resolve_impl("auto", "tpu", seq_len=1024) == "splash"
  assert resolve_impl("auto", "tpu", seq_len=100) == "xla"
  # On a GPU backend auto follows a trial trace of cuDNN (which fails on a CPU-only jax, so xla).
  cudnn_ok = cudnn.problem(64, 128) is None
  assert resolve_impl("auto", "gpu", head_dim=64, seq_len=128) == ("cudnn" if cudnn_ok else "xla")
  assert resolve_impl("auto", "gpu", head_dim=12, seq_len=128) == "xla"  # cuDNN wants K % 8 == 0
  assert resolve_impl("xla", "tpu") == "xla"
  with pytest.raises(UserError, match="attention.impl='flash2'"):
    resolve_impl("flash2", "cpu")


def config_kernel(backend, *overrides):
  """config_impl of base.yml at 256-token rows and `overrides` on `backend`."""
  from nanotext import wiring
  return config_impl(wiring.load(BASE, ["train.seq_len=256", *overrides]), backend)


@pytest.mark.fast
def test_auto_takes_a_kernel_that_tiles_every_row_length():
  """auto resolved on train.seq_len alone, then refused the validation or warmup rows that its
  kernel could not tile, advising 'auto', which was set: it takes what tiles them all."""
  assert config_kernel("tpu") == "splash"
  assert config_kernel("tpu", "train.eval_seq_len=200") == "xla"
  assert config_kernel("tpu", "train.seq_len_start=64") == "xla"
  assert config_kernel("tpu", "attention.window=128", "attention.block_windows=true",
                       "train.eval_seq_len=200") == "blocked"
  docs = ["attention.doc_mask=true", "model.num_heads=2", "model.d_model=128"]
  assert config_kernel("gpu", *docs) == "flash_gpu"
  assert config_kernel("gpu", *docs, "train.eval_seq_len=200") in ("cudnn", "xla")
  with pytest.raises(UserError, match=r"splash needs train\.eval_seq_len .*got 200.*or auto$"):
    config_kernel("tpu", "attention.impl=splash", "train.eval_seq_len=200")
  with pytest.raises(UserError, match=r"flash_gpu cannot tile train\.eval_seq_len=200"):
    config_kernel("gpu", *docs, "attention.impl=flash_gpu", "train.eval_seq_len=200")


@pytest.mark.fast
def test_a_model_max_seq_len_the_kernel_cannot_tile_is_refused_before_training():
  """The sampler's context slides at model.max_seq_len tokens: one a Pallas kernel could not
  tile trained, evaluated and saved, then failed at the sample naming train.seq_len=320."""
  docs = ["attention.doc_mask=true", "model.num_heads=2", "model.d_model=128"]
  with pytest.raises(UserError, match=r"flash_gpu cannot tile model\.max_seq_len=320"):
    config_kernel("gpu", *docs, "attention.impl=flash_gpu", "model.max_seq_len=320")
  with pytest.raises(UserError, match=r"splash needs model\.max_seq_len .*got 320"):
    config_kernel("cpu", "attention.impl=splash", "model.max_seq_len=320")
  assert config_kernel("tpu", "model.max_seq_len=320") == "xla"
  assert config_kernel("tpu", "model.max_seq_len=384") == "splash"


@pytest.mark.parametrize("impl,window,tol", [("splash", 16, SPLASH_TOL), ("flash", 0, 1e-5)])
def test_pallas_kernels_under_a_mesh_are_sharded(impl, window, tol):
  """With sharding rules active, splash and flash run per device (shard_map) on batch/head
  shards (flash has no windows)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from nanotext import sharding
  mesh = conftest_mesh(fsdp=2, tensor=2)
  rules = sharding.parse_rules([["batch", ["data", "fsdp"]], ["act_heads", "tensor"]])
  q, k, v, g, seg = inputs(128, seed=3)
  x_sh = NamedSharding(mesh, P("fsdp", None, "tensor", None))
  q, k, v, g = (jax.device_put(x, x_sh) for x in (q, k, v, g))
  kw = dict(scale=SCALE, window=window, segment_ids_BT=jax.device_put(seg, NamedSharding(
      mesh, P("fsdp", None))))
  def run(impl):
    with sharding.use_rules(rules, mesh):
      return jax.jit(lambda q, k, v, g: forward_and_grads(kernel(impl), q, k, v, g, **kw))(
          q, k, v, g)
  got, want = run(impl), run("xla")
  assert max(max_errors(got, want)) < tol
  assert got[0].sharding.is_equivalent_to(x_sh, 4)


@pytest.mark.fast
def test_the_kernel_modules_behind_the_dispatch():
  """impl=xla is kernels/xla.py; flash says why it cannot run a problem (kernels/flash.py);
  Pallas kernels are built for the platform of the program (kernels/per_device.py)."""
  from nanotext.model.kernels import flash, per_device, xla
  q, k, v, _, _ = inputs(16)
  np.testing.assert_array_equal(kernel("xla")(q, k, v, scale=SCALE),
                                xla.xla_attention(q, k, v, scale=SCALE))
  assert flash.problem(256, 64) is None
  assert "sliding windows" in flash.problem(256, 64, window=16)
  assert "not a multiple of 128" in flash.problem(100, 64)
  assert per_device.platform() == "cpu"


@pytest.mark.fast
def test_the_attention_section_is_checked_by_its_layer():
  import ml_collections
  from conftest import BASE
  from nanotext import config
  from nanotext.model import attention
  a = ml_collections.ConfigDict(config.load(BASE).attention.to_dict())
  attention.check_config(a)
  a.window, a.window_pattern = 16, "LSX"
  with pytest.raises(UserError, match="attention.window_pattern='LSX' may hold only"):
    attention.check_config(a)
