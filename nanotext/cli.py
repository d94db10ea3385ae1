"""The command line every tool shares: `cli.run(main, USAGE)` in each tool's `__main__`.

absl parses the flags the tool defined (`--name=value`, `--name value`, and `--a-b` for `--a_b`);
`-h` / `--help` prints the usage, the tool's docstring and its flags on stdout and exits 0; an
unknown or malformed flag is one `nanotext: error:` line and exit 2. `main(args)` gets the
positional arguments and runs under errors.run_cli: every failure is one line and a status.
"""

import logging
import os
import re
import resource
import signal
import sys

from absl import app, flags, logging as absl_logging

from nanotext import errors, signals, xla_flags

HELP = ("-h", "-?", "-help", "--help", "--helpshort", "--helpfull")
# Address space jax and XLA reserve before any work (thread stacks, malloc arenas, the
# compiler): a tiny train run peaked at 2.1 GiB on 2 cores (VmPeak), jax's CPU backend alone at
# 1.4 GiB. Below this floor no tool that starts jax can run.
MIN_ADDRESS_SPACE, PER_CORE = 1.5 * 2**30, 256 * 2**20
# The values jax reads as true and false in a boolean variable (jax._src.config.bool_env).
JAX_TRUE, JAX_FALSE = ("y", "yes", "t", "true", "on", "1"), ("n", "no", "f", "false", "off", "0")


# at_once's line for a tool that only reads (verify, evaluate, generate): a signal ends it where
# it lands, Python's handlers never raised into library code that could swallow it.
READ_ONLY_STOP = "stopped by {}; this tool only reads, nothing was changed"


def run(main, usage: str, doc: str = "", argv=None, describe=None, jax: bool = False,
        precheck=None, at_once: str = "", aot: bool = False, check_only=None) -> None:
  """Run `main(args)` as this process's program; never returns.

  `doc` follows the usage line in --help; `describe(args)`, when given, returns the whole help
  text instead (a tool with subcommands describes the one named). `jax`: the tool starts a jax
  backend, so the environment that would make XLA abort is checked first. `precheck(args)`, run
  before anything imports jax (a second or more), refuses bad arguments early: a config file
  that is missing or malformed, an unknown key, a value of the wrong type. `at_once`: the line
  a signal stops the process with, at once, until the tool takes the signals (signals.at_once:
  for a start that writes nothing). `aot`: the tool compiles its programs ahead of time
  (jit(...).lower().compile()), which jax refuses under JAX_DISABLE_JIT. --only_check_args (absl's)
  runs `check_only(args)` (default `precheck`) alone and exits 0: nothing is written."""
  errors.open_standard_streams()  # before the signal pipe below takes a closed stdout's fd
  argv = list(sys.argv if argv is None else argv)
  describe = describe or (lambda args: help_text(usage, doc))
  # A file-size limit (ulimit -f) is then EFBIG from the write, said in one line, not a kill
  # (Python ignores SIGXFSZ already; a launcher may have reset it).
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  signals.install()  # SIGTERM and Ctrl-C honoured even inside a long call into XLA
  if at_once:
    signals.at_once(at_once)

  def checked_main(args):
    if not flags.FLAGS["verbosity"].present:  # orbax logs every file it reads or writes at INFO
      absl_logging.set_verbosity(absl_logging.WARNING)
    if precheck:
      precheck(args)
    if jax:
      check_environment(aot=aot)
    main(args)

  def parse_and_check(a):
    args = parse(a, usage, describe)
    if (check_only or precheck) and flags.FLAGS["only_check_args"].value:  # absl exits 0 next
      errors.run_cli(check_only or precheck, args[1:])  # and main never runs
    return args
  app.run(lambda args: errors.run_cli(checked_main, args[1:]), argv=argv,
          flags_parser=parse_and_check)


def check_environment(environ=os.environ, aot: bool = False) -> None:
  """Refuse, in one line, what would make XLA abort the process rather than raise: a flag in
  XLA_FLAGS it does not know, an address-space limit below what jax needs to start; and what
  would fail jax later: JAX_DISABLE_JIT that it cannot read, or set for a tool that compiles
  ahead of time (`aot`: train, evaluate)."""
  malformed = xla_flags.malformed(environ)
  if malformed:
    raise errors.UserError(f"XLA_FLAGS: {malformed} (XLA would abort on it); correct or remove it")
  bad = xla_flags.unknown_flags(environ)
  if bad:
    raise errors.UserError(
        f"XLA_FLAGS: {', '.join(bad)} is not a flag of the installed XLA (XLA would abort on "
        "it); correct or remove it (flags differ between jaxlib versions)")
  soft = resource.getrlimit(resource.RLIMIT_AS)[0]
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  need = MIN_ADDRESS_SPACE + PER_CORE * (cores or 1)
  if soft != resource.RLIM_INFINITY and soft < need:
    raise errors.ResourceError(
        f"the address-space limit (ulimit -v {soft // 1024}) is {soft / 2**30:.1f} GiB, below "
        f"the {need / 2**30:.1f} GiB jax and XLA reserve on {cores} core(s) before any work; "
        "raise it (ulimit -v unlimited) and run again")
  no_jit = environ.get("JAX_DISABLE_JIT")
  if no_jit is not None and no_jit.lower() not in JAX_TRUE + JAX_FALSE:  # jax's import raises
    raise errors.UserError(f"JAX_DISABLE_JIT={no_jit!r} is not a value jax reads: set it to 0 "
                           "or 1, or unset it")
  if aot and no_jit is not None and no_jit.lower() in JAX_TRUE:  # failed at the first step
    raise errors.UserError(f"JAX_DISABLE_JIT={no_jit}: this tool compiles its programs ahead of "
                           "time, which jax cannot do with jit disabled; unset JAX_DISABLE_JIT "
                           "(or set it to 0)")
  platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  if platforms:  # a backend asked for by name: its failure is our one line (errors.py)
    logging.getLogger("jax._src.xla_bridge").addFilter(_drop_plugin_errors)
    if not any(present(p) for p in platforms):
      raise errors.UserError(
          f"JAX_PLATFORMS={','.join(platforms)}: this machine has no such device; set "
          "JAX_PLATFORMS=cpu, or unset it to let jax choose")
  elif not any(present(p) or device_nodes(p) for p in ACCELERATORS):
    # No accelerator at all: jax would still start every installed plugin (a CUDA plugin logs a
    # traceback without cuDNN, libtpu pages of warnings) before it settles on the CPU.
    import jax
    jax.config.update("jax_platforms", "cpu")


def present(platform: str) -> bool:
  """Whether this machine has a device of `platform` (jax's own probe, before it loads the
  plugin: libtpu prints pages of warnings before it fails). True where it cannot tell."""
  if platform == "cpu":
    return True
  try:
    from jax._src import hardware_utils as hw
    probes = {"cuda": hw.has_visible_nvidia_gpu, "gpu": hw.has_visible_nvidia_gpu,
              "tpu": lambda: hw.num_available_tpu_chips_and_device_id()[0] > 0,
              "rocm": lambda: hw.num_available_amd_gpus(stop_at=1) > 0}
    return probes[platform]() if platform in probes else True
  except Exception:  # pylint: disable=broad-except -- a private module: when it moves, jax decides
    return True


ACCELERATORS = ("cuda", "tpu", "rocm")


def device_nodes(platform: str) -> bool:
  """Whether /dev has a device of `platform` (a second sign beside jax's PCI probe)."""
  import glob
  pattern = {"cuda": "/dev/nvidia*", "tpu": "/dev/accel*", "rocm": "/dev/kfd"}[platform]
  return bool(glob.glob(pattern)) or platform == "tpu" and bool(glob.glob("/dev/vfio/[0-9]*"))


def _drop_plugin_errors(record) -> bool:
  """jax logs a plugin that failed to load with its traceback, then fails to start the backend
  (errors.backend_error says so in one line)."""
  return not record.getMessage().startswith("Jax plugin configuration error")


def parse(argv, usage: str, describe=None):
  """absl's flags_parser: help on stdout and exit 0, a bad flag one line and exit 2."""
  args = list(argv[1:])
  options = args[:args.index("--")] if "--" in args else args
  if any(a in HELP for a in options):
    try:
      print(describe(args) if describe else usage, flush=True)
    except BrokenPipeError:  # `--help | head -1`: quiet, as any tool whose reader stopped
      errors.drop_stdout()
      os._exit(141)
    sys.exit(0)
  for a in args:
    if not is_utf8(a):
      errors.fail(f"argument '{printable(a)}' is not UTF-8 text: nanotext writes paths and text "
                  "into UTF-8 files (config.yml, metrics.jsonl, checkpoints); rename the file "
                  "or folder, or give the text as UTF-8")
  try:
    return flags.FLAGS([argv[0]] + undash(args))
  except flags.Error as e:
    errors.fail(f"{e}; {usage}")


def names_config(arg: str) -> bool:
  """Whether a tool's first positional argument is its config file, not a key=value override:
  a file that exists (in a sweep's folder lr=3e-3), or text with no key before its '='."""
  return (os.path.isfile(arg) or "=" not in arg
          or not re.fullmatch(r"[\w.]+", arg.split("=", 1)[0].strip()))


def is_utf8(text: str) -> bool:
  """Whether `text` came from UTF-8 bytes (Python keeps other bytes as lone surrogates)."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError:
    return False
  return True


def printable(text: str) -> str:
  """`text` with its non-UTF-8 bytes as \\xNN escapes."""
  return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


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
