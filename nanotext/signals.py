"""SIGTERM and Ctrl-C honoured in every phase, however long the call the main thread is in.

Python runs a signal's handler only when the main thread next executes Python code, which a
long call into XLA (starting a backend, a compile or an init in the main thread, a restore) can
put off for minutes on a loaded machine. So the entry point (cli.run) also has the signal
written to a pipe (signal.set_wakeup_fd, done by the C-level handler whatever thread it runs
in) and a thread reading it: whoever owns the signals now (watch.Preemption before the first
step stops at once) is told; otherwise the main thread gets GRACE_S to end the process
cleanly (KeyboardInterrupt, Terminated: finally blocks run) before the thread ends it.
"""

import atexit
import contextlib
import os
import signal
import sys
import termios
import threading
import time

GRACE_S = 10.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)
_owner = None  # callable(signum), told in the watching thread; None: the grace period
_pending = []  # signals waiting out the grace period
_raised = []  # signals raised in the main thread (an exit that follows one never reads it)
_exiting = False  # set by exiting(): a signal stops the process at once
_watching = False  # install() ran: the watching thread hears every signal
_at_once = ""  # at_once(): with no owner, a signal stops the process with this line
_done = ""  # work_done(): with no owner, a signal ends the process with this line, status 0
_together = False  # work_done(together=True): the first such signal is kept (late()) instead
_late = []  # the signals kept so
_hangup = ()  # (SIGHUP,) where install() took it: handled as SIGTERM
_ttys = ()  # the standard streams that were a terminal when install() ran


class Terminated(BaseException):
  """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt: the stack unwinds
  (output folders put back, staging folders removed) and the tool exits 143."""


def install() -> None:
  """SIGTERM raises Terminated, both signals are watched, SIGHUP is SIGTERM; main thread only."""
  if threading.current_thread() is not threading.main_thread():
    return
  signal.signal(signal.SIGTERM, _raise_terminated)
  # Python leaves SIGINT ignored where the process started with it ignored (a background job
  # of a script), while the training loop honours it: one behaviour in every phase instead.
  signal.signal(signal.SIGINT, _raise_interrupt)
  global _watching, _hangup, _ttys
  _watching = True
  # SIGHUP (the terminal or ssh session closed) killed a training run unsaved: it is SIGTERM
  # from here, with the dead terminal's streams dropped. Left alone where ignored (nohup).
  if signal.getsignal(signal.SIGHUP) is signal.SIG_DFL:
    signal.signal(signal.SIGHUP, lambda signum, frame: None)  # the watching thread acts
    _hangup = (signal.SIGHUP,)
    _ttys = tuple(fd for fd in (1, 2) if os.isatty(fd))
  read, write = os.pipe()
  os.set_blocking(write, False)
  signal.set_wakeup_fd(write, warn_on_full_buffer=False)
  # A forked child (a data-loading worker) would write its own Ctrl-C into this pipe.
  os.register_at_fork(after_in_child=lambda: signal.set_wakeup_fd(-1))
  threading.Thread(target=_watch, args=(read,), name="nanotext-signals", daemon=True).start()


def watching() -> bool:
  """Whether a tool's command line took the signals (install); False for a library caller."""
  return _watching


def _ignore_from_here() -> None:
  """After every exit handler (registered as `nanotext` is imported, before any module imports
  jax: the last to run), Python's finalization resets its handlers to the default, and a signal
  killed the finished tool without a word (status -2 / -15). Ignored from here, it is lost
  with the process, which ends as it was ending. Until here the watching thread acts."""
  if _watching and threading.current_thread() is threading.main_thread():
    for signum in SIGNALS + _hangup:
      signal.signal(signum, signal.SIG_IGN)


atexit.register(_ignore_from_here)


def exiting() -> None:
  """From here the process only shuts down, its work done: a signal ends it at once in one line,
  from the watching thread, whatever the main thread is in (Terminated raised into an atexit
  callback such as jax's backend teardown printed a traceback and exited 0; Python 3.12 refused
  the grace period's thread at shutdown with another)."""
  global _exiting
  if threading.current_thread() is threading.main_thread():
    if _raised:  # raised into library code that swallowed it (jax's gc callback), work went on
      _stop(_raised[0], "received while the tool worked, and swallowed by a library; the work "
            "finished")
    _exiting = True
    for signum in SIGNALS:  # a handler that does nothing: the wakeup pipe still hears it
      signal.signal(signum, lambda signum, frame: None)


@contextlib.contextmanager
def ending_with(message: str):
  """While the block runs (extra work after the run's own is done and saved), a signal ends
  the process at once from the watching thread: `message` on stdout ({} is the signal's name)
  and exit status 0. The main thread's handlers do nothing meanwhile, so it cannot unwind
  into exit 128 + signal first."""
  if not _watching:  # a library caller's process: its own handlers stay
    yield
    return
  previous = {s: signal.getsignal(s) for s in SIGNALS}
  _quiet_handlers()
  try:
    with owned_by(lambda signum: _keep_or_end(signum, message)):
      yield
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)


def at_once(message: str) -> None:
  """From here, while no owner holds the signals, a signal stops the process at once from the
  watching thread: `message` ({} the signal's name) and exit 128 + signal. For a tool's start
  that writes nothing: raised there, Terminated or KeyboardInterrupt landed in library code
  that swallows it (jax's plugin loader, its gc callback, a dataclass being built) and the
  run went on, or came out as a bug's traceback."""
  global _at_once
  if _watching and threading.current_thread() is threading.main_thread():
    _at_once = message
    _quiet_handlers()


def work_done(message: str, together: bool = False) -> None:
  """From here, while no owner holds the signals, a signal ends the process at once with
  `message` ({} the signal's name) on stdout and exit status 0: the work is done and saved.
  Python's handlers stay as they are (an owner's now; after at_once, quiet). `together`: one
  process of several that run the same collectives to their end (a run's sample), where one
  ending alone left the others waiting in one for ever: the first signal is kept (late()) and
  the process goes on; a second ends it."""
  global _done, _together
  if _watching:
    _done, _together = message, together


def late() -> str:
  """The name of the signal work_done(together=True) kept, or ''."""
  return signal.Signals(_late[0]).name if _late else ""


def _keep_or_end(signum: int, message: str) -> None:
  if _together and not _late:
    _late.append(signum)
  else:
    _end(signum, message)


@contextlib.contextmanager
def held(done: str):
  """SIGTERM and Ctrl-C that arrive during the block (renames that must happen together) wait
  for its end, a second one too: the watching thread does not end the process meanwhile. Then,
  the block done, the process ends in one line `stopped by SIG... {done}`; the block failed,
  the handler they would have met runs. From the main thread only."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  got = []
  previous = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in SIGNALS}
  try:
    with owned_by(got.append):  # the watching thread's turn: deferred as well
      yield
  except BaseException:
    _restore(previous, got)
    raise
  if got and _watching:
    _die(got[0], f"stopped by {signal.Signals(got[0]).name} {done}")
  _restore(previous, got)


def _restore(previous: dict, got: list) -> None:
  """Python's handlers as they were; the first signal `got` meanwhile handed to its own."""
  for signum, handler in previous.items():
    signal.signal(signum, handler)
  if got and callable(previous[got[0]]):
    previous[got[0]](got[0], None)


def flush(*streams) -> None:
  """Flush each of `streams` that can be: one that is None (Python's sys.stdout or sys.stderr
  where that descriptor was closed: `>&-`) or cannot be written (a pipe with no reader, a full
  disk) must not end the caller, whose next line or step is what matters."""
  for stream in streams:
    try:
      if stream is not None:
        stream.flush()
    except (OSError, ValueError):  # ValueError: a stream already closed
      pass


def _quiet_handlers() -> None:
  """Python's handlers do nothing: the watching thread acts (the wakeup pipe still hears)."""
  for signum in SIGNALS:
    signal.signal(signum, lambda signum, frame: None)


def _end(signum: int, message: str) -> None:
  flush(sys.stdout)
  say(1, message.format(signal.Signals(signum).name))
  os._exit(0)


def _raise_terminated(signum, frame):
  del frame
  _raised.append(signum)
  raise Terminated()


def _raise_interrupt(signum, frame):
  """Python's own Ctrl-C (KeyboardInterrupt), remembered: one a library swallows still ends the
  tool (`exiting`)."""
  del frame
  _raised.append(signum)
  raise KeyboardInterrupt()


@contextlib.contextmanager
def owned_by(handler):
  """While the block runs, `handler(signum)` is told of each signal in the watching thread
  (as well as any Python handler in the main thread, whenever that runs)."""
  global _owner
  previous, _owner = _owner, handler
  try:
    yield
  finally:
    _owner = previous


def _watch(fd: int) -> None:
  while True:
    try:
      data = os.read(fd, 64)
    except OSError:
      return
    if not data:
      return
    for signum in data:
      if signum in _hangup:
        _hung_up()
      if signum not in SIGNALS:
        continue
      if _exiting:
        _stop(signum, "while exiting, its work done")
      elif _owner is not None:
        _owner(signum)
      elif _done:
        _keep_or_end(signum, _done)
      elif _at_once:
        _die(signum, _at_once.format(signal.Signals(signum).name))
      elif _pending:  # a second signal while the first waits: stop now
        _stop(signum, "a second signal")
      else:
        _pending.append(signum)
        threading.Thread(target=_deadline, args=(signum,), daemon=True).start()


def _hung_up() -> None:
  """SIGHUP: a standard stream on a terminal that hung up (every write now fails with EIO, the
  run's next line would end it unsaved) goes to /dev/null; then the process gets SIGTERM and
  stops as for it (a run saves its step). A terminal still alive (`kill -HUP`) keeps its lines."""
  dead = []
  for fd in _ttys:
    try:
      termios.tcgetattr(fd)
    except (OSError, termios.error):
      dead.append(fd)
  for fd in dead:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
  say(2, "nanotext: SIGHUP (the terminal or session closed): stopping as for SIGTERM")
  os.kill(os.getpid(), signal.SIGTERM)


def _deadline(signum: int) -> None:
  """The main thread had GRACE_S to act on the signal; it is still inside a call."""
  time.sleep(GRACE_S)
  _stop(signum, f"the main thread did not return from a call within {GRACE_S:.0f} s")


def _stop(signum: int, why: str) -> None:
  _die(signum, f"stopped by {signal.Signals(signum).name} ({why})")


def say(fd: int, line: str) -> None:
  """`line` written to `fd` at once, if it can be: a stream that cannot take it (a full disk,
  a pipe whose reader left) must not keep a signal from ending the process."""
  try:
    os.write(fd, (line + "\n").encode("utf-8", "replace"))
  except OSError:
    pass


def _die(signum: int, line: str) -> None:
  """The process ends now: one error line, exit 128 + signal (the shell's status for it)."""
  say(2, f"nanotext: error: {line}")
  os._exit(128 + signum)
