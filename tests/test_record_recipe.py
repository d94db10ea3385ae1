"""The record config end to end at reduced dims: long rows, its layout and windows, a golden curve."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from conftest import REPO, TINY
from nanotext import config, trainer, wiring
from nanotext.train import run

RECORD = os.path.join(REPO, "configs", "speedrun_record.yml")
SMALL = ["model.num_layers=4", "model.d_model=64", "model.num_heads=2", "model.head_dim=32",
         "model.mlp_dim=256", "model.align=0", "metrics.tensorboard=false", "checkpoint.every=0",
         "sample.max_new_tokens=0", "train.log_every=1"]
# 20 steps without warmup on the embedded corpus: rows of 1,024 tokens in shard order, one per
# device, document masks, block windows growing 128 -> 512 over the run, evaluation on 2,048-token
# rows with the final step's windows, bf16 tables, FP8 head in training.
GOLDEN_RUN = SMALL + ["train.steps=20", "train.seq_len=1024", "train.batch_size=8",
                      "train.eval_every=0", "train.eval_seq_len=2048", "train.eval_batches=1",
                      "attention.window=512", "optim.muon_momentum_warmup=10",
                      "data.source=shakespeare", "data.tokenizer=shakespeare",
                      "model.vocab_size=8192"]
# Recorded at this commit's parent on 8 CPU devices, seed 0.
GOLDEN = ([9.010912895202637, 8.654658317565918, 7.806754112243652, 6.903491020202637,
           6.254466533660889, 6.260995864868164, 5.791075229644775, 5.555566787719727,
           5.4335150718688965, 5.394953727722168, 5.627481460571289, 5.605363368988037,
           5.785171031951904, 5.396341323852539, 5.380489826202393, 5.760692119598389,
           5.392505645751953, 5.313208103179932, 5.557782173156738, 5.61444616317749],
          5.426137924194336)


def test_record_config_is_the_records_layout():
  cfg = config.load(RECORD)
  t, a, d = cfg.train, cfg.attention, cfg.data
  assert (t.batch_size, t.seq_len, t.eval_seq_len, t.eval_batches) == \
      (8, 48 * 1024, 4 * 64 * 1024, 5)
  assert t.eval_batches * t.batch_size * t.eval_seq_len == d.val_tokens == 10485760
  assert (d.shuffle, a.block_windows, a.doc_mask, t.eval_windows) == (False, True, True, "step")
  assert (cfg.optim.warmup_steps, cfg.optim.head_lr_record) == (0, 0.22)


def test_golden_curve_of_the_record_config(tmp_path):
  run(RECORD, GOLDEN_RUN + [f"output_dir={tmp_path}"], log=lambda s: None)
  with open(tmp_path / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  losses = [r["loss"] for r in rows if "loss" in r]
  val = [r["val_loss"] for r in rows if "val_loss" in r]
  assert len(losses) == 20 and len(val) == 1
  np.testing.assert_allclose(losses, GOLDEN[0], rtol=1e-4)
  np.testing.assert_allclose(val, [GOLDEN[1]], rtol=1e-4)


def train_step_temp_bytes(T: int) -> int:
  """Compiled temporaries per device of the record config's train step on rows of T tokens."""
  run_ = wiring.prepare(RECORD, TINY + SMALL + [f"train.seq_len={T}"])
  cfg = run_.cfg
  row = jax.ShapeDtypeStruct((cfg.train.batch_size, T), jnp.int32, sharding=run_.batch_sharding)
  windows = trainer.step_windows(cfg, cfg.train.steps)  # the final (largest) windows
  step = trainer.make_train_step(run_, windows).lower(run_.abstract_state(),
                                                      {"inputs": row, "targets": row})
  return step.compile().memory_analysis().temp_size_in_bytes


def test_long_rows_memory_is_linear_in_T():
  small, large = train_step_temp_bytes(8192), train_step_temp_bytes(16384)
  assert 1.8 < large / small < 2.2, (small, large)


def test_record_config_trains_on_long_rows(tmp_path):
  """One 8,192-token row per device, block windows and document masks, 2 steps and an eval."""
  result = run(RECORD, TINY + SMALL + ["train.seq_len=8192", "train.steps=2",
                                       "train.eval_every=0", "train.eval_batches=1",
                                       f"output_dir={tmp_path}"], log=lambda s: None)
  assert np.isfinite(result.last_loss) and np.isfinite(result.val_loss)
  assert int(result.state["step"]) == 2
