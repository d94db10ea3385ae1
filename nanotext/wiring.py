"""The one wiring path: (config, devices) -> a ready run, and its first state.

train, generate, convert, compile, the benchmarks and the tests all start here:
config -> derived values -> mesh -> abstract model -> shardings and optimizer (`prepare` /
`from_config`), then a state that is fresh, resumed from output_dir or loaded from
checkpoint.load_params_from (`initial_state`). Nothing is allocated until a state is asked for.
"""

import dataclasses

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.experimental import multihost_utils

from nanotext import (checkpoint, config, device_memory, memory_plan, optim, params_from,
                      revisions, rundir, sharding, watch, window_schedule)
from nanotext.errors import UserError
from nanotext.model import attention, count_params, draws, GPT, gpt, loss
from nanotext.model.kernels import splash
from nanotext.data import pipeline, registry
from nanotext.data.fingerprint import fingerprint_change
from nanotext.data.prepare import default_dir
from nanotext.data.tokenizer import known_vocab_size, resolve_eot_id


@dataclasses.dataclass
class Run:
  """Everything built from the config once: model structure, optimizer, shardings."""
  cfg: object
  mesh: object
  backend: str  # platform of the mesh's devices (never the host's default when compiling ahead)
  impl: str  # the attention kernel resolved for that platform
  rules: tuple
  graphdef: object
  labels: object  # each parameter's optimizer group (optim.group_labels)
  state_shardings: dict
  batch_sharding: NamedSharding
  num_params: int
  eot_id: int | None  # set when attention.doc_mask: documents start at this token
  memory: object = None  # the memory.Plan that checked (and chose) remat and loss chunks
  log: object = None  # where its warnings go (from_config's `log`; None: absl's warning)
  axes: frozenset = frozenset(sharding.LOGICAL_AXES)  # the logical axes its arrays have

  @property
  def tx(self):
    """The optimizer of a run of train.steps (its state's layout, host-side use)."""
    return self.tx_at(self.cfg.train.steps)

  def tx_at(self, total_steps, grad_scale=1):
    """The optimizer for `total_steps`: an int, or the train step's float32 [total steps,
    cooldown steps] argument (optim.lr_factor); `grad_scale`: optim.make_optimizer's."""
    return optim.make_optimizer(self.cfg.optim, self.labels, total_steps, grad_scale)

  def schedule(self) -> np.ndarray:
    """The train step's schedule argument for this run's train.steps (optim.schedule_values)."""
    return np.asarray(optim.schedule_values(self.cfg.optim, self.cfg.train.steps), np.float32)

  def create_model(self, seed=None) -> GPT:
    """A GPT of this run's config (parameters initialised from `seed`, an int or a traced
    one; default cfg.seed)."""
    seed = self.cfg.seed if seed is None else seed
    return draws.build(lambda keys: GPT(self.cfg.model, self.cfg.attention, impl=self.impl,
                                        rngs=keys), jax.random.key(seed))

  def init_state(self):
    """The step-0 train state in its shardings; the seed is an argument of the program, so a
    run with another seed compiles no new one. A model small enough to draw whole
    (draws.MAX_FLAT) is drawn by a program on the default device and placed by a second: XLA's
    partitioner spends longer on the draws than on the rest of the sharded program
    (benchmarks/RESULTS.md, "Init draws in one threefry call"). They go to it as host arrays,
    which jit places without compiling; a one-device array it slices with a program per shape
    (jit__multi_slice). A larger model is drawn in its shardings."""
    def init_params(seed):
      return nnx.to_pure_dict(nnx.state(self.create_model(seed)))

    def init(seed):
      return self.state_from(init_params(seed))
    seed = jnp.int32(self.cfg.seed)
    if self.num_params <= draws.MAX_FLAT and jax.process_count() == 1:
      return self.state_from_params(jax.device_get(jax.jit(init_params)(seed)))
    return jax.jit(init, out_shardings=self.state_shardings)(seed)

  def state_from_params(self, params):
    """A step-0 state around given params, with a fresh optimizer state (load_params_from)."""
    return jax.jit(self.state_from, out_shardings=self.state_shardings)(params)

  def state_from(self, params, step=0):
    """The train state around `params`: the one place its layout is spelled."""
    return new_state(jnp.asarray(step, jnp.int32), params, self.tx.init(params))

  def data_kwargs(self) -> dict:
    """This process's share of every global batch, for the data pipelines; token ids must index
    the embedding tables (model.embed_rows rows, at most the head's model.vocab_size)."""
    t = self.cfg.train
    group, groups = sharding.row_groups(self.batch_sharding, t.batch_size)
    return dict(seq_len=t.seq_len, batch_size=t.batch_size // groups,
                process_index=group, process_count=groups,
                vocab_size=self.cfg.model.embed_rows or self.cfg.model.vocab_size)

  def train_iter(self):
    """The checkpointable iterator of this process's training rows (pipeline.TrainIter)."""
    check_vocab(self.cfg)
    return pipeline.make_train_iter(self.cfg.data, seed=self.cfg.seed, **self.data_kwargs())

  def val_batches(self) -> list:
    """The fixed validation batches (this process's rows, as numpy)."""
    check_vocab(self.cfg)
    t = self.cfg.train
    batches = pipeline.make_val_batches(
        self.cfg.data, num_batches=t.eval_batches,
        length_key="train.eval_seq_len" if t.eval_seq_len else "train.seq_len",
        **dict(self.data_kwargs(), seq_len=t.eval_seq_len or t.seq_len))
    pipeline.check_tokenizer_ids(self.cfg.data, batches)
    warn(registry.get(self.cfg.data.source).warn(self.cfg.data), self.log)
    return batches

  def abstract_state(self):
    """ShapeDtypeStructs of the train state carrying its target shardings (for restore)."""
    shapes = jax.eval_shape(lambda: self.state_from(
        nnx.to_pure_dict(nnx.state(self.create_model()))))
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, self.state_shardings)


def new_state(step, params, opt_state) -> dict:
  """The train state: a step counter, the parameters and the optimizer state."""
  return {"step": step, "params": params, "opt_state": opt_state}


def load(path, overrides=(), fresh=True):
  """config.load, then every section checked by the module that owns it (`fresh`: check's)."""
  cfg = check(config.load(path, overrides), fresh)
  pipeline.check_overrides(cfg.data, overrides)
  return cfg


def check(cfg, fresh=True):
  """Each module checks its own section: choices and the rules between its keys; `fresh`: also
  those of a fresh start only, which a saved run made before them still reads and resumes past."""
  gpt.check_config(cfg.model, cfg.attention, cfg, fresh)
  attention.check_config(cfg.attention)
  loss.check_config(cfg.train)
  optim.check_config(cfg.optim, cfg.model.d_model, fresh)
  pipeline.check_config(cfg.data)
  watch.check_config(cfg.train)
  window_schedule.check_config(cfg.train)
  if cfg.attention.impl == "splash":  # it tiles every row length: refused before start-up
    for n, key in [(cfg.train.seq_len, "train.seq_len")] + window_schedule.row_keys(cfg.train):
      splash.block_size(n, key)
  sharding.parse_rules(cfg.mesh.rules)  # its errors quote the rules as written (lists)
  if cfg.data.eot_id >= cfg.model.vocab_size:  # inserted before documents, or never matched
    raise UserError(f"data.eot_id={cfg.data.eot_id} is no token of the model "
                    f"(model.vocab_size={cfg.model.vocab_size}): give an id below it, or -1 for "
                    "the tokenizer's")
  return cfg


def check_placement(run) -> None:
  """Processes holding the same rows of the batch form groups that load equal shares
  (sharding.row_groups; UserError where the mesh gives them overlapping or unequal shares). A
  batch split along the processes is then split by their count; one replicated across them
  (tensor parallelism spanning hosts) need not be."""
  sharding.row_groups(run.batch_sharding, run.cfg.train.batch_size)


def check_vocab(cfg) -> None:
  """The tokenizer's vocabulary fits model.vocab_size where the data are its text (synthetic
  ids are drawn below the tables' rows). Checked where tokens are read (Run.train_iter,
  Run.val_batches: train and every benchmark on data), so a run built only to look at the
  model or compile it is not refused for a tokenizer it never uses."""
  vocab = tokenizer_vocab(cfg.data) if registry.get(cfg.data.source).text else None
  if vocab is not None and vocab > cfg.model.vocab_size:
    raise UserError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the "
                    f"'{cfg.data.tokenizer}' tokenizer's vocabulary ({vocab}); "
                    f"set model.vocab_size>={vocab}")


def warn(line: str, log=None) -> None:
  """A warning line ('': none) to `log`, the caller's (train.run(log=...)), as 'warning: ...';
  without one to absl's log."""
  if line:
    log(f"warning: {line}") if log else logging.warning("%s", line)


def warn_misaligned(cfg, log=None) -> None:
  """One warning line for matmul dims off model.align (model.strict_align=true refuses them in
  config.finalize)."""
  bad = config.misaligned_dims(cfg.model)
  if bad:
    warn(f"matmul dims not multiples of model.align={cfg.model.align}: {', '.join(bad)}", log)


def prepare(path, overrides=(), *, devices=None, capacity=None, log=None) -> Run:
  """Load a config file with `key=value` overrides and build the run on `devices` (all)."""
  return from_config(load(path, overrides), devices=devices, capacity=capacity, checked=True,
                     log=log)


def from_config(cfg, *, devices=None, capacity=None, prefer=None, checked=False,
                log=None) -> Run:
  """Check `cfg`, fill in derived values for `devices` (default jax.devices()) and build the
  run on them: the one path from a loaded config to a run (train, compile, convert, generate,
  the benchmarks).

  `checked`: the caller already ran `check` (`load` does), so it is not run twice. Before
  anything is built the memory plan checks that the train and eval programs fit the devices
  (`capacity` bytes each; None = ask them) and resolves the auto remat / loss chunks,
  preferring the choices in `prefer` ({key: value}, a resumed run's) where they fit. `log`: where
  its warnings go (the run's lines; None: absl's log).
  """
  if not checked:
    check(cfg)
  devices = list(jax.devices() if devices is None else devices)
  cfg, plan = finalize_plan(cfg, devices, capacity=capacity, prefer=prefer)
  warn_misaligned(cfg, log)
  run = build(cfg, sharding.make_mesh(cfg.mesh, devices))
  check_placement(run)  # after the mesh and memory errors, in the order train reported them
  run.memory, run.log = plan, log
  return run


def for_sampling(cfg, devices, *, checked=False) -> tuple:
  """(finalized config, graphdef, abstract params) of `cfg`'s model run forward on devices[0]
  alone (generate): the checks and derived values of `from_config`, without a training mesh,
  optimizer or memory plan (sampling holds the parameters only, so a model trained on many
  devices still samples on one)."""
  if not checked:
    check(cfg, fresh=False)  # a saved run's model
  devices = list(devices)[:1]
  cfg = _finalize(cfg, {a: 1 for a in sharding.MESH_AXES})
  graphdef, abstract, _ = gpt.abstract_model(cfg, devices[0].platform)
  return cfg, graphdef, nnx.to_pure_dict(abstract)


def finalize(cfg, devices, capacity=None):
  """config.finalize with the values that need devices computed here (mesh, memory plan)."""
  return finalize_plan(cfg, devices, capacity=capacity)[0]


def finalize_plan(cfg, devices, *, capacity=None, prefer=None) -> tuple:
  """(finalized config, memory.Plan) for `devices`; UserError if the run cannot fit them."""
  sizes = mesh_sizes(cfg, devices)
  limit, source = device_memory.capacity(devices) if capacity is None else (capacity, "given")
  planner = memory_plan.for_devices(devices, sizes, limit, source, prefer)
  cfg = _finalize(cfg, sizes)
  return config.with_values(cfg, planner(cfg)), planner.plan


def mesh_sizes(cfg, devices) -> dict:
  """{mesh axis: size} of cfg's mesh on `devices` (its -1 resolved)."""
  return dict(zip(sharding.MESH_AXES, sharding.mesh_shape(cfg.mesh, len(devices))))


def _finalize(cfg, sizes: dict):
  """config.finalize with the values it leaves to its caller: mesh `sizes`, data folder, the
  tokenizer's vocabulary."""
  needed = cfg.data.source == "shakespeare" and not cfg.data.dir  # the one source that reads it
  return config.finalize(cfg, mesh_sizes=sizes, data_dir=default_dir(needed=needed),
                         tokenizer_vocab=tokenizer_vocab(cfg.data))


def check_mesh(cfg, devices) -> None:
  """NotDivisible where a dimension of cfg's model or batch does not divide the mesh it asks for
  on `devices`: `build`'s check, without a memory plan or a mesh."""
  cfg = _finalize(cfg, mesh_sizes(cfg, devices))
  _, abstract, _ = gpt.abstract_model(cfg, devices[0].platform)
  check_divisible(cfg, abstract, sharding.parse_rules(cfg.mesh.rules))


def tokenizer_vocab(data_cfg) -> int | None:
  """The tokenizer's vocabulary size (None for data.tokenizer=none)."""
  return None if data_cfg.tokenizer == "none" else known_vocab_size(data_cfg.tokenizer)


def build(cfg, mesh) -> Run:
  """Abstract model -> logical specs -> shardings and optimizer, without allocating anything."""
  backend = mesh.devices.flat[0].platform
  rules = sharding.parse_rules(cfg.mesh.rules)
  eot_id = doc_mask_eot(cfg) if cfg.attention.doc_mask else None
  graphdef, abstract, impl = gpt.abstract_model(cfg, backend)
  check_divisible(cfg, abstract, rules)
  specs = nnx.to_pure_dict(sharding.param_specs(abstract))
  labels = optim.group_labels(abstract)
  tx = optim.make_optimizer(cfg.optim, labels, cfg.train.steps)
  param_sh = sharding.shardings_of(specs, mesh, rules)
  abstract_params = nnx.to_pure_dict(abstract)
  opt_shapes = jax.eval_shape(tx.init, abstract_params)
  replicated = NamedSharding(mesh, P())
  opt_sh = sharding.like_params(opt_shapes, param_sh, abstract_params, replicated)
  state_sh = new_state(replicated, param_sh, opt_sh)
  return Run(cfg, mesh, backend, impl, rules, graphdef, labels, state_sh,
             sharding.batch_sharding(mesh, rules), count_params(abstract_params), eot_id,
             axes=sharding.model_axes(abstract))


def check_divisible(cfg, abstract, rules) -> None:
  """Every sharded dimension of the activations (validation rows too) and of every parameter
  divides its mesh axes."""
  sizes = gpt.logical_sizes(cfg.model, cfg.train)
  # A weight axis no parameter has (length under rope, layers without scan_layers) shards nothing
  have = sharding.model_axes(abstract)
  dims = [(name, size, key) for name, (key, size) in sizes.items() if name in have]
  t = cfg.train
  if t.eval_seq_len not in (0, t.seq_len):  # validation batches are placed as the train rows
    dims.append(("act_length", t.eval_seq_len, "train.eval_seq_len"))
  dims += sharding.param_dims(abstract, sizes, gpt.table_sizes(cfg.model))
  mesh_sizes = {a: cfg.mesh[a] for a in sharding.MESH_AXES}
  sharding.check_divisible(dims, rules, mesh_sizes)


def doc_mask_eot(cfg) -> int:
  """The end-of-text id that separates documents for attention.doc_mask."""
  eot = resolve_eot_id(cfg.data)
  if eot is None:
    raise UserError("attention.doc_mask=true needs an end-of-text id: set data.eot_id or a "
                    "data.tokenizer that has one")
  return eot


@dataclasses.dataclass
class Start:
  """Where a run starts: its state, its first step, and (when resumed) its saved data state."""
  state: dict
  step: int
  data: dict | None = None  # this process's saved {"iterator": ..., "skipped_steps": ...}
  how: str = "fresh"  # fresh | resumed | loaded
  saved_steps: int | None = None  # the train.steps a resumed step was saved under


def initial_state(run: Run, manager, log=print) -> Start:
  """Resume from the newest intact checkpoint in output_dir, else load
  checkpoint.load_params_from, else initialise a fresh state."""
  cfg = run.cfg
  if manager is not None and manager.all_steps():
    step, state, data, integrity = newest_intact(run, manager, log)
    change = check_data_unchanged(cfg, integrity, step, manager.fingerprint)
    log(f"resumed from the checkpoint of step {step} in {cfg.output_dir}"
        + (f"; data.allow_changed=true: {change}" if change else ""))
    was = (rundir.step_config(cfg.output_dir, step).get("train") or {}).get("steps")
    if isinstance(was, int) and was != cfg.train.steps:  # the schedules change: say so
      log(window_schedule.steps_change_line(cfg, was, step))
    if step < cfg.train.steps and (note := revisions.resume_note(integrity, cfg, step)):
      log(note)
    if cfg.checkpoint.load_params_from:
      log("checkpoint.load_params_from is not read again: the run it started resumes from its "
          "own checkpoint")
    return Start(state, step, checkpoint.own_data(data, checkpoint.step_dir(manager, step)),
                 "resumed", was if isinstance(was, int) else None)
  if cfg.checkpoint.load_params_from:
    source, params = params_from.load(cfg.checkpoint.load_params_from,
                                            run.abstract_state()["params"])
    log(f"initialised parameters from {source} (fresh optimizer state, step 0)")
    return Start(run.state_from_params(params), 0, how="loaded")
  return Start(run.init_state(), 0)


def newest_intact(run: Run, manager, log) -> tuple:
  """(step, state, data, integrity) of the newest step that restores and verifies.

  Newer damaged steps get one warning line each and are moved to output_dir/damaged/ (kept,
  never deleted), so later saves of those step numbers can be written; when no step is intact
  nothing is moved and the first step's reason is the error.
  """
  damaged = []
  for step in sorted(manager.all_steps(), reverse=True):
    try:
      state, data, _, integrity = checkpoint.restore_step(manager, step, run.abstract_state())
    except checkpoint.Damaged as e:
      damaged.append((step, e))
      continue
    for bad, why in damaged:
      where = rundir.quarantine(run.cfg.output_dir, bad) if jax.process_index() == 0 else "?"
      log(f"warning: {why}; resuming from step {step}, the newest intact one (step {bad} moved "
          f"to {where})")
    if damaged:
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices("nanotext: damaged steps moved")
      manager.reload()
    return step, state, data, integrity
  step, why = damaged[0]
  raise UserError(f"{why}; no older checkpoint restores either"
                  if len(damaged) > 1 else str(why))


def check_data_unchanged(cfg, integrity, step: int, fingerprint) -> str:
  """Refuse to resume on training shards that differ from those the step was trained on; what
  changed where data.allow_changed=true lets it ('' where nothing did)."""
  saved = (integrity or {}).get("data")
  if saved is None or fingerprint is None:  # unknown: e.g. converted
    return ""
  change = fingerprint_change(saved, fingerprint)
  if change and not cfg.data.allow_changed:
    raise UserError(f"the training data changed since the checkpoint of step {step} ({change}): "
                    "a resume would not see the batches it would have seen. Restore the data, or "
                    "pass data.allow_changed=true to continue on the new data")
  return change
