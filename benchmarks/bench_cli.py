"""The benchmark scripts' command line, the nanotext tools' own (nanotext.cli): --help prints the
usage and the script's docstring and exits 0; an unknown flag, a UserError (bad arguments,
checked before anything is measured) is one `nanotext: error:` line and exit 2.

A library module: `python benchmarks/bench_cli.py` does nothing.
"""

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # nanotext from this checkout, as the other benchmarks import it
  sys.path.insert(0, REPO)


def run(main, usage: str, doc: str = "", jax: bool = True) -> None:
  """Run `main(argv)` (the script's name, then its positional arguments) under nanotext.cli.run;
  never returns. `jax`: the script starts a jax backend (its environment is checked first)."""
  from nanotext import cli
  cli.run(lambda args: main([sys.argv[0], *args]), usage, doc, jax=jax)


def at_least(minimum: int, **values) -> None:
  """UserError naming the first --flag (a keyword) whose value is below `minimum`."""
  from nanotext.errors import UserError
  for name, value in values.items():
    if value < minimum:
      raise UserError(f"--{name}={value}: give at least {minimum}")


def existing_file(path: str, what: str) -> None:
  """UserError unless `path` is a readable file."""
  from nanotext.errors import UserError
  if not os.path.isfile(path):
    raise UserError(f"{what} '{path}' is not a file" + (
        "" if os.path.exists(path) else " (no such file)"))
  if not os.access(path, os.R_OK):
    raise UserError(f"{what} '{path}' cannot be read (permissions)")


def writable_file(path: str, what: str) -> None:
  """UserError (ResourceError for a full disk) unless a file can be written at `path`: not a
  folder, in a folder that exists and takes a new file."""
  from nanotext import probes
  from nanotext.errors import UserError
  if os.path.isdir(path):
    raise UserError(f"{what} '{path}' is a folder; name a file")
  folder = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(folder):
    raise UserError(f"{what} '{path}': folder {folder} does not exist; create it or name another")
  probes.writable_dir(folder, f"{what}'s folder")
