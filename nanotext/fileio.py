"""Atomic file writes: readers see the old file or the whole new one, never half of one; an
append is whole or not there."""

import errno
import os
import shutil
import time
import uuid


def atomic_write(path: str, chunks) -> None:
  """Write the byte strings in `chunks` to `path` via a sibling temp file, fsynced (or a power
  cut after the rename can leave it empty), and os.replace."""
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  # Same folder, so os.replace is a rename on one file system; a unique name, so concurrent
  # writers (several hosts preparing the same cache) never share a temp file.
  tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
  try:
    with open(tmp, "xb") as f:
      for chunk in chunks:
        f.write(chunk)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise
  fsync_path(parent)


def fsync_path(path: str) -> None:
  """fsync the file or folder at `path` (a folder: so a rename in it is on disk); skipped where
  it cannot be opened or its file system does not fsync folders."""
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError as e:
    if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
      raise
  finally:
    os.close(fd)


def replace_synced(src: str, dst: str) -> None:
  """os.replace(src, dst) for a file written by other means than atomic_write: its bytes on disk
  before the rename and the rename after (a power cut leaves the old file or the whole new one)."""
  fsync_path(src)
  os.replace(src, dst)
  fsync_path(os.path.dirname(os.path.abspath(dst)))


def fsync_tree(path: str) -> None:
  """fsync every file and folder under `path` (or the file `path`) before it is renamed into
  place: a power cut after the rename can otherwise leave its files empty."""
  if not os.path.isdir(path):
    return fsync_path(path)
  for folder, _, names in os.walk(path, topdown=False):
    for name in names:
      fsync_path(os.path.join(folder, name))
    fsync_path(folder)


def append_whole(fd: int, data: bytes) -> None:
  """Append `data` to the file open as `fd`, whole or not at all: a write cut short by a full
  disk or a file-size limit is truncated away before the OSError goes on."""
  end = os.lseek(fd, 0, os.SEEK_END)
  view = memoryview(data)
  try:
    while view:
      view = view[os.write(fd, view):]
  except OSError:
    try:
      os.ftruncate(fd, end)
    except OSError:
      pass
    raise


def _open_under(path: str) -> bool:
  """Whether this process holds a file open inside `path` (Linux /proc; False elsewhere)."""
  prefix = os.path.abspath(path) + os.sep
  try:
    fds = os.listdir("/proc/self/fd")
  except OSError:
    return False
  for fd in fds:
    try:
      if os.readlink(f"/proc/self/fd/{fd}").startswith(prefix):
        return True
    except OSError:
      pass  # closed since the listing
  return False


def remove_tree(path: str, settle_s: float = 0.5, limit_s: float = 60.0) -> None:
  """Remove `path` for good, outlasting writers of this process still finishing in it.

  A failed orbax save returns while tensorstore's threads still write the save's other files;
  one landing while rmtree walks the tree left a folder behind. So: remove, and again, until
  nothing is open inside, the path is gone and it stays gone for `settle_s`.
  """
  deadline = time.monotonic() + limit_s
  quiet_since = None
  while time.monotonic() < deadline:
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path) or _open_under(path):
      quiet_since = None
    elif quiet_since is None:
      quiet_since = time.monotonic()
    elif time.monotonic() - quiet_since >= settle_s:
      return
    time.sleep(0.05)
