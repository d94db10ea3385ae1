"""User-facing errors and the CLI wrapper that turns them into one line: exit status 2 for bad
input, 1 for a missing resource, 130 for Ctrl-C."""

import errno
import os
import re
import resource
import select
import stat
import sys
import logging as pylogging
import threading
import traceback

from absl import flags, logging

from nanotext import signals


class UserError(Exception):
  """Bad input the user can fix (config, data, checkpoint, arguments); exit status 2."""


class ResourceError(RuntimeError):
  """A missing resource (disk space, a file-size limit, memory): not bad input, exit status 1."""


# Called before a UserError's exit (distributed.leave_together, once a process joined a run).
BEFORE_REFUSAL: list = []
# errnos that say the machine ran out of something, not that the input was wrong
_RESOURCE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.ENOMEM}


CWD_DELETED = ("the working directory was deleted, so a relative path given cannot be "
               "resolved: cd to a folder that exists (or give absolute paths) and run again")


def cwd_deleted(e: BaseException | None = None) -> bool:
  """Whether the working directory was deleted (relative paths cannot be resolved); given `e`,
  whether `e` is os.getcwd() failing so (a FileNotFoundError naming no file)."""
  if e is not None and not (isinstance(e, FileNotFoundError) and not e.filename):
    return False
  try:
    os.getcwd()
  except FileNotFoundError:
    return True
  return False


def os_error(e: OSError, what: str) -> Exception:
  """The one-line error for an OSError met while doing `what` ("cannot write 'X'"): a
  ResourceError for a full disk or a size limit, else a UserError (permissions, a file where a
  folder belongs, a read-only or kernel file system: the path given is the thing to change)."""
  if cwd_deleted(e):
    return UserError(f"{what}: {CWD_DELETED}")
  reason = e.strerror or type(e).__name__
  if e.errno in _RESOURCE_ERRNOS:
    return ResourceError(f"{what}: {reason}; free some space (or raise the limit) and run again")
  return UserError(f"{what}: {reason}")


class Unreadable(UserError):
  """A file or folder this user may not read (another user's run written with umask 077): a
  read that fails there is no damage (a resume, verify and evaluate pass it on, never skip)."""


def unreadable(e: OSError) -> Unreadable:
  """The one line for `e`, a read refused by permissions (EACCES, EPERM)."""
  code = errno.errorcode.get(e.errno, "EACCES")
  return Unreadable(f"cannot read '{e.filename}': {e.strerror or 'Permission denied'} ({code}): "
                    "this user may not read it (it is not damaged); its owner can allow reading "
                    "(chmod -R a+rX), or read it as that user")


# How libraries that are not Python name the errno of a failed write: tensorstore (orbax),
# Rust's std::io (safetensors, tokenizers), and an OSError's text.
_OS_CODE = re.compile(r"os_error_code='?(\d+)|\(os error (\d+)\)|\[Errno (\d+)\]")


def write_error(e: BaseException, what: str) -> Exception | None:
  """The one-line error (os_error) for a write that failed with `e`, from an OSError or the
  errno another library's error names; None when `e` names none (a bug: keep its traceback)."""
  if isinstance(e, OSError) and e.errno is not None:
    return os_error(e, what)
  m = _OS_CODE.search(str(e))
  if not m:
    return None
  code = int(next(g for g in m.groups() if g))
  return os_error(OSError(code, os.strerror(code)), what)


def fail(message: str, status: int = 2) -> None:
  """Print one `nanotext: error: ...` line on stderr and exit with `status` (2: bad input).

  os._exit, not sys.exit: background threads (orbax's async writers and their event loops)
  would otherwise print their own tracebacks during interpreter shutdown, after this line.
  Callers leave nothing open that needs Python's shutdown (files closed, saves waited for).
  """
  print(f"nanotext: error: {message}", file=sys.stderr, flush=True)
  signals.flush(sys.stdout)
  os._exit(status)


def open_standard_streams() -> None:
  """File descriptors 0, 1 and 2 open, on /dev/null where closed (`>&- 2>&- <&-`, a daemon's
  start), as daemons do, and sys.stdout and sys.stderr streams on them. Else the next pipe or
  file opened takes a free one (the signal pipe, metrics.jsonl at 2), and a line meant for
  stderr is written into it. First thing at a tool's start, before anything opens a file.
  Text their encoding lacks is written as \\xNN (backslashreplace)."""
  try:
    while (fd := os.open(os.devnull, os.O_RDWR)) <= 2:
      pass
    os.close(fd)
  except OSError:  # no /dev/null (a bare chroot): as started
    pass
  for name, fd in (("stdout", 1), ("stderr", 2)):
    stream = getattr(sys, name)
    try:
      if stream is None:  # closed when Python started: the lines go nowhere
        setattr(sys, name, open(fd, "w", buffering=1, encoding="utf-8",
                                errors="backslashreplace", closefd=False))
      elif getattr(stream, "errors", None) == "strict" and hasattr(stream, "reconfigure"):
        # PYTHONIOENCODING=ascii, a Latin-1 locale: a non-ASCII output_dir or prompt in a line
        # raised UnicodeEncodeError, a traceback where the run had worked
        stream.reconfigure(errors="backslashreplace")
    except (OSError, ValueError):  # fd 1 or 2 still closed, or the stream unusable: as it was
      pass


def terminal_gone(e: OSError) -> bool:
  """Whether `e`, from a write to stdout, says its terminal hung up (an ssh session closed)."""
  try:
    return e.errno == errno.EIO and stat.S_ISCHR(os.fstat(sys.stdout.fileno()).st_mode)
  except (OSError, ValueError, AttributeError):
    return False


def reader_gone(e: OSError) -> bool:
  """Whether `e`, from a write to stdout, says nothing reads it any more: a pipe's or a socket's
  reader left (EPIPE; ECONNRESET where a socket's reader left lines unread: a journal
  restarted), or its terminal hung up."""
  return e.errno in (errno.EPIPE, errno.ECONNRESET) or terminal_gone(e)


def stdout_widowed() -> bool:
  """Whether stdout is a pipe or socket whose reader has exited (`| head` that has read its
  lines; a socket's reader shut it down, which sets POLLHUP, not POLLERR)."""
  try:
    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
  except (OSError, ValueError, AttributeError):  # no file descriptor behind sys.stdout
    return False


def drop_stdout() -> None:
  """Send stdout to /dev/null: what is still buffered for a closed pipe goes, not raised again."""
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, sys.stdout.fileno())
  os.close(devnull)


def run_cli(main, argv=None) -> None:
  """Call `main(argv)`: UserError is one line and exit status 2, ResourceError one line and 1,
  a closed stdout pipe or socket nothing and 141 (128 + SIGPIPE), Ctrl-C one line and 130 (the
  tools run under it only read, or write through a staging folder that a kill leaves unused, so
  stopping anywhere loses nothing). Any other error ends the process too, at once, whatever
  threads are still running (explain)."""
  quiet_background_errors()
  drop_storage_error_logs()
  try:
    try:
      main(sys.argv[1:] if argv is None else argv)
    except SystemExit:  # as verify ends
      signals.exiting()
      raise
    signals.exiting()  # only Python's shutdown (atexit callbacks) is left
  except UserError as e:
    for hook in BEFORE_REFUSAL:
      hook()
    fail(str(e))
  except ResourceError as e:
    fail(str(e), 1)
  except KeyboardInterrupt:
    fail("interrupted", 130)
  except signals.Terminated:
    fail("stopped by SIGTERM", 143)
  except (BrokenPipeError, ConnectionResetError) as e:
    if not stdout_widowed():
      fail(*explain(e))
    drop_stdout()  # its reader chose to stop reading: quiet, as a tool that SIGPIPE ends
    os._exit(141)
  except Exception as e:  # pylint: disable=broad-except
    fail(*explain(e))


def explain(e: Exception) -> tuple:
  """(one line, exit status) for an error no tool expected. A bug also gets its traceback
  printed first (where it happened is what matters), and exits 1 like any failed run: with
  os._exit, so threads still running (data loading, async saves, metrics) cannot keep the
  process alive after its error, as Python's shutdown would by joining them."""
  if backend_error(e):
    return backend_error(e), 2
  if limit_error(e):
    return limit_error(e), 1
  if cwd_deleted(e):  # os.path.abspath of a relative path
    return CWD_DELETED, 2
  name = getattr(e, "filename", None) or ("standard output" if stdout_failed(e) else "a file")
  out_of_space = write_error(e, f"cannot write '{name}'")
  if isinstance(out_of_space, ResourceError):  # a disk full or a size limit, in any writer
    return str(out_of_space), 1
  head = (str(e).splitlines() or [""])[0][:300]
  if type(e).__name__ in ("JaxRuntimeError", "XlaRuntimeError"):  # XLA's runtime, not Python
    return f"XLA failed while running a program: {head}", 1
  traceback.print_exc()
  return f"unexpected {type(e).__name__}: {head} (a bug: the traceback above says where)", 1


def stdout_failed(e: BaseException) -> bool:
  """Whether `e`, an OSError naming no file, is stdout's: stdout is a file on a full disk
  (ENOSPC) or at the file-size limit (EFBIG), or what it still holds fails to flush with the
  same errno (a quota's EDQUOT, EIO: the bytes of a failed print stay buffered, unless
  PYTHONUNBUFFERED)."""
  if not isinstance(e, OSError) or e.errno is None:
    return False
  try:
    fd, limit = sys.stdout.fileno(), resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if stat.S_ISREG(os.fstat(fd).st_mode) and (
        e.errno == errno.ENOSPC and os.fstatvfs(fd).f_bavail == 0 or
        e.errno == errno.EFBIG and limit != resource.RLIM_INFINITY
        and os.fstat(fd).st_size >= limit):
      return True
    sys.stdout.flush()
  except OSError as again:
    return again.errno == e.errno
  except (AttributeError, ValueError):  # no stdout (fd 1 closed: None), or a closed one
    pass
  return False


def backend_error(e: BaseException) -> str:
  """The one line for jax failing to start its backend (JAX_PLATFORMS naming one this
  machine lacks: cuda without a GPU, tpu without a TPU, a misspelt name), else ""."""
  frames = [f.f_code for f, _ in traceback.walk_tb(e.__traceback__)]
  if not any(c.co_name == "backends" and c.co_filename.endswith("xla_bridge.py") for c in frames):
    return ""
  why = str(e).split(" (set JAX_PLATFORMS")[0].split(" (you may need")[0]
  why = why or "no device of that kind is visible"
  platforms = os.environ.get("JAX_PLATFORMS", "")
  if not platforms:
    return f"jax could not start a backend ({why}); set JAX_PLATFORMS=cpu to run on the CPU"
  return (f"JAX_PLATFORMS={platforms}: jax cannot start that backend on this machine ({why}); "
          "set JAX_PLATFORMS to one it has (cpu), or unset it to let jax choose")


def limit_error(e: BaseException) -> str:
  """The one line for a thread or allocation refused under an address-space limit
  (`ulimit -v`), else ""."""
  soft = resource.getrlimit(resource.RLIMIT_AS)[0]
  if soft == resource.RLIM_INFINITY:
    return ""
  refused = isinstance(e, MemoryError) or (isinstance(e, OSError) and e.errno == errno.ENOMEM) \
      or (isinstance(e, RuntimeError) and "can't start new thread" in str(e))
  if not refused:
    return ""
  return (f"the address-space limit (ulimit -v {soft // 1024}) refused memory or a thread "
          f"({type(e).__name__}: {str(e)[:80]}); raise it (ulimit -v unlimited) and run again; "
          "checkpoints already written are intact")


def parse_flags(argv):
  """absl `flags_parser` for app.run: a bad flag is one error line and exit 2, not usage text."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(str(e))


STORAGE_STATUS = re.compile(r"[A-Z][A-Z_]{3,}: ")  # tensorstore's errors: 'NOT_FOUND: Error ...'


def _storage_failure(record) -> bool:
  """Whether an asyncio log record is of a checkpoint read or write that failed in orbax or
  tensorstore (a step a run in progress removed, a damaged chunk): its exception passed
  through their code, or is one of tensorstore's statuses, set on a future from C++ with no
  frame of theirs ("Future exception was never retrieved")."""
  if "orbax" in record.getMessage() or re.search(r"exception=\w+\('[A-Z][A-Z_]{3,}: ",
                                                 record.getMessage()):
    return True
  exc = record.exc_info[1] if isinstance(record.exc_info, tuple) else record.exc_info
  seen = set()
  while isinstance(exc, BaseException) and id(exc) not in seen:
    seen.add(id(exc))
    if STORAGE_STATUS.match(str(exc)):
      return True
    tb = exc.__traceback__
    while tb is not None:
      name = tb.tb_frame.f_code.co_filename
      if f"{os.sep}orbax{os.sep}" in name or "tensorstore" in name:
        return True
      tb = tb.tb_next
    exc = exc.__cause__ or exc.__context__
  return False


def quiet_background_errors() -> None:
  """Keep a failed checkpoint write to the one line the run prints about it.

  Orbax's writer threads log each failure with a full traceback, asyncio logs a failed write
  task nobody awaited when it is collected (when, depends on the load), and tensorstore
  callbacks that outlive orbax's event loop print 'Event loop is closed' tracebacks, and reads
  of a damaged checkpoint that orbax dropped raise again when collected; the run itself reports
  the failure (CheckpointError), so the tracebacks go and the log lines stay one line. Installed
  once per process, by run_cli (every tool's entry point).
  """

  class NoTraceback(pylogging.Filter):
    def filter(self, record):
      if record.name == "asyncio" and _storage_failure(record):
        return False  # an orbax task's or future's failure asyncio found unread when collected
      if "orbax" in record.pathname:
        record.exc_info, record.exc_text = None, None
      return True
  logging.get_absl_handler().addFilter(NoTraceback())

  def closed_loop(exc) -> bool:
    return isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc)
  hooks = (sys.excepthook, sys.unraisablehook, threading.excepthook)
  sys.excepthook = lambda t, v, tb: None if closed_loop(v) else hooks[0](t, v, tb)
  sys.unraisablehook = lambda u: None if closed_loop(u.exc_value) or abandoned_orbax_read(u) \
      else hooks[1](u)
  threading.excepthook = lambda a: None if closed_loop(a.exc_value) else hooks[2](a)


def abandoned_orbax_read(unraisable) -> bool:
  """An orbax read coroutine closed unfinished: when one array of a damaged checkpoint fails,
  the reads still pending are dropped, and each raises again as Python collects it (an
  'Exception ignored in: <coroutine ...>' traceback on stderr, when depends on the load: seen in
  1 of 5 `verify` runs of one damaged step). The failure itself is reported where it was read."""
  code = getattr(unraisable.object, "cr_code", None)
  return code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename


def drop_storage_error_logs() -> None:
  """Drop orbax's own error logs (a failed write is logged by each of its threads, with
  tracebacks): the tools report the failure in their one line."""

  class DropErrors(pylogging.Filter):
    def filter(self, record):
      return not (record.levelno >= pylogging.ERROR and "orbax" in record.pathname)
  pylogging.getLogger("absl").addFilter(DropErrors())


def print_log(line: str) -> None:
  """A run's log `line` on stdout. Once stdout cannot take it the run goes on, metrics.jsonl has
  its log: its reader gone (`| tee` closed with its terminal, the run under nohup, a terminal hung
  up, a journal's socket whose reader restarted), or its file's disk full or failing (`> log`)."""
  try:
    print(line, flush=True)
  except OSError as e:
    why = ("stdout was closed" if reader_gone(e) else
           f"cannot write standard output ({e.strerror or type(e).__name__})")
    drop_stdout()
    try:
      print(f"nanotext: {why}; training goes on, its log in the run's metrics.jsonl",
            file=sys.stderr, flush=True)
    except OSError:
      pass
