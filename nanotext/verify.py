"""Check every checkpoint of a run against its checksums: `python -m nanotext.verify DIR`.

A resume verifies only the step it restores (and the newer ones it has to skip); this reads
every step of `DIR/checkpoints`, so damage to an older step is found before it is needed (or the
one step of a params-only folder, `convert params-only`). Each step is read onto one local
device whatever mesh wrote it. Nothing is moved or deleted. A run may be training into DIR
meanwhile. Exit status: 0 when every step is intact, 1 when one is damaged or config.yml is
missing or was edited in a model key after the newest step (the read tools refuse it),
2 for a directory that is not a run or holds a file this user may not read, or where a run
training into it removed every step listed (3 listings) before it was read, 130 on Ctrl-C.
Steps removed (or the run set aside by an overwrite=true start) while they are read are gone,
not damaged.
"""

import os
import sys

# jax, numpy and orbax are imported inside the functions: --help and a bad argument need none.
from nanotext import identity, rundir
from nanotext.errors import UserError

USAGE = "usage: python -m nanotext.verify OUTPUT_DIR"


def check_step(manager, step: int, keep: int = 0, folder=None) -> tuple:
  """(status, detail) of one step: intact, unverified (written before checksums), damaged, or
  gone: removed while it was read (the step or a file seen in it vanished), or, beside a run
  training into the folder with checkpoint.keep=`keep`, older than the newest `keep` steps on
  disk, which that run is removing; or set aside with the whole run by an overwrite=true start
  (checkpoints/ is no longer `folder`, its rundir.folder_id when the read began); or leftover:
  a step a killed run was deleting (rundir.cut_short)."""
  from nanotext import checkpoint
  where = checkpoint.step_dir(manager, step)
  files = rundir.step_files(where)
  try:
    state, integrity = checkpoint.read_on_one_device(manager, step)
    checkpoint.verify(state, integrity, where)
    checkpoint.check_data_files(where)
    checkpoint.check_config_item(where)
  except checkpoint.Damaged as e:
    out = os.path.dirname(str(manager.directory))
    if rundir.set_aside_since(out, folder) and rundir.vanished(where, files):
      return "gone", rundir.SET_ASIDE
    if rundir.rotated_out(out, step, keep) or rundir.vanished(where, files):
      return "gone", "removed while it was read (the run in progress keeps checkpoint.keep)"
    cut = rundir.cut_short(out, step, str(e))  # a kill inside a rotation, not damage
    return ("leftover", cut) if cut else ("damaged", str(e))
  return _read(state, integrity)


def _read(state, integrity) -> tuple:
  """(status, detail) of a tree read and checked: intact, or unverified without checksums."""
  import jax
  import numpy as np
  leaves = jax.tree.leaves(state)
  size = sum(np.dtype(x.dtype).itemsize * x.size for x in leaves) / 2**20
  if not (integrity or {}).get("checksums"):
    return "unverified", f"{len(leaves)} arrays, {size:,.1f} MiB read; no checksums saved with it"
  return "intact", f"{len(leaves)} arrays, {size:,.1f} MiB, every checksum matches"


def report(out: str, log=print) -> int:
  """Print one line per step (newest first) and what else lies in checkpoints/; the exit status.

  Only committed steps are read (orbax renames a step into place once complete), so a run
  training into `out` meanwhile is no false alarm: its saves in progress are listed as such,
  and a step it removes while being read is reported gone, not damaged."""
  from nanotext import checkpoint
  root = checkpoint.checkpoint_dir(out)
  rundir.check_no_glob(os.path.abspath(out), "the run directory")
  if not os.path.isdir(root) and os.path.isdir(os.path.join(out, "params")):
    return params_only_report(out, log)
  if not os.path.isdir(root):
    missing = "does not exist" if not os.path.lexists(out) else \
        "is not a directory" if not os.path.isdir(out) else "holds no checkpoints/ directory"
    raise UserError(f"'{out}' {missing} (give a nanotext run directory){rundir.aside_note(out)}")
  live, folder = rundir.running(out), rundir.folder_id(root)
  manager = checkpoint.reader(out)
  steps = sorted(manager.all_steps(), reverse=True)
  said = f"{len(steps)} checkpoint(s) in {root}, newest first:" if steps else \
      f"no checkpoint in {root} yet: nothing to verify{rundir.aside_note(out)}"
  log(said + (f" (a run is training into it: {live})" if live else ""))
  damaged, keep, tried, todo = 0, rundir.live_keep(out), [], steps
  for listing in range(rundir.READS):  # each step listed rotated away: list the newer ones
    gone = 0
    for step in todo:
      status, detail = check_step(manager, step, keep, folder)
      damaged, gone = damaged + (status == "damaged"), gone + (status == "gone")
      log(f"  step {step:>7d}  {status:<10s}  {detail}")
    tried += todo
    if gone < len(todo) or not todo or listing == rundir.READS - 1 or \
        rundir.set_aside_since(out, folder):
      break
    checkpoint.close(manager)
    manager = checkpoint.reader(out)
    todo = sorted((s for s in manager.all_steps() if s not in tried), reverse=True)
    log(f"each step above was removed while it was read: {len(todo)} newer one(s) listed")
  try:
    names = os.listdir(root)
  except OSError:  # the run was set aside by an overwrite meanwhile
    names = []
  unfinished = sorted(n for n in names if "orbax-checkpoint-tmp" in n)
  for name in sorted((n for n in names if rundir.is_step_name(n) and
                      os.path.lexists(os.path.join(root, n)) and
                      not os.path.isdir(os.path.join(root, n))), key=int, reverse=True):
    damaged += 1  # orbax lists folders only: the step was left out unsaid, exit 0
    log(f"  step {int(name):>7d}  {'damaged':<10s}  '{os.path.join(root, name)}' is not a "
        "folder: no step can be read from it")
  for name in unfinished:
    log(f"  {name}: " + ("being saved by the run in progress" if live else
                         "a save that never finished; ignored by a resume, removed by the next "
                         "save"))
  quarantined = os.path.join(out, "damaged")
  try:
    set_aside = os.listdir(quarantined)
  except OSError:
    set_aside = []
  if set_aside:
    log(f"  {quarantined}: {len(set_aside)} step(s) a resume found damaged and set aside (kept "
        "for you to inspect or delete)")
  checkpoint.close(manager)
  if damaged:
    log(f"{damaged} damaged step(s): a resume never restores them; it uses the newest intact step")
  edited = config_edited(out) if steps else ""
  if steps and rundir.set_aside_since(out, folder):  # checkpoints/ goes first, config.yml after:
    edited = ""  # one missing or another run's is no edit
    log(f"config.yml: {rundir.SET_ASIDE}; not checked")
  if edited:
    log(edited)
  if not (damaged or edited) and tried and gone == len(todo) and \
      not rundir.set_aside_since(out, folder):  # all read was gone: verify checked nothing
    raise rundir.rotated_away("output_dir", out, tried, "every step listed")
  return 1 if damaged or edited else 0


def config_edited(out: str) -> str:
  """One line where config.yml cannot be read or was edited, in a key of the model, after the
  newest step (or a params-only folder's weights) was saved: every read tool refuses the folder
  then, though each checksum matches. '' where it is the saved config. A missing one is named
  as those tools name it, with the cp that puts the saved one back."""
  from nanotext import config
  try:
    cfg = rundir.run_config(out, "output_dir",
                            lambda: config.load(os.path.join(out, "config.yml")))
    identity.check_unedited(out, cfg.to_dict())
  except UserError as e:
    return f"config.yml: {e}"
  return ""


def params_only_report(out: str, log=print) -> int:
  """report() of a params-only folder: its one step, intact, unverified or damaged."""
  from nanotext.convert.common import load_params, params_only_step
  from nanotext.integrity import record_of_params_only
  log(f"a params-only folder: {out}")
  step = "?"
  try:
    step = params_only_step(out)
    step, params = load_params(out)  # checks the checksums written with it
    status, detail = _read(params, record_of_params_only(out))
  except UserError as e:  # unreadable, or not what was written (integrity.Damaged)
    status, detail = "damaged", str(e)
  step = "unknown (no convert.json)" if step == -1 else step
  log(f"  step {step:>7}  {status:<10s}  {detail}")
  edited = config_edited(out)
  if edited:
    log(edited)
  return 1 if status == "damaged" or edited else 0


def main(argv) -> None:
  args = [a for a in argv if a]
  if len(args) != 1:
    raise UserError(USAGE)
  out = args[0].split("=", 1)[1] if args[0].startswith("output_dir=") else args[0]
  out = os.path.expanduser(out)
  sys.exit(report(out, log=lambda line: print(line, flush=True)))  # a signal ends it at once


if __name__ == "__main__":
  from nanotext import cli
  # Orbax reads in threads and an event loop that swallow a KeyboardInterrupt raised inside them
  # (verify went on and exited 0) or turn it into a read error (a step called damaged, exit 1):
  # a signal ends verify where it lands instead. It only reads, so nothing is lost.
  cli.run(main, USAGE, __doc__, jax=True, at_once=cli.READ_ONLY_STOP)
