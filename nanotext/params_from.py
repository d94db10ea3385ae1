"""checkpoint.load_params_from: the parameters of another run's checkpoint, a step directory or a
params-only folder, into this model's shapes and shardings; the other model.scan_layers layout
converted, every name and shape checked, the saved checksums verified."""

import os
import time

import jax
import orbax.checkpoint as ocp

from nanotext.checkpoint import error_head
from nanotext import probes
from nanotext.errors import UserError, unreadable
from nanotext.identity import check_folder
from nanotext.integrity import (Damaged, name_of, record_beside, record_of_params_only,
                                verify_named)
from nanotext.rundir import (aside_note, is_step_name, older_steps, read_again,
                             rotated_away, step_files, vanished)
from nanotext.trees import (cast_checked, fill, flatten, is_stacked, path_name, stack_blocks,
                            unstack_blocks)



def find_item(path: str, what: str = "checkpoint.load_params_from") -> tuple:
  """(item dir, whether it holds the whole train state) of a run dir, its checkpoints/ dir, a
  step dir (the newest step where there are several) or a params-only folder (convert); `what`
  names the argument in errors. A newest step without its state/ folder is Damaged: reading
  an older one instead would answer for another step than the one asked for."""
  check_folder(path, what)
  if os.path.isdir(os.path.join(path, "state")):
    return os.path.join(os.path.abspath(path), "state"), True
  root = os.path.join(path, "checkpoints")
  if os.path.isdir(os.path.join(path, "params")):
    if not os.path.isdir(root):
      return os.path.join(os.path.abspath(path), "params"), False
    raise UserError(f"{what}='{path}' holds both params/ (a params-only folder) and "
                    "checkpoints/ (a run trained into it), which hold different weights: give "
                    f"{os.path.join(path, 'checkpoints')} for that run's, or move checkpoints/ "
                    "out of the folder for params/")
  root = root if os.path.isdir(root) else path
  try:
    names = os.listdir(root)
  except (FileNotFoundError, NotADirectoryError):  # a step a run in progress just removed
    raise Damaged(f"'{path}' was removed while it was read") from None
  except PermissionError as e:  # another user's folder, no damage
    raise unreadable(e) from None
  steps = [int(n) for n in names if is_step_name(n) and os.path.isdir(os.path.join(root, n))]
  if not steps and aside_note(path):  # evaluate said 'give a run directory' of a run set aside
    raise UserError(f"{what}='{path}' holds no checkpoints{aside_note(path)}")
  if not steps:
    raise UserError(f"{what}='{path}' holds no complete checkpoint "
                    "(give a run directory, a checkpoint step directory or a params-only "
                    "folder)")
  step_dir = os.path.join(os.path.abspath(root), str(max(steps)))
  if not os.path.isdir(os.path.join(step_dir, "state")):
    probes.readable(step_dir)  # there, but this user may not look inside
    raise Damaged(f"the checkpoint '{step_dir}' holds no state/ folder (incomplete or damaged)")
  return os.path.join(step_dir, "state"), True


def load(path: str, abstract_params, what: str = "checkpoint.load_params_from",
         step_arg: str = ""):
  """Only the parameters of a checkpoint, into `abstract_params`' shapes and shardings,
  checked against the checksums saved with them. A step that a run still training removes
  while it is read (a file of it or the step vanishes) is no error: the newest step by then is
  read instead (as often as rundir.read_again allows). A damaged newest step is refused, naming
  the older steps and how to read one (`step_arg`, e.g. 'step=', else the step directory)."""
  tried, since = [], time.monotonic()  # the newest steps rotated away while read
  run = path if os.path.isdir(os.path.join(path, "checkpoints")) else os.path.dirname(path)
  while read_again(tried, since, run):
    item = None
    try:
      item, whole_state = find_item(path, what)
      probes.readable(os.path.dirname(item))  # tensorstore calls an unreadable file damaged
      files = step_files(os.path.dirname(item))
      return os.path.dirname(item), _load_params(item, whole_state, abstract_params)
    except Damaged as e:
      if item is None or not (vanished(os.path.dirname(item), files) or
                              _newest(path, what) != item):  # a newer step
        raise Damaged(f"{e}{_older(path, what, step_arg)}") from None
      tried.append(os.path.basename(os.path.dirname(item)))
  raise rotated_away(what, path, tried)


def _newest(path: str, what: str):
  """find_item's item now; None where the newest step is damaged."""
  try:
    return find_item(path, what)[0]
  except Damaged:
    return None


def _older(path: str, what: str, step_arg: str) -> str:
  """rundir.older_steps for a run or checkpoints/ folder (readable steps, those with state/);
  '' for a step directory given by name: its own step was asked for."""
  root = os.path.join(path, "checkpoints")
  root = root if os.path.isdir(root) else path
  if os.path.isdir(os.path.join(path, "state")) or not os.path.isdir(root):
    return ""
  names = [n for n in os.listdir(root) if is_step_name(n)]
  readable = [int(n) for n in names if os.path.isdir(os.path.join(root, n, "state"))]
  arg = step_arg or f"{what}={os.path.abspath(root)}{os.sep}"
  return older_steps(readable, max(map(int, names), default=-1), arg)


def _load_params(item: str, whole_state: bool, abstract_params):
  where = os.path.dirname(item)
  ckptr = ocp.PyTreeCheckpointer()
  try:
    meta = ckptr.metadata(item).item_metadata
  except Exception as e:  # orbax raises many kinds for unreadable folders
    raise Damaged(f"cannot read the checkpoint '{where}': {error_head(e)}") from None
  if meta is None:  # orbax's answer for a missing or unreadable _METADATA
    raise Damaged(f"cannot read the checkpoint '{where}': the metadata of its "
                  f"{os.path.basename(item)}/ (_METADATA, manifest.ocdbt) is missing or damaged "
                  "(python -m nanotext.verify names what is)")
  meta = meta.tree
  if whole_state and not (isinstance(meta, dict) and "params" in meta):
    raise UserError(f"checkpoint '{where}' holds no parameters")
  saved = meta["params"] if whole_state else meta
  integrity = record_beside(item) if whole_state else record_of_params_only(where)
  if _stacked(saved) != _stacked(abstract_params):
    return _load_other_layout(ckptr, item, whole_state, saved, abstract_params, where, integrity)
  _check_same_params(_shapes(saved), _shapes(abstract_params), where)
  # read as saved, checked, then cast (a bfloat16 folder into a float32 model): the sums are of
  # the saved bits, and a cast array went unchecked
  dtypes = {name_of(p): m.dtype for p, m in jax.tree_util.tree_flatten_with_path(saved)[0]}
  as_saved = jax.tree_util.tree_map_with_path(lambda p, a: jax.ShapeDtypeStruct(
      a.shape, dtypes.get(name_of(p), a.dtype), sharding=a.sharding), abstract_params)
  restore_args = jax.tree.map(
      lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype),
      as_saved)
  wrap = (lambda t: {"params": t}) if whole_state else (lambda t: t)
  out = _restore(ckptr, item, wrap(as_saved), wrap(restore_args), whole_state, where)
  params = out["params"] if whole_state else out
  _verify_params(params, saved, integrity, where)
  return jax.tree_util.tree_map_with_path(  # a float32 run into a bfloat16 one: checked
      lambda p, x, a: x if x.dtype == a.dtype else cast_checked(x, a.dtype, path_name(p),
                                                                  f"checkpoint '{where}'"),
      params, abstract_params)


def _restore(ckptr, item: str, target, args, partial: bool, where: str):
  """ckptr.restore, with whatever orbax or tensorstore raise for damaged files as Damaged."""
  try:
    return ckptr.restore(item, args=ocp.args.PyTreeRestore(
        item=target, restore_args=args, partial_restore=partial))
  except Exception as e:  # a truncated file is a bare Exception over a tensorstore ValueError
    raise Damaged(f"checkpoint '{where}' cannot be read, it is damaged "
                  f"({error_head(e)})") from None


def _verify_params(params, saved_meta, integrity, where: str) -> None:
  """Checksums of the restored params, for the arrays restored in their saved dtype (a cast,
  e.g. a bfloat16 run's weights into a float32 model, changes the bits the sums are of)."""
  dtypes = {name_of(p): m.dtype for p, m in jax.tree_util.tree_flatten_with_path(saved_meta)[0]}
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  verify_named({f"params/{name_of(p)}": x for p, x in flat if dtypes.get(name_of(p)) == x.dtype},
                integrity, where)


def _stacked(tree) -> bool:
  """Whether a params tree holds model.scan_layers blocks (stacked on a leading layers axis)."""
  return is_stacked(flatten(tree))


def _load_other_layout(ckptr, item: str, whole_state: bool, saved, abstract_params, where: str,
                       integrity=None):
  """Params saved with the other model.scan_layers setting, read on one device, stacked or
  unstacked, then checked name by name and shape by shape and placed like `abstract_params`."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved)
  args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=device, global_shape=a.shape,
                                                     dtype=a.dtype), target)
  wrap = (lambda t: {"params": t}) if whole_state else (lambda t: t)
  out = _restore(ckptr, item, wrap(target), wrap(args), whole_state, where)
  out = out["params"] if whole_state else out
  _verify_params(out, saved, integrity, where)
  flat = flatten(jax.device_get(out))
  flat = unstack_blocks(flat) if is_stacked(flat) else stack_blocks(flat)
  _check_same_params({k.replace(".", "/"): tuple(v.shape) for k, v in flat.items()},
                     _shapes(abstract_params), where)
  return fill(abstract_params, flat, f"checkpoint '{where}' (model.scan_layers converted)")


def _shapes(tree) -> dict:
  """{'blocks/0/attn/o/bias': shape} of a params tree."""
  # Saved trees key list positions by strings ('0'), live ones by ints: compare as text.
  name = lambda k: str(getattr(k, "key", getattr(k, "idx", k)))
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {"/".join(map(name, p)): tuple(x.shape) for p, x in flat}


def _check_same_params(a: dict, b: dict, where: str) -> None:
  """UserError naming the first parameter whose presence or shape differs between the
  checkpoint's {name: shape} `a` and the model's `b`."""
  for key in sorted(set(a) | set(b)):
    if a.get(key) != b.get(key):
      got = "missing" if key not in a else f"shape {a[key]}"
      want = "absent" if key not in b else f"shape {b[key]}"
      raise UserError(f"checkpoint '{where}' does not fit this model: parameter {key} is {got} "
                      f"in the checkpoint but {want} here ({_qkv_hint(a, b)})")


def _qkv_hint(saved: dict, wanted: dict) -> str:
  """What to check for a mismatch: the keys storing q, k, v as one parameter where one side
  does and the other does not, else the model.* keys."""
  one = lambda names: any("/attn/qkv" in n for n in names)
  if one(saved) == one(wanted):
    return "check the model.* keys"
  return ("the checkpoint holds q, k and v as one attn/qkv parameter, this model as three: set "
          "model.merged_qkv or model.fused_qkv as the source run has them") if one(saved) else \
      ("the checkpoint holds q, k and v as three parameters, this model as one attn/qkv: set "
       "model.merged_qkv=false and model.fused_qkv=false as the source run has them")
