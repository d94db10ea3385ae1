"""User-facing errors and the CLI wrapper that turns them into one line and exit status 2."""

import sys


class UserError(Exception):
  """Bad input the user can fix (config, data, checkpoint, arguments); exit status 2."""


def fail(message: str) -> None:
  """Print one `nanotext: error: ...` line on stderr and exit with status 2."""
  print(f"nanotext: error: {message}", file=sys.stderr, flush=True)
  sys.exit(2)


def run_cli(main, argv=None) -> None:
  """Call `main(argv)`, mapping UserError to a one-line message and exit status 2."""
  try:
    main(sys.argv[1:] if argv is None else argv)
  except UserError as e:
    fail(str(e))
