"""Sampling: greedy and top-k against the model's own logits, seeds, the empty prompt."""

import functools
import re

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import BASE, TINY
from nanotext import generate, wiring
from nanotext.errors import UserError
from nanotext.model import kv_cache

PROMPT = [5, 17, 300, 42]
MAX_LEN = 32  # TINY's seq_len, hence its learned position table


@functools.lru_cache(maxsize=None)
def model_and_params(seed=1):
  """TINY's GPT (one layer) with parameters from `seed`, as (graphdef, params dict) the sampler takes.

  The lm head is untied: with a small tied embedding greedy decoding just repeats the last token.
  """
  run = wiring.prepare(BASE, TINY + ["model.tie_embeddings=false", "model.num_layers=1"])
  params = nnx.to_pure_dict(nnx.state(run.create_model(seed)))
  return run.graphdef, params


@functools.lru_cache(maxsize=None)
def forward():
  graphdef, _ = model_and_params()
  return jax.jit(lambda params, x: nnx.merge(graphdef, params)(x)[0])


def logits_at(tokens):
  """The model's logits [len(tokens), V] in one forward pass over `tokens` (at most MAX_LEN).

  Causal attention makes row i the next-token logits after tokens[:i + 1]; the pass runs on a
  zero-padded MAX_LEN buffer so that every call shares one compiled program.
  """
  buf = np.zeros((1, MAX_LEN), np.int32)
  buf[0, :len(tokens)] = tokens
  return np.asarray(forward()(model_and_params()[1], buf), np.float32)[:len(tokens)]


def sample(prompt=PROMPT, **kw):
  graphdef, params = model_and_params()
  args = dict(max_len=MAX_LEN, max_new_tokens=6, temperature=0.0, top_k=0, seed=0)
  return generate.sample(graphdef, params, list(prompt), **{**args, **kw})


def assert_argmax(logits_V, token):
  top2 = np.sort(logits_V)[-2:]
  assert top2[1] - top2[0] > 1e-4  # no near-tie that rounding could flip
  assert token == int(np.argmax(logits_V))


def test_greedy_is_the_argmax_continuation():
  """temperature=0 appends the argmax of the model's logits after everything before it."""
  got = sample(max_new_tokens=6, seed=9)  # the seed plays no part
  assert len(got) == 6 and all(type(t) is int for t in got)
  logits = logits_at(PROMPT + got)
  for i, t in enumerate(got):
    assert_argmax(logits[len(PROMPT) - 1 + i], t)


@pytest.mark.fast
def test_greedy_keeps_the_last_max_len_tokens():
  """Past max_len the context slides: each token is the argmax after the newest 5 tokens."""
  got = sample(max_len=5, max_new_tokens=4)
  tokens = PROMPT + got
  for i, t in enumerate(got):
    end = len(PROMPT) + i
    ctx = tokens[max(0, end - 5):end]
    assert_argmax(logits_at(ctx)[-1], t)
  # With the whole context the continuation differs: the window really is cut.
  assert got != sample(max_new_tokens=4)


@pytest.mark.fast
def test_top_k_one_is_greedy():
  """With top_k=1 only the most likely token survives, at any temperature."""
  assert sample(max_new_tokens=5, temperature=1.5, top_k=1, seed=3) == \
      sample(max_new_tokens=5)


def test_top_k_samples_only_the_k_most_likely():
  """Every sampled token is among the k most likely after the tokens before it; seeds differ."""
  k, runs = 3, []
  for seed in range(3):
    got = sample(max_new_tokens=5, temperature=2.0, top_k=k, seed=seed)
    logits = logits_at(PROMPT + got)
    for i, t in enumerate(got):
      assert t in np.argsort(logits[len(PROMPT) - 1 + i])[-k:], (seed, i, t)
    runs.append(got)
  assert len({tuple(r) for r in runs}) > 1  # it samples rather than taking the argmax


def test_top_k_sampler_over_many_keys():
  """One position, many keys: the draws cover the k most likely tokens and nothing else."""
  graphdef, params = model_and_params()
  step = generate.make_sampler(graphdef, MAX_LEN, temperature=5.0, top_k=4)
  buf = np.zeros((1, MAX_LEN), np.int32)
  buf[0, :len(PROMPT)] = PROMPT
  keys = jax.random.split(jax.random.key(0), 32)  # one row each
  draws = set(np.asarray(step(params, np.repeat(buf, 32, 0), len(PROMPT) - 1, keys)).tolist())
  top = set(np.argsort(logits_at(PROMPT)[-1])[-4:].tolist())
  assert draws == top


@pytest.mark.fast
def test_same_seed_same_tokens():
  """Sampling is a function of the seed: equal seeds agree, different seeds differ."""
  a = sample(max_new_tokens=8, temperature=1.0, seed=7)
  assert sample(max_new_tokens=8, temperature=1.0, seed=7) == a
  assert sample(max_new_tokens=8, temperature=1.0, seed=8) != a
  assert all(0 <= t < 512 for t in a)


def test_tiktoken_ids_past_its_vocabulary_decode_to_no_text():
  """The speedrun's 50,304 rows pad GPT-2's 50,257 ids: a young model samples the padding rows,
  and tiktoken raised KeyError on them (a traceback at the end-of-run sample)."""
  from nanotext.data.tokenizer import TiktokenTokenizer

  class Encoding:  # tiktoken's interface, as far as decode uses it
    n_vocab, eot_token = 4, 3
    def decode(self, ids):
      return "".join("abc|"[i] for i in ids)
  assert TiktokenTokenizer(Encoding()).decode([0, 50300, 1, 4, -1, 2]) == "abc"


@pytest.mark.parametrize("source", ["shakespeare", "synthetic"])
def test_a_prompt_past_the_models_rows_is_refused(tmp_path, source):
  """Prompt ids past the token table's rows were looked up clamped: generate printed garbage,
  exit 0 (a run whose tokenizer outgrows its model: written by from-hf, or trained on synthetic
  ids). Refused before the checkpoint is read; a prompt whose ids fit is read."""
  out = tmp_path / "run"
  out.mkdir()
  with open(BASE) as f:
    text = f.read().replace("vocab_size: 8192 ", "vocab_size: 512 ")
  (out / "config.yml").write_text(text.replace("source: shakespeare ", f"source: {source} "))
  with pytest.raises(UserError, match=r"the prompt's token id \d+ \(tokenizer 'shakespeare'\) "
                                      r"is past the model's 512 token rows"):
    generate.main([f"output_dir={out}", "prompt=Thou art a villain", "max_new_tokens=2"])
  with pytest.raises(UserError, match="holds no checkpoints"):  # past the prompt's check
    generate.main([f"output_dir={out}", "prompt=a", "max_new_tokens=2"])


def test_a_run_without_a_tokenizer_is_told_where_to_name_one(tmp_path):
  """generate on a data.tokenizer=none run said 'set data.tokenizer', an argument it refuses:
  the line names the run's config.yml (data.* is no model key its checkpoint is checked on)."""
  out = tmp_path / "run"
  out.mkdir()
  with open(BASE) as f:
    text = f.read().replace("tokenizer: shakespeare ", "tokenizer: none ")
  (out / "config.yml").write_text(text.replace("eot_id: -1 ", "eot_id: 0 "))
  with pytest.raises(UserError, match=r"^data.tokenizer is 'none' .*: set it in '"
                     + re.escape(str(out / "config.yml")) + "' .*before training resumes"):
    generate.main([f"output_dir={out}", "max_new_tokens=2"])


def test_empty_prompt_is_a_user_error():
  """A prompt that encodes to nothing is refused before any compile."""
  with pytest.raises(UserError, match="no tokens"):
    sample(prompt=[])


@pytest.mark.fast
def test_for_sampling_rebuilds_the_saved_run_on_one_device(tmp_path):
  """generate's path: a run's saved config (finalized for 8 devices) checked and finalized by
  wiring for one device gives the trained model's parameter shapes."""
  import os
  from nanotext import config
  run = wiring.prepare(BASE, TINY)
  path = os.path.join(tmp_path, "config.yml")
  config.save(run.cfg, path)
  cfg, _, abstract = wiring.for_sampling(wiring.load(path), jax.devices(), checked=True)
  assert cfg.mesh.fsdp == 1 and run.cfg.mesh.fsdp == 8
  shapes = lambda tree: jax.tree.map(lambda x: tuple(x.shape), tree)
  assert shapes(abstract) == shapes(run.abstract_state()["params"])


@pytest.mark.fast
def test_text_pieces_are_whole_characters_and_join_to_the_whole_decode():
  """generate prints each token's text as it is drawn: a token that ends inside a multi-byte
  character waits for the rest of it, and the printed pieces are the text decoded at once."""
  from nanotext.data.tokenizer import get_tokenizer
  tok = get_tokenizer("shakespeare")
  ids = tok.encode("ROMEO: héllo — wörld 日本語 😀, thou art.\nJULIET: ay.")
  pieces = list(generate.text_pieces(tok, ids))
  assert "".join(pieces) == tok.decode(ids)
  assert not any("\ufffd" in p for p in pieces)
  assert len(pieces) < len(ids)  # a character split over tokens waited for its last
  ascii_ids = tok.encode("ROMEO: thou art.")
  assert list(generate.text_pieces(tok, ascii_ids)) == [tok.decode([i]) for i in ascii_ids]


@pytest.mark.fast
def test_text_pieces_hold_back_at_most_a_few_tokens():
  """Tokens that never complete a character still print, MAX_PENDING at a time."""
  class Broken:
    def decode(self, ids):
      return "\ufffd" * len(ids)
  pieces = list(generate.text_pieces(Broken(), range(20)))
  assert [len(p) for p in pieces] == [5, 5, 5, 5] and generate.MAX_PENDING == 8
  # lone continuation bytes, then a whole character split over tokens: held back with the
  # last tokens, not cut at the eighth (the pieces did not join to the text then)
  from nanotext.data.tokenizer import get_tokenizer
  tok = get_tokenizer("shakespeare")
  ids = [tok.encode("日")[1]] * 7 + tok.encode("日本")
  assert "".join(generate.text_pieces(tok, ids)) == tok.decode(ids)


@pytest.mark.fast
def test_a_context_runs_in_the_smallest_power_of_two_bucket():
  assert [generate.bucket(n, 49152) for n in (1, 128, 129, 4000, 40000, 49152)] == \
      [128, 128, 256, 4096, 49152, 49152]
  assert generate.bucket(5, MAX_LEN) == MAX_LEN  # never past the model's max_seq_len


def test_bucketed_buffers_sample_what_the_whole_buffer_does(monkeypatch):
  """Causal attention: the logits after a context are the same in any buffer that holds it, so
  sampling in a bucket of the context's size draws the whole buffer's greedy tokens."""
  monkeypatch.setattr(generate, "MIN_BUCKET", 8)  # buckets 8, 16, 32 inside TINY's 32
  tokens = sample(max_new_tokens=12)  # contexts of 4..15 tokens: buckets of 8 and 16
  context = list(PROMPT)
  for token in tokens:
    assert_argmax(logits_at(context)[-1], token)  # a forward over all MAX_LEN positions
    context.append(token)


@pytest.mark.fast
def test_a_temperature_near_zero_is_greedy():
  """Logits divided by 1e-38 overflowed to inf and the draw became NaN's (token 0 each time):
  they are shifted by their maximum first, so a tiny temperature is the argmax."""
  greedy = sample(max_new_tokens=5)
  assert sample(max_new_tokens=5, temperature=1e-38, seed=3) == greedy
  assert sample(max_new_tokens=5, temperature=1e-38, top_k=3, seed=4) == greedy


@pytest.mark.fast
def test_samples_are_drawn_in_batches_that_fit(monkeypatch):
  """num_samples rows per batch: every sample up to MAX_ROWS, fewer where their caches (and,
  once the context slides, a buffer's logits) would pass BATCH_BYTES; at least one."""
  graphdef, params = model_and_params()
  cfg = wiring.prepare(BASE, TINY + ["sample.max_new_tokens=8"]).cfg
  assert generate.batch_rows(graphdef, params, cfg, 4, 5) == 5
  assert generate.batch_rows(graphdef, params, cfg, 4, 1000) == generate.MAX_ROWS
  monkeypatch.setattr(generate, "BATCH_BYTES", 1)
  assert generate.batch_rows(graphdef, params, cfg, 4, 1000) == 1
  row = kv_cache.row_bytes(nnx.merge(graphdef, params), 32)  # 12 positions: bucket 32
  monkeypatch.setattr(generate, "BATCH_BYTES", 3 * row)
  assert generate.batch_rows(graphdef, params, cfg, 4, 1000) == 3
  slides = TINY + ["sample.max_new_tokens=40"]  # past max_len 32: + a buffer's logits per row
  cfg = wiring.prepare(BASE, slides).cfg
  monkeypatch.setattr(generate, "BATCH_BYTES", 3 * (row + 32 * 512 * 4))
  assert generate.batch_rows(graphdef, params, cfg, 4, 1000) == 3


@pytest.mark.fast
def test_seeds_2_to_the_32_apart_draw_different_keys():
  """Without jax_enable_x64 jax.random.key keeps a seed's low 32 bits: seed 3 and 2**32 + 3
  (and -1 and 2**32 - 1) sampled the same text under different labels."""
  data = lambda seeds: np.asarray(jax.random.key_data(generate.seed_keys(seeds)))
  small = [0, 3, 2**32 - 1]
  np.testing.assert_array_equal(data(small), np.stack(
      [jax.random.key_data(jax.random.key(s)) for s in small]))  # as before for 32-bit seeds
  rows = data([3, 2**32 + 3, -1, 2**32 - 1, 2**63 - 1])
  assert len({tuple(r) for r in rows}) == 5, rows


@pytest.mark.fast
def test_a_model_trained_with_document_masks_samples_with_them():
  """generate and the closing sample pass the run's end-of-text id (documents then see nothing
  before their end-of-text; test_kv_cache) where attention.doc_mask is on, and only there."""
  assert generate.doc_eot(wiring.load(BASE, TINY)) is None
  assert generate.doc_eot(wiring.load(BASE, TINY + ["attention.doc_mask=true",
                                                    "data.eot_id=7"])) == 7


@pytest.mark.fast
def test_an_argument_given_twice_is_refused():
  """output_dir=A output_dir=B read B, seed=1 seed=2 drew with 2, silently."""
  for argv in (["output_dir=a", "output_dir=b"], ["output_dir=a", "seed=1", "seed=2"]):
    with pytest.raises(UserError, match=f"{argv[-1].split('=')[0]}= is given twice"):
      generate.parse(argv)


@functools.lru_cache(maxsize=None)
def padded_model():
  """(run, graphdef, params): TINY's one-layer GPT with 8 token rows under a 512-wide head
  (model.embed_rows, as the record pads its head), the padding ids' logits made to dominate."""
  run = wiring.prepare(BASE, TINY + ["model.tie_embeddings=false", "model.num_layers=1",
                                     "model.embed_rows=8", "sample.max_new_tokens=12"])
  params = nnx.to_pure_dict(nnx.state(run.create_model(1)))
  kernel = np.array(params["head"]["kernel"], np.float32)
  kernel[:, :8] *= 0.01
  kernel[:, 8:] *= 10.0
  params["head"]["kernel"] = kernel.astype(params["head"]["kernel"].dtype)
  return run, run.graphdef, params


@pytest.mark.parametrize("temperature,top_k", [(0.0, 0), (1.0, 0), (1.0, 100), (1e-38, 3)])
def test_head_padding_ids_are_never_drawn(temperature, top_k):
  """A head wider than the token table (the record's 50,304 over 50,257 rows) drew padding ids:
  fed back, jnp.take's fill made the row NaN and every later token id 0. Only ids with a row
  are drawn, greedy, sampled and with top_k past them, in a batch and with or without the
  key-value cache, which agree."""
  _, graphdef, params = padded_model()
  kw = dict(max_len=MAX_LEN, max_new_tokens=12, temperature=temperature, top_k=top_k)
  draw = lambda cache: [list(r) for r in zip(*generate.stream_rows(
      graphdef, params, [1, 2, 3], seeds=(0, 1, 2), cache=cache, **kw))]
  cached, uncached = draw(True), draw(False)
  assert all(0 <= t < 8 for row in cached for t in row), cached
  assert cached == uncached


def test_ids_past_the_tokenizers_vocabulary_are_never_drawn():
  """Token rows past the tokenizer's vocabulary (a model wider than it) were drawn and dropped
  from the text: fewer tokens printed than asked for. The end-of-run sample draws below it."""
  run, graphdef, params = padded_model()

  class Tokenizer:
    vocab_size = 4
    def encode(self, text):
      return [1, 2, 3]
  got = list(generate.sample_ids(graphdef, params, run.cfg, Tokenizer(), "x"))
  assert len(got) == 12 and all(0 <= t < 4 for t in got), got
  wide = generate.sample(graphdef, params, [1, 2], seed=0, max_len=MAX_LEN, max_new_tokens=12,
                         temperature=1.0, top_k=0, ids=4, cache=False)
  assert all(0 <= t < 4 for t in wide), wide
