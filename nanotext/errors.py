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
