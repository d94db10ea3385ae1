"""Whether output_dir holds this run: config.yml against the command, against the checkpoint
it was saved with, and where a config file lies. `session.Session` runs `check_run` for train;
the read tools (evaluate, generate, convert, verify) run `check_unedited`.

- `check_run`: the same run resumes (another mesh or device count included); a different one
  needs overwrite=true; a run already past train.steps is refused (replaced under overwrite).
- A config.yml edited after the checkpoint it describes is named as edited, not as another run.
- `check_source`: train starts from a run's saved config.yml only in that run's own folder.
"""

import os

from nanotext import config, config_file
from nanotext.errors import UserError
from nanotext.rundir import params_only_config, step_config, steps_on_disk

RUN_SECTIONS = ("model", "train", "data")  # what every run's config.yml has


def check_run(cfg, out: str) -> bool:
  """Refuse an output_dir that holds a different run unless overwrite=true, or a run already
  past train.steps (replaced under overwrite=true); True when the previous run is to be replaced
  (set aside, then deleted), which checkpoint.load_params_from must then not lie in."""
  replacing, src = _check_run(cfg, out), cfg.checkpoint.load_params_from
  if not (replacing and src):  # '' (none given) resolves against the cwd, which may be gone
    return replacing
  check_folder(src, "checkpoint.load_params_from")  # before the run is set aside for nothing
  real, ckpts = os.path.realpath(src), os.path.join(os.path.realpath(out), "checkpoints")
  if real in (ckpts, os.path.dirname(ckpts)) or real.startswith(ckpts + os.sep):
    raise UserError(f"checkpoint.load_params_from='{src}' lies in the run in output_dir, which "
                    "overwrite=true sets aside before the parameters are read: to start from its "
                    "weights, train into another output_dir (or copy them out first: python -m "
                    f"nanotext.convert params-only --run={out} --out=DIR)")
  return replacing


def as_saved(cfg, out: str):
  """`cfg` finalized without devices as the run in `out` was (its tokenizer's vocabulary for
  model.embed_rows=-1; mesh sizes and the memory plan's keys resume): check_run's input for
  train --only_check_args."""
  try:
    rows = (config_file.read(os.path.join(out, "config.yml")).get("model") or {}).get("embed_rows")
  except (UserError, AttributeError):  # missing or no run's: check_run says what it says then
    rows = None
  return config.finalize(cfg, mesh_sizes={}, data_dir="",
                         tokenizer_vocab=rows if isinstance(rows, int) and rows > 0 else None)


def check_folder(path: str, what: str) -> None:
  """Refuse a checkpoint path that names no folder (`what`: the argument that gave it): the
  cheap part of params_from.find_item, without jax."""
  from nanotext.rundir import check_no_glob
  check_no_glob(os.path.abspath(path), what)
  if not os.path.isdir(path):
    raise UserError(f"{what}='{path}' " + ("is not a directory" if os.path.lexists(path) else
                                           "does not exist"))


def _source_change(old: dict, cfg, done: list) -> list:
  """checkpoint.load_params_from changed where the run has checkpoints: another start, so
  another run (a resume would not read the new source)."""
  new = cfg.checkpoint.load_params_from
  section = old.get("checkpoint")
  was = section.get("load_params_from") if isinstance(section, dict) else ""
  was = was if isinstance(was, str) else ""
  if not done or not new or was == new or (was and os.path.realpath(was) ==
                                           os.path.realpath(new)):
    return []
  return [f"checkpoint.load_params_from: {was or repr('')} -> {new}"]


def _check_run(cfg, out: str) -> bool:
  path = os.path.join(out, "config.yml")
  done = steps_on_disk(out)
  linked = [n for n in done if os.path.islink(os.path.join(out, "checkpoints", str(n)))]
  if linked and not cfg.overwrite:  # resumed, then the first rotation died on it (rmtree)
    raise UserError(f"'{os.path.join(out, 'checkpoints', str(linked[0]))}' is a symbolic link, "
                    "which the run cannot rotate away (checkpoint.keep): put a copy of the step "
                    "there instead (cp -rL)")
  if not os.path.lexists(path):
    return _without_config(cfg, out)
  try:
    old = config_file.read(path)
  except UserError as e:
    if cfg.overwrite:
      return True
    raise UserError(f"'{path}' is damaged ({e}), so this run cannot tell whether output_dir "
                    "holds the same run; restore that file, or pass overwrite=true to replace "
                    "the run in output_dir") from None
  if not (isinstance(old, dict) and all(isinstance(old.get(k), dict) for k in RUN_SECTIONS)):
    if cfg.overwrite:  # someone else's config.yml (and metrics.jsonl) was taken for this run's
      return True
    raise UserError(f"output_dir '{cfg.output_dir}' holds a config.yml that is no nanotext "
                    f"run's (no {', '.join(k + ':' for k in RUN_SECTIONS)} sections): choose "
                    "another output_dir, or pass overwrite=true to replace what is there")
  diff, saved = config.run_identity_diff(old, cfg.to_dict()) + _source_change(old, cfg, done), ""
  kept = step_config(out, done[-1]) if done else {}
  against = config.run_identity_diff(kept, cfg.to_dict()) if kept else []
  if not diff and against:  # config.yml edited since the newest step was saved by the run
    diff, saved = against, \
        f", against its checkpoint of step {done[-1]}: config.yml was edited after it"
  elif diff and kept and not against and not _source_change(kept, cfg, done) and not cfg.overwrite:
    edited(path, config.run_identity_diff(kept, old) or diff, done[-1])  # the checkpoint's run
  if diff:
    if not cfg.overwrite:
      same = "; or give the checkpoint.load_params_from it started from (or none) to resume " \
          "it" if any(d.startswith("checkpoint.load") for d in diff) else ""
      # a recipe's default changed since the run began: its own config.yml resumes it as it was
      as_saved = "" if saved else f", resume it as it began with `nanotext.train {path}`,"
      raise UserError(f"output_dir '{cfg.output_dir}' holds a different run ({diff[0]}"
                      f"{f' and {len(diff) - 1} more' if len(diff) > 1 else ''}{saved}); choose "
                      f"another output_dir{as_saved} or pass overwrite=true to replace it{same}")
    return True
  if done and max(done) > cfg.train.steps:
    if cfg.overwrite:  # it cannot be continued: replaced, as asked
      return True
    raise UserError(f"output_dir '{cfg.output_dir}' holds a checkpoint of step {max(done)}, past "
                    f"train.steps={cfg.train.steps}: raise train.steps to continue that run, "
                    "choose another output_dir, or pass overwrite=true to replace it")
  return False


def edited(path: str, diff: list, step: int, where: str = "") -> None:
  """UserError: config.yml at `path` was edited after its checkpoint of `step` was saved."""
  raise UserError(f"'{path}' differs from the config its checkpoint of step {step} was saved "
                  f"with ({diff[0]}{f' and {len(diff) - 1} more' if len(diff) > 1 else ''}): it "
                  "was edited after; put the saved values back "
                  f"({where or f'checkpoints/{step}/config/metadata'} holds them)")


def _without_config(cfg, out: str) -> bool:
  """check_run of a folder without config.yml: a run's rows or steps there are not appended to
  or resumed blind (whose are they?); True to replace them under overwrite=true."""
  metrics = os.path.join(out, "metrics.jsonl")
  found = (["metrics.jsonl"] if os.path.isfile(metrics) and os.path.getsize(metrics) else []) + \
      ([f"checkpoint steps {steps_on_disk(out)}"] if steps_on_disk(out) else [])
  if found and not cfg.overwrite:
    raise UserError(f"output_dir '{cfg.output_dir}' holds {' and '.join(found)} but no "
                    "config.yml, so this run cannot tell whose they are; put that run's "
                    "config.yml back to continue it, choose another output_dir, or pass "
                    "overwrite=true to replace them")
  return bool(found)


def check_unedited(out: str, cfg_dict: dict) -> None:
  """Refuse a run whose config.yml (read as `cfg_dict`) differs, in a key of its model
  (config.changes_model), from the config its newest checkpoint was saved with (a params-only
  folder's: its convert.json's): a read tool would build another model around its weights (heads
  regrouped, a softcap added) and say nothing."""
  done = steps_on_disk(out)
  (saved, step), where = ((step_config(out, done[-1]), done[-1]), "") if done else \
      (params_only_config(out), "convert.json's config")
  diff = [d for d in (config.run_identity_diff(saved, cfg_dict) if saved else [])
          if config.changes_model(d.split(":")[0])]
  if diff:
    edited(os.path.join(out, "config.yml"), diff, step, where)


def check_source(path, overrides, cfg) -> None:
  """UserError where train's config file is a config.yml it cannot start from as it stands:
  output_dir's own where no run is yet (the run saves over it), or a training run's saved one
  in a folder other than its output_dir (moved or copied: it would train at the old path)."""
  src, out = os.path.realpath(path), os.path.realpath(cfg.output_dir)
  folder = os.path.dirname(os.path.abspath(path))
  if src == os.path.join(out, "config.yml"):
    if not config.in_run_folder(src):
      raise UserError(f"config file '{path}' is output_dir's own config.yml, which the run "
                      "replaces with the config it resolves: keep your config elsewhere, or "
                      "name another output_dir")
  elif config.in_run_folder(src, config.TRAINED) and not any(
      config.parse_override(a)[0] == "output_dir" for a in overrides):
    raise UserError(f"config file '{path}' is the saved config of the run whose output_dir is "
                    f"'{cfg.output_dir}', not of the folder it lies in: pass output_dir={folder} "
                    "to resume the run there, or output_dir=DIR to start one elsewhere")
