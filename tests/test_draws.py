"""Parameter draws made as one threefry call (model/draws.py) equal jax.random's, bit for bit."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import BASE, REPO, SPEEDRUN
from nanotext import wiring
from nanotext.model import GPT, Keys, draws

SMALL = ["model.num_layers=2", "model.d_model=64", "model.num_heads=2", "model.head_dim=32",
         "model.vocab_size=256", "model.align=0", "train.seq_len=16", "train.batch_size=8",
         "data.source=synthetic", "data.tokenizer=none", "data.eot_id=0"]
RECORD = os.path.join(REPO, "configs", "speedrun_record.yml")
# (path, overrides): normal draws in float32; the record's uniform linears beside normal bf16
# tables (value embeddings, a padded head); scanned blocks, whose draws stay under nnx.vmap.
MODELS = {"base": (BASE, []),
          "record": (RECORD, ["model.mlp_dim=256", "model.num_layers=4", "model.init_std=0.013",
                              "attention.window=16", "attention.window_block=8",
                              "attention.window_start=8", "model.remat=none"]),
          "scanned": (SPEEDRUN, ["model.scan_layers=true", "model.value_embeds=0",
                                 "model.unet_skips=false", "attention.window_pattern=",
                                 "model.no_attention_layers=[]", "model.value_residual=false",
                                 "attention.window=16", "attention.window_block=8",
                                 "attention.window_start=8", "model.remat=none"])}


def bits_of(tree) -> list:
  """Each leaf's bytes (bfloat16 compared as such, not through float32)."""
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(jax.device_get(tree))]


def direct_params(run, seed):
  """The parameters of the model built drawing each parameter with jax.random."""
  model = GPT(run.cfg.model, run.cfg.attention, impl=run.impl, rngs=Keys(jax.random.key(seed)))
  return nnx.to_pure_dict(nnx.state(model))


@pytest.mark.fast
def test_one_flat_draw_equals_each_parameters_own():
  """Counts out of order, odd stds (one rounding of sqrt(2) * std, as XLA folds them in a
  compiled init), both dtypes and both distributions, shapes of 1 to 3 dimensions."""
  specs = ((5, (48, 64), 0.013, "float32", "normal"), (0, (7,), 0.5, "float32", "uniform"),
           (2, (3, 16, 40), 1 / np.sqrt(768) / np.sqrt(24), "bfloat16", "normal"),
           (9, (64, 48), 0.02, "bfloat16", "uniform"), (1, (1000,), 0.3, "float32", "normal"))
  key = jax.random.key(7)
  flat = draws._flat(jax.random.key_data(key), specs)

  @jax.jit
  def each(key):
    return [draws.direct(jax.random.fold_in(key, c), shape, std, jnp.dtype(dtype), dist)
            for c, shape, std, dtype, dist in specs]
  assert [(x.shape, x.dtype.name) for x in flat] == [(s[1], s[3]) for s in specs]
  assert bits_of(flat) == bits_of(each(key))


# The record in the fast tier; base and scanned (10 s each on a 2-core Zen 3) in the whole suite.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.fast) if n == "record" else n
                                  for n in MODELS])
def test_a_model_built_from_one_draw_equals_one_drawn_parameter_by_parameter(name):
  path, overrides = MODELS[name]
  run = wiring.prepare(path, SMALL + overrides)
  direct = jax.jit(lambda s: direct_params(run, s))
  expected = bits_of(direct(jnp.int32(3)))
  assert bits_of(jax.jit(lambda s: nnx.to_pure_dict(nnx.state(run.create_model(s))))(
      jnp.int32(3))) == expected
  assert bits_of(nnx.to_pure_dict(nnx.state(run.create_model(3)))) == expected  # eager too
  # The train state's init program (its seed an argument, its outputs in their shardings).
  assert bits_of(run.init_state()["params"]) == bits_of(direct(jnp.int32(run.cfg.seed)))


@pytest.mark.fast
def test_the_init_program_draws_once():
  """The point of it: one threefry call and one erfinv in the program, not one per shape."""
  run = wiring.prepare(BASE, SMALL)
  text = jax.jit(lambda s: nnx.to_pure_dict(nnx.state(run.create_model(s)))).lower(
      jnp.int32(0)).as_text()
  assert text.count("erf_inv") == 1
  shapes = {x.shape for x in jax.tree.leaves(direct_params(run, 0)) if x.ndim == 2}
  assert len(shapes) > 3  # (what drawing parameter by parameter compiled: one per shape)


def test_large_models_and_other_generators_draw_each_parameter(monkeypatch):
  run = wiring.prepare(BASE, SMALL)
  expected = bits_of(jax.jit(lambda s: direct_params(run, s))(jnp.int32(0)))

  def refuse(*args):
    raise AssertionError("drew flat")
  monkeypatch.setattr(draws, "_flat", refuse)
  monkeypatch.setattr(draws, "MAX_FLAT", 1000)
  assert bits_of(jax.jit(lambda s: nnx.to_pure_dict(nnx.state(run.create_model(s))))(
      jnp.int32(0))) == expected
  monkeypatch.undo()
  monkeypatch.setattr(draws, "_flat", refuse)
  make = lambda keys: GPT(run.cfg.model, run.cfg.attention, impl=run.impl, rngs=keys)
  rbg = draws.build(make, jax.random.key(0, impl="rbg"))  # another generator's bits
  assert jax.tree.leaves(nnx.state(rbg))
