"""Shared pieces of the converters: reading a run, flat parameter names, writing a run of
imported weights (their outputs are written whole or not at all by nanotext.outputs)."""

import json
import os

import jax

from nanotext.errors import UserError
from nanotext.outputs import staged_dir
from nanotext.trees import fill, int_keys, stack_blocks, unstack_blocks
from nanotext import identity, rundir

# What --force may replace where from-hf and from-torch write a run (a training run's folder,
# once trained in, is replaced by no tool).
RUN_OWN = ("config.yml",)
MESH_SIZES = ("mesh.data", "mesh.fsdp", "mesh.tensor")


def load_run(run: str, step: int = -1):
  """(config, step, params as numpy) of a run directory's newest (or given) checkpoint, or of a
  params-only folder (what `params-only` writes: one step), in the model's own tree."""
  from nanotext import config
  rundir.check_run_dir(run, "--run")
  cfg = rundir.run_config(run, "--run", lambda: config.load(os.path.join(run, "config.yml")))
  identity.check_unedited(run, cfg.to_dict())
  step, _, params = model_params(run, cfg, step, "--run", "--step")
  return cfg, step, jax.device_get(params)


def model_params(path: str, cfg, step: int, what: str, step_arg: str, *,
                 checked: bool = False) -> tuple:
  """(step, graphdef, params) of `path`'s newest (or given) checkpoint, or of a params-only
  folder, on one local device in the tree of the model `cfg` builds (as config.load reads it;
  `checked`: wiring.check already ran), matched name by name: a parameter that model does not
  have, or has in another shape, is refused, naming it (an edited config.yml).

  Saved trees key list items by strings, so a restore without a target returns layers in
  string order ('0', '1', '10', '11', '2', ...): merged by position, 11 or more layers would be
  permuted. Dtypes stay as saved (a params-only folder may be bfloat16)."""
  from nanotext import wiring
  from nanotext.trees import fill, flatten, is_stacked
  _, graphdef, abstract = wiring.for_sampling(cfg, jax.local_devices(), checked=checked)
  step, params = read_params(path, step, what, step_arg)
  flat = flatten(params)
  if is_stacked(flat) != is_stacked(flatten(abstract)):  # model.scan_layers edited: same weights
    flat = unstack_blocks(flat) if is_stacked(flat) else stack_blocks(flat)
  return step, graphdef, fill(abstract, flat, f"{what} '{path}' step {step} against its "
                              "config.yml (check the model.* keys there)", cast=False)


def read_params(path: str, step: int, what: str, step_arg: str):
  """(step, params) on one local device of a run's newest (or given) checkpoint, or of a
  params-only folder; `what` and `step_arg` name the caller's arguments in errors."""
  from nanotext import checkpoint
  if not os.path.isdir(os.path.join(path, "params")):
    return checkpoint.latest_params(path, step, what=what, step_arg=step_arg)
  if step != -1:  # a step below -1 is refused as in a run folder (checkpoint.latest_params)
    bad = f"{step_arg.removesuffix('=')}={step} is not a checkpoint step: " if step < 0 else ""
    raise UserError(f"{bad}{what} '{path}' is a params-only folder (one step): leave {step_arg} "
                    "out")
  return load_params(path)


def load_params(path: str):
  """(step, params) of a params-only folder, on one local device, checked against the checksums
  written with it (a folder written before they existed is read unchecked), in the model's key
  types (layers keyed 0, 1, 2, ... as nnx.to_pure_dict(nnx.state(model)) has them)."""
  import orbax.checkpoint as ocp
  from nanotext.checkpoint import error_head
  from nanotext.integrity import record_of_params_only, verify
  where = os.path.abspath(os.path.join(path, "params"))  # orbax refuses a relative path
  if not os.path.isdir(where):
    raise UserError(f"'{path}' holds no params/ folder (is it a params-only checkpoint?)")
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  ckptr = ocp.StandardCheckpointer()
  try:
    meta = ckptr.metadata(where)
    meta = getattr(meta, "item_metadata", meta)  # newer orbax wraps the tree
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
    params = ckptr.restore(where, target)
  except Exception as e:  # orbax raises many kinds for unreadable folders
    raise UserError(f"cannot read the params-only checkpoint '{path}': {error_head(e)}") \
        from None
  finally:
    ckptr.close()
  step = params_only_step(path)
  verify(params, record_of_params_only(path), path, prefix="params/")
  return step, int_keys(params)


def params_only_step(path: str) -> int:
  """The step a params-only folder was taken from (its convert.json), -1 without one; a
  convert.json that cannot say is refused, naming it."""
  where = os.path.join(path, "convert.json")
  try:
    with open(where, encoding="utf-8") as f:
      step = json.load(f)["step"]
    if type(step) is not int or not 0 <= step < 2**31:  # train.steps fits 32 bits
      raise ValueError(f"step {step!r}")
    return step
  except FileNotFoundError:
    return -1
  except (OSError, ValueError, KeyError, TypeError) as e:
    raise UserError(f"'{where}' is damaged ({type(e).__name__}): write the folder again with "
                    "python -m nanotext.convert params-only (it holds the weights' checksums: "
                    "without it nothing is checked)") from None


def per_layer(cfg, flat: dict) -> dict:
  """Flat params of a model.scan_layers run under the unrolled model's names (one layer each);
  other runs' params unchanged."""
  return unstack_blocks(flat) if cfg.model.scan_layers else flat


def stacked(cfg, flat: dict) -> dict:
  """Inverse of `per_layer`: unrolled 'blocks.{i}.*' names stacked for a model.scan_layers run."""
  return stack_blocks(flat, cfg.model.num_layers) if cfg.model.scan_layers else flat


def require(cfg, wanted: dict, why: str) -> None:
  """Refuse the first config key whose value differs from `wanted[key]`, naming it."""
  from nanotext import config
  for key, value in wanted.items():
    have = config.get(cfg, key)
    ok = value(have) if callable(value) else have == value
    if not ok:
      want = "" if callable(value) else f" (needs {value!r})"
      raise UserError(f"{why}: {key}={have!r} is not supported{want}")


def write_run(run, flat: dict, source: str, out: str, *, what: str, given=None,
              force: bool = False, log=print) -> str:
  """Write `run` (built by wiring from the config `given`) holding `flat` (the model's names, one
  layer each; `what` names them in errors) as a step-0 run directory at `out`, which may not
  replace the input `source`. Its config.yml keeps the mesh as given (fsdp: -1, unless
  overridden): the sizes resolved for this machine's devices made the printed command fail on
  any other device count."""
  from nanotext import checkpoint, config
  out_abs = os.path.abspath(out)
  cfg = run.cfg
  if given is not None:
    cfg = config.with_values(cfg, {k: config.get(given, k) for k in MESH_SIZES})
  params = fill(run.abstract_state()["params"], stacked(cfg, flat), what)
  state = run.state_from_params(params)
  data_state = {"iterator": {"batches": 0}}  # a new run's data position
  with staged_dir(out_abs, force=force, protect=(source,), own=RUN_OWN) as tmp:
    config.save(cfg, os.path.join(tmp, "config.yml"))
    manager = checkpoint.make_manager(tmp, keep=cfg.checkpoint.keep)
    try:
      checkpoint.save(manager, 0, state, data_state, cfg.to_dict())
      manager.wait_until_finished()
    finally:
      manager.close()
  log(f"wrote {out_abs}: {run.num_params:,} parameters at step 0; train on with "
      f"python -m nanotext.train {os.path.join(out_abs, 'config.yml')} output_dir={out_abs}")
  return out_abs
