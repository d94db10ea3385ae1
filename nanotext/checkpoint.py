"""Orbax CheckpointManager over one step's train state, every process's data state and config.

A step directory holds four items: `state` (params, optimizer state, step: sharded arrays, each
process writes its shards), `data` (one JSON file per process, `process_<i>-of-<n>.json`, with
that process's data position, because each process reads a different stride of the data),
`config` (the resolved config, written by process 0) and `integrity` (a checksum of every array
and the training data's fingerprint). Orbax writes a step into a temporary directory and renames
it when every item is complete, so a killed save leaves no step behind; the checksums catch what
happens to a step afterwards (truncation, bytes overwritten in place).
"""

import dataclasses
import json
import os
import re
import time

from absl import logging
import jax
import orbax.checkpoint as ocp
from etils import epath

from nanotext.errors import ResourceError, UserError, write_error
from nanotext.integrity import Damaged, checksums, require_listed, verify
from nanotext import probes, revisions, trees
from nanotext.rundir import (aside_note, check_no_glob, folder_id, gone_while_read, no_step_note,
                             older_steps, read_again, rotated_away, step_files, steps_on_disk,
                             vanished)


def _not_news(record) -> bool:
  """False for orbax's warnings that an item read on its own (a step's state/: load_params_from)
  or a step folder left empty has no metadata file of its own, or that an item's metadata
  cannot be read: the reader's own error says what matters, in one line."""
  return not record.getMessage().startswith(("Metadata file does not exist",
                                             "Failed to get item metadata"))


logging.get_absl_logger().addFilter(_not_news)


class CheckpointError(ResourceError):
  """A checkpoint write failed (disk full, permissions, ...): not bad input, exit status 1."""


class ProcessJsonHandler(ocp.CheckpointHandler):
  """Each process writes its own JSON file; restore returns {process index: value} of all."""

  def save(self, directory: epath.Path, args: "ProcessJsonSave") -> None:
    name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    (directory / name).write_text(json.dumps(args.item))

  def restore(self, directory: epath.Path, args: "ProcessJsonRestore" = None) -> dict:
    del args
    out = {}
    for path in directory.iterdir():
      m = re.fullmatch(r"process_(\d+)-of-(\d+)\.json", path.name)
      if m:
        out[int(m.group(1))] = {"count": int(m.group(2)), **json.loads(path.read_text())}
    return out

  def metadata(self, directory: epath.Path):
    del directory
    return None

  def finalize(self, directory: epath.Path) -> None:
    del directory

  def close(self) -> None:
    pass


@ocp.args.register_with_handler(ProcessJsonHandler, for_save=True)
@dataclasses.dataclass
class ProcessJsonSave(ocp.args.CheckpointArgs):
  item: dict


@ocp.args.register_with_handler(ProcessJsonHandler, for_restore=True)
@dataclasses.dataclass
class ProcessJsonRestore(ocp.args.CheckpointArgs):
  pass


class Manager(ocp.CheckpointManager):
  """A CheckpointManager that remembers its last requested step, to prove it reached disk.

  `fingerprint`: the training data's, saved with every step (None = unknown); `on_confirmed`:
  called with each step once it is known to be complete on disk. As a context manager it is
  closed on the way out; under a failing run's own error a late write error is only logged.
  """

  def __init__(self, directory, *, fingerprint=None, on_confirmed=None, **kwargs):
    super().__init__(directory, **kwargs)
    self.fingerprint, self.on_confirmed, self.requested = fingerprint, on_confirmed, None

  def __enter__(self):
    return self

  def __exit__(self, exc_type, *exc):
    if exc_type is None:
      self.close()
    else:
      close(self)


def checkpoint_dir(output_dir: str) -> str:
  return os.path.join(os.path.abspath(output_dir), "checkpoints")


def _handlers() -> dict:
  return {"state": ocp.StandardCheckpointHandler(), "data": ProcessJsonHandler(),
          "config": ocp.JsonCheckpointHandler(), "integrity": ocp.JsonCheckpointHandler()}


def make_manager(output_dir: str, *, keep: int, create: bool = True, async_save: bool = True,
                 fingerprint: list | None = None, on_confirmed=None) -> Manager:
  """A manager that keeps the newest `keep` steps; saves are atomic, async unless told not.
  `fingerprint` and `on_confirmed`: see Manager."""
  check_no_glob(checkpoint_dir(output_dir), "the checkpoint folder")
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=create, enable_async_checkpointing=async_save,
      # Leftovers of a save killed midway are removed, never mistaken for a step.
      cleanup_tmp_directories=create)
  return Manager(checkpoint_dir(output_dir), options=options, item_handlers=_handlers(),
                 fingerprint=fingerprint, on_confirmed=on_confirmed)


def reader(output_dir: str) -> Manager:
  """A manager that only reads a run's steps, which a run may be training into meanwhile: it
  lists them without reading their metadata (orbax reads every step's at the start, and a step
  the run rotated away at that moment raised out of it)."""
  check_no_glob(checkpoint_dir(output_dir), "the checkpoint folder")
  # Never saving, it never removes anything either (orbax rotates steps inside save).
  options = ocp.CheckpointManagerOptions(create=False, lightweight_initialize=True)
  steps_on_disk(output_dir)  # a checkpoints/ folder this user may not list: one line naming it
  return Manager(checkpoint_dir(output_dir), options=options, item_handlers=_handlers())


def save(manager: Manager, step: int, state, data_state: dict, config_dict: dict) -> None:
  """Start saving a step; async saves return once the arrays are copied off the devices."""
  wait(manager)  # surfaces a failed earlier write before starting the next
  try:  # orbax would wait 300 s for a step directory it failed to create, then raise
    probes.writable_dir(str(manager.directory), "the checkpoint folder")
  except (UserError, ResourceError) as e:
    raise CheckpointError(f"cannot save the checkpoint of step {step}: {e}") from None
  fp = manager.fingerprint
  integrity = {"checksums": checksums(state), "data": None if fp is None else list(fp),
               **revisions.stamp()}
  manager.save(step, force=True, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=ProcessJsonSave(data_state),
      config=ocp.args.JsonSave(config_dict),
      integrity=ocp.args.JsonSave(integrity)))
  manager.requested = step


def wait(manager: Manager) -> None:
  """Block until the last save is on disk; raise CheckpointError if it never got there."""
  try:
    manager.wait_until_finished()
    manager.check_for_errors()
  except Exception as e:  # whatever the writer raised, the run must not go on silently
    why = write_error(e, f"cannot write a checkpoint in '{manager.directory}'")  # the errno
    earlier = [s for s in manager.all_steps() if s != manager.requested]  # complete ones
    kept = (f"step {max(earlier)}, saved before, is intact" if earlier else
            "no step was saved before it")
    raise CheckpointError(f"writing a checkpoint failed: {why or error_head(e)}; {kept}") from e
  step = manager.requested
  if step is None:
    return
  # Orbax's finalizer logs (and consumes) a background error instead of raising it, so look
  # at the disk: a step that failed never loses its temporary name.
  manager.reload()
  if step not in manager.all_steps():
    raise CheckpointError(f"the checkpoint of step {step} in '{manager.directory}' was not "
                          "completed (see the orbax error logged above)")
  manager.requested = None
  if manager.on_confirmed is not None:
    manager.on_confirmed(step)


def close(manager: Manager) -> None:
  """Close on the way out of a failing run: a late write error is logged, not raised over it."""
  try:
    manager.close()
  except Exception as e:  # the run's own error (already propagating) is the one to report
    logging.error("closing the checkpoint manager: %s", error_head(e))


def step_dir(manager, step: int) -> str:
  return os.path.join(str(manager.directory), str(step))


def restore_step(manager, step: int, abstract_state):
  """Restore and verify `step` straight into the shardings carried by `abstract_state`'s leaves.

  Returns (state, data, config, integrity); data is {process index: its saved data dict}.
  Raises Damaged when the step does not restore or does not match its checksums.
  """
  where = step_dir(manager, step)
  items = dict(state=ocp.args.StandardRestore(abstract_state), data=ProcessJsonRestore(),
               config=ocp.args.JsonRestore())
  probes.readable(where)  # orbax takes a file this user may not read for a damaged one
  require_listed(where)
  if os.path.isdir(os.path.join(where, "integrity")):
    items["integrity"] = ocp.args.JsonRestore()
  try:
    out = manager.restore(step, args=ocp.args.Composite(**items))
  except Exception as e:  # orbax raises a bare Exception for a truncated array file
    raise Damaged(other_optimizer(manager, step, abstract_state, where) or
                  f"checkpoint '{where}' does not match this model or is damaged "
                  f"({type(e).__name__}: {error_head(e)})") from None
  require_whole_data(out.data, where)
  integrity = out["integrity"] if "integrity" in items else None
  verify(out.state, integrity, where)
  return out.state, out.data, out.config, integrity


def other_optimizer(manager, step: int, abstract_state, where: str) -> str:
  """Why a step that did not restore failed, where its metadata tells: the model's parameters
  with an optimizer state laid out otherwise ('' where not, or unknown)."""
  try:
    meta = manager.item_metadata(step)["state"]
    same = [trees.shapes(meta[k]) == trees.shapes(abstract_state[k]) for k in ("params",
                                                                           "opt_state")]
  except Exception:  # no metadata to read: the caller's reason stands
    return ""
  return "" if same != [True, False] else (
      f"checkpoint '{where}' holds this model's parameters with an optimizer state laid out "
      "for another optimizer (optim.* or nanotext changed since the run began): start a new run "
      f"from its parameters (a fresh optimizer, from step 0) with checkpoint.load_params_from="
      f"{where}")


def saved_position(state):
  """Batches read, from a saved data state: TrainIter's, or grain's in checkpoints written before
  it ({'next_index': n} in process; with workers, an interleave of each worker's own); None
  where it says none."""
  n = None
  if isinstance(state, dict):
    if "batches" in state:
      n = state["batches"]
    elif "next_index" in state:
      n = state["next_index"]
    elif isinstance(state.get("iterators_in_use_states"), list):
      counts = [s.get("next_index") if isinstance(s, dict) else None
                for s in state["iterators_in_use_states"]]
      n = sum(counts) if all(isinstance(c, int) for c in counts) else None
  return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def data_problem(data: dict) -> str:
  """What is missing from a step's restored data item ({process index: its saved dict}, one
  file per process that saved it), or '' when every process's file is there."""
  if not data:
    return "no data-iterator file (data/process_<i>-of-<n>.json)"
  counts = sorted({d["count"] for d in data.values()})
  if len(counts) > 1:
    return f"data-iterator files of runs of {counts} processes"
  missing = sorted(set(range(counts[0])) - set(data))
  if missing or len(data) != counts[0]:
    return (f"the data-iterator files of {len(data)} of the {counts[0]} processes that saved "
            f"it (process(es) {missing} missing)")
  bad = [i for i, d in sorted(data.items()) if saved_position(d.get("iterator")) is None]
  if bad:
    return f"a data position no reader understands (process {bad[0]}'s file)"
  return ""


def require_whole_data(data: dict, where: str) -> None:
  """Raise Damaged unless the restored data item of step folder `where` is whole."""
  problem = data_problem(data)
  if problem:
    raise Damaged(f"checkpoint '{where}' is damaged: it holds {problem}")


def check_data_files(where: str) -> None:
  """Raise Damaged unless the step folder `where` holds every process's readable data file."""
  try:
    data = ProcessJsonHandler().restore(epath.Path(where) / "data")
  except (OSError, ValueError, TypeError) as e:
    raise Damaged(f"cannot read the data-iterator files of '{where}': {error_head(e)}") from None
  require_whole_data(data, where)


def check_config_item(where: str) -> None:
  """Raise Damaged unless the step folder `where` holds the readable config item a resume
  restores beside the state."""
  try:
    saved = ocp.JsonCheckpointHandler().restore(epath.Path(where) / "config")
  except Exception as e:  # a missing folder, a truncated or garbled file: orbax's many kinds
    raise Damaged(f"cannot read the config saved in '{where}': {error_head(e)}") from None
  if not isinstance(saved, dict):
    raise Damaged(f"the config saved in '{where}' is not a mapping")


def restore(manager, step: int, abstract_state):
  """(state, data, config) of a verified step; raises UserError (Damaged) if it is not sound."""
  return restore_step(manager, step, abstract_state)[:3]


def own_data(data: dict, where: str) -> dict:
  """This process's entry of a restored, whole `data` item (restore_step checks it is),
  carried over to another process count.

  Batch k of every process covers the same global rows whatever the process count
  (pipeline.make_train_iter), so when all saved processes stopped at the same position that
  position holds for any count.
  """
  pid, count = jax.process_index(), jax.process_count()
  saved = data.get(pid)
  if saved is not None and saved["count"] == count:
    return saved
  positions = {json.dumps([d.get("iterator"), d.get("skipped_steps", 0)], sort_keys=True)
               for d in data.values()}
  if len(positions) == 1:
    return {**next(iter(data.values())), "count": count}
  raise UserError(f"checkpoint '{where}' holds data-iterator states of {len(data)} process(es) "
                  f"that do not agree on a position; this run has {count} process(es). Resume "
                  "it with the process count it was saved with, or start a new output_dir with "
                  "checkpoint.load_params_from")


def abstract_with_shardings(tree, shardings):
  """ShapeDtypeStructs carrying target shardings, for restore."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def latest_params(output_dir: str, step: int = -1, what: str = "output_dir",
                  step_arg: str = "step="):
  """Parameters of a run's newest (or given) checkpoint on one local device; for sampling.
  `what` and `step_arg` name the arguments in errors (convert's --run and --step).

  The newest step of a run still training may be removed (rotated out) while it is read, file
  by file: a read that fails as a file of it or the step vanishes, or once a newer step is on
  disk, reads the step newest by then instead (as often as rundir.read_again says); a given
  step that vanishes is not there."""
  if step < -1:
    raise UserError(f"{step_arg.removesuffix('=')}={step} is not a checkpoint step: give a "
                    "step >= 0, or -1 (the default) for the newest")
  if not os.path.isdir(checkpoint_dir(output_dir)):
    raise UserError(f"{what} '{output_dir}' holds no checkpoints{aside_note(output_dir)}")
  tried, start = [], time.monotonic()  # the newest steps rotated away while read
  folder = folder_id(checkpoint_dir(output_dir))  # another one later: the run was set aside
  while read_again(tried, start, output_dir):
    manager = reader(output_dir)  # a fresh listing each time
    at = manager.latest_step() if step < 0 else step
    if at is None:
      raise UserError(f"{what} '{output_dir}' holds no checkpoints{no_step_note(output_dir)}")
    if at not in manager.all_steps():
      raise UserError(f"{what} '{output_dir}' has no checkpoint for step {at}; "
                      f"it has {list(manager.all_steps())}{aside_note(output_dir)}")
    where = step_dir(manager, at)
    files = step_files(where)
    try:
      params, integrity = read_on_one_device(manager, at, "params")
      verify(params, integrity, where, prefix="params/")
      return at, params
    except Damaged as e:
      gone = vanished(where, files)
      if step >= 0 and gone:
        raise UserError(gone_while_read(what, output_dir, at, folder)) from None
      on_disk = steps_on_disk(output_dir)
      rotated = gone or max(on_disk, default=at) > at
      if step >= 0 or not rotated:
        raise Damaged(f"{e}{older_steps(on_disk, at, step_arg.rstrip('=') + '=')}") from None
      tried.append(at)
  raise rotated_away(what, output_dir, tried)


def read_on_one_device(manager, step: int, part: str = ""):
  """(the step's state, or its `part` such as "params", on one local device; its integrity
  record or None), whatever mesh or process count wrote it. Damaged if it cannot be read."""
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  where = step_dir(manager, step)
  probes.readable(where)  # an unreadable state/ folder looked missing, an array file damaged
  if os.path.isdir(where) and not os.path.isdir(os.path.join(where, "state")):
    raise Damaged(f"the checkpoint of step {step} in '{where}' holds no state/ folder (an "
                  "incomplete or damaged step: read an older one)")
  require_listed(where)
  try:
    meta = manager.item_metadata(step)["state"]
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
    items = dict(state=ocp.args.StandardRestore(target))
    if os.path.isdir(os.path.join(where, "integrity")):
      items["integrity"] = ocp.args.JsonRestore()
    out = manager.restore(step, args=ocp.args.Composite(**items))
  except Exception as e:  # orbax raises many kinds for unreadable folders
    raise Damaged(f"cannot read the checkpoint of step {step} in '{where}': "
                  f"{error_head(e)}") from None
  state = out.state[part] if part else out.state
  return state, out["integrity"] if "integrity" in items else None


def error_head(e: Exception) -> str:
  """The readable head of an orbax/tensorstore error (their tails are reprs of bound methods)."""
  line = (str(e).splitlines() or [type(e).__name__])[0].split(" See full TensorStore")[0]
  return line[:200]
