"""Golden loss curves: 20 steps without warmup pin the optimizer's math, not just the init.

Recorded with seed 0 on 8 CPU devices (FSDP=8) on the embedded corpus. A change to the model, the
optimizer, the schedules or the data order moves these curves; a refactor must not. A deliberate
change of the math re-records them, and its commit says by how much they moved; float32 rounding
changes move speedrun/record by a few 1e-4 over 20 steps (the FP8 head's e5m2 rounding and bf16
amplify them). Last re-recorded on an AVX2-only AMD EPYC after the FP8 head's weight gradient was
summed inside its GEMMs (rounding only: record moved 4.0e-4, speedrun 5.3e-5, base 0), on top of
the runtime attention windows, the fused head loss, the record's float32 rotary frequencies and
the FP8 head's row-sum gradient scale. speedrun and record re-recorded on an Intel Xeon (family 6
model 167) when model.norm_eps became the record's 2^-23 (was 2^-7): record's losses moved up to
9.5e-3 (val 5.4205 -> 5.4302), speedrun's 7.2e-4; base as it was.

Across machines the curves agree only to rounding: XLA's CPU code follows the processor (vector
width, FMA), and 20 steps of training amplify float32 rounding, more so under bf16 and the FP8
head. Measured between an AVX2-only AMD EPYC (where they are recorded now) and the machine that
recorded them before: base to 1.1e-7 at every step; speedrun and record equal for the first two
steps, then up to 5e-5 by step 6 and 7.1e-4 (speedrun) and 3.1e-4 (record) by step 20. So base is
pinned to 1e-5 throughout, and speedrun and record to 1e-6 for the init and first update, 3e-4 to
step 6 and 2e-3 after (TOLERANCES). A change that only moves rounding in bf16 or FP8 (the FP8
head's scale moved these curves 2.7e-4) is left to the step-by-step comparisons with the record
(tests/test_record_training.py, tests/test_head_loss.py).
Re-record with NANOTEXT_RECORD_GOLDEN=1 python -m pytest tests/test_golden.py -n 0.
"""

import json
import os

import numpy as np
import pytest

from conftest import BASE, REPO, SPEEDRUN, TINY
from nanotext.train import run

COMMON = ["train.steps=20", "optim.warmup_steps=0", "train.log_every=1", "train.eval_every=0",
          "sample.max_new_tokens=0", "train.eval_at_start=false", "data.source=shakespeare",
          "data.tokenizer=shakespeare",
          "model.vocab_size=8192", "metrics.tensorboard=false", "checkpoint.every=0"]
BASE_TINY = [o for o in TINY if not o.startswith(("data.", "model.vocab_size"))]
SPEEDRUN_TINY = ["model.num_layers=4", "model.d_model=64", "model.num_heads=2",
                 "model.head_dim=32", "model.mlp_dim=128", "model.align=0", "train.seq_len=64",
                 "train.batch_size=8", "model.dtype=float32", "attention.window=32",
                 "attention.window_start=16", "attention.window_block=16",
                 "optim.muon_momentum_warmup=10", "train.eval_batches=2",
                 "train.eval_seq_len=0",
                 # Recorded without remat: recomputing activations reorders float rounding
                 # (3e-4 apart after 15 steps); test_lean_step pins remat's gradients instead.
                 "model.remat=none"]
# The record config (speedrun_record.yml) in its own layout: one 1,024-token row per device in
# shard order, block windows 128 -> 512, evaluation on a 2,048-token row at the final windows.
# Recorded with the whole-sequence loss and no remat (rounding order, as above).
RECORD_TINY = ["model.num_layers=4", "model.d_model=64", "model.num_heads=2", "model.head_dim=32",
               "model.mlp_dim=256", "model.align=0", "train.seq_len=1024", "train.batch_size=8",
               "train.eval_seq_len=2048", "train.eval_batches=1", "attention.window=512",
               "optim.muon_momentum_warmup=10", "model.remat=none", "train.loss_chunk=0"]

# {recipe: {"train_loss": [20 values], "val_loss": final}}, recorded as the docstring says.
GOLDEN_PATH = os.path.join(os.path.dirname(__file__), "golden_curves.json")
with open(GOLDEN_PATH) as f:
  GOLDEN = json.load(f)
# rtol by recipe: [(up to step, rtol), ...] of the training losses, the validation loss at the
# last (the docstring's measurements).
ROUNDING = [(2, 1e-6), (6, 3e-4), (20, 2e-3)]
TOLERANCES = {"base": [(20, 1e-5)], "speedrun": ROUNDING, "record": ROUNDING}
RECIPES = {"base": (BASE, BASE_TINY), "speedrun": (SPEEDRUN, SPEEDRUN_TINY),
           "record": (os.path.join(REPO, "configs", "speedrun_record.yml"), RECORD_TINY)}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_curve(name, tmp_path):
  path, overrides = RECIPES[name]
  run(path, overrides + COMMON + [f"output_dir={tmp_path}"], log=lambda s: None)
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  losses = [r["loss"] for r in rows if "loss" in r]
  val = [r["val_loss"] for r in rows if "val_loss" in r]
  if os.environ.get("NANOTEXT_RECORD_GOLDEN"):
    _record(name, {"train_loss": losses, "val_loss": val[0]})
  want, start = GOLDEN[name]["train_loss"], 0
  assert len(losses) == len(want) == TOLERANCES[name][-1][0]
  for stop, rtol in TOLERANCES[name]:
    np.testing.assert_allclose(losses[start:stop], want[start:stop], rtol=rtol,
                               err_msg=f"steps {start}-{stop - 1}")
    start = stop
  np.testing.assert_allclose(val, [GOLDEN[name]["val_loss"]], rtol=TOLERANCES[name][-1][1])


def _record(name: str, curve: dict) -> None:
  """Write this recipe's curve into golden_curves.json (NANOTEXT_RECORD_GOLDEN=1)."""
  with open(GOLDEN_PATH) as f:
    golden = json.load(f)
  golden[name] = curve
  with open(GOLDEN_PATH, "w") as f:
    json.dump(golden, f, indent=1)
    f.write("\n")
  GOLDEN[name] = curve
