"""Validation loss of a trained run: `python -m nanotext.evaluate output_dir=DIR [step=N|all]
[key=value ...]`.

The run's own config.yml with `key=value` overrides (more batches: train.eval_batches=64;
longer rows: train.eval_seq_len; other text: data.*), built and compiled as training builds its
eval step, on every device, with the remat and loss chunks the run chose; the numbers are the
run's own at that step (its metrics.jsonl) when nothing is overridden. A params-only folder
(convert) reads the same. Nothing in output_dir is written.
"""

import os
import re

# jax is imported inside the functions: a Ctrl-C while it loads is one line (errors.run_cli).
from nanotext.errors import Unreadable, UserError

USAGE = "usage: python -m nanotext.evaluate output_dir=DIR [step=N|all] [key=value ...]"


def parse(argv) -> tuple:
  """(output_dir, step: an int, -1 for the newest, or "all"; config overrides) from `key=value`
  arguments: output_dir and step are this tool's, the rest are the config's keys."""
  from nanotext import config, rundir
  out, step, overrides, seen = None, "-1", [], set()
  for arg in argv:
    key, value = config.parse_override(arg)
    if key in seen and key in ("output_dir", "step"):
      raise UserError(f"{key}= is given twice; give it once")
    seen.add(key)
    if key == "output_dir":
      out = os.path.expanduser(value)
    elif key == "step":
      step = value.strip()
    else:
      check_override(key)
      overrides.append(arg)
  if out is None:
    raise UserError(f"output_dir is required; {USAGE}")
  rundir.check_no_glob(os.path.abspath(out), "output_dir")
  rundir.check_run_dir(out, "output_dir")
  if step != "all":
    if not re.fullmatch(r"[+-]?\d+", step):
      raise UserError(f"step={step!r} is not a checkpoint step: give an integer, all, or leave "
                      "it out for the newest")
    step = int(step)
    if step < -1:
      raise UserError(f"step={step} is not a checkpoint step: give a step >= 0, all, or leave "
                      "it out for the newest")
  if step != -1 and is_params_only(out):
    raise UserError(f"output_dir '{out}' is a params-only folder (one step): leave step= out")
  return out, step, overrides


def is_params_only(out: str) -> bool:
  """Whether `out` is what `convert params-only` writes (params/, no checkpoints/)."""
  return os.path.isdir(os.path.join(out, "params")) and \
      not os.path.isdir(os.path.join(out, "checkpoints"))


def check_override(key: str) -> None:
  """Refuse an override of a key that changes the model the checkpoint was trained as (the
  loss of another model, qk_norm=false or a window, reported as the run's)."""
  from nanotext.config import HOW_COMPUTED, changes_model
  if changes_model(key):
    raise UserError(f"{key} changes the model the checkpoint was trained as; evaluate reads the "
                    f"run's own (it takes data.*, train.*, mesh.* and {', '.join(HOW_COMPUTED)})")


def load_config(out: str, overrides, checked: bool = True):
  """The run's config with `overrides` (output_dir: the run's folder, wherever it was trained),
  `checked` as train checks it (wiring, which imports jax), else only read and typed; a
  config.yml edited after the newest checkpoint is refused (identity.check_unedited)."""
  from nanotext import rundir
  return rundir.run_config(out, "output_dir", lambda: _load_config(out, overrides, checked))


def _load_config(out: str, overrides, checked: bool):
  from nanotext import config, config_file, identity
  # distributed.* as the schema has them: a run of 2 processes saved its coordinator, count and
  # index, and evaluate waited init_timeout to join a coordinator long gone (the environment's
  # NANOTEXT_* keys, or overrides, choose)
  own = [f"distributed.{k}={config.yaml_scalar(v) if v != '' else ''}" for k, v in
         config_file.read(config.SCHEMA_PATH)["distributed"].items() if k != "init_timeout"]
  # The eval step's memory choices back to auto (memory_plan.KEYS), the run's own preferred
  # where they still fit (evaluate's saved_choice): config.yml's resolved values read as set kept
  # one that no longer fit, and its advice walked one pass count at a time
  auto = ["train.eval_accum=-1", "train.eval_loss_chunk=-1"]
  args = (os.path.join(out, "config.yml"), [*own, *auto, *overrides, f"output_dir={out}"])
  if checked:
    from nanotext import wiring
    if "model.scan_layers" in override_keys(overrides):
      # checked here first: wiring's line advises turning off model.* keys evaluate refuses
      from nanotext.model.gpt import check_scan
      cfg = config.load(*args)
      check_scan(cfg.model, cfg.attention, "evaluate keeps them as the run trained them: leave "
                 "model.scan_layers as the run has it")
    cfg = wiring.load(*args, fresh=False)
  else:
    cfg = config.load(*args)
  # its overrides change no key of the model (check_override): the model is config.yml's
  identity.check_unedited(out, cfg.to_dict())
  if cfg.attention.doc_mask:
    check_doc_mask_eot(cfg, config.load(args[0], [*own, *auto, f"output_dir={out}"]), overrides)
  return cfg


def override_keys(overrides) -> set:
  """The keys `overrides` set, read as config.load reads them ("data.eot_id =5" sets
  data.eot_id: a test of the raw text let it change the id under attention.doc_mask)."""
  from nanotext.config import parse_override
  return {parse_override(o)[0] for o in overrides}


def check_doc_mask_eot(cfg, own, overrides) -> None:
  """Refuse overrides that change the end-of-text id of a run trained with attention.doc_mask
  (`own`: its config without them): the id chooses the document mask the model computes, so
  the loss was another model's, reported as the run's."""
  from nanotext.data.tokenizer import resolve_eot_id
  keys = [k for k in ("data.eot_id", "data.tokenizer") if k in override_keys(overrides)]
  if not keys:  # the run's own id (resolving it may load a tokenizer: only when overridden)
    return
  ran, now = resolve_eot_id(own.data), resolve_eot_id(cfg.data)
  if now != ran:
    raise UserError(f"{keys[0]} changes the model the checkpoint was trained as: its "
                    f"attention.doc_mask starts documents at end-of-text id {ran}, the "
                    f"overrides give {now}; evaluate reads the run's own (leave {keys[0]} out, "
                    f"or set data.eot_id={ran})")


def precheck(argv) -> None:
  """The arguments, the run's config with the overrides and its steps, checked before jax loads."""
  out, step, overrides = parse(argv)
  load_config(out, overrides, checked=False)
  sources(out, step)


def fit_mesh(cfg, out: str, overrides, devices, log):
  """The run's config where its mesh (saved with the sizes it resolved to) spans `devices` (a
  list, or a count of jax.devices()), or where the overrides set a mesh.* key; else the config
  with every device on fsdp, or on data where the model's dimensions do not divide that."""
  import jax
  from nanotext import sharding, wiring
  devices = jax.devices()[:devices] if isinstance(devices, int) else list(devices)
  try:
    sharding.mesh_shape(cfg.mesh, len(devices))
    return cfg
  except UserError:
    if any(k.startswith("mesh.") for k in override_keys(overrides)):
      return cfg  # the user's own mesh: its error comes from wiring, as train's would

  def divides(layout) -> bool:
    try:
      wiring.check_mesh(load_config(out, [*layout, *overrides]), devices)
      return True
    except sharding.NotDivisible:
      return False
  layouts = (sharding.ALL_ON_FSDP, sharding.ALL_ON_DATA)
  layout = next((a for a in layouts if divides(a)), layouts[0])  # neither: fsdp's refusal
  log(f"the run's mesh ({sharding.sizes_text(cfg.mesh)}) does not span this machine's "
      f"{len(devices)} devices: evaluating with {' '.join(layout)} (set mesh.* to choose)")
  return load_config(out, [*layout, *overrides])


def sources(out: str, step) -> list:
  """[(step or None, path for params_from.load)] to evaluate: the newest step (resolved as it is
  read), one step, or every step on disk oldest first."""
  from nanotext import rundir
  from nanotext.checkpoint import checkpoint_dir
  if step == -1 and is_params_only(out):
    return [(None, out)]
  have = [s for s in rundir.steps_on_disk(out)  # folders: a file named 7 is no step
          if os.path.isdir(os.path.join(checkpoint_dir(out), str(s)))]
  if not have and step in (-1, "all"):
    raise UserError(f"output_dir '{out}' holds no checkpoints{rundir.no_step_note(out)}")
  if step == -1:
    return [(None, out)]
  if step != "all" and (isinstance(step, bool) or not isinstance(step, int)):
    raise UserError(f"step={step!r} is no step: give an int (-1: the newest) or 'all'")
  if step == "all":
    return [(s, os.path.join(checkpoint_dir(out), str(s))) for s in have]
  if step not in have:
    raise UserError(f"output_dir '{out}' has no checkpoint for step {step}; it has "
                    f"{have}{rundir.aside_note(out)}")
  return [(step, os.path.join(checkpoint_dir(out), str(step)))]


def step_of(source: str) -> int:
  """The step of the folder params_from.load read: a params-only folder's (convert.json), or a
  step directory's name."""
  from nanotext.convert.common import params_only_step
  if is_params_only(source):
    return params_only_step(source)
  return int(os.path.basename(os.path.normpath(source)))


def evaluate(out: str, step=-1, overrides=(), log=print) -> list:
  """[{"step", "val_loss", "val_bpb" (when the text's bytes are known), "tokens"}] of the
  checkpoints `step` names (-1: the newest; all: each), evaluated on the run's validation
  batches; a step that a run still training removes while it is read is left out, said in a
  line."""
  import jax
  import numpy as np
  from nanotext import (distributed, memory_plan, metrics, params_from, programs, rundir, sharding,
                        trainer, wiring)
  from nanotext.data.pipeline import tokenizer_problem, val_bytes_per_token
  from nanotext.checkpoint import checkpoint_dir
  from nanotext.integrity import Damaged
  from nanotext.model.kernels.dispatch import takes_runtime_window
  from nanotext.window_schedule import eval_plan, eval_windows
  from nanotext.config import parse_override
  for override in overrides:  # as the command line refuses them (else: 'config.yml edited')
    check_override(parse_override(override)[0])
  cfg = load_config(out, overrides)
  folder = rundir.folder_id(checkpoint_dir(out))  # another one later: the run was set aside
  todo = sources(out, step)  # a run without checkpoints refused before its data and model
  distributed.maybe_initialize(cfg.distributed)  # before the first backend use
  cfg = fit_mesh(cfg, out, overrides, jax.devices(), log)
  try:
    run = wiring.from_config(cfg, prefer=memory_plan.saved_choice(out), checked=True, log=log)
  except sharding.NotDivisible as e:
    if e.key.startswith("train."):  # a key evaluate takes: the advice stands
      raise
    raise e.mesh_only("evaluate builds the model as the run trained it") from None
  run.memory.require("eval")
  cfg, t = run.cfg, run.cfg.train
  val_local = run.val_batches()
  val = [trainer.global_batch(run, b) for b in val_local]
  bytes_per_token = val_bytes_per_token(cfg.data, trainer.every_process(val_local))
  if bytes_per_token is None and (why := tokenizer_problem(cfg.data)):  # as train says it
    log(f"warning: {why}; no val_bpb without it")
  seq_len = t.eval_seq_len or t.seq_len
  tokens = len(val) * t.batch_size * seq_len
  short = f", all the validation data holds (train.eval_batches={t.eval_batches})" \
      if len(val) < t.eval_batches else ""
  log(f"model: {run.num_params:,} parameters | {len(val)} batch{'es' * (len(val) != 1)} of "
      f"{t.batch_size}x{seq_len} tokens ({tokens:,}{short}) | {run.mesh.size} {run.backend} "
      "device(s)")
  abstract = run.abstract_state()["params"]
  done = lambda s: t.steps if s < 0 else s  # eval_windows=step: the windows of that step
  execs, rows, damaged, gone, listed = None, [], [], [], 1
  for at, path in todo:  # grows where each step listed was removed while read: the newer ones
    try:
      source, params = params_from.load(path, abstract, what="output_dir",
                                         step_arg="step=")
    except (Damaged, UserError) as e:
      if at is None or isinstance(e, Unreadable):  # another user's files: no step to leave out
        raise
      cut = os.path.isdir(path) and rundir.cut_short(out, at, str(e))  # by a killed run
      if cut and step != "all":
        raise UserError(f"output_dir '{out}': the checkpoint of step {at} was {cut}") from None
      if cut:
        log(f"step {at:>6d} | left out: it was {cut}")
        continue
      # there, and not readable; or being removed by the run training into `out`, state/ first
      if os.path.isdir(path) and not rundir.rotated_out(out, at, rundir.live_keep(out)):
        why = str(e) if os.path.isdir(os.path.join(path, "state")) else \
            f"the checkpoint of step {at} holds no state/ folder (incomplete or damaged)"
        if step != "all":
          raise UserError(why) from None
        log(f"step {at:>6d} | left out: {why}")
        damaged.append(at)
        continue
      if step != "all":
        raise UserError(rundir.gone_while_read("output_dir", out, at, folder)) from None
      log(f"step {at:>6d} | " + (f"{rundir.SET_ASIDE}; left out" if rundir.set_aside_since(
          out, folder) else "removed while it was read (a run still training); left out"))
      gone.append(at)
      if len(gone) == len(todo) and listed < rundir.READS and \
          not rundir.set_aside_since(out, folder):
        todo += newer_steps(out, gone)  # in place: this loop goes on with them
        listed += 1
      continue
    at = step_of(source)
    if execs is None:  # every eval program the steps need, compiled together once
      dones = [done(s) for s, _ in todo if s not in gone] if step == "all" else [done(at)]
      execs = programs.compile_programs(run, "eval", eval_plan(
          cfg, dones, takes_runtime_window(run.impl)), (params, val[0]), log)
    stage = (eval_windows(cfg, done(at)), seq_len)
    losses = trainer.dispatch_each(run, lambda b: execs(stage, params, b), val)
    row = metrics.val_row(float(np.mean(jax.device_get(losses))), bytes_per_token)
    rows.append({"step": at, **row, "tokens": tokens})
    log(f"step {at if at >= 0 else '?':>6} | {metrics.val_text(row)}")  # ?: no convert.json
  if gone and len(gone) == len(todo) and not rundir.set_aside_since(out, folder):
    raise rundir.rotated_away("output_dir", out, gone, "every step listed")  # none read
  if damaged:  # the intact steps are above; the status says not every step was read
    raise UserError(f"step(s) {', '.join(map(str, damaged))} of '{out}' could not be read "
                    f"(python -m nanotext.verify {out} says how each is damaged)")
  return rows


def newer_steps(out: str, tried: list) -> list:
  """sources() of step=all but the steps `tried`, which a run training into `out` removed."""
  try:
    return [(s, path) for s, path in sources(out, "all") if s not in tried]
  except UserError:  # no step left
    return []


def main(argv) -> None:
  from nanotext.xla_flags import maybe_set_cpu_flags
  maybe_set_cpu_flags()  # the CPU flags training ran with (before the backend starts)
  out, step, overrides = parse(argv)
  evaluate(out, step, overrides, log=lambda line: print(line, flush=True) if is_main() else None)


def is_main() -> bool:
  import jax
  return jax.process_index() == 0


if __name__ == "__main__":
  from nanotext import cli
  cli.run(main, USAGE, __doc__, jax=True, precheck=precheck, aot=True,
          at_once=cli.READ_ONLY_STOP)
