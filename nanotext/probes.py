"""Writes tried before the expensive work: a run or a tool that cannot write where it must says
so in one line before it compiles, trains or converts, not minutes later (or never: orbax waits
300 s on a step directory it could not create). And a read tried before a checkpoint's
(`readable`): a file this user may not read is named as such, not taken for damage.

A probe writes a few bytes into a new file and deletes it; folders it had to create are removed
again. Errors are `errors.os_error`: exit 2 for a path that cannot be written (permissions, an
immutable file, a read-only or kernel file system), exit 1 for a full disk or a size limit.
"""

import contextlib
import errno
import os
import shutil
import stat
import tempfile

from nanotext.errors import ResourceError, UserError, os_error, unreadable

PROBE = ".nanotext-probe-"  # the name a probe file starts with


def writable_dir(path: str, what: str) -> None:
  """Raise unless a file can be written in folder `path` (created for the probe if missing)."""
  made = []
  try:
    parent = os.path.abspath(path)
    while not os.path.isdir(parent):
      if os.path.lexists(parent):
        raise NotADirectoryError(errno.ENOTDIR, f"'{parent}' is a file, not a folder")
      made.append(parent)
      parent = os.path.dirname(parent)
    for d in reversed(made):
      os.mkdir(d)
    fd, probe = tempfile.mkstemp(prefix=PROBE, dir=path)
    try:
      os.write(fd, b"probe\n")
      os.fsync(fd)
    finally:
      os.close(fd)
      with contextlib.suppress(FileNotFoundError):  # removed as a leftover meanwhile
        os.remove(probe)
  except OSError as e:
    raise os_error(e, f"cannot write to {what} '{path}'") from None
  finally:
    for d in made:  # deepest first
      try:
        os.rmdir(d)
      except OSError:
        pass


def remove_left(folders) -> None:
  """Delete the probe files a process killed mid-probe left in `folders` (a run's own, under its
  lock): nothing else removed them, and each kill there left one more."""
  for folder in folders:
    with contextlib.suppress(OSError):
      for entry in os.scandir(folder):
        if entry.name.startswith(PROBE) and entry.is_file(follow_symlinks=False):
          with contextlib.suppress(OSError):
            os.remove(entry.path)


def readable(path: str) -> None:
  """Raise errors.Unreadable naming the first folder or file under `path` that this user may not
  read: orbax and tensorstore report one as a missing state/ folder or a failed array read.
  Names that vanish meanwhile (a run rotating its steps out) are left to the read itself."""
  def refuse(e: OSError):
    if e.errno in (errno.EACCES, errno.EPERM):
      raise unreadable(e) from None
  for folder, _, files in os.walk(path, onerror=refuse):
    for name in files:
      try:  # O_NONBLOCK: a FIFO left in a step opens at once, where a read would wait
        os.close(os.open(os.path.join(folder, name), os.O_RDONLY | os.O_NONBLOCK))
      except OSError as e:
        refuse(e)


def _links_through_proc(path: str) -> bool:
  """Whether `path` is a symbolic link whose chain passes through /proc (an open descriptor)."""
  for _ in range(40):  # the kernel's own limit on a chain of links
    if not os.path.islink(path):
      return False
    path = os.path.join(os.path.dirname(os.path.abspath(path)), os.readlink(path))
    if os.path.normpath(path).startswith("/proc/"):
      return True
  return False


def appendable(path: str, what: str) -> None:
  """Raise unless an existing file `path` can be opened for appending (a plain file, not
  immutable or read-only)."""
  if not os.path.lexists(path):
    return
  plain_file_or_none(path, what)
  try:
    with open(path, "ab"):
      pass
  except OSError as e:
    raise os_error(e, f"cannot write {what} '{path}'") from None


def plain_file_or_none(path: str, what: str) -> None:
  """UserError when `path` is a device, a pipe or a socket: a rename would put a file where
  it was (as root, `--out=/dev/null` would replace the system's), and opening a pipe waits
  for a reader. Folders and links to files are the callers' to judge."""
  if _links_through_proc(path):  # /dev/stdout: the rename would replace the link itself
    raise UserError(f"{what} '{path}' is a link to a process's open file, not a file: give the "
                    "path of a file to write")
  try:
    mode = os.stat(path).st_mode
  except OSError:
    return  # absent (or a dangling link): a new file goes there
  if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
    kind = "a pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    raise UserError(f"{what} '{path}' is {kind}, not a file: give the path of a file to write")


def replaceable(path: str, what: str) -> None:
  """Raise unless an existing file `path` can be replaced by a rename (a plain file, not
  immutable)."""
  if not os.path.lexists(path):
    return
  appendable(path, what)
  if os.path.isdir(path):
    raise os_error(IsADirectoryError(21, "it is a folder"), f"cannot write {what} '{path}'")


def free_space(path: str, need: int, what: str) -> None:
  """ResourceError when the file system of `path` has less than `need` bytes free."""
  probe = os.path.abspath(path)
  while not os.path.exists(probe):
    probe = os.path.dirname(probe)
  try:
    free = shutil.disk_usage(probe).free
  except OSError:
    return  # cannot tell: the write itself reports it
  if free < need:
    raise ResourceError(f"{what} needs about {need / 2**20:,.1f} MiB but the file system of "
                        f"'{path}' has {free / 2**20:,.1f} MiB free; free some space or choose "
                        "another output_dir")


def run_outputs(cfg, out: str, checkpoint_bytes: int) -> None:
  """Every path a run writes, tried before it compiles: checkpoints/, config.yml,
  metrics.jsonl, tb/, the profile and compile-cache folders, and room on disk for one
  checkpoint."""
  ckpt = os.path.join(out, "checkpoints")
  writable_dir(ckpt, "the checkpoint folder")
  replaceable(os.path.join(out, "config.yml"), "the run's config")
  appendable(os.path.join(out, "metrics.jsonl"), "the run's metrics")
  if cfg.metrics.tensorboard:
    writable_dir(os.path.join(out, "tb"), "the TensorBoard folder")
  if cfg.profile.steps > 0 and cfg.profile.start_step >= 0 and \
      cfg.profile.start_step < cfg.train.steps:
    writable_dir(cfg.profile.dir or os.path.join(out, "profile"), "profile.dir")
  if cfg.train.compile_cache_dir:  # JAX would warn per program and cache nothing
    writable_dir(os.path.expanduser(cfg.train.compile_cache_dir), "train.compile_cache_dir")
  free_space(ckpt, checkpoint_bytes, "a checkpoint of this run")
