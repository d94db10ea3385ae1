"""Mesh from config and logical-axis rules."""

import types

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from conftest import BASE, TINY, mesh_sizes
from nanotext import config, sharding, wiring
from nanotext.errors import UserError

pytestmark = pytest.mark.fast


def mesh_cfg(**kw):
  cfg = config.load(BASE, [f"mesh.{k}={v}" for k, v in kw.items()])
  return cfg.mesh


def test_mesh_shape_resolves_minus_one():
  sizes = lambda cfg: dict(zip(sharding.MESH_AXES, sharding.mesh_shape(cfg, 8)))
  assert sizes(mesh_cfg()) == mesh_sizes(fsdp=8)
  assert sizes(mesh_cfg(data=2, fsdp=-1, tensor=2)) == mesh_sizes(data=2, fsdp=2, tensor=2)
  assert sizes(mesh_cfg(data=8, fsdp=1)) == mesh_sizes(data=8)


@pytest.mark.parametrize("kw, match", [
    (dict(data=3, fsdp=1), "product"),
    (dict(data=3, fsdp=-1), "cannot be split"),
    (dict(data=-1, fsdp=-1), "at most one"),
    # fsdp is -1 by default: the line named no axis and left it to be guessed
    (dict(tensor=-1), r"^mesh.fsdp and mesh.tensor are both -1 \(mesh.fsdp=-1 is "
                      r"configs/base.yml's default\); at most one mesh axis may be -1: give the "
                      r"others a size$"),
    (dict(data=-1, fsdp=1, tensor=-1), r"^mesh.data and mesh.tensor are both -1; at most one"),
    (dict(tensor=0), "positive"),
])
def test_mesh_shape_errors(kw, match):
  with pytest.raises(UserError, match=match):
    sharding.mesh_shape(mesh_cfg(**kw), 8)


def test_one_device_is_named_in_the_singular():
  with pytest.raises(UserError, match=r"= 8 but there is 1 device; make the product match"):
    sharding.mesh_shape(mesh_cfg(data=8, fsdp=1), 1)


def test_logical_to_spec_uses_each_mesh_axis_once():
  rules = sharding.parse_rules([["batch", ["data", "fsdp"]], ["embed", "fsdp"],
                                ["mlp", "tensor"]])
  assert sharding.logical_to_spec(("batch", "act_length", "embed"), rules) == \
      P(("data", "fsdp"), None, None)
  assert sharding.logical_to_spec(("embed", "mlp"), rules) == P("fsdp", "tensor")
  assert sharding.logical_to_spec(("vocab", "embed"), rules) == P(None, "fsdp")


@pytest.mark.parametrize("rules, match", [
    ([["bogus", "fsdp"]], "unknown logical axis 'bogus'"),
    ([["embed", "model"]], "unknown mesh axis 'model'"),
    ([["embed"]], "must be"),
    ([["batch", 5]], "mesh axes are names"),  # were TypeError tracebacks
    ([["batch", {"data": 1}]], "mesh axes are names"),
    ([["batch", ["data", 3]]], "mesh axes are names"),
])
def test_bad_rules(rules, match):
  with pytest.raises(UserError, match=match):
    sharding.parse_rules(rules)


def test_divisibility_errors_name_the_keys():
  cfg = config.load(BASE, ["mesh.tensor=2", "model.num_heads=3", "model.head_dim=64"])
  with pytest.raises(UserError, match=r"model.num_heads=3 .*mesh.tensor=2"):
    wiring.from_config(cfg, devices=jax.devices()[:8])
  cfg = config.load(BASE, ["train.batch_size=12"])
  with pytest.raises(UserError, match=r"train.batch_size=12 .*mesh.data\*mesh.fsdp=8"):
    wiring.from_config(cfg, devices=jax.devices()[:8])


def test_state_follows_the_rules_under_fsdp_and_tp():
  setup = wiring.prepare(BASE, TINY + ["mesh.fsdp=4", "mesh.tensor=2"])
  state = setup.init_state()
  q = state["params"]["blocks"][0]["attn"]["q"]["kernel"]
  assert q.sharding.spec == P("fsdp", "tensor")
  assert q.addressable_shards[0].data.shape == (64 // 4, 64 // 2)
  emb = state["params"]["embed"]["embedding"]
  assert emb.sharding.spec == P("tensor", "fsdp")
  # Adam moments live exactly where their parameters live.
  suffix = "['blocks'][0]['attn']['q']['kernel']"
  moments = [x for path, x in jax.tree_util.tree_flatten_with_path(state["opt_state"])[0]
             if jax.tree_util.keystr(path).endswith(suffix)]
  assert len(moments) == 2  # Adam's mu and nu
  assert all(x.sharding.spec == P("fsdp", "tensor") for x in moments)


def test_validation_rows_must_divide_the_act_length_axes():
  """train.eval_seq_len=63 with act_length over tensor=2 passed every check (train.seq_len=62 was
  refused) and crashed placing the first validation batch (IndivisibleError traceback)."""
  rules = "mesh.rules=[[batch, fsdp], [act_length, tensor]]"
  cfg = config.load(BASE, TINY + ["mesh.tensor=2", "mesh.fsdp=4", rules,
                                  "train.eval_seq_len=63", "model.max_seq_len=64"])
  with pytest.raises(UserError, match=r"^train.eval_seq_len=63 is not divisible by "
                                      r"mesh.tensor=2 \(logical axis 'act_length'\); change "
                                      r"train.eval_seq_len or the mesh$"):
    wiring.from_config(cfg, devices=jax.devices()[:8])
  cfg = config.load(BASE, TINY + ["mesh.tensor=2", "mesh.fsdp=4", rules,
                                  "train.eval_seq_len=64", "model.max_seq_len=64"])
  assert wiring.from_config(cfg, devices=jax.devices()[:8]).cfg.train.eval_seq_len == 64


@pytest.mark.parametrize("override, key", [
    ("model.d_model=100", "model.d_model=100"),
    ("model.mlp_dim=100", "model.mlp_dim=100"),
    ("model.vocab_size=1001", "model.vocab_size=1001"),
    ("model.max_seq_len=260", "model.max_seq_len=260"),  # the learned position table's rows
])
def test_dims_must_divide_their_mesh_axes(override, key):
  """Checked from the model's activations and every parameter dimension, naming the key."""
  rules = ("mesh.rules=[[batch, [data, fsdp]], [embed, fsdp], [mlp, fsdp], [vocab, fsdp], "
           "[length, fsdp]]")
  cfg = config.load(BASE, [override, "model.head_dim=64", rules])
  with pytest.raises(UserError, match=rf"{key} is not divisible by mesh.fsdp=8"):
    wiring.from_config(cfg, devices=jax.devices()[:8])


def test_a_parameter_dim_no_key_sets_is_named_by_its_path():
  import jax.numpy as jnp
  from flax import nnx
  from nanotext.model.layers import param
  state = nnx.state(nnx.Dict(w=param(jnp.zeros((3, 16)), ("layers", "embed"), "scalar")))
  dims = sharding.param_dims(state, {"embed": ("model.d_model", 16)})
  assert dims == [("layers", 3, "dim 0 of parameter w"), ("embed", 16, "model.d_model")]
  rules = sharding.parse_rules([["layers", "fsdp"]])
  with pytest.raises(UserError, match=r"dim 0 of parameter w=3 is not divisible by mesh.fsdp=2"):
    sharding.check_divisible(dims, rules, {"data": 1, "fsdp": 2, "tensor": 1})


def test_token_tables_shorter_than_the_head_name_embed_rows():
  from conftest import TINY, one_line_error, run_cli
  proc = run_cli("nanotext.train", "configs/base.yml", *TINY, "model.tie_embeddings=false",
                 "model.embed_rows=511", "mesh.tensor=2", "mesh.data=1", "mesh.fsdp=4")
  one_line_error(proc, "model.embed_rows=511", "mesh.tensor")


class _Device:
  def __init__(self, process_index):
    self.process_index = process_index


class _Sharding:
  """devices_indices_map of 8 devices, 4 a process, each holding the rows `rows(device)`; a
  data=2 x fsdp=4 mesh (the processes along data) whose batch rule splits rows over `spec`'s."""
  def __init__(self, rows, spec=P()):
    devices = np.array([_Device(d // 4) for d in range(8)]).reshape(2, 4)
    self.mesh = types.SimpleNamespace(size=8, devices=devices, axis_names=("data", "fsdp"),
                                      shape={"data": 2, "fsdp": 4})
    self.rows, self.spec = rows, spec

  def devices_indices_map(self, shape):
    return {_Device(d // 4): (self.rows(d), slice(None)) for d in range(8)}


@pytest.mark.fast
def test_processes_holding_the_same_rows_load_the_same_rows():
  """A batch split along the processes: a share each. Replicated across them (tensor
  parallelism spanning hosts): one share, the whole batch, on each (jax took each process's
  rows for its own half and mixed them)."""
  split = _Sharding(lambda d: slice(d, d + 1))
  assert [sharding.row_groups(split, 8, p) for p in (0, 1)] == [(0, 2), (1, 2)]
  whole = _Sharding(lambda d: slice(None))
  assert [sharding.row_groups(whole, 8, p) for p in (0, 1)] == [(0, 1), (0, 1)]
  assert sharding.row_groups(whole, 3, 1) == (0, 1)  # 3 rows on 2 processes: each loads all 3
  pairs = _Sharding(lambda d: slice(4 * (d % 2), 4 * (d % 2) + 4))  # halves along `tensor`
  assert [sharding.row_groups(pairs, 8, p) for p in (0, 1)] == [(0, 1), (0, 1)]
  crossed = _Sharding(lambda d: slice(0, 4) if d < 4 else slice(2, 8), P("fsdp", None))
  with pytest.raises(UserError, match="unequal shares of the batch"):
    sharding.row_groups(crossed, 8, 0)


@pytest.mark.fast
def test_overlapping_shares_name_the_mesh_keys():
  """The refusal named the row counts alone, not the rule and mesh axes that cross them."""
  crossed = _Sharding(lambda d: slice(0, 4) if d < 4 else slice(2, 8), P(("fsdp", "data")))
  with pytest.raises(UserError, match=r"\(process 0: 4 row\(s\), process 1: 6 row\(s\)\): its "
                     r"rows split over mesh.fsdp=4 x mesh.data=2 \(mesh.rules' batch rule\) while "
                     r"the processes lie along mesh.data=2; shard the batch along whole"):
    sharding.row_groups(crossed, 8, 1)
  with pytest.raises(UserError, match="rows split over no mesh axis"):
    sharding.row_groups(_Sharding(lambda d: slice(0, 4) if d < 4 else slice(2, 8)), 8, 0)


def test_rules_for_axes_the_model_lacks_shard_nothing():
  """Under rope there is no position table and without scan_layers no stacked layers, yet their
  rules were refused for model.max_seq_len and model.num_layers; and a mesh axis named only by
  such rules got no 'replicated' note, as one no rule names gets."""
  from nanotext.train import sharding_summary
  load = lambda *o: config.load(BASE, TINY + ["mesh.fsdp=1", *o])
  run = wiring.from_config(load("model.positions=rope", "train.batch_size=6", "mesh.data=3",
                                "mesh.rules=[[batch, data], [length, data]]"),
                           devices=jax.devices()[:3])
  assert "length" not in run.axes and "replicated" not in sharding_summary(run)
  run = wiring.from_config(load("mesh.data=4", "mesh.rules=[[layers, data]]"),
                           devices=jax.devices()[:4])  # model.num_layers=2
  assert sharding_summary(run).endswith(
      "(data=4 shards no array of this model under mesh.rules: everything is replicated over it)")
  run = wiring.from_config(load("model.positions=rope", "mesh.data=4",
                                "mesh.rules=[[length, data]]"), devices=jax.devices()[:4])
  assert sharding.unused_axes(run.mesh, run.rules, run.axes) == ["data"]
  # The learned position table has the axis: its rule shards it and is checked.
  run = wiring.from_config(load("mesh.data=4", "mesh.rules=[[length, data]]"),
                           devices=jax.devices()[:4])
  assert sharding.unused_axes(run.mesh, run.rules, run.axes) == []
  with pytest.raises(UserError, match=r"^model.max_seq_len=32 is not divisible by mesh.data=3"):
    wiring.from_config(load("train.batch_size=6", "mesh.data=3", "mesh.rules=[[length, data]]"),
                       devices=jax.devices()[:3])


@pytest.mark.fast
def test_a_mesh_axis_no_rule_names_is_said_to_replicate():
  """mesh.data=2 with rules that never name data: the start line said 'mesh data=2 fsdp=4' while
  every step was done twice over (a 'dp2' ablation row that was not)."""
  from conftest import mesh as make_mesh
  mesh = make_mesh(data=2, fsdp=4)
  assert sharding.unused_axes(mesh, sharding.parse_rules([["batch", "fsdp"],
                                                          ["embed", "fsdp"]])) == ["data"]
  assert sharding.unused_axes(mesh, sharding.parse_rules([["batch", ["data", "fsdp"]]])) == []
