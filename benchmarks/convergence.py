"""Convergence: `python benchmarks/convergence.py [--steps N] [--out PREFIX]`.

Trains the speedrun recipe (configs/speedrun.yml) and the AdamW GPT-2 baseline (configs/base.yml)
at the same small model size, tokens per step and step count on the embedded Shakespeare corpus,
in-process through `nanotext.train.run`, each into its own temporary output_dir, evaluating both
on the same validation batches. Writes PREFIX.png (validation loss vs step) and PREFIX.md: each
recipe's final validation loss, and how many steps the speedrun recipe needs to reach the
baseline's final validation loss (interpolated between evaluations), with the ratio to the
baseline's step count. The recipe keys come from the config files, so recipe changes show up here.
Both configs are built with the shared overrides (their validation data included) before either
trains. PREFIX defaults to ./convergence; the committed report is benchmarks/convergence.
"""

import json
import os
import sys
import tempfile
import time

from absl import flags, logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The current directory: benchmarks/convergence (the committed report) only when asked for.
DEFAULT_OUT = "convergence"


def _define_flags() -> None:
  # Defined only when run as a script: tests import several benchmarks into one absl registry.
  flags.DEFINE_integer("steps", 200, "Optimizer steps of each run.")
  flags.DEFINE_integer("batch_size", 16, "Sequences per step (both runs).")
  flags.DEFINE_integer("seq_len", 128, "Tokens per sequence (both runs).")
  flags.DEFINE_integer("eval_every", 10, "Steps between validations.")
  flags.DEFINE_integer("eval_batches", 8, "Validation batches per evaluation.")
  flags.DEFINE_string("out", DEFAULT_OUT,
                      "Output prefix: writes PREFIX.png and PREFIX.md (benchmarks/convergence "
                      "is the committed report).")


# One model size for both recipes (the speedrun's own shape is far too big for 2 CPU cores).
SIZE = ["model.num_layers=4", "model.d_model=256", "model.num_heads=2", "model.head_dim=128",
        "model.mlp_dim=1024", "model.vocab_size=8192", "model.dtype=float32"]
RECIPES = (("baseline (AdamW GPT-2)", "configs/base.yml"),
           ("speedrun recipe", "configs/speedrun.yml"))


def common_overrides(*, steps, batch_size, seq_len, eval_every, eval_batches) -> list:
  """Overrides shared by both runs: size, data, schedule length, evaluation; no side outputs."""
  return SIZE + [
      f"train.steps={steps}", f"train.batch_size={batch_size}", f"train.seq_len={seq_len}",
      f"train.eval_every={eval_every}", f"train.eval_batches={eval_batches}",
      f"train.log_every={max(eval_every, 1)}", "train.grad_accum=1", "train.eval_seq_len=0",
      "data.source=shakespeare", "data.tokenizer=shakespeare", "data.val_tokens=0", "data.dir=",
      "checkpoint.every=0", "metrics.tensorboard=false", "sample.max_new_tokens=0", "seed=0"]


def val_curve(metrics_path) -> list:
  """[(step, val_loss)] from a metrics.jsonl, in step order."""
  curve = {}
  with open(metrics_path) as f:
    for line in f:
      row = json.loads(line)
      if "val_loss" in row:
        curve[int(row["step"])] = float(row["val_loss"])
  return sorted(curve.items())


def steps_to_reach(curve, target):
  """First step where the curve reaches `target`, linearly interpolated; None if it never does.

  Before the first evaluation nothing is known, so a curve already at the target there returns
  that evaluation's step (an upper bound).
  """
  prev = None
  for step, loss in curve:
    if loss <= target:
      if prev is None:
        return float(step)
      (s0, l0) = prev
      return s0 + (step - s0) * (l0 - target) / (l0 - loss)
    prev = (step, loss)
  return None


def check_recipes(overrides) -> None:
  """Build both runs and their validation batches before either trains: a recipe the overrides
  do not fit is refused (UserError) before the other's minutes of training are spent."""
  from nanotext import wiring
  for _, path in RECIPES:
    run = wiring.from_config(wiring.load(os.path.join(REPO, path), overrides), checked=True)
    run.val_batches()


def run_recipe(path, overrides, out_dir, tag):
  """Train one recipe in-process; returns (val curve, wall seconds)."""
  from nanotext import train
  t0 = time.perf_counter()
  train.run(path, list(overrides) + [f"output_dir={out_dir}"],
            log=lambda s: print(f"[{tag}] {s}", flush=True))
  return val_curve(os.path.join(out_dir, "metrics.jsonl")), time.perf_counter() - t0


def plot(curves, target, reach, path) -> None:
  """Validation loss vs step for both recipes, the baseline's final loss marked."""
  import matplotlib
  matplotlib.use("Agg")  # files only; no display on benchmark machines
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for (name, curve), color in zip(curves.items(), ("tab:blue", "tab:red")):
    ax.plot(*zip(*curve), marker="o", ms=3, color=color, label=name)
  ax.axhline(target, color="gray", ls="--", lw=1, label=f"baseline final {target:.3f}")
  if reach is not None:
    ax.axvline(reach, color="tab:red", ls=":", lw=1, label=f"speedrun reaches it by {reach:.0f}")
  ax.set_xlabel("step")
  ax.set_ylabel("validation loss (nats/token)")
  ax.set_title("Shakespeare, 4 layers x 256, same tokens per step")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def report(curves, walls, settings, command, image="convergence.png") -> str:
  """The markdown summary: settings, final losses, steps-to-target and ratio, all evaluations."""
  import jax
  (base_name, base), (sr_name, sr) = curves.items()
  steps = settings["steps"]
  target = base[-1][1]
  reach = steps_to_reach(sr, target)
  lines = [
      "# Convergence: speedrun recipe vs AdamW GPT-2 baseline", "",
      "```bash", command, "```", "",
      f"Machine: {jax.device_count()} {jax.default_backend()} device(s), {os.cpu_count()} cores, "
      f"jax {jax.__version__}; total wall time {sum(walls.values()):.0f} s (compile and "
      "evaluation included).", "",
      f"Both runs: {' '.join(common_overrides(**settings))}; speedrun: configs/speedrun.yml with "
      "those overrides (its own optimizer, attention and model switches); baseline: "
      "configs/base.yml with the same overrides. Same validation batches, "
      f"{settings['batch_size']} x {settings['seq_len']} = "
      f"{settings['batch_size'] * settings['seq_len']:,} tokens per step, {steps} steps.", "",
      "| recipe | final val loss | steps to reach the baseline's final val loss | wall time |",
      "| --- | --- | --- | --- |",
      f"| {base_name} | {target:.4f} | {steps} | {walls[base_name]:.0f} s |",
  ]
  if reach is None:
    reach_txt, verdict = f"not reached in {steps}", "target (<= 0.5) missed"
  else:
    ratio = reach / steps
    # Below the target at the first evaluation: only an upper bound is known (--eval_every).
    bound = "<= " if sr[0][1] <= target else ""
    reach_txt = f"{bound}{reach:.1f}" + (" (first evaluation)" if bound else "")
    verdict = (f"ratio {bound}{ratio:.2f} of the baseline's steps; target (<= 0.5) "
               f"{'met' if ratio <= 0.5 else 'missed'}")
  lines += [f"| {sr_name} | {sr[-1][1]:.4f} | {reach_txt} | {walls[sr_name]:.0f} s |", "",
            f"Speedrun steps to the baseline's final val loss: {verdict}.", "",
            f"![validation loss vs step]({image})", "",
            "| step | " + " | ".join(curves) + " |", "| --- | --- | --- |"]
  by_step = [dict(c) for c in curves.values()]
  for step in sorted(set().union(*by_step)):
    lines.append(f"| {step} | " + " | ".join(
        f"{c[step]:.4f}" if step in c else "" for c in by_step) + " |")
  return "\n".join(lines) + "\n"


USAGE = "usage: python benchmarks/convergence.py [--steps N] [--out PREFIX]"


def main(argv):
  from nanotext.errors import UserError, fail
  if len(argv) > 1:
    fail(f"unexpected argument {argv[1]!r}; {USAGE}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)  # orbax and grain log every step at INFO
  f = flags.FLAGS
  settings = dict(steps=f.steps, batch_size=f.batch_size, seq_len=f.seq_len,
                  eval_every=f.eval_every, eval_batches=f.eval_batches)
  if min(settings.values()) < 1:
    fail("--steps, --batch_size, --seq_len, --eval_every and --eval_batches must be >= 1")
  import bench_cli
  for suffix in (".md", ".png"):
    bench_cli.writable_file(f.out + suffix, "--out")
  overrides = common_overrides(**settings)
  curves, walls = {}, {}
  try:
    check_recipes(overrides)
    with tempfile.TemporaryDirectory(prefix="nanotext_convergence_") as tmp:
      for i, (name, path) in enumerate(RECIPES):
        curve, wall = run_recipe(os.path.join(REPO, path), overrides,
                                 os.path.join(tmp, str(i)), name.split()[0])
        curves[name], walls[name] = curve, wall
  except UserError as e:
    fail(str(e))
  command = "python benchmarks/convergence.py " + " ".join(argv_flags())
  md = report(curves, walls, settings, command.strip(), os.path.basename(f.out) + ".png")
  base = list(curves.values())[0]
  plot(curves, base[-1][1], steps_to_reach(list(curves.values())[1], base[-1][1]),
       f.out + ".png")
  with open(f.out + ".md", "w") as fh:
    fh.write(md)
  print(md)
  print(f"wrote {f.out}.png and {f.out}.md")


def argv_flags() -> list:
  """This run's non-default flags, for the command line recorded in the report."""
  names = ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "out")
  return [f"--{n}={flags.FLAGS[n].value}" for n in names if flags.FLAGS[n].present]


if __name__ == "__main__":
  _define_flags()
  import bench_cli
  bench_cli.run(main, USAGE, __doc__)
