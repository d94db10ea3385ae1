"""Layouts are a config change: DP, FSDP, TP and hybrids give the single-device losses."""

import functools

import jax
import numpy as np
import pytest

from conftest import BASE, SPEEDRUN, TINY
from nanotext import trainer, wiring

STEPS = 4
LAYOUTS = {"dp8": (8, 1, 1), "fsdp8": (1, 8, 1), "fsdp4_tp2": (1, 4, 2),
           "dp2_fsdp2_tp2": (2, 2, 2)}
# float32 everywhere: what is compared is the sharded math, not bf16 rounding.
EXACT = ["model.dtype=float32", "model.embed_dtype=float32", "model.fp8_head=false",
         "optim.muon_bf16=false", "train.steps=4"]


@functools.lru_cache(maxsize=None)
def _losses(path, layout, extra):
  return _train(path, layout, extra)


def losses(path, layout, extra=()):
  """Per-step losses and the final state of a few train steps under mesh (data, fsdp, tensor);
  computed once per session for each (config, layout): the single-device references recur."""
  return _losses(path, tuple(layout), tuple(extra))


def _setup(path, layout, extra):
  data, fsdp, tensor = layout
  overrides = TINY + EXACT + list(extra) + [f"mesh.data={data}", f"mesh.fsdp={fsdp}",
                                            f"mesh.tensor={tensor}"]
  return wiring.prepare(path, overrides, devices=jax.devices()[:data * fsdp * tensor])


@functools.lru_cache(maxsize=None)
def _initial(path, extra):
  """The single-device initial state, on the host: every layout starts from it."""
  return jax.device_get(_setup(path, (1, 1, 1), extra).init_state())


def _train(path, layout, extra):
  setup = _setup(path, layout, extra)
  # The initial state placed in this layout's shardings: an init program per layout (3 s of
  # compiling each) checked nothing the init test below does not.
  state = jax.device_put(_initial(path, extra), setup.state_shardings)
  it = setup.train_iter()
  step = trainer.make_train_step(setup)
  out = []
  for _ in range(STEPS):
    state, m = step(state, trainer.global_batch(setup, next(it)))
    out.append(float(m["loss"]))
  return np.array(out), state


# The speedrun family zero-initialises its head and projections: make the first steps
# informative. Every speedrun test here uses the same list, so their runs are computed once.
SPEEDRUN_EXTRA = ("model.zero_init_head=false", "model.zero_init_proj=false", "model.mlp_dim=0")


@pytest.mark.parametrize("path", [BASE, SPEEDRUN], ids=["base", "speedrun"])
def test_layouts_match_one_device(path):
  extra = SPEEDRUN_EXTRA if path == SPEEDRUN else ()
  ref, _ = losses(path, (1, 1, 1), extra)
  assert np.all(np.diff(ref) != 0)
  for name, layout in LAYOUTS.items():
    got, _ = losses(path, layout, extra)
    # Sharded reductions sum in another order: f32 rounding differences of ~1e-7 relative
    # per op, grown a little by four optimizer steps; anything larger is a real bug.
    np.testing.assert_allclose(got, ref, rtol=2e-5, err_msg=name)


@pytest.mark.parametrize("path", [BASE, SPEEDRUN], ids=["base", "speedrun"])
def test_a_sharded_init_is_the_single_device_init(path):
  """The init program under the most mixed layout (FSDP x TP) gives the single-device values."""
  extra = SPEEDRUN_EXTRA if path == SPEEDRUN else ()
  setup = _setup(path, (1, 4, 2), extra)
  jax.tree_util.tree_map_with_path(  # the same tree (or it raises), every leaf bit for bit
      lambda name, a, b: np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(name)),
      jax.device_get(setup.init_state()), _initial(path, extra))


def test_muon_momentum_is_sharded_like_its_parameter():
  _, state = losses(SPEEDRUN, (1, 4, 2), SPEEDRUN_EXTRA)  # fsdp4_tp2 above: computed once
  q = state["params"]["blocks"][0]["attn"]["qkv"]["kernel"]  # merged QKV [3, embed, heads]
  suffix = "['blocks'][0]['attn']['qkv']['kernel']"
  found = [x for path, x in jax.tree_util.tree_flatten_with_path(state["opt_state"])[0]
           if jax.tree_util.keystr(path).endswith(suffix)]
  assert found and all(x.sharding.spec == q.sharding.spec for x in found)
  assert q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")


def state_bytes_per_device(path, layout):
  """Per-device bytes of params + optimizer state, from the compiled step's memory analysis."""
  data, fsdp, tensor = layout
  setup = wiring.prepare(path, TINY + [f"mesh.data={data}", f"mesh.fsdp={fsdp}",
                                       f"mesh.tensor={tensor}"])
  state = setup.abstract_state()
  batch = {k: jax.ShapeDtypeStruct((8, 32), np.int32, sharding=setup.batch_sharding)
           for k in ("inputs", "targets")}
  mem = trainer.make_train_step(setup).lower(state, batch).compile().memory_analysis()
  batch_bytes = 2 * 8 * 32 * 4 // (data * fsdp)
  return mem.argument_size_in_bytes - batch_bytes


def test_fsdp_holds_at_least_7x_less_state_per_device_than_dp():
  dp = state_bytes_per_device(BASE, (8, 1, 1))
  fsdp = state_bytes_per_device(BASE, (1, 8, 1))
  assert dp >= 7 * fsdp, (dp, fsdp)


@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_muon_layouts_agree(layout):
  ref, _ = losses(SPEEDRUN, (1, 1, 1), SPEEDRUN_EXTRA)
  got, _ = losses(SPEEDRUN, (1, 4, 2), SPEEDRUN_EXTRA + (f"optim.muon_layout={layout}",))
  np.testing.assert_allclose(got, ref, rtol=2e-5)
