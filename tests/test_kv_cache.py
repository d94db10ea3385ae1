"""Sampling with a key-value cache: a prompt, then one token at a time against the cached keys and
values, gives the logits of the whole context run at once, with every switch the cache must carry
(windows, block windows, value embeddings, U-net skips, MLP-only layers, a carried v1, rotary and
learned positions, fused QKV with a learned scale, scanned layers)."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import BASE, REPO, SPEEDRUN
from nanotext import generate, wiring
from nanotext.model import kv_cache
from nanotext.model.kernels.masks import segment_ids_from_tokens

SMALL = ["model.d_model=64", "model.num_heads=2", "model.head_dim=32", "model.mlp_dim=128",
         "model.vocab_size=256", "model.align=0", "model.dtype=float32",
         "model.param_dtype=float32", "train.seq_len=64", "model.max_seq_len=64",
         "train.batch_size=8", "train.grad_accum=1", "train.seq_len_start=0",
         "data.source=synthetic", "data.tokenizer=none", "data.eot_id=0"]
CASES = {
    # blocks.2 without attention, windows of 2 blocks of 16 (the record's block mask), two
    # value-embedding tables, U-net skips, x0 mixing
    "record": (os.path.join(REPO, "configs", "speedrun_record.yml"),
               ["model.num_layers=4", "model.no_attention_layers=[2]", "model.embed_rows=0",
                "attention.window=32", "attention.window_block=16", "attention.window_start=16"]),
    "value_residual": (SPEEDRUN, ["model.num_layers=2", "model.value_residual=true",
                                  "attention.window=32", "attention.window_block=16",
                                  "attention.window_start=16"]),
    "gpt2": (BASE, ["model.num_layers=2"]),  # learned positions, LayerNorm, GELU
    # as "record", in bf16 with the flash_gpu kernel (compiled for a GPU, not run)
    "record_gpu": (os.path.join(REPO, "configs", "speedrun_record.yml"),
                   ["model.num_layers=4", "model.no_attention_layers=[2]", "model.embed_rows=0",
                    "attention.window=256", "attention.window_start=128",
                    "attention.impl=flash_gpu", "model.head_dim=64", "model.num_heads=1",
                    "model.dtype=bfloat16", "train.seq_len=256", "model.max_seq_len=256"]),
    "port": (os.path.join(REPO, "configs", "modded_nanogpt_jax.yml"), ["model.num_layers=2"]),
    "scanned": (BASE, ["model.num_layers=3", "model.scan_layers=true", "model.positions=rope",
                       "attention.window=16"]),
}
PROMPT, LENGTH = 5, 48  # positions past every window above


def model_and_params(case: str):
  """(graphdef, params) of a case's model, every parameter moved off its init (zero-initialised
  projections and heads would make every position's logits alike)."""
  path, overrides = CASES[case]
  run = wiring.prepare(path, SMALL + overrides)
  graphdef, params = nnx.split(run.create_model(0))
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  leaves = [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return graphdef, jax.tree.unflatten(tree, leaves)


@pytest.mark.parametrize("case", sorted(set(CASES) - {"record_gpu"}))
def test_a_prompt_then_one_token_at_a_time_gives_the_whole_contexts_logits(case):
  graphdef, params = model_and_params(case)
  tokens = np.asarray(jax.random.randint(jax.random.key(2), (1, LENGTH), 1, 256), np.int32)
  whole = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t, train=False)[0])(params, tokens)

  @jax.jit
  def prompt(p, caches, buf):  # a padded buffer: its last positions are written, then replaced
    return nnx.merge(graphdef, p).extend(buf, caches, 0, PROMPT - 1)

  @jax.jit
  def step(p, caches, token, pos):
    return nnx.merge(graphdef, p).extend(token.reshape(1, 1), caches, pos, 0)

  caches = kv_cache.empty(nnx.merge(graphdef, params), 1, 64)
  buf = np.zeros((1, 16), np.int32)
  buf[0, :PROMPT] = tokens[0, :PROMPT]
  got, caches = prompt(params, caches, buf)
  rows = [got[0]]
  for pos in range(PROMPT, LENGTH - 1):
    got, caches = step(params, caches, tokens[0, pos], pos)
    rows.append(got[0])
  np.testing.assert_allclose(np.stack(rows), whole[PROMPT - 1:LENGTH - 1], rtol=1e-4, atol=1e-4)
  assert float(jnp.std(whole[PROMPT - 1:] - whole[PROMPT - 1])) > 1e-2  # positions do differ


@pytest.mark.fast
def test_sampling_with_the_cache_draws_the_uncached_tokens_past_max_len():
  """Greedy and sampled tokens with and without the cache agree, across the point where the
  context outgrows max_len and the sampler goes on without it."""
  graphdef, params = model_and_params("gpt2")
  prompt = [5, 17, 3, 99, 42]
  for temperature, top_k in ((0.0, 0), (1.0, 20)):
    draw = lambda cache: generate.sample(graphdef, params, prompt, max_len=64,
                                         max_new_tokens=66, temperature=temperature,
                                         top_k=top_k, seed=3, cache=cache)
    cached = draw(True)
    assert cached == draw(False) and len(cached) == 66
  assert len(set(cached)) > 10  # the sampled run: not one token repeated


def test_samples_drawn_together_are_those_drawn_one_by_one():
  """Rows of one batch (generate num_samples=N) draw each seed's own tokens, with the cache and
  past max_len without it; one row's cache bytes as `empty` allocates them."""
  graphdef, params = model_and_params("record")
  prompt = [5, 17, 3, 99, 42]
  kw = dict(max_len=64, max_new_tokens=66, temperature=1.0, top_k=20)
  together = list(generate.stream_rows(graphdef, params, prompt, seeds=(3, 4, 2**63 - 1), **kw))
  alone = [generate.sample(graphdef, params, prompt, seed=s, **kw) for s in (3, 4, 2**63 - 1)]
  assert [list(r) for r in zip(*together)] == alone and len(alone[0]) == 66
  assert len({tuple(r) for r in alone}) == 3  # the seeds do differ
  model = nnx.merge(graphdef, params)
  held = sum(x.nbytes for c in kv_cache.empty(model, 1, 128) if c is not None for x in c[:3])
  assert kv_cache.row_bytes(model, 128) == held > 0


@pytest.mark.parametrize("case", ["record", "scanned"])
def test_the_cache_keeps_each_token_to_its_document(case):
  """With document masks (attention.doc_mask, end-of-text 0 here), a prompt and then one token at
  a time give the logits of the whole context run with training's segment ids; the document
  before an end-of-text is then out of sight (it was seen: logits differ by up to 0.47)."""
  graphdef, params = model_and_params(case)
  tokens = np.array(jax.random.randint(jax.random.key(2), (1, LENGTH), 1, 256), np.int32)
  tokens[0, [3, 20, 33]] = 0  # one in the prompt, two after it
  docs = segment_ids_from_tokens(tokens, 0)
  run = jax.jit(lambda p, t, d: nnx.merge(graphdef, p)(t, d, train=False)[0])
  whole = run(params, tokens, docs)
  prompt = jax.jit(lambda p, c, t, d: nnx.merge(graphdef, p).extend(t, c, 0, PROMPT - 1, d))
  step = jax.jit(lambda p, c, t, pos, d: nnx.merge(graphdef, p).extend(t, c, pos, 0, d))
  got, caches = prompt(params, kv_cache.empty(nnx.merge(graphdef, params), 1, 64),
                       tokens[:, :PROMPT], docs[:, :PROMPT])
  rows = [got[0]]
  for pos in range(PROMPT, LENGTH - 1):
    got, caches = step(params, caches, tokens[:, pos:pos + 1], pos, docs[:, pos:pos + 1])
    rows.append(got[0])
  np.testing.assert_allclose(np.stack(rows), whole[PROMPT - 1:LENGTH - 1], rtol=1e-4, atol=1e-4)
  unmasked = run(params, tokens, None)
  assert float(jnp.max(jnp.abs(unmasked[21:] - whole[21:]))) > 1e-2  # the masks do matter


def test_text_after_an_end_of_text_does_not_depend_on_the_document_before_it():
  """Sampled continuations (the cache's, then past max_len the sliding context's) of two prompts
  that differ only before their end-of-text token are the same with the model's document masks;
  without them they differ."""
  graphdef, params = model_and_params("record")
  kw = dict(max_len=64, max_new_tokens=66, temperature=1.0, top_k=20, seed=3)
  draw = lambda prefix, **more: generate.sample(graphdef, params, prefix + [0, 42, 7],
                                                **{**kw, **more})
  first = draw([5, 17, 3], eot=0)
  assert first == draw([99, 18, 250], eot=0) == draw([99, 18, 250], eot=0, cache=False)
  assert draw([5, 17, 3]) != draw([99, 18, 250])


def test_windows_hide_what_the_cache_still_holds():
  """A cached token attends to the keys inside its window and no others: with window 4 the
  logits at position 20 do not move when tokens at positions 0-16 change."""
  run = wiring.prepare(BASE, SMALL + ["model.num_layers=1", "model.positions=rope",
                                      "attention.window=4"])
  graphdef, params = nnx.split(run.create_model(0))
  step = jax.jit(lambda p, c, t, pos: nnx.merge(graphdef, p).extend(t, c, pos, 0))
  def last_logits(tokens):
    caches = kv_cache.empty(nnx.merge(graphdef, params), 1, 32)
    for pos, token in enumerate(tokens):
      logits, caches = step(params, caches, jnp.full((1, 1), token, jnp.int32), pos)
    return np.asarray(logits)
  tokens = list(range(1, 22))
  other = [250 - t for t in tokens[:17]] + tokens[17:]
  np.testing.assert_array_equal(last_logits(tokens), last_logits(other))
  assert not np.allclose(last_logits(tokens), last_logits(other[:-4] + [9] + tokens[-3:]))


@pytest.mark.gpu_compile
def test_the_records_sampling_programs_lower_for_cuda():
  """Built for an H100 from this CPU host: the prompt runs the training forward pass's kernels
  (flash_gpu, QK-norm with rotation; opted in, ReLU^2 in the up-projection), each new token a
  dense attention over the cache written in place, no kernel."""
  from conftest import TRITON, cuda_mlir
  from nanotext.model.kernels import per_device
  graphdef, params = model_and_params("record_gpu")
  caches = kv_cache.empty(nnx.merge(graphdef, params), 1, 256)
  spec = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
  model = lambda p: nnx.merge(graphdef, p)
  with per_device.building_for("gpu"), per_device.opting_in("relu2_mlp"):
    prompt = cuda_mlir(lambda p, c, buf: model(p).extend(buf, c, 0, 4), spec(params),
                       spec(caches), jax.ShapeDtypeStruct((1, 128), jnp.int32))
    step = cuda_mlir(lambda p, c, t, pos: model(p).extend(t, c, pos, 0), spec(params),
                     spec(caches), jax.ShapeDtypeStruct((1, 1), jnp.int32),
                     jax.ShapeDtypeStruct((), jnp.int32))
  kernels = re.findall(r'name = "(\w+)"', prompt)  # three attention layers, four MLPs
  assert sorted(kernels) == ["flash_gpu_forward"] * 3 + ["qk_norm_rope"] * 3 + ["relu2_up_gemm"] * 4
  assert prompt.count(f"custom_call @{TRITON}") == len(kernels)
  assert f"custom_call @{TRITON}" not in step and "dynamic_update_slice" in step
