"""CLI of nanotext.convert; see the package docstring for the subcommands and their flags."""

import os

from absl import flags

from nanotext.errors import UserError
from nanotext import convert

USAGE = ("usage: python -m nanotext.convert "
         "from-hf --hf=DIR --out=DIR [--config=YML] [key=value ...]"
         " | to-hf --run=DIR [--step=N] --out=DIR"
         " | params-only --run=DIR [--step=N] --out=DIR [--dtype=bfloat16]"
         " | export-torch --run=DIR [--step=N] --out=FILE.safetensors"
         " | from-torch --torch=FILE --out=DIR [--config=YML] [key=value ...]"
         " (each also takes --force)")
# What each subcommand does, for `SUBCOMMAND --help`.
ABOUT = {
    "from-hf": "HF GPT2LMHeadModel directory (config.json + model.safetensors) -> nanotext run "
               "directory with a step-0 checkpoint; key=value arguments override its config.",
    "to-hf": "classic GPT-2 nanotext run -> HF directory (config.json, generation_config.json, "
             "model.safetensors, tokenizer files) for from_pretrained, AutoTokenizer, pipeline.",
    "params-only": "a run's train state -> DIR/params (parameters only, optionally cast).",
    "export-torch": "speedrun-architecture run -> a safetensors state dict named as "
                    "modded-nanogpt's GPT.",
    "from-torch": "modded-nanogpt GPT state dict (.safetensors, or a torch.save .pt/.pth: its "
                  "checkpoint dict or a bare state dict) -> nanotext run directory of --config "
                  "(default configs/speedrun_record.yml) with a step-0 checkpoint; key=value "
                  "arguments override its config.",
}
# Flags each subcommand accepts, beyond --force; the first two are required.
ACCEPTS = {"from-hf": ("hf", "out", "config"), "to-hf": ("run", "out", "step"),
           "params-only": ("run", "out", "step", "dtype"), "export-torch": ("run", "out", "step"),
           "from-torch": ("torch", "out", "config")}


def define_flags() -> None:
  """The CLI's flags (defined only when run as a program: no clash with other tools' flags)."""
  flags.DEFINE_string("hf", None, "Hugging Face model directory (from-hf).")
  flags.DEFINE_string("torch", None, "modded-nanogpt state dict: .safetensors, .pt or .pth "
                      "(from-torch).")
  flags.DEFINE_string("run", None, "nanotext run directory (output_dir of a run).")
  flags.DEFINE_string("out", None, "Where to write the result.")
  flags.DEFINE_string("config", "", "Base config: '' = configs/base.yml (from-hf), "
                      "configs/speedrun_record.yml (from-torch).")
  flags.DEFINE_integer("step", -1, "Checkpoint step to read; -1 = the newest.")
  flags.DEFINE_string("dtype", "", "params-only: cast to float32 or bfloat16.")
  flags.DEFINE_bool("force", False, "Replace an existing, non-empty --out.")


def describe(args) -> str:
  """--help: the package's text, or one subcommand's when it is named first."""
  if args and args[0] in ACCEPTS:
    return subcommand_help(args[0])
  return f"{USAGE}\n\n{convert.__doc__.strip()}"


def subcommand_help(command: str) -> str:
  """Usage, purpose and flags of one subcommand."""
  usage = next(u.strip() for u in USAGE.split(" | ") if command in u)
  usage = usage.replace("usage: python -m nanotext.convert ", "").replace(
      " (each also takes --force)", "")
  lines = [f"usage: python -m nanotext.convert {usage} [--force]", "", ABOUT[command], "",
           "flags:"]
  for name in ACCEPTS[command] + ("force",):
    flag = flags.FLAGS[name]
    default = "" if flag.default in (None, "", False) else f" (default: {flag.default})"
    lines.append(f"  --{name}: {flag.help}{default}")
  return "\n".join(lines)


def main(args) -> None:
  """The CLI: `args` are the subcommand and from-hf's or from-torch's key=value overrides."""
  if args and args[0] == "help":
    print(describe(args[1:]))
    return
  if not args:  # flags alone did nothing: not a success a script could take for one
    raise UserError(f"name a subcommand first; {USAGE}")
  command, positional = args[0], list(args[1:])
  if command not in ACCEPTS:
    raise UserError(f"unknown subcommand '{command}'; {USAGE}")
  f = flags.FLAGS
  accepts = ACCEPTS[command]
  for name in ("hf", "torch", "run", "out", "config", "step", "dtype"):
    if f[name].present and name not in accepts:
      raise UserError(f"{command} does not take --{name}; {USAGE}")
  for name in accepts[:2]:
    if not f[name].value:
      raise UserError(f"{command} needs --{name}; {USAGE}")
  if positional and command not in ("from-hf", "from-torch"):
    raise UserError(f"{command} takes no arguments besides flags, got {positional[0]!r}; {USAGE}")
  hf, torch, run, out, config = (f[name].value and os.path.expanduser(f[name].value)
                                  for name in ("hf", "torch", "run", "out", "config"))
  if command == "from-hf":
    convert.from_hf(hf, out, positional, config_path=config, force=f.force)
  elif command == "to-hf":
    convert.to_hf(run, out, step=f.step, force=f.force)
  elif command == "from-torch":
    convert.from_torch(torch, out, positional, config_path=config, force=f.force)
  elif command == "params-only":
    convert.params_only(run, out, step=f.step, dtype=f.dtype, force=f.force)
  else:
    convert.export_torch(run, out, step=f.step, force=f.force)


if __name__ == "__main__":
  from nanotext import cli
  define_flags()
  cli.run(main, USAGE, describe=describe, jax=True)
