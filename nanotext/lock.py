"""One run at a time per output_dir: `output_dir/.lock` names the pid and host of the run that
holds it; a second run is refused, a lock left by a killed run (its pid gone, or reused by a
younger process) is taken over."""

import datetime
import json
import os
import socket
import time

from nanotext.errors import UserError, os_error

LOCK = ".lock"


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
    if holder is not None and alive(holder):
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
