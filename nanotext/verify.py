"""Check every checkpoint of a run against its checksums: `python -m nanotext.verify DIR`.

A resume verifies only the step it restores (and the newer ones it has to skip); this reads
every step of `DIR/checkpoints`, so damage to an older step is found before it is needed. Each
step is read onto one local device whatever mesh wrote it. Nothing is moved or deleted. Exit
status: 0 when every step is intact, 1 when one is damaged, 2 for a directory that is not a run.
"""

import os
import sys

import jax
import numpy as np

from nanotext import checkpoint
from nanotext.errors import UserError, run_cli

USAGE = "usage: python -m nanotext.verify OUTPUT_DIR"


def check_step(manager, step: int) -> tuple:
  """(status, detail) of one step: intact, unverified (written before checksums) or damaged."""
  where = checkpoint.step_dir(manager, step)
  try:
    state, integrity = checkpoint.read_on_one_device(manager, step)
    checkpoint.verify(state, integrity, where)
  except checkpoint.Damaged as e:
    return "damaged", str(e)
  leaves = jax.tree.leaves(state)
  size = sum(np.dtype(x.dtype).itemsize * x.size for x in leaves) / 2**20
  if not (integrity or {}).get("checksums"):
    return "unverified", f"{len(leaves)} arrays, {size:,.1f} MiB read; no checksums saved with it"
  return "intact", f"{len(leaves)} arrays, {size:,.1f} MiB, every checksum matches"


def report(out: str, log=print) -> int:
  """Print one line per step (newest first) and what else lies in checkpoints/; the exit status."""
  root = checkpoint.checkpoint_dir(out)
  if not os.path.isdir(root):
    raise UserError(f"'{out}' holds no checkpoints/ directory (is it a nanotext run directory?)")
  manager = checkpoint.make_manager(out, keep=1, create=False)
  steps = sorted(manager.all_steps(), reverse=True)
  log(f"{len(steps)} checkpoint(s) in {root}" + (", newest first:" if steps else ""))
  damaged = 0
  for step in steps:
    status, detail = check_step(manager, step)
    damaged += status == "damaged"
    log(f"  step {step:>7d}  {status:<10s}  {detail}")
  unfinished = sorted(n for n in os.listdir(root) if "orbax-checkpoint-tmp" in n)
  for name in unfinished:
    log(f"  {name}: a save that never finished; ignored by a resume, removed by the next save")
  quarantined = os.path.join(out, "damaged")
  if os.path.isdir(quarantined) and os.listdir(quarantined):
    log(f"  {quarantined}: {len(os.listdir(quarantined))} step(s) a resume found damaged and "
        "set aside (kept for you to inspect or delete)")
  checkpoint.close(manager)
  if damaged:
    log(f"{damaged} damaged step(s): a resume never restores them; it uses the newest intact step")
  return 1 if damaged else 0


def main(argv) -> None:
  args = [a for a in argv if a]
  if len(args) != 1 or args[0].startswith("-"):
    raise UserError(USAGE)
  out = args[0].split("=", 1)[1] if args[0].startswith("output_dir=") else args[0]
  sys.exit(report(out))


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
