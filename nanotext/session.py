"""output_dir through one run's life, with one owner: `Session` takes the lock, finishes an
interrupted overwrite, checks the run already there, sets it aside when replacing it, tries every
write the run will make, and on the way out keeps, commits or rolls back by its own state.
`StartUp` is what the run's start changed, so that a stop before the first step undoes it."""

import contextlib
import os
import shutil

import jax

from nanotext import config, config_file, distributed, identity, probes, rundir
from nanotext.lock import Lock


class Session:
  """output_dir for the life of one run; nothing is written before `open`.

  `replacing` holds while a previous run is set aside (overwrite=true) and the new one has no
  checkpoint yet; the Preemption given to `open` says whether training began. On the way out of
  `open` with an error: before the first step output_dir is put back as it was (the replaced run
  included); after it, a replaced run comes back if the new one has no checkpoint on disk, and
  otherwise what the run wrote is kept. The replaced run is deleted for good once the checkpoint
  manager confirms a step of the new one (`confirmed`, its on_confirmed). Only process 0
  changes output_dir; every process checks it.
  """

  def __init__(self, cfg, log=print, fresh_rules=lambda: None):
    self.cfg, self.log = cfg, log
    self.fresh_rules = fresh_rules  # raises where a new run may not start so (a resume may)
    self.out = rundir.check_output_dir_path(cfg.output_dir)  # read only: refusing changes nothing
    self.main = jax.process_index() == 0
    self.lock = Lock(self.out)
    self.existed = self.start = self.preemption = None
    self.replacing = False

  @contextlib.contextmanager
  def open(self, preemption, checkpoint_bytes: int):
    """The run's body inside: output_dir locked, checked, set aside where replaced, probed."""
    self.preemption, self.existed = preemption, os.path.isdir(self.out)
    try:
      with preemption.deferred():  # output_dir changes as a whole before a signal acts
        self._begin(checkpoint_bytes)
      if jax.process_count() > 1:  # nobody reads output_dir while process 0 changes it
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("nanotext: output_dir ready")
        distributed.check_shared_file(self.lock.path, f"output_dir '{self.cfg.output_dir}'")
      yield self
    except BaseException:
      self._fail()
      raise
    finally:
      self.lock.release()
      self._remove_if_new()

  def _begin(self, checkpoint_bytes: int) -> None:
    if self.main:
      self.lock.acquire()
      rundir.recover(self.out, self.log)
      profile = self.cfg.profile.dir or os.path.join(self.out, "profile")  # as watch.py names it
      probes.remove_left([self.out, profile, os.path.expanduser(self.cfg.train.compile_cache_dir)]
                         + [os.path.join(self.out, d) for d in ("checkpoints", "tb")])
      self.start = StartUp(self.out)  # after the repairs, which stay made
    replacing = identity.check_run(self.cfg, self.out)
    if replacing or not rundir.has_checkpoint(self.out):  # a fresh start, nothing set aside yet
      self.fresh_rules()
    self.replacing = replacing
    path = os.path.join(self.out, "config.yml")
    if not self.replacing and os.path.isfile(path):  # a newer nanotext's key: refused as the
      config.check_known(config.flatten(config_file.read(path)), path)  # read tools refuse it,
      # not dropped unsaid from config.yml as the resume rewrites it
    if self.main and self.replacing:
      rundir.set_aside(self.out)
    elif self.main and self.cfg.overwrite and rundir.has_checkpoint(self.out):
      # overwrite is resume-ok: a command that keeps it (a preempted job restarted) goes on
      self.log(f"overwrite=true changed nothing: output_dir '{self.cfg.output_dir}' holds this "
               "same run (the config is its own), which goes on from its checkpoint; "
               "overwrite=true replaces only a different run (to start afresh, choose another "
               "output_dir or delete this one)")
    if self.main:  # every write the run will make, tried before it compiles
      probes.run_outputs(self.cfg, self.out, checkpoint_bytes)
    if self.main and not self.replacing:
      self.remove_leftovers()

  def remove_leftovers(self) -> None:
    """Remove the steps a killed run was deleting (rundir.cut_short; never a complete step):
    orbax's rotation at the first save removed them, so a resume that never saves (its run
    already at train.steps) left them for good."""
    root = os.path.join(self.out, "checkpoints")
    for step in rundir.steps_on_disk(self.out):
      where = os.path.join(root, str(step))
      if os.path.islink(where) or not os.path.isdir(where) or \
          not rundir.cut_short(self.out, step, "", held=True):
        continue
      shutil.rmtree(where, ignore_errors=True)  # what stays is still a leftover: the next start
      if not os.path.lexists(where):
        self.log(f"removed the checkpoint of step {step}: a run killed while deleting it (older "
                 "than its newest checkpoint.keep steps) left it half-deleted")

  def confirmed(self, step: int) -> None:
    """A step of the new run is complete on disk: a replaced run is deleted for good."""
    del step
    if self.main and self.replacing:
      rundir.commit(self.out)
      self.replacing = False

  def stop_early(self, signame: str) -> str:
    """Preemption's on_early_stop (in the signal handler, before the first step): output_dir
    put back and released; returns the line printed."""
    if self._ours():
      self.start.undo(self.replacing)
      self.lock.release()
      self._remove_if_new()
    return (f"stopped by {signame} before the first step: nothing to save, output_dir "
            f"'{self.cfg.output_dir}' is as it was")

  def _fail(self) -> None:
    """Put back what a failed run must not leave: all of it before the first step, the
    replaced run after it where the new one has no checkpoint."""
    if not self._ours():
      return
    training = self.preemption is not None and self.preemption.training
    restore = self.replacing and not (training and rundir.has_checkpoint(self.out))
    if not training:
      self.start.undo(self.replacing)
    elif restore:
      rundir.roll_back(self.out)
    if restore:
      self.replacing = False
      self.log(f"restored the previous run in {self.out}")

  def _ours(self) -> bool:
    """Whether this process holds output_dir and has changed it (the snapshot is taken)."""
    return self.main and self.lock.held and self.start is not None

  def _remove_if_new(self) -> None:
    """Remove output_dir again if this run created it and it is empty (after the lock went)."""
    if self.main and self.existed is False:
      try:
        os.rmdir(self.out)
      except OSError:
        pass


class StartUp:
  """What a run's start changes in output_dir, put back by `undo` when it stops before its
  first step: checkpoints/ and tb/ when new, config.yml (bytes and time), metrics.jsonl (length
  and time); with an overwrite, the previous run moved back.

  Taken with the lock held, after an interrupted earlier overwrite is finished or rolled back:
  that repair stays made, as do those after it (a damaged step moved to damaged/, leftovers of a
  killed save removed). The directory itself is the Session's (`existed`).
  """

  KEEP = "keep"  # a file that could not be read: left alone

  def __init__(self, out: str):
    self.out = out
    self.had = {n: os.path.lexists(os.path.join(out, n)) for n in ("checkpoints", "tb")}
    self.config = self._read(os.path.join(out, "config.yml"), whole=True)
    self.metrics = self._read(os.path.join(out, "metrics.jsonl"), whole=False)
    self.tb_files = set(self._files(os.path.join(out, "tb")))

  @staticmethod
  def _read(path: str, whole: bool):
    """(bytes or size, mtime_ns) of a file; None when absent, KEEP when it cannot be read."""
    if not os.path.lexists(path):
      return None
    try:
      st = os.stat(path)
      if whole:
        if st.st_size > 1 << 20:  # not a config this run could have written: leave it be
          return StartUp.KEEP
        with open(path, "rb") as f:
          return f.read(), st.st_mtime_ns
      return st.st_size, st.st_mtime_ns
    except OSError:
      return StartUp.KEEP

  @staticmethod
  def _files(root: str) -> list:
    return [os.path.join(d, f) for d, _, files in os.walk(root) for f in files]

  def undo(self, set_aside: bool) -> None:
    """Put output_dir back as it was (best effort: every step is tried, none raises)."""
    out = self.out
    steps = [lambda: rundir.roll_back(out)] if set_aside else [
        lambda: self._put_back(os.path.join(out, "config.yml"), self.config, whole=True),
        lambda: self._put_back(os.path.join(out, "metrics.jsonl"), self.metrics, whole=False),
        self._undo_tb]
    if not self.had["checkpoints"]:
      steps.append(lambda: os.rmdir(os.path.join(out, "checkpoints")))  # only when still empty
    for step in steps:
      try:
        step()
      except OSError:
        pass

  def _put_back(self, path: str, saved, whole: bool) -> None:
    if saved == self.KEEP:
      return
    if saved is None:
      if os.path.lexists(path):
        os.remove(path)
      return
    content, mtime = saved
    if whole:
      if self._read(path, whole=True) != saved:
        with open(path + ".restore", "wb") as f:
          f.write(content)
        os.replace(path + ".restore", path)
    elif os.path.getsize(path) != content:
      os.truncate(path, content)
    os.utime(path, ns=(mtime, mtime))

  def _undo_tb(self) -> None:
    tb = os.path.join(self.out, "tb")
    for f in self._files(tb):
      if f not in self.tb_files:
        os.remove(f)
    if not self.had["tb"] and os.path.isdir(tb):
      shutil.rmtree(tb)
