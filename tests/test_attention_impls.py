"""The flash (Pallas, interpreted on CPU) and einsum kernels agree with xla forward and backward,
refuse what they cannot express, and einsum trains to xla's losses."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE, REPO, TINY
from conftest import mesh as conftest_mesh
from test_attention import (MASKS, SCALE, forward_and_grads, inputs, kernel, max_errors,
                            reference)
from nanotext.errors import UserError
from nanotext.model.kernels.dispatch import config_impl, resolve_impl

# float32: einsum is xla's math written out (same einsums, float32 softmax), so they agree to
# round-off, observed <= 1e-6; flash's online softmax over 128-key tiles and its backward from the
# saved logsumexp round differently, observed <= 1e-6 too. bfloat16 inputs: both cast the
# probabilities to bfloat16 before the value product, as xla does; one bf16 ulp of O(1) is 8e-3.
F32_TOL = 1e-5
BF16_TOL = 3e-2


@pytest.mark.fast
@pytest.mark.parametrize("window,docs", MASKS)
def test_einsum_matches_xla_and_reference(window, docs):
  q, k, v, g, seg = inputs(64)
  kw = dict(scale=SCALE, window=window, segment_ids_BT=seg if docs else None)
  got = forward_and_grads(kernel("einsum"), q, k, v, g, **kw)
  assert max(max_errors(got, forward_and_grads(kernel("xla"), q, k, v, g, **kw))) < F32_TOL
  assert max(max_errors(got, forward_and_grads(reference, q, k, v, g, **kw))) < F32_TOL


@pytest.mark.fast
def test_einsum_block_windows_match_xla():
  q, k, v, g, seg = inputs(64, seed=4)
  kw = dict(scale=SCALE, window=32, block=16, segment_ids_BT=seg)
  errs = max_errors(forward_and_grads(kernel("einsum"), q, k, v, g, **kw),
                    forward_and_grads(kernel("xla"), q, k, v, g, **kw))
  assert max(errs) < F32_TOL, errs


@pytest.mark.parametrize("T,docs", [(128, False), (128, True), (256, True)])
def test_flash_matches_xla(T, docs):
  """T = 256 is two key tiles: the kernel skips the tile above the diagonal and carries the
  online softmax across the other two."""
  q, k, v, g, seg = inputs(T, seed=1)
  kw = dict(scale=SCALE, segment_ids_BT=seg if docs else None)
  errs = max_errors(forward_and_grads(kernel("flash"), q, k, v, g, **kw),
                    forward_and_grads(kernel("xla"), q, k, v, g, **kw))
  assert max(errs) < F32_TOL, errs


@pytest.mark.parametrize("impl", ["flash", "einsum"])
def test_bfloat16(impl):
  q, k, v, g, seg = inputs(128, seed=2)
  bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  got = forward_and_grads(kernel(impl), *bf, g, scale=SCALE, segment_ids_BT=seg)
  want = forward_and_grads(kernel("xla"), *bf, g, scale=SCALE, segment_ids_BT=seg)
  assert got[0].dtype == jnp.bfloat16
  errs = [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
          for a, b in zip((got[0], *got[1]), (want[0], *want[1]))]
  assert max(errs) < BF16_TOL, errs


def test_a_pallas_kernel_off_its_chip_says_it_is_interpreted(tmp_path):
  """attention.impl=flash (a TPU kernel) on a CPU run ran in Pallas's interpreter, far slower,
  and no start-up line said so: the model line does; a kernel on its own platform adds nothing."""
  from nanotext.model.kernels.dispatch import interpreted
  from nanotext.train import run
  lines = []
  run(BASE, [*TINY, "train.seq_len=128", "train.steps=1", "train.eval_batches=1",
             "attention.impl=flash", f"output_dir={tmp_path}"], log=lines.append)
  model = [l for l in lines if l.startswith("model:")]
  assert len(model) == 1 and model[0].endswith(
      "| attention flash (Pallas interpret mode on CPU: a test mode, far slower)"), model
  assert interpreted("flash_gpu", "gpu") == interpreted("splash", "tpu") == ""
  assert interpreted("cpu", "cpu") == interpreted("xla", "tpu") == ""
  assert "flash_gpu (Pallas interpret mode on CPU" in interpreted("flash_gpu", "cpu")


@pytest.mark.fast
def test_flash_takes_windows_that_cover_every_row():
  """shakespeare.yml's windows (1792, short 896) all cover its 256-token rows, so its attention is
  plain causal; attention.impl=flash was refused for attention.window=1792. A window shorter
  than rows a program takes (training's, validation's, the sampler's) is still refused."""
  from nanotext import wiring
  path = os.path.join(REPO, "configs", "shakespeare.yml")
  impl = lambda *o: config_impl(wiring.load(path, ["attention.impl=flash", *o]), "tpu")
  assert impl() == "flash"
  for longer in ("train.eval_seq_len=2048", "model.max_seq_len=1024"):
    with pytest.raises(UserError, match=r"attention\.impl=flash cannot express sliding windows"):
      impl(longer)
  with pytest.raises(UserError, match=r"a window of 128 tokens"):
    impl("attention.window=256", "attention.window_schedule=false")


@pytest.mark.fast
def test_flash_refuses_windows_and_untileable_shapes():
  with pytest.raises(UserError, match=r"attention\.impl=flash.*window of 64 tokens"):
    resolve_impl("flash", "tpu", head_dim=64, seq_len=1024, window=64)
  with pytest.raises(UserError, match=r"train\.seq_len=200: it is not a multiple of 128"):
    resolve_impl("flash", "tpu", head_dim=64, seq_len=200)
  with pytest.raises(UserError, match=r"model\.head_dim=192"):
    resolve_impl("flash", "tpu", head_dim=192, seq_len=256)
  assert resolve_impl("flash", "tpu", head_dim=256, seq_len=2048) == "flash"
  assert resolve_impl("einsum", "tpu", seq_len=100, window=7, block_windows=True) == "einsum"
  q, k, v, _, _ = inputs(128)
  with pytest.raises(UserError, match=r"attention\.impl=flash.*window of 16 tokens"):
    kernel("flash")(q, k, v, scale=SCALE, window=16)
  # A window covering the whole sequence is plain causal, which flash does express.
  np.testing.assert_allclose(kernel("flash")(q, k, v, scale=SCALE, window=128),
                             kernel("xla")(q, k, v, scale=SCALE), atol=F32_TOL)


def test_einsum_trains_to_xla_losses(tmp_path):
  from nanotext.train import run
  losses = {}
  for impl in ("xla", "einsum"):
    out = tmp_path / impl
    run(BASE, TINY + [f"output_dir={out}", f"attention.impl={impl}", "attention.window=16",
                      "attention.doc_mask=true", "sample.max_new_tokens=0"], log=lambda s: None)
    with open(os.path.join(out, "metrics.jsonl")) as f:
      losses[impl] = [r["loss"] for r in map(json.loads, f) if "loss" in r]
  assert len(losses["xla"]) == 4
  np.testing.assert_allclose(losses["einsum"], losses["xla"], rtol=1e-5)


@pytest.mark.tpu
def test_flash_compiles_to_mosaic_for_a_tpu():
  """Built for a TPU mesh from this CPU host, flash is Mosaic (forward, dK/dV and dQ kernels)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from nanotext import sharding, topology
  mesh = conftest_mesh(topology.devices(topology.parse("v5e-1")))
  x = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  seg = jax.ShapeDtypeStruct((2, 256), jnp.int32, sharding=NamedSharding(mesh, P()))
  def loss(q, k, v, seg):
    out = kernel("flash")(q, k, v, scale=SCALE, segment_ids_BT=seg)
    return out.astype(jnp.float32).sum()
  with sharding.use_rules(sharding.parse_rules([]), mesh):
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x, seg)
  assert lowered.compile().as_text().count('custom_call_target="tpu_custom_call"') == 3


@pytest.mark.fast
@pytest.mark.parametrize("impl,says", [
    ("splash", "needs train.eval_seq_len to be a multiple of 128"),
    ("flash", "cannot tile train.eval_seq_len=200: .*; use attention.impl=blocked or auto"),
    ("flash_gpu", "cannot tile train.eval_seq_len=200")])
def test_an_eval_length_a_kernel_cannot_tile_is_named_as_such(impl, says):
  """train.seq_len=128 tiled and eval_seq_len=200 did not: the line named train.seq_len (got
  200), found only as eval was traced; flash's advice named splash, which tiles no more."""
  from nanotext import config
  from nanotext.model import gpt
  cfg = config.load(BASE, [*TINY, "train.seq_len=128", "train.eval_seq_len=200",
                           "model.positions=rope", f"attention.impl={impl}"])
  with pytest.raises(UserError, match=says):
    gpt.abstract_model(cfg, "cpu")


@pytest.mark.fast
@pytest.mark.parametrize("impl,says", [
    ("splash", "needs train.seq_len_start to be a multiple of 128 \\(got 64\\)"),
    ("flash", "cannot tile train.seq_len_start=64"),
    ("flash_gpu", "cannot tile train.seq_len_start=64")])
def test_a_warmup_row_a_kernel_cannot_tile_is_named_as_such(impl, says):
  """train.seq_len=256 tiled and the warmup's 64-token rows did not: the line named
  train.seq_len (got 64), found only as the warmup's program was traced."""
  from nanotext import config, wiring
  from nanotext.model import gpt
  rows = [*TINY, "train.seq_len=256", "train.seq_len_start=64", "model.positions=rope",
          f"attention.impl={impl}"]
  with pytest.raises(UserError, match=says):
    gpt.abstract_model(config.load(BASE, rows), "cpu")
  if impl == "splash":  # refused with the config checks, before start-up (it needs no backend)
    with pytest.raises(UserError, match=r"^attention\.impl=splash needs train\.seq_len_start "):
      wiring.load(BASE, rows)
