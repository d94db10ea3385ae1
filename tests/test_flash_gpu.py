"""The block-sparse flash kernel (Pallas; interpreted on CPU): its block tables against a dense
mask, forward and gradients against the blocked and einsum kernels for the record's mask (causal,
block or token windows, documents on and off block edges), a runtime window, a mesh, `auto`
on GPU, and its lowering to Triton for CUDA."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TRITON, cuda_mlir, mesh as conftest_mesh

from nanotext.errors import UserError
from nanotext.model.kernels import flash_gpu, per_device
from nanotext.model.kernels.block_tables import document_bounds, key_tiles, query_tiles
from nanotext.model.kernels.dispatch import dot_product_attention, resolve_impl
from nanotext.model.kernels.masks import block_window_mask

B, H, K = 2, 2, 32
SCALE = 0.7 / np.sqrt(K)
# Tiles smaller than the 128-token window block and unequal (forward 64 x 32, backward 32 x 64),
# so that tile edges and window-block edges differ.
TILES = flash_gpu.Tiles(block_q=64, block_k=32, block_q_bwd=32, block_k_bwd=64)


def docs(T, seed, edges=True):
  """Document ids (end-of-text counts): a few random starts, some exactly on 128-token edges."""
  rng = np.random.default_rng(seed)
  eot = rng.random((B, T)) < 4 / T
  if edges:
    eot[:, rng.choice(T // 128, 2) * 128] = True
  eot[1, :] = False if seed % 2 else eot[1, :]  # one row without documents in odd seeds
  return np.cumsum(eot, axis=1).astype(np.int32)


def dense_mask(seg, window, block):
  """[B, T, T] keys each query sees: causal, same document, token or block window."""
  T = seg.shape[1]
  t, s = np.arange(T)[:, None], np.arange(T)[None, :]
  if window and block:
    m = block_window_mask(T, window, block)
  else:
    m = (s <= t) & ((t - s < window) if window else True)
  return m[None] & (seg[:, :, None] == seg[:, None, :])


def tile_ranges(mask, rows, cols):
  """(first, last) column tile with a True entry, per row tile: [B, nrows] each."""
  B_, T, _ = mask.shape
  any_ = mask.reshape(B_, T // rows, rows, T // cols, cols).any(axis=(2, 4))
  first = np.argmax(any_, axis=2)
  last = any_.shape[2] - 1 - np.argmax(any_[:, :, ::-1], axis=2)
  assert all(any_[b, i, first[b, i]:last[b, i] + 1].all() for b in range(B_)
             for i in range(any_.shape[1])), "visible tiles of a row tile are not contiguous"
  return first, last


@pytest.mark.fast
@pytest.mark.parametrize("window,block", [(0, 0), (128, 128), (256, 128), (384, 128), (96, 32),
                                          (100, 0), (1, 0)])
@pytest.mark.parametrize("tiles", [(64, 32), (32, 64), (128, 128)])
def test_block_tables_are_exactly_the_tiles_with_visible_keys(window, block, tiles):
  bq, bk = tiles
  for seed in range(3):
    seg = docs(512, seed, edges=seed != 2)
    mask = dense_mask(seg, window, block)
    kw = dict(block_q=bq, block_k=bk, window_block=block)
    want_k = tile_ranges(mask, bq, bk)
    got_k = key_tiles(jnp.asarray(seg), window, **kw)
    want_q = tile_ranges(mask.transpose(0, 2, 1), bk, bq)  # per key tile, its query tiles
    got_q = query_tiles(jnp.asarray(seg), jnp.int32(window), **kw)  # traced window too
    for got, want in zip(got_k + got_q, want_k + want_q):
      np.testing.assert_array_equal(got, want, err_msg=f"seed {seed}")


@pytest.mark.fast
def test_document_bounds():
  first, last = document_bounds(jnp.array([[0, 0, 1, 1, 1, 2], [3, 3, 3, 3, 3, 3]]))
  np.testing.assert_array_equal(first, [[0, 0, 2, 2, 2, 5], [0] * 6])
  np.testing.assert_array_equal(last, [[1, 1, 4, 4, 4, 5], [5] * 6])


def inputs(T, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  return [jax.random.normal(k, (B, T, H, K), jnp.float32).astype(dtype) for k in keys]


def out_and_grads(impl, block, dtype, **kernel_kw):
  """jit(q, k, v, g, segment ids, window) -> [out, dq, dk, dv] of kernel `impl`, the window a
  runtime input: one compile serves every case."""
  def run(q, k, v, g, seg, window):
    def f(q, k, v):
      return dot_product_attention(q, k, v, impl=impl, scale=SCALE, segment_ids_BT=seg,
                                   block=block, runtime_window=window, **kernel_kw)
    out, vjp = jax.vjp(f, q, k, v)
    return [out, *vjp(g.astype(dtype))]
  return jax.jit(run)


def errors(a, b):
  """Max abs difference of each array, relative to the reference's largest magnitude when that
  is above 1 (one bf16 ulp at 4 is 2^-5)."""
  f32 = lambda x: x.astype(jnp.float32)
  return [float(jnp.max(jnp.abs(f32(x) - f32(y))) / jnp.maximum(1.0, jnp.max(jnp.abs(f32(y)))))
          for x, y in zip(a, b)]


def flash(block, dtype):
  """flash_gpu with the test tiles, through the dispatch's keyword."""
  def run(q, k, v, g, seg, window):
    def f(q, k, v):
      return flash_gpu.flash_gpu_attention(q, k, v, scale=SCALE, window=window,
                                           segment_ids_BT=seg, block=block, tiles=TILES)
    out, vjp = jax.vjp(f, q, k, v)
    return [out, *vjp(g.astype(dtype))]
  return jax.jit(run)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 3e-2)])
def test_block_windows_match_blocked_and_einsum(dtype, tol):
  """The record's block windows (128-token blocks) at T = 512: 1, 2 and 3 blocks, and none, with
  documents on and off block edges and a row without documents."""
  T = 512
  q, k, v, g = inputs(T, dtype)
  ours, blocked, einsum = flash(128, dtype), out_and_grads("blocked", 128, dtype), \
      out_and_grads("einsum", 128, dtype)
  for seed, window in enumerate((128, 256, 384, 0)):
    seg = jnp.asarray(docs(T, seed, edges=seed % 2 == 0))
    w = jnp.int32(window)
    got = ours(q, k, v, g, seg, w)
    assert got[0].dtype == dtype
    assert max(errors(got, einsum(q, k, v, g, seg, w))) < tol, window
    assert max(errors(got, blocked(q, k, v, g, seg, w))) < tol, window


def test_the_opt_in_one_backward_kernel_equals_the_two():
  """per_device.OWN_KERNELS' flash_gpu_one_backward (dq and dk/dv programs in one kernel, the
  row term computed inside; 1.26x slower on an H200) gives the two kernels' gradients."""
  T = 256
  q, k, v, g = inputs(T, jnp.float32, seed=2)
  seg, w = jnp.asarray(docs(T, 2)), jnp.int32(128)
  two = flash(128, jnp.float32)(q, k, v, g, seg, w)
  with per_device.opting_in("flash_gpu_one_backward"):
    one = flash(128, jnp.float32)(q, k, v, g, seg, w)
  assert max(errors(one, two)) < 2e-6


def test_token_windows_match_einsum():
  T = 512
  q, k, v, g = inputs(T, jnp.float32, seed=1)
  ours, einsum = flash(0, jnp.float32), out_and_grads("einsum", 0, jnp.float32)
  for seed, window in enumerate((1, 37, 200, 0)):
    seg = jnp.asarray(docs(T, seed + 3))
    w = jnp.int32(window)
    assert max(errors(ours(q, k, v, g, seg, w), einsum(q, k, v, g, seg, w))) < 2e-5, window


def test_dispatch_default_tiles_and_static_window():
  """Through dot_product_attention with its default 128-token tiles and a static window."""
  T = 512
  q, k, v, g = inputs(T, jnp.float32, seed=2)
  seg = jnp.asarray(docs(T, 4))
  def both(impl):
    f = lambda q, k, v: dot_product_attention(q, k, v, impl=impl, scale=SCALE, window=256,
                                              segment_ids_BT=seg, block=128)
    out, vjp = jax.vjp(f, q, k, v)
    return [out, *vjp(g)]
  assert max(errors(jax.jit(lambda: both("flash_gpu"))(), both("einsum"))) < 2e-5


def test_under_a_mesh_runs_per_device():
  from jax.sharding import NamedSharding, PartitionSpec as P
  from nanotext import sharding
  mesh = conftest_mesh(fsdp=2, tensor=2)
  rules = sharding.parse_rules([["batch", ["data", "fsdp"]], ["act_heads", "tensor"]])
  T = 256
  q, k, v, g = inputs(T, jnp.float32, seed=3)
  x_sh = NamedSharding(mesh, P("fsdp", None, "tensor", None))
  q, k, v, g = (jax.device_put(x, x_sh) for x in (q, k, v, g))
  seg = jax.device_put(jnp.asarray(docs(T, 5)), NamedSharding(mesh, P("fsdp", None)))
  def run(impl):
    with sharding.use_rules(rules, mesh):
      return out_and_grads(impl, 128, jnp.float32)(q, k, v, g, seg, jnp.int32(128))
  got = run("flash_gpu")
  assert max(errors(got, run("einsum"))) < 2e-5
  assert got[0].sharding.is_equivalent_to(x_sh, 4)


@pytest.mark.fast
def test_auto_takes_it_on_gpu_for_windows_and_documents():
  gpu = dict(head_dim=128, seq_len=49152)
  assert resolve_impl("auto", "gpu", window=1792, block_windows=True, doc_mask=True,
                      **gpu) == "flash_gpu"
  assert resolve_impl("auto", "gpu", doc_mask=True, **gpu) == "flash_gpu"
  assert resolve_impl("auto", "gpu", window=1792, **gpu) == "flash_gpu"
  assert resolve_impl("auto", "gpu", **gpu) in ("cudnn", "xla")  # plain causal: cuDNN's
  assert resolve_impl("auto", "cpu", window=1792, block_windows=True, doc_mask=True,
                      **gpu) == "blocked"
  assert resolve_impl("auto", "gpu", head_dim=12, seq_len=1024, window=256) == "xla"
  with pytest.raises(UserError, match=r"attention\.impl=flash_gpu.*train\.seq_len=200"):
    resolve_impl("flash_gpu", "gpu", head_dim=64, seq_len=200)
  with pytest.raises(UserError, match=r"model\.head_dim=96"):
    resolve_impl("flash_gpu", "gpu", head_dim=96, seq_len=1024)


@pytest.mark.fast
def test_float32_tiles_past_shared_memory_are_refused_and_auto_passes_them_by():
  """At model.dtype=float32 and head_dim 256 the kernel's tiles take 256 KiB of shared memory, an
  H100 gives a block 227: accepted, the program failed to compile (RESOURCE_EXHAUSTED), and auto
  picked it itself. bfloat16 at 256 and float32 at 128 compile (compile --topology=h100)."""
  gpu = dict(seq_len=1024, doc_mask=True, window=256)
  with pytest.raises(UserError, match=r"flash_gpu cannot hold model\.head_dim=256 at "
                                      r"model\.dtype=float32 in shared memory.*227 KiB"):
    resolve_impl("flash_gpu", "gpu", head_dim=256, dtype="float32", **gpu)
  assert resolve_impl("auto", "gpu", head_dim=256, dtype="float32", block_windows=True,
                      **gpu) == "blocked"
  assert resolve_impl("auto", "gpu", head_dim=256, dtype="bfloat16", **gpu) == "flash_gpu"
  assert resolve_impl("auto", "gpu", head_dim=128, dtype="float32", **gpu) == "flash_gpu"
  # the interpreter has no shared memory: the tests' CPU path takes any dtype
  assert resolve_impl("flash_gpu", "cpu", head_dim=256, dtype="float32", **gpu) == "flash_gpu"


@pytest.mark.fast
def test_lowers_to_three_triton_kernels_for_cuda(monkeypatch):
  """Built for CUDA from this CPU host (jax.export), forward + backward are the forward Triton
  kernel and the backward's dq and dk/dv kernels, with no [T, T] array, each at 4 warps for
  128-wide heads (1.8x faster than 8 on an H100: RESULTS)."""
  monkeypatch.setattr(flash_gpu, "platform", lambda: "gpu")
  T = 1024
  x = jax.ShapeDtypeStruct((1, T, 2, 128), jnp.bfloat16)
  seg = jax.ShapeDtypeStruct((1, T), jnp.int32)
  def loss(q, k, v, seg, window):
    out = flash_gpu.flash_gpu_attention(q, k, v, scale=0.12, window=window, segment_ids_BT=seg,
                                        block=128)
    return out.astype(jnp.float32).sum()
  text = cuda_mlir(jax.grad(loss, argnums=(0, 1, 2)), x, x, x, seg,
                   jax.ShapeDtypeStruct((), jnp.int32))
  assert text.count(f"custom_call @{TRITON}") == 3
  for name in ("flash_gpu_forward", "flash_gpu_dq", "flash_gpu_dkv"):
    assert f'name = "{name}"' in text
  assert f"{T}x{T}x" not in text and f"x{T}x{T}" not in text
  assert re.findall(r"num_warps = (\d+)", text) == ["4"] * 3
  with per_device.opting_in("flash_gpu_one_backward"):  # dq and dk/dv programs in one kernel
    text = cuda_mlir(jax.grad(loss, argnums=(0, 1, 2)), x, x, x, seg,
                     jax.ShapeDtypeStruct((), jnp.int32))
  assert text.count(f"custom_call @{TRITON}") == 2 and 'name = "flash_gpu_backward"' in text


def test_kernels_read_only_the_tiles_of_their_tables(monkeypatch):
  """Tables narrowed to each tile's own diagonal tile (no window, no documents) give attention
  within 64-token blocks: the loops run over the tables' ranges, not over every tile."""
  tiles = flash_gpu.Tiles(64, 64, 64, 64)
  def diagonal(seg, window, *, block_q, block_k, window_block):
    n = seg.shape[1] // block_q
    return [jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (B, n))] * 2
  monkeypatch.setattr(flash_gpu, "key_tiles", diagonal)
  monkeypatch.setattr(flash_gpu, "query_tiles", diagonal)
  T = 128
  q, k, v, g = inputs(T, jnp.float32, seed=4)
  def run(f):
    out, vjp = jax.vjp(f, q, k, v)
    return [out, *vjp(g)]
  got = run(lambda q, k, v: flash_gpu.flash_gpu_attention(q, k, v, scale=SCALE, tiles=tiles))
  want = run(lambda q, k, v: dot_product_attention(q, k, v, impl="einsum", scale=SCALE,
                                                   window=64, block=64))
  assert max(errors(got, want)) < 2e-5


@pytest.mark.slow
def test_record_config_trains_with_it_to_the_blocked_kernels_losses(tmp_path):
  """The record config shrunk (2 layers: one long window, one short; block windows 128 -> 512,
  documents, one 1,024-token row per device) trains through flash_gpu (interpreted) in one
  runtime-window program, with the blocked kernel's losses (float32)."""
  import json
  import os
  from conftest import REPO
  from nanotext.train import run
  over = ["model.num_layers=2", "model.d_model=64", "model.num_heads=2", "model.head_dim=32",
          "model.mlp_dim=256", "model.align=0", "model.dtype=float32", "model.vocab_size=8192",
          "data.source=shakespeare", "data.tokenizer=shakespeare", "train.seq_len=1024",
          "train.batch_size=8", "train.eval_seq_len=0", "train.eval_batches=1",
          "attention.window=512", "train.steps=4", "train.eval_every=0", "train.log_every=1",
          "train.eval_at_start=false", "optim.warmup_steps=0", "model.remat=dots",
          "train.loss_chunk=0", "sample.max_new_tokens=0", "metrics.tensorboard=false",
          "checkpoint.every=0"]
  losses = {}
  for impl in ("flash_gpu", "blocked"):
    result = run(os.path.join(REPO, "configs", "speedrun_record.yml"),
                 over + [f"attention.impl={impl}", f"output_dir={tmp_path / impl}"],
                 log=lambda s: None)
    assert result.programs == 2 and result.compiles_in_loop == 0
    with open(tmp_path / impl / "metrics.jsonl") as f:
      losses[impl] = [r.get("loss", r.get("val_loss")) for r in map(json.loads, f)]
  assert len(losses["flash_gpu"]) == 5
  np.testing.assert_allclose(losses["flash_gpu"], losses["blocked"], rtol=1e-4)
