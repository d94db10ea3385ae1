"""Start-up work before anything compiles, per config: building the model abstractly
(gpt.abstract_model), tracing the init program, and the memory plan:
`python benchmarks/build_time.py [CONFIG ...] [key=value ...] [--target=h100] [--repeats 3]
[--tree DIR ...]`.

Each measurement runs in a fresh process (nothing cached), the trees (nanotext source folders,
default this one) interleaved so machine noise hits them alike; `--tree A --tree B` compares two
checkouts side by side. The plan is made for `--target` (a TPU slice or a GPU, as
`nanotext.compile --topology` takes it), without its accelerator. Prints a markdown table of
medians in seconds.
"""

import json
import os
import statistics
import subprocess
import sys
import time

from absl import flags

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
FLAGS = flags.FLAGS
SYNTHETIC = ["data.source=synthetic", "data.tokenizer=none", "data.eot_id=0"]  # no dataset


def define_flags() -> None:
  """The script's flags, defined only when it runs: tests import benchmarks into one registry."""
  flags.DEFINE_string("target", "h100", "What the memory plan is made for (nanotext.compile's "
                      "--topology).")
  flags.DEFINE_integer("repeats", 3, "Fresh processes per config and tree (median).")
  flags.DEFINE_multi_string("tree", [REPO], "nanotext checkouts to time (their repository root).")


def times(path: str, target: str, overrides=()) -> dict:
  """{'model', 'init trace', 'plan'}: seconds of one fresh build of `path`'s run."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from nanotext import config, topology, wiring
  from nanotext.model.gpt import abstract_model
  cfg = config.load(path, list(overrides))
  out = {}
  t = time.perf_counter()
  abstract_model(cfg, "cpu")
  out["model"] = time.perf_counter() - t
  run = wiring.prepare(path, [*overrides, *SYNTHETIC], devices=jax.devices()[:1])
  t = time.perf_counter()
  jax.jit(lambda s: nnx.to_pure_dict(nnx.state(run.create_model(s)))).trace(jnp.int32(0))
  out["init trace"] = time.perf_counter() - t
  t = time.perf_counter()
  wiring.finalize_plan(cfg, topology.devices(topology.parse(target)))
  out["plan"] = time.perf_counter() - t
  return out


def measure(tree: str, path: str, target: str, overrides: list) -> dict:
  """times() in a fresh process importing nanotext from `tree`."""
  code = ("import sys, json; sys.path[:0] = sys.argv[1:3]; import build_time as b; "
          "print(json.dumps(b.times(sys.argv[3], sys.argv[4], sys.argv[5:])))")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", code, HERE, tree, path, target, *overrides],
                       cwd=tree, env=env, capture_output=True, text=True)
  if out.returncode:
    raise SystemExit(f"{tree}, {path}: {out.stderr.strip().splitlines()[-1]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def table(rows: dict, trees: list) -> str:
  """Markdown: one row per config and tree, the medians of each phase."""
  phases = ["model", "init trace", "plan"]
  lines = ["| config | tree | " + " | ".join(f"{p}, s" for p in phases) + " |",
           "| --- | --- | " + " | ".join("---:" for _ in phases) + " |"]
  for (path, tree), samples in rows.items():
    med = [statistics.median(s[p] for s in samples) for p in phases]
    name = tree if len(trees) > 1 else "this"
    lines.append(f"| `{os.path.basename(path)}` | {name} | "
                 + " | ".join(f"{m:.2f}" for m in med) + " |")
  return "\n".join(lines)


USAGE = ("usage: python benchmarks/build_time.py [CONFIG ...] [key=value ...] [--target=h100] "
         "[--repeats 3] [--tree DIR ...]")


def main(argv):
  import bench_cli
  from nanotext import topology
  from nanotext.errors import UserError
  bench_cli.at_least(1, repeats=FLAGS.repeats)
  topology.parse(FLAGS.target)
  for tree in FLAGS.tree:
    if not os.path.isfile(os.path.join(tree, "nanotext", "__init__.py")):
      raise UserError(f"--tree {tree}: not a nanotext checkout (no nanotext/__init__.py there)")
  for path in [a for a in argv[1:] if "=" not in a]:
    bench_cli.existing_file(path, "config")
  configs = [a for a in argv[1:] if "=" not in a] or \
      [os.path.join(REPO, "configs", "speedrun_record.yml")]
  overrides = [a for a in argv[1:] if "=" in a]
  rows = {}
  for _ in range(FLAGS.repeats):
    for path in configs:
      for tree in FLAGS.tree:
        rows.setdefault((os.path.abspath(path), tree), []).append(
            measure(tree, os.path.abspath(path), FLAGS.target, overrides))
  print(table(rows, FLAGS.tree))


if __name__ == "__main__":
  define_flags()
  import bench_cli
  bench_cli.run(main, USAGE, __doc__)
