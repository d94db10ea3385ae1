"""User-facing errors and the CLI wrapper that turns them into one line and exit status 2."""

import os
import sys


class UserError(Exception):
  """Bad input the user can fix (config, data, checkpoint, arguments); exit status 2."""


def fail(message: str, status: int = 2) -> None:
  """Print one `nanotext: error: ...` line on stderr and exit with `status` (2: bad input).

  os._exit, not sys.exit: background threads (orbax's async writers and their event loops)
  would otherwise print their own tracebacks during interpreter shutdown, after this line.
  Callers leave nothing open that needs Python's shutdown (files closed, saves waited for).
  """
  print(f"nanotext: error: {message}", file=sys.stderr, flush=True)
  sys.stdout.flush()
  os._exit(status)


def run_cli(main, argv=None) -> None:
  """Call `main(argv)`, mapping UserError to a one-line message and exit status 2."""
  quiet_background_errors()
  try:
    main(sys.argv[1:] if argv is None else argv)
  except UserError as e:
    fail(str(e))


def parse_flags(argv):
  """absl `flags_parser` for app.run: a bad flag is one error line and exit 2, not usage text."""
  from absl import flags
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    fail(str(e))


def quiet_background_errors() -> None:
  """Keep a failed checkpoint write to the one line the run prints about it.

  Orbax's writer threads log each failure with a full traceback, and tensorstore callbacks
  that outlive orbax's event loop print 'Event loop is closed' tracebacks; the run itself
  reports the failure (CheckpointError), so the tracebacks go and the log lines stay one line.
  """
  import logging as pylogging
  import threading
  from absl import logging

  class NoTraceback(pylogging.Filter):
    def filter(self, record):
      if "orbax" in record.pathname:
        record.exc_info, record.exc_text = None, None
      return True
  logging.get_absl_handler().addFilter(NoTraceback())

  def closed_loop(exc) -> bool:
    return isinstance(exc, RuntimeError) and "Event loop is closed" in str(exc)
  hooks = (sys.excepthook, sys.unraisablehook, threading.excepthook)
  sys.excepthook = lambda t, v, tb: None if closed_loop(v) else hooks[0](t, v, tb)
  sys.unraisablehook = lambda u: None if closed_loop(u.exc_value) else hooks[1](u)
  threading.excepthook = lambda a: None if closed_loop(a.exc_value) else hooks[2](a)
