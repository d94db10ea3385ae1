"""The run directory's facts and moves: which paths can hold a run, its steps and saved
configs, the overwrite transaction, and quarantine (whether it holds this run: identity.py).
`session.Session` puts them in order for one run.

- Overwrite: the previous run's files are moved into `output_dir/.overwritten/` and deleted only
  once the new run has a checkpoint on disk (`commit`); until then any failure, or a kill followed
  by the next start, moves them back (`roll_back` / `recover`).
- Damaged checkpoint steps are moved to `output_dir/damaged/`, never deleted.
"""

import json
import os
import shutil
import time

from nanotext import config_file, lock
from nanotext.errors import UserError, unreadable

ASIDE = ".overwritten"  # the previous run while an overwrite is not yet committed
COMMITTED = "COMMITTED"  # written into ASIDE once the new run has a checkpoint: delete ASIDE
DAMAGED = "damaged"
RUN_FILES = ("checkpoints", "tb", "metrics.jsonl", "config.yml")
# Longer names make orbax's temporary step names fail deep inside a save; refuse them up front.
MAX_PATH = 3000
# Orbax globs inside a checkpoint's own path (merging OCDBT files, reading array metadata)
GLOB_CHARS = "*?["


def check_no_glob(path: str, what: str) -> None:
  """UserError when `path` holds a character orbax reads as a glob, or '\\' (tensorstore: '/')."""
  if bad := sorted({c for c in path if c in GLOB_CHARS}):
    raise UserError(f"{what} '{path}' contains {' and '.join(repr(c) for c in bad)}: checkpoints "
                    "use the path as a glob pattern and could not be read back; choose (or "
                    "symlink) a path without * ? [")
  if "\\" in path:  # its arrays went to a stray folder beside the run, which said it finished
    raise UserError(f"{what} '{path}' contains a backslash, which tensorstore reads as '/': "
                    "checkpoint arrays would go astray, never read back; choose a path without it")


def kernel_fs(path: str) -> str:
  """'proc', 'sys' or 'dev' when `path` lies in that kernel file system, else '' (/dev/shm is
  memory a run may write to, tmpfs)."""
  parts = os.path.realpath(path).split(os.sep) + ["", ""]
  return parts[1] if parts[1] in ("proc", "sys", "dev") and parts[1:3] != ["dev", "shm"] else ""


def is_step_name(name: str) -> bool:
  """Whether a name in checkpoints/ is a step number (ASCII digits: '²' and '٣' are not)."""
  return name.isascii() and name.isdigit()


def check_run_dir(path: str, what: str, holds: str = "config.yml",
                  kind: str = "a run's output_dir") -> None:
  """UserError unless `path` (the value of `what`) is a folder holding the file `holds`: the one
  check of the tools that read a run directory (convert, generate, plot; the HF folder alike)."""
  if os.path.isfile(path):
    raise UserError(f"{what} '{path}' is a file; give {kind}")
  if not os.path.isdir(path):
    raise UserError(f"{what} '{path}' does not exist")
  if not os.path.isfile(os.path.join(path, holds)):
    if holds == "config.yml" and (note := aside_note(path)):  # moved, with the run
      raise UserError(f"{what} '{path}' holds no config.yml{note}")
    saved = [s for s in steps_on_disk(path) if holds == "config.yml" and step_config(path, s)]
    back = saved and os.path.join(path, "checkpoints", str(saved[-1]), "config", "metadata")
    raise UserError(f"{what} '{path}' holds no {holds}" + (
        f", which its checkpoint of step {saved[-1]} was saved with: put it back (cp '{back}' "
        f"'{os.path.join(path, holds)}': JSON is YAML)" if saved else f": is it {kind}?"))


def run_config(out: str, what: str, load):
  """load(), which reads the config.yml of the run in `out`; where that fails as config.yml
  vanished meanwhile (an overwrite=true start set the run aside), check_run_dir's line instead."""
  try:
    return load()
  except UserError:
    check_run_dir(out, what)
    raise


def run_holding(path: str) -> str:
  """The run directory whose checkpoints/ folder `path` lies in, else ''."""
  parent = os.path.dirname(path)
  while parent != os.path.dirname(parent):
    if os.path.basename(parent) == "checkpoints":
      run = os.path.dirname(parent)
      if any(os.path.exists(os.path.join(run, n)) for n in ("config.yml", ".lock")):
        return run
    parent = os.path.dirname(parent)
  return ""


def training_mark(path: str) -> str:
  """What at `path` shows a training run's folder (its checkpoints/, metrics, lock), else ''.
  A params-only folder holds config.yml too: that one alone is no mark."""
  marks = [n for n in RUN_FILES if n != "config.yml"] + [lock.LOCK]
  return next((n for n in marks if os.path.lexists(os.path.join(path, n))), "")


def is_params_only(path: str) -> bool:
  """Whether `path` is a params-only folder (`convert params-only`: params/ and convert.json)."""
  return os.path.isdir(os.path.join(path, "params")) and \
      os.path.isfile(os.path.join(path, "convert.json"))


def check_output_dir_path(out: str) -> str:
  """The absolute output_dir, refused (UserError) when it cannot hold a run."""
  if not out or not out.strip():
    raise UserError("output_dir is empty: set output_dir=DIR")
  path = os.path.abspath(os.path.expanduser(out))
  check_no_glob(path, "output_dir")
  if os.path.dirname(path) == path:  # config.yml, checkpoints/ and tb/ written into '/'
    raise UserError(f"output_dir '{out}' is the file system's root: choose a folder under it")
  if len(path) > MAX_PATH or any(len(p.encode()) > 255 for p in path.split(os.sep)):
    raise UserError(f"output_dir '{out[:80]}...' is too long a path for this file system")
  if kernel_fs(path):
    raise UserError(f"output_dir '{out}' lies in a kernel file system ({kernel_fs(path)}): "
                    "choose a directory on disk")
  if os.path.exists(path) and not os.path.isdir(path):
    raise UserError(f"output_dir '{out}' exists and is not a directory")
  if os.path.islink(path) and not os.path.exists(path):
    raise UserError(f"output_dir '{out}' is a symbolic link to '{os.readlink(path)}', which "
                    "does not exist: create that folder, or choose another output_dir")
  holder = run_holding(path) or run_holding(os.path.realpath(path))
  if holder:  # its checkpoint rotation would delete this run
    raise UserError(f"output_dir '{out}' lies inside the checkpoints/ of the run '{holder}'; "
                    "choose a folder outside it")
  if is_params_only(path):  # a run there would start from random weights, ignoring params/
    raise UserError(f"output_dir '{out}' is a params-only folder (params/ and convert.json), "
                    "whose weights a run there would ignore; to start from them, pass "
                    f"checkpoint.load_params_from={path} and another output_dir")
  ckpt = os.path.join(path, "checkpoints")
  if os.path.lexists(ckpt) and not os.path.isdir(ckpt):
    raise UserError(f"'{ckpt}' exists and is not a directory: move it away (checkpoints are "
                    "written there)")
  return path


def has_checkpoint(out: str) -> bool:
  return bool(steps_on_disk(out))


def params_only_config(out: str) -> tuple:
  """(the config a params-only folder's weights were written with, their step), from its
  convert.json; ({}, -1) where it holds none (written before the record existed, or no folder)."""
  if not is_params_only(out):
    return {}, -1
  try:
    with open(os.path.join(out, "convert.json"), encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, ValueError):  # the step and checksums reader names a damaged one
    return {}, -1
  saved = record.get("config") if isinstance(record, dict) else None
  return (saved, record.get("step", -1)) if isinstance(saved, dict) else ({}, -1)


def step_config(out: str, step: int) -> dict:
  """The config a step was saved with (its orbax JSON item); {} where it cannot be read."""
  try:
    with open(os.path.join(out, "checkpoints", str(step), "config", "metadata"), "rb") as f:
      saved = json.loads(f.read())
  except (OSError, ValueError):
    return {}
  return saved if isinstance(saved, dict) else {}


def aside_note(out: str) -> str:
  """What a read tool says of a run moved aside by an overwrite: one in progress (it holds the
  lock) deletes it at its first checkpoint; one that never got there (killed) left it whole, and
  the next start in output_dir puts it back. '' if none."""
  aside = os.path.join(out, ASIDE)
  if not os.path.isdir(aside) or os.path.lexists(os.path.join(aside, COMMITTED)):
    return ""
  live = running(out)
  if live:
    return (f"; an overwrite=true run ({live}) is replacing the run it held, set aside in "
            f"'{aside}' until the new run's first checkpoint, which deletes it")
  return (f"; the run it held is set aside whole in '{aside}' by an overwrite=true start that "
          "ended before its first checkpoint: the next train start there puts it back")


def no_step_note(out: str) -> str:
  """What a read tool adds to 'holds no checkpoints' where checkpoints/ holds no step: a run
  saving its first one or none yet, an unfinished save, an empty folder; and aside_note."""
  try:
    names = os.listdir(os.path.join(out, "checkpoints"))
  except OSError:
    names = None
  live, note = running(out), aside_note(out)
  saving = any("orbax-checkpoint-tmp" in n for n in names or ())
  if live:  # an overwrite's note names the live run itself
    return (f" yet: the run training into it ({live}) is saving its first one" if saving else
            " yet" if note else f" yet: the run training into it ({live}) has saved none") + note
  if saving:  # not 'empty', as it was called: verify names it the same
    return " (its checkpoints/ folder holds a save that never finished)" + note
  return " (its checkpoints/ folder is empty)" * (names == []) + note


def steps_on_disk(out: str) -> list:
  """The step numbers in output_dir/checkpoints now (complete or being removed), oldest first."""
  try:
    return sorted(int(n) for n in os.listdir(os.path.join(out, "checkpoints")) if is_step_name(n))
  except (FileNotFoundError, NotADirectoryError):
    return []
  except PermissionError as e:  # another user's run: named, never taken for one without steps
    raise unreadable(e) from None


def running(out: str) -> str:
  """'pid N on HOST' of a run that holds output_dir's lock now, else ''."""
  try:
    with open(os.path.join(out, lock.LOCK)) as f:
      holder = json.loads(f.read())
  except (OSError, ValueError):
    return ""
  if not isinstance(holder, dict) or not lock.alive(holder):
    return ""
  return f"pid {holder.get('pid')} on {holder.get('host')}"


def config_keep(out: str) -> int:
  """checkpoint.keep of the run in `out` (its config.yml); 0 where that cannot be read."""
  try:
    keep = config_file.read(os.path.join(out, "config.yml"))["checkpoint"]["keep"]
  except (UserError, KeyError, TypeError):
    return 0
  return keep if isinstance(keep, int) and keep > 0 else 0


def live_keep(out: str) -> int:
  """checkpoint.keep of a run training into `out` now (config_keep); 0 with none."""
  return config_keep(out) if running(out) else 0


def rotated_out(out: str, step: int, keep: int) -> bool:
  """Whether `step` is older than the newest `keep` steps on disk: a run training into `out`
  with checkpoint.keep=`keep` (live_keep) is removing it, file by file."""
  kept = steps_on_disk(out)[-keep:] if keep else []
  return bool(keep) and len(kept) == keep and step < kept[0]


# What every complete step holds, and how a read says a file is missing (tensorstore, orbax, os)
STEP_SKELETON = ("_CHECKPOINT_METADATA", "state/_METADATA", "state/manifest.ocdbt",
                 "config/metadata", "data")
NOT_FOUND = ("NOT_FOUND", "No such file", "not found", "does not exist")


def missing_files(step_dir: str) -> bool:
  """Whether a step folder lacks a file every complete step holds (STEP_SKELETON)."""
  return any(not os.path.lexists(os.path.join(step_dir, f)) for f in STEP_SKELETON)


def cut_short(out: str, step: int, why: str, held: bool = False) -> str:
  """What a tool says of a step a run was deleting when it was killed (orbax removes a step in
  place, file by file, once `checkpoint.keep` newer ones are complete): it misses files (or a
  read of it failed, as `why`, on one missing) and that many newer steps look complete. '' for
  any other step, and while a run holds the lock (it is deleting the step now) unless `held`:
  this process holds it, before a save of its own (Session.remove_leftovers)."""
  keep = 0 if running(out) and not held else config_keep(out)
  where = os.path.join(out, "checkpoints", str(step))
  if not keep or not (missing_files(where) or any(n in why for n in NOT_FOUND)):
    return ""
  newer = [s for s in steps_on_disk(out)
           if s > step and not missing_files(os.path.join(out, "checkpoints", str(s)))]
  if len(newer) < keep:
    return ""
  return (f"being deleted when the run stopped (older than its newest checkpoint.keep={keep} "
          "steps, it misses files); the next start removes it")


# The reads of a newest step that a run in progress rotates away as it is read (latest_params,
# params_from.load): READS; while the run holding the lock is alive, up to LIVE_READS within
# LIVE_S seconds (checkpoint.keep=1 with a save every step rotates each away as it is read).
READS, LIVE_READS, LIVE_S = 3, 10, 30


def read_again(tried: list, since: float, out: str) -> bool:
  """Whether a tool that saw the newest steps `tried` of `out` rotated away, its first read
  at `since` (time.monotonic()), reads the newest one again."""
  return len(tried) < READS or (len(tried) < LIVE_READS and time.monotonic() - since < LIVE_S
                                and bool(running(out)))


def rotated_away(what: str, out: str, tried: list, each: str = "each newest step") -> UserError:
  """The one line of a tool that gave up reading the newest step (read_again), or `each` step."""
  return UserError(f"{what} '{out}': a run training into it removed {each} before it "
                   f"could be read (steps {', '.join(map(str, tried))}); read it with a larger "
                   "checkpoint.keep, or once the run has ended")


def older_steps(steps, newest: int, arg: str) -> str:
  """'; the older step(s) [..]: read one with ARG<step>' for a damaged step `newest`, naming the
  last three of `steps` below it ('' where there is none): the tools' one advice."""
  older = sorted(s for s in steps if s < newest)[-3:]
  return f"; the older step(s) {older}: read one with {arg}{older[-1]}" if older else ""


def step_files(step_dir: str) -> frozenset:
  """Every file under a checkpoint step directory, as relative paths (empty once it is gone)."""
  return frozenset(os.path.relpath(os.path.join(d, f), step_dir)
                   for d, _, files in os.walk(step_dir) for f in files)


def vanished(step_dir: str, files: frozenset) -> bool:
  """Whether a step directory, or any of `files` seen in it before a read (step_files), is gone:
  a run training into the folder removes its old steps file by file, then the directory."""
  return not os.path.isdir(step_dir) or any(
      not os.path.lexists(os.path.join(step_dir, f)) for f in files)


def folder_id(path: str):
  """(device, inode) of a folder, None where there is none: set_aside moves checkpoints/ away and
  the new run makes another, so a changed id says the run read was replaced meanwhile."""
  try:
    st = os.stat(path)
  except OSError:
    return None
  return st.st_dev, st.st_ino


def set_aside_since(out: str, checkpoints_id) -> bool:
  """Whether the run whose checkpoints/ folder had `checkpoints_id` (folder_id) when a read began
  was moved aside since, by an overwrite=true start (its new run may have committed already)."""
  return checkpoints_id is not None and \
      folder_id(os.path.join(out, "checkpoints")) != checkpoints_id


SET_ASIDE = "set aside with the run while it was read, by an overwrite=true start replacing it"


def gone_while_read(what: str, out: str, step: int, folder) -> str:
  """The line of a tool whose step asked for by number vanished while it was read: set aside
  with the run (checkpoints/ is no longer `folder`, its folder_id before the read), or removed
  by the run training into `out`."""
  why = SET_ASIDE + aside_note(out) if set_aside_since(out, folder) else \
      "removed while it was read (a run training into it keeps checkpoint.keep steps)"
  return f"{what} '{out}': the checkpoint of step {step} was {why}"


def set_aside(out: str) -> str:
  """Move the previous run's files into output_dir/.overwritten (deleted at `commit`)."""
  aside = os.path.join(out, ASIDE)
  os.makedirs(aside, exist_ok=True)
  for name in RUN_FILES:
    if os.path.lexists(os.path.join(out, name)):
      os.replace(os.path.join(out, name), os.path.join(aside, name))
  return aside


def commit(out: str) -> None:
  """The new run has a checkpoint: the set-aside previous run is deleted for good."""
  aside = os.path.join(out, ASIDE)
  if not os.path.isdir(aside):
    return
  with open(os.path.join(aside, COMMITTED), "w"):
    pass  # a kill during the deletion below finishes it at the next start, not a roll-back
  shutil.rmtree(aside)


def roll_back(out: str) -> None:
  """Undo an uncommitted overwrite: the new run's files go, the previous run's come back."""
  aside = os.path.join(out, ASIDE)
  # checkpoints/ last: while it is not back, `recover` can tell the roll-back is unfinished.
  for name in reversed(RUN_FILES):
    old, new = os.path.join(aside, name), os.path.join(out, name)
    if os.path.isdir(new) and not os.path.islink(new):
      shutil.rmtree(new)
    elif os.path.lexists(new):
      os.remove(new)
    if os.path.lexists(old):
      os.replace(old, new)
  shutil.rmtree(aside, ignore_errors=True)


def recover(out: str, log) -> None:
  """Finish what an interrupted overwrite left: delete a committed old run, else restore it."""
  aside = os.path.join(out, ASIDE)
  if not os.path.isdir(aside):
    return
  # A complete step in checkpoints/ belongs to the new run: it got as far as committing.
  if os.path.exists(os.path.join(aside, COMMITTED)) or has_checkpoint(out):
    commit(out)
    return
  roll_back(out)
  log(f"restored the previous run in {out}: an overwrite=true run was stopped before its first "
      "checkpoint")


def quarantine(out: str, step: int) -> str:
  """Move a damaged checkpoint step to output_dir/damaged/ (kept for inspection, not deleted)."""
  src = os.path.join(out, "checkpoints", str(step))
  dst = os.path.join(out, DAMAGED, f"step_{step}")
  if os.path.lexists(dst):
    dst = f"{dst}_{int(time.time())}"
  try:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.replace(src, dst)
  except OSError as e:  # a file named damaged, a read-only or immutable folder
    raise UserError(f"checkpoint step {step} is damaged and cannot be moved aside to '{dst}' "
                    f"({e.strerror}): move or delete '{src}' yourself, then start again") from None
  return dst
