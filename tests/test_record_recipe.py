"""The record config end to end at reduced dims: long rows, its layout and windows (its golden
curve is in test_golden.py)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from conftest import REPO, TINY, run_cli
from nanotext import config, programs, trainer, wiring
from nanotext.train import run

RECORD = os.path.join(REPO, "configs", "speedrun_record.yml")
SMALL = ["model.num_layers=4", "model.d_model=64", "model.num_heads=2", "model.head_dim=32",
         "model.mlp_dim=256", "model.align=0", "metrics.tensorboard=false", "checkpoint.every=0",
         "sample.max_new_tokens=0", "train.log_every=1"]
def test_record_config_is_the_records_layout():
  cfg = config.load(RECORD)
  t, a, d = cfg.train, cfg.attention, cfg.data
  assert (t.batch_size, t.seq_len, t.eval_seq_len, t.eval_batches) == \
      (8, 48 * 1024, 4 * 64 * 1024, 5)
  assert t.eval_batches * t.batch_size * t.eval_seq_len == d.val_tokens == 10485760
  assert (d.shuffle, a.block_windows, a.doc_mask, t.eval_windows) == (False, True, True, "step")
  assert (cfg.optim.warmup_steps, cfg.optim.head_lr_record) == (0, 0.22)


def train_step_temp_bytes(T: int) -> int:
  """Compiled temporaries per device of the record config's train step on rows of T tokens: the
  program a 2-step run compiles (one, taking its windows at run time; at T = 8,192 the next
  test's run finds it in the compilation cache)."""
  run_ = wiring.prepare(RECORD, TINY + SMALL + [f"train.seq_len={T}", "train.steps=2"])
  cfg = run_.cfg
  row = jax.ShapeDtypeStruct((cfg.train.batch_size, T), jnp.int32, sharding=run_.batch_sharding)
  steps = programs.compile_train_steps(run_, run_.abstract_state(),
                                       {"inputs": row, "targets": row}, range(cfg.train.steps),
                                       log=lambda s: None)
  (step,) = steps.execs.values()
  return step.memory_analysis().temp_size_in_bytes


def test_long_rows_memory_is_linear_in_T():
  small, large = train_step_temp_bytes(8192), train_step_temp_bytes(16384)
  print(f"train step temporaries: T=8192 {small / 2**20:.1f} MiB, T=16384 {large / 2**20:.1f} MiB")
  assert 1.8 < large / small < 2.2, (small, large)


def test_record_config_trains_on_long_rows(tmp_path):
  """One 8,192-token row per device, block windows and document masks, 2 steps and an eval."""
  result = run(RECORD, TINY + SMALL + ["train.seq_len=8192", "train.steps=2",
                                       "train.eval_every=0", "train.eval_batches=1",
                                       f"output_dir={tmp_path}"], log=lambda s: None)
  assert np.isfinite(result.last_loss) and np.isfinite(result.val_loss)
  assert int(result.state["step"]) == 2


def test_record_config_trains_on_one_49152_token_row(tmp_path):
  """The record's row length end to end through the CLI: one 49,152-token row on one device, the
  first two window stages (one program: the blocked kernel takes the windows at run time),
  validation on the same row length."""
  over = [o for o in TINY + SMALL if not o.startswith(("train.", "checkpoint."))]
  proc = run_cli("nanotext.train", RECORD, *over, "train.seq_len=49152", "train.batch_size=1",
                 "train.steps=2", "train.log_every=1", "train.eval_every=0",
                 "train.eval_batches=1", "train.eval_seq_len=0", "train.eval_at_start=false",
                 "checkpoint.every=0", f"output_dir={tmp_path}",
                 env={"XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "1x49152 tokens/step" in proc.stdout and "compiled 1 train step program " in proc.stdout
  assert "compilations inside the training loop: 0" in proc.stdout
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows if "loss" in r] == [1, 2]
  assert all(np.isfinite(r.get("loss", r.get("val_loss"))) for r in rows)


def one_step(reduction: str, clip: float = 0):
  """Params before and after one AdamW step whose eps dwarfs the gradient, so that the update is
  proportional to it, and the step's metrics."""
  ov = TINY + [f"train.loss_reduction={reduction}", "optim.eps=1e6", "optim.lr=1e6",
               "optim.warmup_steps=0", f"optim.grad_clip={clip}", "optim.weight_decay=0"]
  run_ = wiring.prepare(os.path.join(REPO, "configs", "base.yml"), ov, devices=jax.devices()[:1])
  state = run_.init_state()
  before = jax.tree.map(np.asarray, state["params"])
  batch = trainer.global_batch(run_, next(run_.train_iter()))
  after, m = trainer.make_train_step(run_)(state, batch)
  return before, jax.tree.map(np.asarray, after["params"]), jax.device_get(m)


def test_row_sum_steps_on_each_rows_summed_loss():
  """The record's reduction='sum' over a row: the gradient is seq_len times the mean's; the
  logged loss and gradient norm stay those of the mean."""
  p0, p_mean, m_mean = one_step("mean")
  _, p_sum, m_sum = one_step("row_sum")
  for a, b, c in zip(jax.tree.leaves(p0), jax.tree.leaves(p_mean), jax.tree.leaves(p_sum)):
    np.testing.assert_allclose(c - a, 32 * (b - a), rtol=2e-3, atol=1e-5)  # train.seq_len=32
  assert float(m_sum["loss"]) == float(m_mean["loss"])
  np.testing.assert_allclose(m_sum["grad_norm"], m_mean["grad_norm"], rtol=1e-5)


def test_grad_clip_bounds_the_logged_grad_norm_under_row_sum_too():
  """optim.grad_clip clipped row_sum's gradient, 32 times the logged grad_norm: a clip above
  that norm changed the step. Now it bounds the logged norm under either reduction."""
  p0, p_free, m = one_step("row_sum")
  norm = float(m["grad_norm"])
  _, p_above, _ = one_step("row_sum", clip=2 * norm)
  for a, b in zip(jax.tree.leaves(p_free), jax.tree.leaves(p_above)):
    np.testing.assert_array_equal(a, b)  # nothing clipped
  _, p_mean, _ = one_step("mean", clip=norm / 2)
  _, p_sum, _ = one_step("row_sum", clip=norm / 2)  # both halved: row_sum's still 32 times
  for a, b, c in zip(jax.tree.leaves(p0), jax.tree.leaves(p_mean), jax.tree.leaves(p_sum)):
    np.testing.assert_allclose(c - a, 32 * (b - a), rtol=2e-3, atol=1e-5)


def test_eval_at_start_validates_the_initial_weights_once(tmp_path):
  """train.eval_at_start (the record's step-0 validation): the zero-initialised head gives
  exactly ln(vocab); a resumed run does not validate step 0 again."""
  # No window schedule: its stages follow train.steps, so the resume (4 steps) would compile
  # programs of its own; with one stage it runs the first run's.
  common = TINY + SMALL + ["model.num_layers=2", "train.seq_len=256", "train.eval_every=2",
                           "train.eval_at_start=true", "attention.window_schedule=false",
                           "checkpoint.every=2", f"output_dir={tmp_path}"]
  run(RECORD, common + ["train.steps=2"], log=lambda s: None)
  run(RECORD, common + ["train.steps=4"], log=lambda s: None)
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  val = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
  assert sorted(val) == [0, 2, 4]
  np.testing.assert_allclose(val[0], np.log(512), rtol=1e-6)
