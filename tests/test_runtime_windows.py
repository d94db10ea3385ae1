"""Windows as a runtime input: kernels that take a traced window agree with their static-window
programs, the program plan groups window stages, and the record's schedule runs in one train
program (plus one eval program) with the per-stage programs' losses."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE, REPO, TINY
from test_attention import forward_and_grads, inputs, kernel, max_errors, SCALE
from nanotext import programs, trainer, window_schedule, wiring
from nanotext.model.kernels.dispatch import RUNTIME_WINDOW_IMPLS, takes_runtime_window
from nanotext.train import run

# (window, bound, block): token windows under a token bound, block windows under a block bound,
# a window covering the row (0 = causal) under no bound, and a 1-block window.
CASES = [(16, 40, 0), (40, 40, 0), (0, 0, 0), (16, 48, 16), (32, 0, 16), (16, 16, 16), (0, 48, 0)]


@pytest.mark.parametrize("impl", RUNTIME_WINDOW_IMPLS)
@pytest.mark.parametrize("window,bound,block", CASES)
def test_runtime_window_matches_the_static_window(impl, window, bound, block):
  if impl == "cpu" and block:
    pytest.skip("the cpu kernel has no block windows")
  if impl == "flash_gpu":
    pytest.skip("its tiles need rows of 128+: tests/test_flash_gpu.py runs its runtime windows")
  if window == 0 and bound:
    pytest.skip("0 (no window) needs no bound")
  q, k, v, g, seg = inputs(64, seed=window + bound)
  static = forward_and_grads(kernel(impl), q, k, v, g, scale=SCALE, window=window, block=block,
                             segment_ids_BT=seg)
  fn = jax.jit(lambda q, k, v, g, w: forward_and_grads(
      kernel(impl), q, k, v, g, scale=SCALE, window=bound, block=block, segment_ids_BT=seg,
      runtime_window=w))
  live = fn(q, k, v, g, jnp.int32(window))
  assert max(max_errors(live, static)) < 2e-6
  # The same compiled program with another window gives that window's attention.
  other = 8 if not block else 16
  if not bound or other <= bound:
    want = forward_and_grads(kernel(impl), q, k, v, g, scale=SCALE, window=other, block=block,
                             segment_ids_BT=seg)
    assert max(max_errors(fn(q, k, v, g, jnp.int32(other)), want)) < 2e-6


def test_static_only_kernels_refuse_a_runtime_window():
  assert not any(takes_runtime_window(i) for i in ("splash", "cudnn", "flash"))
  q, k, v, _, _ = inputs(128)
  with pytest.raises(ValueError, match="static window"):
    kernel("splash")(q, k, v, scale=SCALE, window=32, runtime_window=jnp.int32(16))


def test_plan_groups_window_stages_by_row_length():
  stages = [((16, 16), 32), ((32, 16), 32), ((16, 16), 64), ((32, 16), 64), ((0, 32), 64)]
  static = window_schedule.plan(stages, runtime=False)
  assert len(set(static.values())) == 5 and not any(p.runtime for p in static.values())
  runtime = window_schedule.plan(stages, runtime=True)
  progs = list(dict.fromkeys(runtime.values()))
  assert [(p.seq_len, p.windows, p.runtime) for p in progs] == \
      [(32, (32, 16), True), (64, (0, 32), True)]  # 0 (causal) bounds nothing
  assert progs[0].describe() == "windows 16..32, runtime"
  single = window_schedule.plan([((16, 16), 32)], runtime=True)
  assert not single[((16, 16), 32)].runtime  # one stage: the tighter static program


@pytest.mark.parametrize("extra", [["attention.window_pattern=LS"],  # cpu kernel, token windows
                                   ["model.scan_layers=true", "attention.block_windows=true"]])
def test_model_runtime_windows_match_static_windows(extra):
  """GPT.hidden with per-layer windows as an array (under bounds) equals the static windows,
  unrolled (the cpu kernel, long and short layers) and scanned (the blocked kernel)."""
  r = wiring.prepare(BASE, TINY + ["train.seq_len=64", "attention.window=32",
                                   "attention.window_block=16", "attention.window_start=16",
                                   "attention.window_schedule=true"] + extra,
                     devices=jax.devices()[:1])
  model = r.create_model()
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 500, (2, 64)), jnp.int32)
  segments = jnp.cumsum(tokens % 7 == 0, axis=1, dtype=jnp.int32)
  hidden = jax.jit(lambda w: model.hidden(tokens, segments, (32, 32), w))
  for windows in ((16, 16), (32, 16), (32, 32)):
    if len(set(windows)) > 1 and r.cfg.model.scan_layers:
      continue
    want = jax.jit(lambda: model.hidden(tokens, segments, windows))()  # not one program per op
    np.testing.assert_allclose(hidden(jnp.asarray(windows, jnp.int32)), want, atol=2e-6)


# The record config (speedrun_record.yml) shrunk: 2 layers of 64 (one long window, one short: each
# layer takes its own window at run time), one 1,024-token row per device (8 devices), block
# windows 128 -> 512 over 8 steps (4 stages), validation every 4 steps at the step's windows
# (eval_windows=step, as the record) on 2,048-token rows.
RECORD = os.path.join(REPO, "configs", "speedrun_record.yml")
RECORD_SMALL = ["model.num_layers=2", "model.d_model=64", "model.num_heads=2",
                "model.head_dim=32", "model.mlp_dim=256", "model.align=0", "model.dtype=float32",
                "model.vocab_size=8192", "data.source=shakespeare", "data.tokenizer=shakespeare",
                "train.seq_len=1024", "train.batch_size=8", "train.eval_seq_len=2048",
                "train.eval_batches=1", "attention.window=512", "train.steps=8",
                "train.eval_every=4", "train.log_every=1", "train.eval_at_start=false",
                "optim.warmup_steps=0", "optim.muon_momentum_warmup=10", "model.remat=none",
                "train.loss_chunk=0", "sample.max_new_tokens=0", "metrics.tensorboard=false",
                "checkpoint.every=0"]


@pytest.mark.slow
def test_record_schedule_compiles_one_train_and_one_eval_program(tmp_path):
  lines = []
  result = run(RECORD, RECORD_SMALL + [f"output_dir={tmp_path}"], log=lines.append)
  assert result.programs == 2 and result.compiles_in_loop == 0
  assert any(l.startswith("compiled train (windows 128..512, runtime) in ") for l in lines)
  assert any(l.startswith("compiled eval (windows 256..512, runtime) in ") for l in lines)
  assert any(l.startswith("compiled 1 train step program and the eval step (2 in all)")
             for l in lines)
  with open(tmp_path / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  windows = [r["attn_window"] for r in rows if "loss" in r]  # the schedule's, per step
  assert sorted(set(windows)) == [128, 256, 384, 512] and windows == sorted(windows)
  assert len([r for r in rows if "val_loss" in r]) == 2


@pytest.mark.slow
def test_record_schedule_steps_equal_the_per_stage_programs(monkeypatch):
  """Every step of the schedule, from the same state: the one runtime-window program's loss and
  gradient norm equal the static per-stage program's, as do the evaluations. (Trajectories are
  compared step by step: training amplifies last-bit differences, from reductions over the
  wider strips, ~100x in three steps here.)"""
  r = wiring.prepare(RECORD, RECORD_SMALL)
  cfg = r.cfg
  steps = range(cfg.train.steps)
  it = r.train_iter()
  batches = [trainer.global_batch(r, next(it)) for _ in steps]
  val = trainer.global_batch(r, r.val_batches()[0])
  state = r.init_state()
  copy = lambda s: jax.tree.map(jnp.copy, s)
  live = programs.compile_train_steps(r, state, batches[0], steps, log=lambda s: None)
  dones = window_schedule.eval_points(cfg.train)
  evals = {"live": window_schedule.eval_plan(cfg, dones, True)}
  monkeypatch.setattr(programs, "takes_runtime_window", lambda impl: False)
  static = programs.compile_train_steps(r, state, batches[0], steps, log=lambda s: None)
  evals["static"] = window_schedule.eval_plan(cfg, dones, False)
  assert (len(live), len(static)) == (1, 4)
  progs = {k: programs.compile_programs(r, "eval", p, (state["params"], val), lambda s: None)
           for k, p in evals.items()}
  assert (len(progs["live"]), len(progs["static"])) == (1, 2)
  for step, batch in zip(steps, batches):
    stage = window_schedule.step_stage(cfg, step)
    want = jax.device_get(static(stage, copy(state), batch)[1])
    state, got = live(stage, state, batch)
    got = jax.device_get(got)
    for key in ("loss", "grad_norm"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=f"{key} step {step}")
    if step + 1 in dones:
      key = (window_schedule.eval_windows(cfg, step + 1), 2048)
      np.testing.assert_allclose(progs["live"](key, state["params"], val),
                                 progs["static"](key, state["params"], val), rtol=1e-5)
