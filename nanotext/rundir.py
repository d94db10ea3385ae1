"""The run directory as a safe place: one run at a time, overwrite as a transaction, quarantine.

- `check_run`: the same run resumes (another mesh or device count included); a different one
  needs overwrite=true; a run already past train.steps is refused.
- `Lock`: `output_dir/.lock` names the pid and host of the run that holds it; a second run is
  refused, a lock left by a killed run (its pid gone, or reused by a younger process) is taken over.
- Overwrite: the previous run's files are moved into `output_dir/.overwritten/` and deleted only
  once the new run has a checkpoint on disk (`commit`); until then any failure, or a kill followed
  by the next start, moves them back (`roll_back` / `recover`).
- Damaged checkpoint steps are moved to `output_dir/damaged/`, never deleted.
- `fingerprint`: names, sizes and a cheap hash of the training shards, saved with each step, so a
  resume on data that changed is noticed.
- `StartUp`: what a run's start changed in output_dir, put back when it is stopped before its
  first step (there is nothing to save then).
"""

import datetime
import json
import os
import shutil
import socket
import time
import zlib

from nanotext.errors import UserError, os_error

LOCK = ".lock"
ASIDE = ".overwritten"  # the previous run while an overwrite is not yet committed
COMMITTED = "COMMITTED"  # written into ASIDE once the new run has a checkpoint: delete ASIDE
DAMAGED = "damaged"
RUN_FILES = ("checkpoints", "tb", "metrics.jsonl", "config.yml")
# Longer names make orbax's temporary step names fail deep inside a save; refuse them up front.
MAX_PATH = 3000
# Orbax globs inside a checkpoint's own path (merging per-process OCDBT files, reading array
# metadata), so a path with these characters saves steps that can never be read back.
GLOB_CHARS = "*?["


def check_no_glob(path: str, what: str) -> None:
  """UserError when `path` holds a character orbax would read as a glob pattern."""
  bad = sorted({c for c in path if c in GLOB_CHARS})
  if bad:
    raise UserError(f"{what} '{path}' contains {' and '.join(repr(c) for c in bad)}: checkpoints "
                    "use the path as a glob pattern and could not be read back; choose (or "
                    "symlink) a path without * ? [")


def kernel_fs(path: str) -> str:
  """'proc', 'sys' or 'dev' when `path` lies in that kernel file system, else ''."""
  real = os.path.realpath(path)
  top = real.split(os.sep)[1] if real.count(os.sep) else ""
  return top if top in ("proc", "sys", "dev") else ""


def is_step_name(name: str) -> bool:
  """Whether a name in checkpoints/ is a step number (ASCII digits: '²' and '٣' are not)."""
  return name.isascii() and name.isdigit()


def check_output_dir_path(out: str) -> str:
  """The absolute output_dir, refused (UserError) when it cannot hold a run."""
  if not out or not out.strip():
    raise UserError("output_dir is empty: set output_dir=DIR")
  path = os.path.abspath(os.path.expanduser(out))
  check_no_glob(path, "output_dir")
  if len(path) > MAX_PATH or any(len(p.encode()) > 255 for p in path.split(os.sep)):
    raise UserError(f"output_dir '{out[:80]}...' is too long a path for this file system")
  if kernel_fs(path):
    raise UserError(f"output_dir '{out}' lies in a kernel file system ({kernel_fs(path)}): "
                    "choose a directory on disk")
  if os.path.exists(path) and not os.path.isdir(path):
    raise UserError(f"output_dir '{out}' exists and is not a directory")
  ckpt = os.path.join(path, "checkpoints")
  if os.path.lexists(ckpt) and not os.path.isdir(ckpt):
    raise UserError(f"'{ckpt}' exists and is not a directory: move it away (checkpoints are "
                    "written there)")
  return path


def _start_time(pid: int):
  """The kernel's start time of `pid` (to tell a reused pid from the lock holder), or None."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return int(f.read().rsplit(")", 1)[1].split()[19])
  except (OSError, ValueError, IndexError):
    return None


def _alive(holder: dict) -> bool:
  """Whether the run that wrote a lock may still be running (another host: assume it is)."""
  if holder.get("host") != socket.gethostname():
    return True
  pid = holder.get("pid")
  if not isinstance(pid, int):
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  started = holder.get("start_time")
  return started is None or _start_time(pid) in (None, started)


class Lock:
  """Exclusive use of output_dir for the life of a run (process 0 of a multi-process run)."""

  def __init__(self, out: str):
    self.out, self.path, self.held = out, os.path.join(out, LOCK), False

  def __enter__(self):
    self.acquire()
    return self

  def __exit__(self, *exc):
    self.release()

  def acquire(self) -> None:
    try:
      os.makedirs(self.out, exist_ok=True)
    except OSError as e:
      raise UserError(f"cannot create output_dir '{self.out}': {e.strerror}") from None
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start_time": _start_time(os.getpid()),
          "since": datetime.datetime.now().isoformat(timespec="seconds")}
    for _ in range(3):
      try:
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
      except FileExistsError:
        self._take_over_if_stale()
        continue
      except IsADirectoryError:
        raise UserError(f"'{self.path}' is a directory, not a nanotext lock: move it out of "
                        "output_dir") from None
      except OSError as e:
        raise os_error(e, f"cannot write to output_dir '{self.out}'") from None
      try:
        with os.fdopen(fd, "w") as f:
          f.write(json.dumps(me))
      except OSError as e:  # a full disk: the empty lock must not outlive this run
        os.remove(self.path)
        raise os_error(e, f"cannot write '{self.path}'") from None
      self.held = True
      return
    raise UserError(f"output_dir '{self.out}' is being locked by another run right now")

  def _take_over_if_stale(self) -> None:
    if os.path.isdir(self.path) and not os.path.islink(self.path):
      raise UserError(f"'{self.path}' is a directory, not a nanotext lock: move it out of "
                      "output_dir")
    try:
      with open(self.path, encoding="utf-8", errors="replace") as f:
        text = f.read(4096)
      age = time.time() - os.path.getmtime(self.path)
    except FileNotFoundError:
      return  # released meanwhile: try again
    except OSError as e:
      raise os_error(e, f"cannot read the lock '{self.path}'") from None
    try:
      holder = json.loads(text)
    except ValueError:
      holder = None
    holder = holder if isinstance(holder, dict) else None
    if holder is None and age < 10:  # being written this instant by another run
      holder = {"host": "?", "pid": "?", "since": "just now"}
    if holder is not None and _alive(holder):
      raise UserError(f"output_dir '{self.out}' is in use by another run (pid {holder.get('pid')}"
                      f" on {holder.get('host')}, since {holder.get('since')}); wait for it to "
                      f"end or choose another output_dir (if that run is gone, delete "
                      f"'{self.path}')")
    # A killed run's lock: move it out of the way; of two runs racing here only one rename wins.
    try:
      os.rename(self.path, f"{self.path}.stale-{os.getpid()}")
      os.remove(f"{self.path}.stale-{os.getpid()}")
    except FileNotFoundError:
      pass
    except OSError as e:
      raise os_error(e, f"cannot take over the stale lock '{self.path}'") from None

  def release(self) -> None:
    if not self.held:
      return
    self.held = False
    try:
      with open(self.path) as f:
        if json.loads(f.read()).get("pid") == os.getpid():
          os.remove(self.path)
    except (OSError, ValueError, AttributeError):
      pass


def check_run(cfg, out: str) -> bool:
  """Refuse an output_dir that holds a different run unless overwrite=true, or a run already
  past train.steps; True when the previous run is to be replaced (set aside, then deleted)."""
  from nanotext import config
  path = os.path.join(out, "config.yml")
  if not os.path.lexists(path):
    return False
  try:
    old = config.read_file(path)
  except UserError as e:
    if cfg.overwrite:
      return True
    raise UserError(f"'{path}' is damaged ({e}), so this run cannot tell whether output_dir "
                    "holds the same run; restore that file, or pass overwrite=true to replace "
                    "the run in output_dir") from None
  diff = config.run_identity_diff(old, cfg.to_dict())
  if diff:
    if not cfg.overwrite:
      raise UserError(f"output_dir '{cfg.output_dir}' holds a different run ({diff[0]}"
                      f"{f' and {len(diff) - 1} more' if len(diff) > 1 else ''}); choose another "
                      "output_dir or pass overwrite=true to replace it")
    return True
  done = [int(n) for n in os.listdir(os.path.join(out, "checkpoints")) if is_step_name(n)] \
      if os.path.isdir(os.path.join(out, "checkpoints")) else []
  if done and max(done) > cfg.train.steps:
    raise UserError(f"output_dir '{cfg.output_dir}' holds a checkpoint of step {max(done)}, past "
                    f"train.steps={cfg.train.steps}: raise train.steps to continue that run, or "
                    "choose another output_dir")
  return False


def has_checkpoint(out: str) -> bool:
  root = os.path.join(out, "checkpoints")
  return os.path.isdir(root) and any(is_step_name(n) for n in os.listdir(root))


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
  os.makedirs(os.path.dirname(dst), exist_ok=True)
  os.replace(src, dst)
  return dst


def _cheap_hash(path: str, size: int, chunk: int = 1 << 16) -> str:
  """crc32 of a file's first and last 64 KiB: catches replaced shards without reading them all."""
  with open(path, "rb") as f:
    crc = zlib.crc32(f.read(chunk))
    if size > chunk:
      f.seek(max(chunk, size - chunk))
      crc = zlib.crc32(f.read(chunk), crc)
  return f"{crc:08x}"


def fingerprint(data_cfg) -> list:
  """[[name, size, hash]] of the training files its source names ([] for one without files)."""
  from nanotext.data import registry
  files = registry.get(data_cfg.source).files
  out = []
  for path in files(data_cfg, "train") if files else []:
    try:
      size = os.path.getsize(path)
      out.append([os.path.basename(path), size, _cheap_hash(path, size)])
    except OSError as e:
      raise UserError(f"cannot read training shard '{path}': {e.strerror}") from None
  return out


def fingerprint_change(old: list, new: list) -> str:
  """'' when equal, else what changed between two fingerprints, in a few words."""
  a, b = {n: (s, h) for n, s, h in old}, {n: (s, h) for n, s, h in new}
  for name in sorted(set(a) | set(b)):
    if name not in b:
      return f"shard '{name}' is gone"
    if name not in a:
      return f"shard '{name}' is new"
    if a[name] != b[name]:
      return f"shard '{name}' changed (size {a[name][0]} -> {b[name][0]} bytes)" \
          if a[name][0] != b[name][0] else f"shard '{name}' changed (same size, other contents)"
  return ""


class StartUp:
  """What a run's start changes in output_dir, put back by `undo` when it is stopped before its
  first step: the directory itself, checkpoints/ and tb/ when new, config.yml (bytes and time),
  metrics.jsonl (length and time); with an overwrite, the previous run moved back.

  Taken before the lock. Repairs made meanwhile stay made: a damaged step moved to damaged/,
  an interrupted earlier overwrite finished or rolled back, leftovers of a killed save removed.
  """

  KEEP = "keep"  # a file that could not be read: left alone

  def __init__(self, out: str):
    self.out, self.existed = out, os.path.isdir(out)
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
    steps = [lambda: roll_back(out)] if set_aside else [
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

  def remove_if_new(self) -> None:
    """Remove output_dir again if this run created it and it is empty (after the lock went)."""
    if not self.existed:
      try:
        os.rmdir(self.out)
      except OSError:
        pass
