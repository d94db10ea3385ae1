"""Golden loss curves: 20 steps without warmup pin the optimizer's math, not just the init.

Recorded at commit 7b05e9b (before the wiring refactor) with seed 0 on 8 CPU devices (FSDP=8),
on the embedded corpus. A change to the model, the optimizer, the schedules or the data order
moves these curves; a refactor must not.
"""

import json
import os

import numpy as np
import pytest

from conftest import BASE, SPEEDRUN, TINY
from nanotext.train import run

COMMON = ["train.steps=20", "optim.warmup_steps=0", "train.log_every=1", "train.eval_every=0",
          "sample.max_new_tokens=0", "data.source=shakespeare", "data.tokenizer=shakespeare",
          "model.vocab_size=8192", "metrics.tensorboard=false", "checkpoint.every=0"]
BASE_TINY = [o for o in TINY if not o.startswith(("data.", "model.vocab_size"))]
SPEEDRUN_TINY = ["model.num_layers=4", "model.d_model=64", "model.num_heads=2",
                 "model.head_dim=32", "model.mlp_dim=128", "model.align=0", "train.seq_len=64",
                 "train.batch_size=8", "model.dtype=float32", "attention.window=32",
                 "attention.window_start=16", "attention.window_block=16",
                 "optim.muon_momentum_warmup=10", "train.eval_batches=2"]

GOLDEN = {
    "base": ([9.01789665222168, 8.790735244750977, 8.595321655273438, 8.524178504943848,
              8.325800895690918, 8.233342170715332, 8.02171802520752, 7.862581253051758,
              7.81530237197876, 7.585991382598877, 7.4041290283203125, 7.302680969238281,
              7.156219482421875, 7.108122825622559, 7.017547607421875, 7.022927284240723,
              6.8034210205078125, 6.616366863250732, 6.492212772369385, 7.16455078125],
             7.72665548324585),
    "speedrun": ([9.010912895202637, 8.929916381835938, 8.806196212768555, 8.711005210876465,
                  8.30925464630127, 7.9214653968811035, 7.447397708892822, 7.055258750915527,
                  7.163339614868164, 6.951822757720947, 6.5020012855529785, 6.887025833129883,
                  6.834877967834473, 6.565648078918457, 6.608776569366455, 6.514261245727539,
                  6.335787296295166, 6.374418258666992, 6.637154579162598, 6.361015796661377],
                 6.955089569091797),
}
RECIPES = {"base": (BASE, BASE_TINY), "speedrun": (SPEEDRUN, SPEEDRUN_TINY)}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_curve(name, tmp_path):
  path, overrides = RECIPES[name]
  run(path, overrides + COMMON + [f"output_dir={tmp_path}"], log=lambda s: None)
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  losses = [r["loss"] for r in rows if "loss" in r]
  val = [r["val_loss"] for r in rows if "val_loss" in r]
  want_losses, want_val = GOLDEN[name]
  np.testing.assert_allclose(losses, want_losses, rtol=1e-4)
  np.testing.assert_allclose(val, [want_val], rtol=1e-4)
