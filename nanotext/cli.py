"""The command line every tool shares: `cli.run(main, USAGE)` in each tool's `__main__`.

absl parses the flags the tool defined (`--name=value`, `--name value`, and `--a-b` for `--a_b`);
`-h` / `--help` prints the usage, the tool's docstring and its flags on stdout and exits 0; an
unknown or malformed flag is one `nanotext: error:` line and exit 2. `main(args)` gets the
positional arguments and runs under errors.run_cli: every failure is one line and a status.
"""

import sys

from absl import app, flags

from nanotext import errors

HELP = ("-h", "-?", "-help", "--help", "--helpshort", "--helpfull")


def run(main, usage: str, doc: str = "", argv=None, describe=None) -> None:
  """Run `main(args)` as this process's program; never returns.

  `doc` follows the usage line in --help; `describe(args)`, when given, returns the whole help
  text instead (a tool with subcommands describes the one named)."""
  argv = list(sys.argv if argv is None else argv)
  describe = describe or (lambda args: help_text(usage, doc))
  app.run(lambda args: errors.run_cli(main, args[1:]), argv=argv,
          flags_parser=lambda a: parse(a, usage, describe))


def parse(argv, usage: str, describe=None):
  """absl's flags_parser: help on stdout and exit 0, a bad flag one line and exit 2."""
  args = list(argv[1:])
  options = args[:args.index("--")] if "--" in args else args
  if any(a in HELP for a in options):
    print(describe(args) if describe else usage, flush=True)
    sys.exit(0)
  try:
    return flags.FLAGS([argv[0]] + undash(args))
  except flags.Error as e:
    errors.fail(f"{e}; {usage}")


def undash(args) -> list:
  """`--train-shards=8` as `--train_shards=8` where that flag exists (absl knows only one)."""
  out = []
  for i, a in enumerate(args):
    if a == "--":  # what follows is positional
      return out + list(args[i:])
    name, eq, value = a.partition("=")
    if a.startswith("--") and "-" in name[2:] and name[2:].replace("-", "_") in flags.FLAGS:
      a = "--" + name[2:].replace("-", "_") + eq + value
    out.append(a)
  return out


def help_text(usage: str, doc: str = "") -> str:
  """Usage, the tool's docstring, and the flags it defined (absl's own left out)."""
  lines = [usage]
  if doc.strip():
    lines += ["", doc.strip()]
  own = tool_flags()
  if own:
    lines += ["", "flags:"]
  for flag in own:
    default = "" if flag.default in (None, "", False, []) else f" (default: {flag.default})"
    lines.append(f"  --{flag.name}: {flag.help}{default}")
  return "\n".join(lines)


def tool_flags() -> list:
  """The flags defined outside absl (by the tool), sorted by name."""
  seen = {}
  for module, defined in flags.FLAGS.flags_by_module_dict().items():
    if not module.startswith("absl"):
      for flag in defined:
        seen[flag.name] = flag
  return [seen[n] for n in sorted(seen)]
