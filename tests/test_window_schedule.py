"""Sliding-window schedule: values, per-layer pattern, masking, AOT programs, profiler, cache."""

import glob
import json
import math
import os

import jax
import numpy as np
import pytest

from conftest import BASE, SPEEDRUN, TINY
from nanotext import config, metrics, wiring
from nanotext.errors import UserError
from nanotext import window_schedule as A
from nanotext.train import run

RECORD = ["attention.window=1792", "attention.window_start=128", "attention.window_block=128",
          "attention.window_schedule=true", "attention.window_pattern=LSSSLSSLSSSL",
          "model.num_layers=12"]


def attn(*overrides):
  return config.load(BASE, list(overrides)).attention


def record_window(step: int, steps: int) -> int:
  """modded-nanogpt 587b45fb: next_multiple_of_n(1728 * step / num_iterations, n=128)."""
  v = 1728 * step / steps
  return 128 * max(1, math.ceil(v / 128))


@pytest.mark.fast
def test_schedule_matches_the_record():
  a = attn(*RECORD)
  windows = [A.long_window(a, s, 1770) for s in range(1771)]
  assert windows == [record_window(s, 1770) for s in range(1771)]
  assert windows[0] == 128 and windows[-1] == 1792
  assert sorted(set(windows)) == list(range(128, 1793, 128))  # every block size, in order
  assert windows == sorted(windows)


@pytest.mark.fast
def test_schedule_from_a_later_start_and_off():
  a = attn("attention.window=32", "attention.window_start=16", "attention.window_block=16",
           "attention.window_schedule=true")
  assert [A.long_window(a, s, 4) for s in range(5)] == [16, 16, 16, 32, 32]
  b = attn("attention.window=64", "attention.window_start=32", "attention.window_block=16",
           "attention.window_schedule=true")
  got = [A.long_window(b, s, 10) for s in range(11)]
  assert got[0] == 32 and got[-1] == 64 and set(got) == {32, 48, 64} and got == sorted(got)
  assert A.long_window(attn("attention.window=48"), 3, 10) == 48  # no schedule: the config


@pytest.mark.fast
@pytest.mark.fast
@pytest.mark.parametrize("eval_windows", ["step", "final"])
def test_the_eval_programs_are_those_of_every_evaluation(eval_windows):
  """eval_plan finds each distinct window of the evaluations by bisection; the same programs as
  computing every evaluation's (which stalled minutes at train.steps=2**31-1)."""
  cfg = config.load(SPEEDRUN, [f"train.eval_windows={eval_windows}", "train.steps=1750",
                               "train.eval_every=25", "train.eval_at_start=true"])
  dones = A.eval_points(cfg.train)
  assert dones[:3] == [0, 25, 50] and dones[-2:] == [1725, 1750] and len(dones) == 71
  seq_len = cfg.train.eval_seq_len or cfg.train.seq_len
  every = A.plan(dict.fromkeys((A.eval_windows(cfg, d), seq_len) for d in dones), False)
  assert A.eval_plan(cfg, dones, False) == every
  assert len(every) == (1 if eval_windows == "final" else 14)


def test_pattern_maps_letters_to_layers():
  a = attn(*RECORD)
  final = A.windows_at(a, 12, 1770, 1770)
  assert final == (1792, 896, 896, 896, 1792, 896, 896, 1792, 896, 896, 896, 1792)
  assert A.windows_at(a, 12, 0, 1770) == (128,) * 12  # the short window floors at one block
  assert A.layer_windows(a, 12, 384) == (384, 128, 128, 128, 384, 128, 128, 384, 128, 128, 128,
                                         384)  # 3 blocks // 2 = 1 block, as the record
  assert A.layer_windows(a, 2, 1792) == (1792, 896)  # the pattern repeats or is cut to the layers
  assert A.layer_windows(attn("attention.window=64"), 3, 64) == (64, 64, 64)  # "" = all long
  assert A.effective_windows((1792, 896, 0), 1024) == (0, 896, 0)  # >= seq_len: plain causal


@pytest.mark.fast
@pytest.mark.parametrize("overrides,key", [
    (["attention.window=64", "attention.window_pattern=LSX"], "attention.window_pattern"),
    (["attention.window_pattern=LS"], "attention.window"),
    (["attention.window=100", "attention.window_schedule=true"], "attention.window="),
    (["attention.window=256", "attention.window_start=384", "attention.window_schedule=true"],
     "attention.window_start"),
    (["profile.start_step=-2"], "profile.start_step"),
])
def test_bad_window_config_names_the_key(overrides, key):
  with pytest.raises(UserError, match=key):
    wiring.load(BASE, overrides)


@pytest.mark.fast
def test_speedrun_turns_the_record_schedule_on():
  cfg = config.load(SPEEDRUN)
  a = cfg.attention
  assert a.window_schedule and a.window_pattern == "LSSSLSSLSSSL" and a.window == 1792
  assert cfg.train.seq_len > a.window  # every stage, the final one included, is a real window


@pytest.mark.fast
def test_per_layer_flops_take_every_window():
  m = wiring.finalize(config.load(BASE, ["train.seq_len=64"]), jax.devices()[:8]).model
  same = metrics.flops_per_token(m, 64, 16)
  assert metrics.flops_per_token(m, 64, (16,) * m.num_layers) == pytest.approx(same)
  mixed = metrics.flops_per_token(m, 64, (16, 0, 16, 0))
  assert same < mixed < metrics.flops_per_token(m, 64, 0)


@pytest.mark.fast
def test_a_short_window_layer_cannot_see_beyond_its_window():
  model = wiring.prepare(BASE, [
      "model.num_layers=1", "model.d_model=64", "model.num_heads=2", "model.head_dim=32",
      "model.vocab_size=256", "model.align=0", "train.seq_len=32", "attention.window=16",
      "attention.window_pattern=S"]).create_model(0)
  assert model.windows == (8,)  # S = half of the 16-token long window
  a = jax.random.randint(jax.random.key(0), (2, 32), 0, 256)
  p = 5
  b = a.at[:, p].set((a[:, p] + 1) % 256)
  la, lb = np.asarray(model(a)), np.asarray(model(b))
  np.testing.assert_allclose(la[:, p + 8:], lb[:, p + 8:], atol=1e-6)  # p is out of their window
  assert not np.allclose(la[:, p:p + 8], lb[:, p:p + 8])  # ... but inside these ones'
  lc = np.asarray(model(b, windows=(16,)))  # the long window sees further
  assert not np.allclose(la[:, p + 8:p + 16], lc[:, p + 8:p + 16])


def test_run_switches_windows_without_compiling_and_profiles(tmp_path, restore_jax_cache_config):
  out, cache = tmp_path / "run", tmp_path / "cache"
  lines = []
  result = run(BASE, TINY + [
      f"output_dir={out}", "train.seq_len=64", "train.steps=4", "attention.window=32",
      "attention.window_start=16", "attention.window_block=16", "attention.window_schedule=true",
      "attention.window_pattern=LS", "profile.start_step=1", "profile.steps=2",
      f"train.compile_cache_dir={cache}", "sample.max_new_tokens=0"], log=lines.append)
  # Steps 1-3 run (16, 16), step 4 (32, 16): one program (the cpu kernel takes the windows at
  # run time) compiled before step 1, with a line of its own.
  assert any(l.startswith("compiled train (windows 16..32, runtime) in ") for l in lines), lines
  assert any(l.startswith("compiled 1 train step program and the eval step") for l in lines)
  with open(out / "metrics.jsonl") as f:
    rows = [json.loads(l) for l in f]
  assert [r["attn_window"] for r in rows if "loss" in r] == [16, 16, 16, 32]
  assert result.programs == 2
  assert result.compiles_in_loop == 0 and all(r["compiles"] == 0 for r in rows if "loss" in r)
  assert glob.glob(os.path.join(out, "profile", "plugins", "profile", "*", "*.xplane.pb"))
  assert any(l.startswith("profile of steps 2..3") for l in lines)
  assert os.listdir(cache)  # the run's programs cached there (its settings given back after)
