"""The record config end to end at reduced dims: long rows, its layout and windows (its golden
curve is in test_golden.py)."""

import os

import jax
import jax.numpy as jnp
import numpy as np

from conftest import REPO, TINY
from nanotext import config, trainer, wiring, window_schedule
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
  """Compiled temporaries per device of the record config's train step on rows of T tokens."""
  run_ = wiring.prepare(RECORD, TINY + SMALL + [f"train.seq_len={T}"])
  cfg = run_.cfg
  row = jax.ShapeDtypeStruct((cfg.train.batch_size, T), jnp.int32, sharding=run_.batch_sharding)
  windows = window_schedule.step_windows(cfg, cfg.train.steps)  # the final (largest) windows
  step = trainer.make_train_step(run_, windows).lower(run_.abstract_state(),
                                                      {"inputs": row, "targets": row})
  return step.compile().memory_analysis().temp_size_in_bytes


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
