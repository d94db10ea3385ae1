"""One run at a time per output_dir: `output_dir/.lock` names the pid and host of the run that
holds it; a second run is refused, a lock left by a killed run (its pid gone, or reused by a
younger process) is taken over. Starts take it one at a time, under an flock of GUARD."""

import contextlib
import datetime
import json
import os
import socket
import time

from nanotext.errors import UserError, os_error

try:
  import fcntl
except ImportError:  # no flock (Windows): the takeover's rename-and-check alone
  fcntl = None

LOCK = ".lock"
# flock'ed by a start while it judges and takes the lock, removed by it after: two starts taking
# over a dead run's lock, and a third creating its own meanwhile, ended with two holders. The
# kernel drops an flock when its holder dies (SIGKILL too), so a killed start never blocks one.
GUARD = ".lock.guard"
GUARD_S = 10  # how long a start waits for another's judge-and-take (a few file operations)


def _start_time(pid: int):
  """The kernel's start time of `pid` (to tell a reused pid from the lock holder), or None."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return int(f.read().rsplit(")", 1)[1].split()[19])
  except (OSError, ValueError, IndexError):
    return None


def alive(holder: dict) -> bool:
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


def _read(path: str) -> tuple:
  """(text, inode) of a lock file: the inode alone may be reused at once by a new lock."""
  with open(path, encoding="utf-8", errors="replace") as f:
    return f.read(4096), os.fstat(f.fileno()).st_ino


def _holder(text: str):
  """The lock's holder record, None where the text is not one."""
  try:
    holder = json.loads(text)
  except ValueError:
    return None
  return holder if isinstance(holder, dict) else None


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
    with self._guarded():
      self._acquire()

  def _acquire(self) -> None:
    me = {"pid": os.getpid(), "host": socket.gethostname(), "start_time": _start_time(os.getpid()),
          "since": datetime.datetime.now().isoformat(timespec="seconds")}
    for _ in range(3):
      try:
        fd = self._open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
      except FileExistsError:
        self._take_over_if_stale()
        continue
      try:
        with os.fdopen(fd, "w") as f:
          f.write(json.dumps(me))
      except OSError as e:  # a full disk: the empty lock must not outlive this run
        os.remove(self.path)
        raise os_error(e, f"cannot write '{self.path}'") from None
      self.held = True
      return
    raise UserError(f"output_dir '{self.out}' is being locked by another run right now")

  def _open(self, path: str, flags: int) -> int:
    """os.open of a lock file in output_dir; FileExistsError passes, other failures are one line."""
    try:
      return os.open(path, flags, 0o644)
    except FileExistsError:
      raise
    except IsADirectoryError:
      raise UserError(f"'{path}' is a directory, not a nanotext lock: move it out of "
                      "output_dir") from None
    except OSError as e:
      raise os_error(e, f"cannot write to output_dir '{self.out}'") from None

  @contextlib.contextmanager
  def _guarded(self):
    """The block under an exclusive flock of output_dir/GUARD (without fcntl, or on a file system
    without flock, the block alone); the file is removed while still held."""
    path = os.path.join(self.out, GUARD)
    fd = self._guard(path) if fcntl else None
    try:
      yield
    finally:
      if fd is not None:
        with contextlib.suppress(OSError):  # a start waiting on this file then opens a new one
          os.remove(path)
        os.close(fd)

  def _guard(self, path: str):
    """A descriptor of GUARD holding its flock, None where the file system has none."""
    deadline = time.monotonic() + GUARD_S
    while True:
      fd = self._open(path, os.O_CREAT | os.O_RDWR)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:  # another start is judging the lock now
        os.close(fd)
        if time.monotonic() >= deadline:
          raise UserError(f"output_dir '{self.out}' is being locked by another run right now "
                          f"(it holds '{path}')") from None
        time.sleep(0.05)
        continue
      except OSError:  # ENOLCK, EOPNOTSUPP: no flock on this file system
        os.close(fd)
        with contextlib.suppress(OSError):
          os.remove(path)
        return None
      try:  # the file its holder removed (on the way out) is no guard: open the one there now
        if os.path.samestat(os.fstat(fd), os.stat(path)):
          return fd
      except FileNotFoundError:
        pass
      os.close(fd)

  def _take_over_if_stale(self) -> None:
    if os.path.isdir(self.path) and not os.path.islink(self.path):
      raise UserError(f"'{self.path}' is a directory, not a nanotext lock: move it out of "
                      "output_dir")
    try:
      text, ino = _read(self.path)
      age = time.time() - os.path.getmtime(self.path)
    except FileNotFoundError:
      return  # released meanwhile: try again
    except OSError as e:
      raise os_error(e, f"cannot read the lock '{self.path}'") from None
    holder = _holder(text)
    if holder is None and age < 10:  # being written this instant by another run
      holder = {"host": "?", "pid": "?", "since": "just now"}
    if holder is not None and alive(holder):
      raise self._in_use(holder)
    # A killed run's lock: move it out of the way. Another start may have taken it over since it
    # was read (its own fresh lock now lies at the path): only the file judged stale goes.
    moved = f"{self.path}.stale-{os.getpid()}"
    try:
      os.rename(self.path, moved)
    except FileNotFoundError:
      return
    except OSError as e:
      raise os_error(e, f"cannot take over the stale lock '{self.path}'") from None
    try:
      taken = _read(moved)
    except OSError:
      taken = None
    lost = taken != (text, ino)
    if lost:  # the winner's lock: put it back (never over a newer one)
      try:
        os.link(moved, self.path)
      except OSError:
        pass
    try:
      os.remove(moved)
    except OSError:
      pass
    if lost:
      raise self._in_use(_holder(taken[0]) if taken else None)

  def _in_use(self, holder) -> UserError:
    holder = holder or {}
    return UserError(f"output_dir '{self.out}' is in use by another run (pid {holder.get('pid')}"
                     f" on {holder.get('host')}, since {holder.get('since')}); wait for it to end "
                     f"or choose another output_dir (if that run is gone, delete '{self.path}')")

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
