"""train.eval_accum: each device's validation rows in several forward passes, one after another.

The eval step is a forward pass: it keeps nothing from one pass to the next, so the passes need
a share of the memory and give the same mean loss (equal tokens in each). The memory plan takes
them where the whole step does not fit (speedrun.yml's 8 x 262,144-token validation rows on one
H100: 65.4 GiB compiled, now 33.4 in two passes).
"""

import jax
import numpy as np
import pytest

from conftest import BASE, SPEEDRUN, TINY, mesh_sizes
from nanotext import config, memory, memory_plan, trainer, wiring
from nanotext.errors import UserError

SYNTH = ["data.source=synthetic", "data.tokenizer=none", "data.eot_id=0"]
# Four validation rows per device (2 devices on mesh.data), each 4 x the training rows.
EVAL = ["mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", "train.batch_size=8",
        "train.eval_seq_len=128", "model.max_seq_len=128"]


def _eval_run(accum: int):
  return wiring.prepare(BASE, TINY + EVAL + [f"train.eval_accum={accum}"],
                        devices=jax.devices()[:2])


@pytest.mark.fast
def test_passes_give_the_mean_loss_of_one_pass():
  runs = {a: _eval_run(a) for a in (1, 2, 4)}
  params = runs[1].init_state()["params"]
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 512, size=(8, 129)).astype(np.int32)
  local = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  losses = {}
  for a, run in runs.items():
    assert run.cfg.train.eval_accum == a
    step = trainer.make_eval_step(run)
    losses[a] = float(step(params, trainer.global_batch(run, local)))
  assert np.isfinite(losses[1]) and losses[1] > 1.0
  # The mean of equal-sized passes' means against one mean: float32 summation order only.
  np.testing.assert_allclose([losses[2], losses[4]], losses[1], rtol=2e-6)


def planned(overrides, capacity):
  """(finalized config, plan) of speedrun.yml on one GPU of `capacity` bytes."""
  cfg = wiring.load(SPEEDRUN, list(overrides) + SYNTH)
  sizes = mesh_sizes()
  planner = memory_plan.Planner("gpu", sizes, capacity, "test")
  cfg = config.finalize(cfg, mesh_sizes=sizes, data_dir="", tokenizer_vocab=None)
  return config.with_values(cfg, planner(cfg)), planner.plan


SMALL = ["model.num_layers=2", "model.d_model=128", "model.num_heads=2", "model.head_dim=64",
         "model.mlp_dim=512", "model.vocab_size=1024", "model.align=0", "train.seq_len=256",
         "train.batch_size=8", "train.eval_seq_len=16384", "attention.window=256",
         "attention.window_start=128", "attention.window_block=64", "train.eval_loss_chunk=0"]


@pytest.mark.fast
def test_auto_takes_the_fewest_passes_that_fit_and_says_so():
  cfg = wiring.load(SPEEDRUN, SMALL + SYNTH)
  cfg = config.finalize(cfg, mesh_sizes=mesh_sizes(), data_dir="",
                        tokenizer_vocab=None)
  model = memory.model_of(cfg, "gpu", mesh_sizes())
  whole, two, four = (model.eval(0, a).total for a in (1, 2, 4))
  train = max(model.train(r, 0).total for r in memory.REMATS)
  assert whole > two > four and whole > 1.5 * train  # the validation rows are the peak
  capacity = max(train, two) / (1 - memory_plan.HEADROOM) * 1.01  # two passes fit, one not
  assert whole > capacity * (1 + memory_plan.TOLERANCE["gpu"])
  cfg, plan = planned(SMALL, capacity)
  assert cfg.train.eval_accum == 2 and plan.eval.total == pytest.approx(two)
  assert ", eval_accum=2 (" in plan.line() and "the plain eval step needs" in plan.line()
  # Where the whole eval fits, one pass, and the line as it was
  cfg, plan = planned(SMALL, whole * 2)
  assert cfg.train.eval_accum == 1 and "eval_accum" not in plan.line()


@pytest.mark.fast
def test_a_saved_number_that_no_longer_divides_the_rows_is_chosen_again():
  """A run that chose eval_accum=3 for 24 rows on one device, resumed on 6 (4 rows each), kept
  3 ('kept from the run's config.yml') and evaluate then refused its config.yml."""
  cfg = wiring.load(SPEEDRUN, SMALL + SYNTH + ["train.batch_size=6"])
  sizes = mesh_sizes()
  cfg = config.finalize(cfg, mesh_sizes=sizes, data_dir="", tokenizer_vocab=None)
  plan = lambda prefer: memory_plan.Planner("gpu", sizes, 64 * 2**30, "test", prefer=prefer)(cfg)
  assert plan({"train.eval_accum": 3})["train.eval_accum"] == 3  # 6 rows: kept
  assert plan({"train.eval_accum": 4})["train.eval_accum"] == 1  # no divisor: chosen again


@pytest.mark.fast
def test_a_fixed_number_is_kept_and_refused_advice_names_passes():
  cfg, plan = planned(SMALL + ["train.eval_accum=4"], 64 * 2**30)
  assert cfg.train.eval_accum == 4 and ", eval_accum=4 (" in plan.line()
  cfg = wiring.load(SPEEDRUN, SMALL + SYNTH + ["train.eval_accum=1"])
  cfg = config.finalize(cfg, mesh_sizes=mesh_sizes(), data_dir="",
                        tokenizer_vocab=None)
  model = memory.model_of(cfg, "gpu", mesh_sizes())
  _, plan = planned(SMALL + ["train.eval_accum=1"], model.eval(0, 1).total / 1.5)
  with pytest.raises(UserError, match=r"train\.eval_accum=2 \(~"):
    plan.require("eval")


@pytest.mark.fast
@pytest.mark.parametrize("value,needle", [
    (0, "train.eval_accum=0 is not a value: give a divisor"),
    (3, "train.eval_accum=3 does not divide train.batch_size=8"),
    (-2, "train.eval_accum"),
])
def test_a_number_that_cannot_split_the_rows_is_one_line(value, needle):
  with pytest.raises(UserError, match=needle.replace(".", r"\.")) as e:
    wiring.prepare(BASE, TINY + EVAL + [f"train.eval_accum={value}"], devices=jax.devices()[:2])
  assert "\n" not in str(e.value)


@pytest.mark.fast
def test_each_device_must_get_its_share_of_every_pass():
  # 8 rows over 8 devices: one a device, which two passes cannot split
  with pytest.raises(UserError, match=r"^train\.eval_accum=2 does not divide each device's 1 "
                                      r"validation row"):
    wiring.prepare(BASE, TINY + ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1",
                                 "train.eval_accum=2"], devices=jax.devices()[:8])


@pytest.mark.gpu_compile
def test_speedrun_validates_on_one_h100_in_two_passes():
  """speedrun.yml on one H100: 8 validation rows of 262,144 tokens on the one device. Whole,
  the eval step compiled to 65.40 GiB of the 59.36 GiB pool (the plan said 61.44, "may not
  fit", and a run would have stopped at its first validation); in two passes it fits."""
  from nanotext import compile as nt_compile
  run, _, (rec,) = nt_compile.run_compile(SPEEDRUN, [], "h100", "eval", log=lambda s: None)
  assert run.cfg.train.eval_accum == 2 and ", eval_accum=2 (" in run.memory.line()
  assert "error" not in rec and rec["fits"], rec
  assert 0.85 <= rec["estimate_bytes_per_chip"] / rec["total_bytes_per_chip"] <= 1.15
  assert rec["headroom"] > 0.3  # 33.4 GiB compiled
