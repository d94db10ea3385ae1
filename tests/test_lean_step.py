"""The lean step on CPU: chunked cross-entropy and every remat policy give the plain step's loss
and gradients (float32, the speedrun's soft-capped FP8 head included), and what a chunked step's
compiled program does with the head weight."""

import jax
import numpy as np
import pytest

from conftest import BASE, SPEEDRUN, TINY
from nanotext import compile as nt_compile
from nanotext import hlo, hlo_loops, trainer, wiring, window_schedule
from nanotext.errors import UserError
from nanotext.model.gpt import REMAT_POLICIES

SPEEDRUN_TINY = ["model.num_layers=4", "model.d_model=64", "model.num_heads=2",
                 "model.head_dim=32", "model.mlp_dim=128", "model.align=0", "model.vocab_size=512",
                 "model.dtype=float32", "train.seq_len=64", "train.batch_size=8",
                 "attention.impl=xla", "attention.window=32", "attention.window_start=16",
                 "attention.window_block=16", "data.source=synthetic", "data.tokenizer=none",
                 "data.eot_id=0", "model.zero_init_head=false", "train.eval_seq_len=0"]


def loss_and_grads(path, overrides):
  """(loss, grads) of the train objective at step 0 on fixed tokens, as the train step sees it."""
  # One device: the math under test does not depend on the mesh, and it compiles fastest.
  run = wiring.prepare(path, overrides + ["mesh.fsdp=1"], devices=jax.devices()[:1])
  cfg = run.cfg
  params = run.init_state()["params"]
  rng = np.random.default_rng(0)
  shape = (cfg.train.batch_size, cfg.train.seq_len)
  x, y = (rng.integers(0, cfg.model.vocab_size, shape).astype(np.int32) for _ in range(2))
  windows = window_schedule.step_windows(cfg, 0)

  def objective(p):
    return trainer.loss_fn(run.graphdef, p, x, y, run.eot_id, windows, cfg.train.loss_chunk)
  return jax.jit(jax.value_and_grad(objective))(params)


def assert_same(got, want, rtol=2e-5, atol=1e-6):
  np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=rtol)
  for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def speedrun_plain():
  return loss_and_grads(SPEEDRUN, SPEEDRUN_TINY + ["model.remat=none", "train.loss_chunk=0"])


def test_chunked_loss_matches_plain_tied_head():
  want = loss_and_grads(BASE, TINY + ["train.loss_chunk=0"])
  assert_same(loss_and_grads(BASE, TINY + ["train.loss_chunk=8"]), want)


def test_chunked_loss_matches_plain_softcap_fp8_head(speedrun_plain):
  assert_same(loss_and_grads(SPEEDRUN, SPEEDRUN_TINY + ["train.loss_chunk=16"]), speedrun_plain)


def test_chunked_loss_matches_plain_bfloat16_fp8_head():
  """In bfloat16 too (the FP8 head's codes made once, before the chunks' loop: model/loss.py)."""
  tiny = SPEEDRUN_TINY + ["model.dtype=bfloat16", "model.remat=none"]
  assert_same(loss_and_grads(SPEEDRUN, tiny + ["train.loss_chunk=16"]),
              loss_and_grads(SPEEDRUN, tiny + ["train.loss_chunk=0"]))


@pytest.mark.parametrize("policy", sorted(REMAT_POLICIES))
def test_remat_policies_match_no_remat(policy, speedrun_plain):
  got = loss_and_grads(SPEEDRUN, SPEEDRUN_TINY + [f"model.remat={policy}",
                                                   "train.loss_chunk=32"])
  assert_same(got, speedrun_plain)


def head_weight_gathers(text: str, vocab: int, d_model: int) -> int:
  """All-gathers of a [d_model, vocab] array (FSDP's of the head weight) one step of a compiled
  program runs, those of a loop body once per trip."""
  return sum(k.count for k in hlo.kernels(text)
             if k.name.startswith("all-gather") and k.largest == vocab * d_model)


def test_a_chunked_loss_gathers_the_head_weight_once_a_step():
  """Under FSDP the loss chunks read the head weight gathered once before their loop: read in
  each chunk, the train step's backward pass gathered it twice a chunk (9 gathers here; the
  record's eval on v6e-8 once a chunk, 1,024 times: tests/test_compile.py)."""
  run = wiring.prepare(BASE, TINY + ["train.loss_chunk=8", "mesh.fsdp=8"])
  m = run.cfg.model
  lowered = trainer.make_train_step(run).lower(run.abstract_state(),
                                               nt_compile.abstract_batch(run))
  assert head_weight_gathers(lowered.compile().as_text(), m.vocab_size, m.d_model) == 1


def e4m3_made(text: str, shape: str) -> int:
  """How many times one step of a compiled program makes e4m3 codes of an array of `shape`
  ('64,512'): converts inside fusions too, those of a loop body once per trip."""
  comps, entry = hlo.parse(text)
  runs = hlo_loops.runs(comps, entry)
  return sum(runs.get(name, 0) for name, instrs in comps.items() for ins in instrs
             if ins.opcode == "convert" and ins.type.startswith(f"f8e4m3fn[{shape}]"))


def test_a_chunked_fp8_head_quantizes_its_weight_once_a_step():
  """Under loss chunks the FP8 head's [d_model, vocab] weight becomes e4m3 codes once a step,
  before the chunks' loop: made in each chunk, the rematerialised backward pass quantized the
  whole weight again in every chunk (5 times here; at the record's 768 x 50,304 weight and
  256-token chunks of a 49,152-token row, 192 passes over its 154 MB a step)."""
  run = wiring.prepare(SPEEDRUN, SPEEDRUN_TINY + ["train.loss_chunk=16", "mesh.fsdp=1"],
                       devices=jax.devices()[:1])
  m = run.cfg.model
  lowered = trainer.make_train_step(run).lower(run.abstract_state(),
                                               nt_compile.abstract_batch(run))
  assert e4m3_made(lowered.compile().as_text(), f"{m.d_model},{m.vocab_size}") == 1


@pytest.mark.fast
def test_bad_lean_step_keys_are_user_errors():
  with pytest.raises(UserError, match="train.loss_chunk=24 does not divide train.seq_len=32"):
    wiring.load(BASE, TINY + ["train.loss_chunk=24"])
  # 16 divides train.seq_len=48 but not the warmup's 24-token rows; 12 divides both.
  warmup = TINY + ["train.seq_len=48", "train.seq_len_start=24"]
  with pytest.raises(UserError, match=r"^train\.loss_chunk=16 does not divide the 24-token rows .*"
                                      r"train\.seq_len_start=24"):
    wiring.load(BASE, warmup + ["train.loss_chunk=16"])
  wiring.load(BASE, warmup + ["train.loss_chunk=12"])
  with pytest.raises(UserError, match="model.remat='some' is not one of: none, full, dots, auto"):
    wiring.load(BASE, TINY + ["model.remat=some"])
