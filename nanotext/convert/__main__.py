"""CLI of nanotext.convert; see the package docstring for the subcommands and their flags."""

import sys

from absl import flags, logging

from nanotext.errors import UserError, run_cli
from nanotext import convert

USAGE = ("usage: python -m nanotext.convert "
         "from-hf --hf=DIR --out=DIR [--config=YML] [key=value ...]"
         " | to-hf --run=DIR [--step=N] --out=DIR"
         " | params-only --run=DIR [--step=N] --out=DIR [--dtype=bfloat16]"
         " | export-torch --run=DIR [--step=N] --out=FILE.safetensors"
         " (each also takes --force)")
HELP = ("-h", "--help", "--helpshort", "--helpfull", "help")
# What each subcommand does, for `SUBCOMMAND --help`.
ABOUT = {
    "from-hf": "HF GPT2LMHeadModel directory (config.json + model.safetensors) -> nanotext run "
               "directory with a step-0 checkpoint; key=value arguments override its config.",
    "to-hf": "classic GPT-2 nanotext run -> HF directory (config.json, generation_config.json, "
             "model.safetensors, tokenizer files) for from_pretrained, AutoTokenizer, pipeline.",
    "params-only": "a run's train state -> DIR/params (parameters only, optionally cast).",
    "export-torch": "speedrun-architecture run -> a safetensors state dict named as "
                    "modded-nanogpt's GPT.",
}
# Flags each subcommand accepts, beyond --force; the first two are required.
ACCEPTS = {"from-hf": ("hf", "out", "config"), "to-hf": ("run", "out", "step"),
           "params-only": ("run", "out", "step", "dtype"), "export-torch": ("run", "out", "step")}


def _flag_values() -> flags.FlagValues:
  # A private registry: no clash with nanotext.train's global flags when both are imported.
  fv = flags.FlagValues()
  flags.DEFINE_string("hf", None, "Hugging Face model directory (from-hf).", flag_values=fv)
  flags.DEFINE_string("run", None, "nanotext run directory (output_dir of a run).", flag_values=fv)
  flags.DEFINE_string("out", None, "Where to write the result.", flag_values=fv)
  flags.DEFINE_string("config", "", "Base config for from-hf; '' = configs/base.yml.",
                      flag_values=fv)
  flags.DEFINE_integer("step", -1, "Checkpoint step to read; -1 = the newest.", flag_values=fv)
  flags.DEFINE_string("dtype", "", "params-only: cast to float32 or bfloat16.", flag_values=fv)
  flags.DEFINE_bool("force", False, "Replace an existing, non-empty --out.", flag_values=fv)
  return fv


def subcommand_help(command: str, fv: flags.FlagValues) -> str:
  """Usage, purpose and flags of one subcommand."""
  usage = next(u.strip() for u in USAGE.split(" | ") if command in u)
  usage = usage.replace("usage: python -m nanotext.convert ", "").replace(
      " (each also takes --force)", "")
  lines = [f"usage: python -m nanotext.convert {usage} [--force]", "", ABOUT[command], "",
           "flags:"]
  for name in ACCEPTS[command] + ("force",):
    flag = fv[name]
    default = "" if flag.default in (None, "", False) else f" (default: {flag.default})"
    lines.append(f"  --{name}: {flag.help}{default}")
  return "\n".join(lines)


def main(argv) -> None:
  argv = list(argv)
  if not argv or argv[0] in ("-h", "--help", "help"):
    print(__import__("nanotext.convert").convert.__doc__)
    return
  command, rest = argv[0], argv[1:]
  if command not in ACCEPTS:
    raise UserError(f"unknown subcommand '{command}'; {USAGE}")
  fv = _flag_values()
  if any(a.split("=")[0] in HELP for a in rest):
    print(subcommand_help(command, fv))
    return
  try:
    positional = fv(["nanotext.convert"] + rest)[1:]
  except flags.Error as e:
    raise UserError(f"{e}; {USAGE}") from None
  accepts = ACCEPTS[command]
  for name in ("hf", "run", "out", "config", "step", "dtype"):
    if fv[name].present and name not in accepts:
      raise UserError(f"{command} does not take --{name}; {USAGE}")
  for name in accepts[:2]:
    if not fv[name].value:
      raise UserError(f"{command} needs --{name}; {USAGE}")
  if positional and command != "from-hf":
    raise UserError(f"{command} takes no arguments besides flags, got {positional[0]!r}; {USAGE}")
  if not logging.get_verbosity() < logging.INFO:
    logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  f = fv
  if command == "from-hf":
    convert.from_hf(f.hf, f.out, positional, config_path=f.config, force=f.force)
  elif command == "to-hf":
    convert.to_hf(f.run, f.out, step=f.step, force=f.force)
  elif command == "params-only":
    convert.params_only(f.run, f.out, step=f.step, dtype=f.dtype, force=f.force)
  else:
    convert.export_torch(f.run, f.out, step=f.step, force=f.force)


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
