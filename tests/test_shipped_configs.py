"""Every shipped config, at toy dims but with its own dtypes, optimizer and schedules: the train
step's state keeps its dtypes and shapes (an AOT-compiled step refuses its own output otherwise),
and a few steps run through the CLI."""

import glob
import json
import os
import re

import jax
import jax.numpy as jnp
import pytest
import yaml

from conftest import REPO, run_cli
from nanotext import config, trainer, wiring, window_schedule

CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "*.yml")))
# Toy dims only: dtypes, optimizer, FP8 head, loss reduction and schedules stay each config's.
SHRINK = ["model.num_layers=4", "model.d_model=64", "model.num_heads=2", "model.head_dim=32",
          "model.mlp_dim=128", "model.vocab_size=512", "model.embed_rows=0", "model.align=0",
          "model.max_seq_len=0", "train.seq_len=256", "train.eval_seq_len=0",
          "train.eval_batches=1", "train.steps=3", "train.eval_every=0", "train.log_every=1",
          "data.source=synthetic", "data.tokenizer=none", "data.eot_id=0", "data.val_tokens=0",
          "checkpoint.every=0", "sample.max_new_tokens=0", "metrics.tensorboard=false"]
# Per config, what the toy dims force: windows that fit a 256-token row, a batch the recipe's
# micro-batching and sequence-length warmup can cut.
FIT = {"speedrun": ["attention.window=256", "attention.window_start=128", "train.batch_size=8"],
       "speedrun_record": ["attention.window=256", "attention.window_start=128",
                           "train.batch_size=8"],
       "shakespeare": ["train.batch_size=8"],
       "modded_nanogpt_jax": ["train.batch_size=16", "train.grad_accum=2",
                              "train.seq_len_start=128", "train.seq_len_step=128"],
       "base": ["train.batch_size=8"]}


def overrides(path):
  return SHRINK + FIT[os.path.basename(path)[:-4]]


def test_every_shipped_config_is_covered():
  assert {os.path.basename(p)[:-4] for p in CONFIGS} == set(FIT)


@pytest.mark.fast
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(p)[:-4])
def test_a_shipped_config_warns_of_no_misaligned_dims(path):
  """modded_nanogpt_jax.yml's vocab_size=50304 under base.yml's model.align=256 warned about
  itself on every start; a shipped config's shapes are multiples of its own align."""
  cfg = config.finalize(wiring.load(path), mesh_sizes={"data": 1, "fsdp": 1, "tensor": 1},
                        data_dir="unused")
  lines = []
  wiring.warn_misaligned(cfg, lines.append)
  assert lines == []


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(p)[:-4])
def test_a_train_step_keeps_the_states_dtypes(path):
  run = wiring.prepare(path, overrides(path))
  state = run.abstract_state()
  cfg = run.cfg
  row = jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.train.seq_len), jnp.int32,
                             sharding=run.batch_sharding)
  batch = {"inputs": row, "targets": row}
  for step in (0, cfg.train.steps - 1):  # first and last stage (windows, row length)
    fn = trainer.make_train_step(run, *window_schedule.step_stage(cfg, step))
    out, _ = jax.eval_shape(fn, state, batch)
    flat_in = jax.tree_util.tree_flatten_with_path(state)[0]
    flat_out = jax.tree.leaves(out)
    changed = [(jax.tree_util.keystr(p), a.dtype, b.dtype, a.shape, b.shape)
               for (p, a), b in zip(flat_in, flat_out) if (a.dtype, a.shape) != (b.dtype, b.shape)]
    assert not changed, changed


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(p)[:-4])
def test_a_few_steps_through_the_cli(path, tmp_path):
  # 2 layers: what runs is each config's recipe (the dtypes test above keeps 4 layers).
  proc = run_cli("nanotext.train", path, *overrides(path), "model.num_layers=2",
                 f"output_dir={tmp_path}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  losses = [r["loss"] for r in rows if "loss" in r]
  assert len(losses) == 3 and all(0 < x < 20 for x in losses), losses
  # The memory plan's line, and its choices saved in config.yml (so a resume keeps them).
  line = next(l for l in proc.stdout.splitlines() if l.startswith("memory plan:"))
  chosen = re.search(r"remat=(\w+), loss_chunk=(\d+), eval_loss_chunk=(\d+)", line)
  assert chosen and "per device" in line, line
  saved = yaml.safe_load((tmp_path / "config.yml").read_text())
  assert (saved["model"]["remat"], str(saved["train"]["loss_chunk"]),
          str(saved["train"]["eval_loss_chunk"])) == chosen.groups()
  if path.endswith("base.yml"):  # auto at toy dims: everything kept, nothing chunked
    assert chosen.groups() == ("none", "0", "0")
