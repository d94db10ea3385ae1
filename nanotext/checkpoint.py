"""Orbax CheckpointManager over one step's train state, data-iterator state and config."""

import os

import jax
import orbax.checkpoint as ocp

from nanotext.errors import UserError


def checkpoint_dir(output_dir: str) -> str:
  return os.path.join(os.path.abspath(output_dir), "checkpoints")


def make_manager(output_dir: str, *, keep: int, create: bool = True) -> ocp.CheckpointManager:
  """A manager that keeps the newest `keep` steps; saves are async and atomic."""
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create,
                                         enable_async_checkpointing=True)
  handlers = {"state": ocp.StandardCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
              "config": ocp.JsonCheckpointHandler()}
  return ocp.CheckpointManager(checkpoint_dir(output_dir), options=options,
                               item_handlers=handlers)


def save(manager, step: int, state, data_state: dict, config_dict: dict) -> None:
  """Start saving a step (returns while the write continues in the background)."""
  manager.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      data=ocp.args.JsonSave(data_state),
      config=ocp.args.JsonSave(config_dict)))


def restore(manager, step: int, abstract_state):
  """Restore `step` straight into the shardings carried by `abstract_state`'s leaves."""
  try:
    out = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(),
        config=ocp.args.JsonRestore()))
  except (ValueError, KeyError, FileNotFoundError) as e:
    where = os.path.join(str(manager.directory), str(step))
    raise UserError(f"checkpoint '{where}' does not match this model or is damaged "
                    f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
  return out.state, out.data, out.config


def abstract_with_shardings(tree, shardings):
  """ShapeDtypeStructs carrying target shardings, for restore."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def latest_params(output_dir: str, step: int = -1):
  """Parameters of a run's newest (or given) checkpoint on one local device; for sampling."""
  if not os.path.isdir(checkpoint_dir(output_dir)):
    raise UserError(f"output_dir '{output_dir}' holds no checkpoints")
  manager = make_manager(output_dir, keep=1, create=False)
  step = manager.latest_step() if step < 0 else step
  if step is None or step not in manager.all_steps():
    raise UserError(f"output_dir '{output_dir}' has no checkpoint for step {step}; "
                    f"it has {list(manager.all_steps())}")
  # An explicit single-device target: checkpoints written by several processes restore too.
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  try:
    meta = manager.item_metadata(step)["state"]
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
    out = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))
  except Exception as e:  # orbax raises many kinds for unreadable folders
    raise UserError(f"cannot read the checkpoint of step {step} in '{output_dir}': "
                    f"{str(e).splitlines()[0][:200]}") from None
  return step, out.state["params"]
