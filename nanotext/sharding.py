"""The device mesh and the logical-axis rules: the only module that names mesh axes.

Layers tag parameters and activations with logical names (`batch`, `embed`, `heads`, ...).
`mesh.rules` in the config maps each logical name to zero, one or several mesh axes. Everything
here turns those names into `PartitionSpec`s and `NamedSharding`s.
"""

import contextlib
import functools
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from jax.experimental import mesh_utils

from nanotext.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor")
# Weight axes name what a parameter dimension is; activation axes (batch, act_*) what an
# activation dimension is. Distinct names let the rules place them apart: FSDP shards the
# weights' embed dimension while activations keep theirs whole.
WEIGHT_AXES = ("vocab", "embed", "heads", "kv", "mlp", "length", "layers")
ACTIVATION_AXES = ("batch", "act_length", "act_embed", "act_heads", "act_kv", "act_mlp",
                   "act_vocab")
LOGICAL_AXES = WEIGHT_AXES + ACTIVATION_AXES

_active_rules: list = []  # stack of (rules, mesh); the innermost `use_rules` wins


class MeshSizeError(UserError):
  """The mesh's sizes multiply to another device count than the devices there are."""


def mesh_shape(mesh_cfg, num_devices: int) -> tuple:
  """Sizes of MESH_AXES (data, fsdp, tensor) with a -1 entry resolved to the remaining devices."""
  sizes = [mesh_cfg[a] for a in MESH_AXES]
  keys = [f"mesh.{a}" for a in MESH_AXES]
  if sizes.count(-1) > 1:
    named = [k for k, s in zip(keys, sizes) if s == -1]
    which = f"{', '.join(named[:-1])} and {named[-1]} are {'both' if len(named) == 2 else 'all'}"
    default = " (mesh.fsdp=-1 is configs/base.yml's default)" if mesh_cfg["fsdp"] == -1 else ""
    raise UserError(f"{which} -1{default}; at most one mesh axis may be -1: give the others "
                    "a size")
  if any(s == 0 or s < -1 for s in sizes):
    got = " ".join(f"{a}={n}" for a, n in zip(MESH_AXES, sizes))
    raise UserError(f"mesh sizes must be positive or -1, got {got}")
  known = math.prod(s for s in sizes if s != -1)
  if -1 in sizes:
    if num_devices % known:
      raise MeshSizeError(f"{num_devices} devices cannot be split into a mesh with fixed axes of "
                      f"product {known}; change {'/'.join(keys)}")
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    there = "there is 1 device" if num_devices == 1 else f"there are {num_devices} devices"
    raise MeshSizeError(f"{'*'.join(keys)} = {math.prod(sizes)} but {there}; make the product "
                        "match (or use -1 for one axis)")
  return tuple(sizes)


# Overrides that put every device on the fsdp axis: the schema's mesh (configs/base.yml).
ALL_ON_FSDP = tuple(f"mesh.{a}={-1 if a == 'fsdp' else 1}" for a in MESH_AXES)
# Every device on the data axis: parameters whole on each, so no model dimension need divide.
ALL_ON_DATA = tuple(f"mesh.{a}={-1 if a == 'data' else 1}" for a in MESH_AXES)


def sizes_text(mesh_cfg) -> str:
  """'data=1 fsdp=4 tensor=2': a config's mesh sizes as written (-1 unresolved)."""
  return " ".join(f"{a}={mesh_cfg[a]}" for a in MESH_AXES)


def parse_rules(rules) -> tuple:
  """Config rule list -> ((logical, (mesh_axis, ...)), ...), checked for unknown names."""
  out = []
  for rule in rules:
    if not (isinstance(rule, (list, tuple)) and len(rule) == 2 and isinstance(rule[0], str)):
      raise UserError(f"mesh.rules entry {rule!r} must be [logical_name, mesh_axis or list]")
    name, axes = rule
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    if not (isinstance(axes, (list, tuple)) and all(isinstance(a, str) for a in axes)):
      raise UserError(f"mesh.rules entry {rule!r} must be [logical_name, mesh_axis or list]: "
                      "mesh axes are names")
    axes = tuple(axes)
    if name not in LOGICAL_AXES:
      raise UserError(f"mesh.rules names unknown logical axis '{name}'; known: "
                      f"{', '.join(LOGICAL_AXES)}")
    for a in axes:
      if a not in MESH_AXES:
        raise UserError(f"mesh.rules maps '{name}' to unknown mesh axis '{a}'; known: "
                        f"{', '.join(MESH_AXES)}")
    if len(set(axes)) != len(axes):
      dup = next(a for a in axes if axes.count(a) > 1)
      raise UserError(f"mesh.rules maps '{name}' to mesh axis '{dup}' twice ({rule!r}); "
                      "a mesh axis can shard a dimension once")
    if name in dict(out):
      raise UserError(f"mesh.rules has two rules for '{name}'; keep one")
    out.append((name, axes))
  return tuple(out)


def unused_axes(mesh: Mesh, rules, model_axes=LOGICAL_AXES) -> list:
  """Mesh axes of more than one device that no rule of an axis in `model_axes` (the model's:
  model_axes) names: everything is replicated over them (the work done that many times over, as
  a mislabelled ablation row would not show)."""
  named = {a for name, axes in rules if name in model_axes for a in axes}
  return [a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in named]


def unused_note(mesh: Mesh, rules, model_axes=LOGICAL_AXES) -> str:
  """' (tensor=2 shards no array ...)' per axis of unused_axes, for a line naming the mesh."""
  return "".join(f" ({a}={mesh.shape[a]} shards no array of this model under mesh.rules: "
                 "everything is replicated over it)" for a in unused_axes(mesh, rules, model_axes))


def model_axes(abstract_state) -> frozenset:
  """The logical axes a model's arrays have: every activation axis, and the weight axes of its
  parameters (no `length` under rope, no `layers` without model.scan_layers)."""
  specs = jax.tree.leaves(param_specs(abstract_state), is_leaf=lambda v: isinstance(v, P))
  names = lambda entry: (entry,) if isinstance(entry, str) else entry or ()
  return frozenset(ACTIVATION_AXES) | {n for s in specs for e in s for n in names(e)}


def logical_to_spec(logical_axes, rules) -> P:
  """PartitionSpec for a tuple of logical names; a mesh axis is used at most once per array."""
  table = dict(rules)
  used, spec = set(), []
  for name in logical_axes:
    axes = tuple(a for a in table.get(name, ()) if a not in used)
    used.update(axes)
    spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
  return P(*spec)


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  """A Mesh over all (or the given) devices with Auto axis types."""
  devices = jax.devices() if devices is None else devices
  shape = mesh_shape(mesh_cfg, len(devices))
  try:
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)
  except TypeError:  # older jax without the devices argument
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES,
                axis_types=(AxisType.Auto,) * len(MESH_AXES))
  except NotImplementedError:
    # A TPU torus whose physical axes do not factor into this shape (fsdp 8 x tensor 2 on a 4x4
    # v6e-16): let a mesh axis span part of a physical one, still in torus order.
    grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


@contextlib.contextmanager
def use_rules(rules, mesh: Mesh):
  """Make `rules` on `mesh` the active logical->mesh mapping for `constrain` while tracing."""
  _active_rules.append((tuple(rules), mesh))
  try:
    yield
  finally:
    _active_rules.pop()


def constrain(x, logical_axes):
  """Constrain an activation's sharding by logical names; a no-op outside `use_rules`."""
  if not _active_rules:
    return x
  rules, mesh = _active_rules[-1]
  return jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, logical_to_spec(logical_axes, rules)))


def param_specs(abstract_state):
  """Tree of PartitionSpecs (in logical names) read from each Param's `out_sharding` tag."""
  return nnx.get_partition_spec(abstract_state)


def shardings_of(spec_tree, mesh: Mesh, rules):
  """NamedShardings for a tree of logical PartitionSpecs (as `param_specs` gives)."""
  return jax.tree.map(lambda s: NamedSharding(mesh, logical_to_spec(tuple(s), rules)),
                      spec_tree, is_leaf=lambda x: isinstance(x, P))


def describe(mesh: Mesh) -> str:
  """'data=1 fsdp=8 tensor=1': the mesh axes and their sizes, for logs."""
  return " ".join(f"{a}={mesh.shape[a]}" for a in mesh.axis_names)


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
  """Sharding of a [batch, length] token array."""
  return NamedSharding(mesh, logical_to_spec(("batch", "act_length"), rules))


@functools.cache
def row_groups(batch: NamedSharding, rows: int, process: int | None = None) -> tuple:
  """(this process's group, the number of groups) of a batch of `rows` rows: processes whose
  devices hold the same rows form a group and load the same rows (a batch replicated across
  processes: tensor parallelism or no batch rule spanning hosts); each group loads its own,
  equal share. One group per process where the batch is split along the processes."""
  held: dict = {}
  for device, index in batch.devices_indices_map((rows, batch.mesh.size)).items():
    held.setdefault(device.process_index, set()).update(range(rows)[index[0]])
  shares = sorted({tuple(sorted(r)) for r in held.values()})
  if sorted(r for s in shares for r in s) != list(range(rows)) or \
      len({len(s) for s in shares}) > 1:
    counts = ", ".join(f"process {p}: {len(r)} row(s)" for p, r in sorted(held.items()))
    raise UserError(f"the mesh and mesh.rules give processes overlapping or unequal shares of "
                    f"the batch ({counts}): {crossing(batch)}; shard the batch along whole "
                    "processes or replicate it on all")
  mine = tuple(sorted(held[jax.process_index() if process is None else process]))
  return shares.index(mine), len(shares)


def crossing(batch: NamedSharding) -> str:
  """The keys behind a batch's shares: the mesh axes its rows split over (mesh.rules' batch
  rule) and those the processes lie along, with their mesh.* sizes."""
  mesh, rows = batch.mesh, batch.spec[0] if len(batch.spec) else None
  rows = () if rows is None else (rows,) if isinstance(rows, str) else tuple(rows)
  procs = np.vectorize(lambda d: d.process_index)(np.asarray(mesh.devices))
  across = [a for i, a in enumerate(mesh.axis_names) if (np.diff(procs, axis=i) != 0).any()]
  name = lambda axes: " x ".join(f"mesh.{a}={mesh.shape[a]}" for a in axes) or "no mesh axis"
  return (f"its rows split over {name(rows)} (mesh.rules' batch rule) while the processes lie "
          f"along {name(across)}")


def per_device(fn, args, in_axes, out_axes, out_shape=None):
  """Run `fn` per device (shard_map) over the active mesh, or plainly outside `use_rules`.

  Each argument is split along its logical axes (`in_axes`, one tuple per argument, None =
  whole) where its size divides evenly, else kept whole (e.g. sampling with batch 1); the
  output (or each output), shaped like the first argument or `out_shape`, is split by
  `out_axes`, or with lists of both, each output by its own. For opaque kernels (Pallas) that
  the SPMD partitioner cannot split by itself.
  """
  if not _active_rules:
    return fn(*args)
  rules, mesh = _active_rules[-1]
  table = dict(rules)
  def spec(axes, shape):
    used, out = set(), []
    for name, size in zip(axes, shape):
      mesh_axes = tuple(a for a in table.get(name, ()) if a not in used) if name else ()
      if mesh_axes and size % math.prod(mesh.shape[a] for a in mesh_axes) == 0:
        used.update(mesh_axes)
        out.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
      else:
        out.append(None)
    return P(*out)
  in_specs = tuple(spec(a, x.shape) for a, x in zip(in_axes, args))
  if isinstance(out_axes, list):
    out_specs = tuple(spec(a, s) for a, s in zip(out_axes, out_shape))
  else:
    out_specs = spec(out_axes, out_shape or args[0].shape)
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                       check_vma=False)(*args)


def as_compute_sees_weights(mesh_sizes: dict) -> dict:
  """The mesh sizes that split a weight as a matmul reads it: weights sharded over data or fsdp
  are gathered whole for the matmul (measured on TPU under FSDP, the gathered copies are live at
  once); tensor-parallel shards stay split."""
  return {a: (n if a == "tensor" else 1) for a, n in mesh_sizes.items()}


# The mesh change that stops replicating parameters and optimizer state over the data axis.
FSDP_FOR_DATA = "mesh.data=1 mesh.fsdp=-1"


def fsdp_for_data(mesh_sizes: dict) -> dict | None:
  """The mesh sizes with the data axis folded into fsdp (FSDP_FOR_DATA); None where data is 1."""
  if mesh_sizes.get("data", 1) == 1:
    return None
  return dict(mesh_sizes, data=1, fsdp=mesh_sizes["fsdp"] * mesh_sizes["data"])


def extent(logical_name: str, rules, mesh_sizes: dict) -> int:
  """How many shards a dimension with this logical name is split into."""
  return math.prod(mesh_sizes[a] for a in dict(rules).get(logical_name, ()))


def shard_count(logical_axes, rules, mesh_sizes: dict) -> int:
  """How many pieces an array with these logical axes is split into (its size / per device)."""
  count = 1
  for entry in logical_to_spec(tuple(logical_axes), rules):
    for a in (() if entry is None else (entry,) if isinstance(entry, str) else entry):
      count *= mesh_sizes[a]
  return count


class NotDivisible(UserError):
  """A dimension its mesh axes do not divide; `key` sets it (to `size`), `head` says which and by
  what (a tool that cannot change `key` gives its own advice)."""

  def __init__(self, key: str, head: str, size: int | None = None):
    super().__init__(f"{head}; change {key} or the mesh")
    self.key, self.head, self.size = key, head, size

  def mesh_only(self, why: str) -> UserError:
    """The line for a tool where only the mesh can change (`why`: the model is the run's)."""
    return UserError(f"{self.head}; {why}: change the mesh (mesh.*) or the number of devices")


def check_divisible(dims, rules, mesh_sizes: dict) -> None:
  """Each dimension must divide evenly by the mesh axes its logical name maps to.

  `dims`: (logical name, size, what sets it) triples, e.g. ("embed", 768, "model.d_model"), from
  the model's activations and the abstract parameters; the error names the key to change.
  """
  table = dict(rules)
  for name, size, what in dims:
    n = math.prod(mesh_sizes[a] for a in table.get(name, ()))
    if size % n:
      axes = "*".join(f"mesh.{a}" for a in table[name])
      raise NotDivisible(what, f"{what}={size} is not divisible by {axes}={n} (logical axis "
                               f"'{name}')", size)


def param_dims(abstract_state, keys_by_axis: dict, alternates: dict | None = None):
  """(logical name, size, what sets it) for every dimension of every parameter.

  `what` is the config key that sets that axis (from the model) when the size is its value, or
  the key in `alternates` ({axis: (key, size)}, e.g. token tables shorter than the head) when
  that is; else the parameter's path and axis.
  """
  specs = nnx.to_pure_dict(param_specs(abstract_state))
  shapes = nnx.to_pure_dict(abstract_state)
  name = lambda path: ".".join(str(getattr(k, "key", k)) for k in path)
  out = []
  for (path, spec), x in zip(jax.tree_util.tree_flatten_with_path(
      specs, is_leaf=lambda v: isinstance(v, P))[0], jax.tree.leaves(shapes)):
    for i, (axis, size) in enumerate(zip(spec, x.shape)):
      if axis is None:
        continue
      key, value = keys_by_axis.get(axis, (None, None))
      alt_key, alt_value = (alternates or {}).get(axis, (None, None))
      out.append((axis, size, key if value == size else alt_key if alt_value == size
                  else f"dim {i} of parameter {name(path)}"))
  return out


def like_params(tree, param_shardings, shapes_of_params, default):
  """Shardings for an optimizer-state tree: a leaf whose key path ends with a parameter's path
  (and has its shape) shares that parameter's sharding; every other leaf gets `default`."""
  by_path = {}
  for path, s in jax.tree_util.tree_flatten_with_path(param_shardings)[0]:
    by_path[tuple(map(str, path))] = s
  shapes = {tuple(map(str, p)): x.shape
            for p, x in jax.tree_util.tree_flatten_with_path(shapes_of_params)[0]}
  def pick(path, leaf):
    keys = tuple(map(str, path))
    for i in range(len(keys)):
      s = by_path.get(keys[i:])
      if s is not None and shapes[keys[i:]] == leaf.shape:
        return s
    return default
  return jax.tree_util.tree_map_with_path(pick, tree)


def replicate(x):
  """Constrain an array to be whole on every device (inside `use_rules`; else a no-op)."""
  if not _active_rules:
    return x
  _, mesh = _active_rules[-1]
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P()))


def spread_count() -> int:
  """How many devices `spread_leading` splits over (1 outside `use_rules`)."""
  return _active_rules[-1][1].size if _active_rules else 1


def spread_leading(x):
  """Split the leading axis over every device (each holds whole items of a stack)."""
  if not _active_rules:
    return x
  _, mesh = _active_rules[-1]
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(MESH_AXES)))


def active():
  """The innermost (rules, mesh) of `use_rules`, or None outside it."""
  return _active_rules[-1] if _active_rules else None


def active_count(logical_axes) -> int:
  """shard_count under the active mesh: 1 outside `use_rules`."""
  if not _active_rules:
    return 1
  rules, mesh = _active_rules[-1]
  return shard_count(logical_axes, rules, dict(mesh.shape))


def active_local(size: int, logical_axes) -> int:
  """A dimension's size on one device under the active mesh as per_device splits it: divided by
  active_count where that divides it evenly, else whole."""
  n = active_count(logical_axes)
  return size // n if size % n == 0 else size
