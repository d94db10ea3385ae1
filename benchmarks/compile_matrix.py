"""Every shipped config compiled for GPU and TPU targets on this machine (nanotext.compile), one
table: `python benchmarks/compile_matrix.py [--targets=h100,v6e-8] [--configs=...] [--json=FILE]`.

Per config, target and program: memory compiled against the memory plan's estimate and the
device, launches (ops on a TPU), the roofline estimate of the step (a lower bound, not a
measured time) and compile seconds, wall and CPU. Speedrun configs run at their per-device
shape: on a one-GPU target, one row per GPU as the record (`train.batch_size=1`); on a slice, as
shipped. Needs the tpu and gpu-compile extras.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CONFIGS = ("speedrun_record.yml", "speedrun.yml", "modded_nanogpt_jax.yml", "shakespeare.yml",
           "base.yml")
ONE_ROW = ("speedrun_record.yml", "speedrun.yml")  # one 49,152-token row per device


def overrides(config: str, target) -> list:
  """The per-device shape of `config` on `target`."""
  if config in ONE_ROW and target.platform == "gpu":
    return [f"train.batch_size={target.num_chips}"]
  return []


def run(targets, configs, programs="first,last,eval", log=print) -> list:
  """Records of nanotext.compile for each target and config (an error is a record too)."""
  import jax
  from nanotext import compile as nt_compile, topology
  from nanotext.errors import UserError
  out = []
  for name in targets:
    target = topology.parse(name)
    for config in configs:
      extra = overrides(config, target)
      path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs",
                          config)
      try:
        _, _, recs = nt_compile.run_compile(path, extra, name, programs, log=lambda s: None)
      except UserError as e:
        recs = [{"name": "-", "error": str(e), "stage": "plan"}]
      for r in recs:
        r.update(config=" ".join([config, *extra]), jax=jax.__version__)
        out.append(r)
        log(row(r))
  return out


def row(r: dict) -> str:
  """One table row."""
  gib = lambda b: f"{b / 2**30:.2f}"
  head = f"| `{r['config']}` | {r.get('target', '-')} | {r['name']} |"
  if r.get("error"):
    return head + f" failed ({r['stage']}): {r['error'][:80]} |" + " |" * 4
  k = r.get("kernels", {})
  est = r.get("estimate_bytes_per_chip")
  ratio = f" ({est / r['total_bytes_per_chip']:.2f})" if est else ""
  return (head + f" {gib(r['total_bytes_per_chip'])} / {gib(est) if est else '-'}{ratio} | "
          f"{100 * r.get('headroom', 0):.1f}% | {k.get('launches', '-')} | "
          f"{1e3 * k.get('estimate_s', 0):.1f} | {r['compile_s']:.0f} / "
          f"{r.get('compile_cpu_s', 0):.0f} |")


HEADER = ("| config | target | program | GiB per device: compiled / planned (ratio) | headroom | "
          "launches (TPU: ops) | step estimate, ms (lower bound) | compile s: wall / CPU |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")


USAGE = ("usage: python benchmarks/compile_matrix.py [--targets=h100,v6e-8] [--configs=...] "
         "[--programs=...] [--json=FILE]")


def main(argv):
  from absl import flags
  import bench_cli
  from nanotext import topology
  from nanotext.errors import UserError
  f = flags.FLAGS
  if len(argv) > 1:
    raise UserError(f"unexpected argument '{argv[1]}'; {USAGE}")
  for target in [t for t in f.targets.split(",") if t]:
    topology.parse(target)
  for config in [c for c in f.configs.split(",") if c]:
    bench_cli.existing_file(os.path.join(bench_cli.REPO, "configs", config), "--configs:")
  if f.json:
    bench_cli.writable_file(f.json, "--json")
  print(HEADER, flush=True)
  recs = run([t for t in f.targets.split(",") if t], [c for c in f.configs.split(",") if c],
             f.programs, log=lambda s: print(s, flush=True))
  if f.json:
    with open(f.json, "w") as out:
      out.writelines(json.dumps(r) + "\n" for r in recs)


def define_flags():
  from absl import flags
  flags.DEFINE_string("targets", "h100,v6e-8", "Comma list of nanotext.compile targets.")
  flags.DEFINE_string("configs", ",".join(CONFIGS), "Comma list of configs/ files.")
  flags.DEFINE_string("programs", "first,last,eval", "Programs of each run (nanotext.compile).")
  flags.DEFINE_string("json", "", "Also write every record as a JSON line to this file.")


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  define_flags()
  import bench_cli
  bench_cli.run(main, USAGE, __doc__)
