"""The memory estimate against the compiler: `python benchmarks/memory_estimate.py [--topology=v6e-1]
[--cases=small|mid|full] [--only="NAME;NAME"]`.

For each case, nanotext.memory's per-device estimate of the train and eval programs (what the
memory plan decides by) beside XLA's accounting of the same programs compiled for this host's CPU
(default) or a TPU slice (libtpu, nothing runs): arguments + outputs - aliased + temporaries.
Prints one markdown table. Eval programs run rows of train.seq_len here (eval_seq_len=0). Case
names hold commas, so --only separates them with ';'. A case needing more devices than there are
is a row saying so.
"""

import os
import time

from absl import flags


SMALL = ["model.num_layers=4", "model.d_model=128", "model.num_heads=2", "model.head_dim=64",
         "model.mlp_dim=512", "model.vocab_size=1024", "model.align=0", "train.seq_len=512",
         "train.batch_size=8", "attention.window=256", "attention.window_start=128",
         "attention.window_block=64"]
MID = ["model.num_layers=4", "model.d_model=256", "model.num_heads=2", "model.head_dim=128",
       "model.mlp_dim=1024", "model.vocab_size=8192", "model.align=0", "train.seq_len=8192",
       "train.batch_size=2", "attention.window=1024", "attention.window_start=128",
       "attention.window_block=128"]
SR, BASE = "configs/speedrun.yml", "configs/base.yml"
PORT, REC = "configs/modded_nanogpt_jax.yml", "configs/speedrun_record.yml"


def lean(remat, chunk):
  return [f"model.remat={remat}", f"train.loss_chunk={chunk}", f"train.eval_loss_chunk={chunk}"]


CASES = {
    "small": [
        ("speedrun small, none/0", SR, SMALL + lean("none", 0), 1),
        ("speedrun small, none/128", SR, SMALL + lean("none", 128), 1),
        ("speedrun small, xla attention", SR, SMALL + lean("none", 0) + ["attention.impl=xla"],
         1),
        ("speedrun small, grad_accum 2", SR, SMALL + lean("none", 0) +
         ["train.grad_accum=2", "train.batch_size=16"], 1),
        ("speedrun small, fsdp 8", SR, SMALL + lean("none", 0) + ["train.batch_size=16"], 8),
        ("base, none/0", BASE, ["model.num_layers=4", "train.batch_size=16",
                                "train.seq_len=256"] + lean("none", 0), 1),
        ("base, dots/64", BASE, ["model.num_layers=4", "train.batch_size=16",
                                 "train.seq_len=256"] + lean("dots", 64), 1),
        ("port small, grad_accum 2", PORT, SMALL[:7] + ["train.seq_len=512",
                                                        "train.seq_len_start=0",
                                                        "train.batch_size=16",
                                                        "train.grad_accum=2"] + lean("none", 0),
         1),
    ],
    "mid": [(f"speedrun mid, {r}/{c}", SR, MID + lean(r, c), 1)
            for r, c in (("none", 0), ("dots", 0), ("none", 256), ("dots", 256))],
    "full": [
        ("record, 1 row, none/0", REC, ["train.batch_size=1"] + lean("none", 0), 1),
        ("record, 1 row, dots/256", REC, ["train.batch_size=1"] + lean("dots", 256), 1),
        ("speedrun, fsdp 8, none/256", SR, lean("none", 256), 8),
        ("speedrun, fsdp 8, dots/256", SR, lean("dots", 256), 8),
    ],
}


def compiled_bytes(run, program: str):
  """XLA's per-device bytes of the program, or the bytes its RESOURCE_EXHAUSTED names: the final
  eval program, or the last train program (the final windows and full rows, the widest)."""
  from nanotext import compile as nt_compile
  from nanotext.program_names import is_eval
  chosen = [(name, p) for name, p, _ in nt_compile.programs(run.cfg, run.impl)
            if is_eval(name) == (program == "eval")][-1]
  rec = nt_compile.compile_program(run, *chosen, 2**60)
  return rec["total_bytes_per_chip"], rec["compile_s"]


def define_flags():
  """The script's flags (defined only when run as a script: tests import it by path)."""
  flags.DEFINE_string("topology", "", "Compile for this TPU slice instead of the CPU.")
  flags.DEFINE_string("cases", "small", "small (CPU, seconds), mid or full (TPU sizes).")
  flags.DEFINE_string("only", "", "Case names to run, separated by ';' (the names hold commas).")


USAGE = ("usage: python benchmarks/memory_estimate.py [--topology=v6e-1] [--cases=small|mid|full] "
         "[--only=\"NAME;NAME\"]")


def select(cases: str, only: str) -> list:
  """The cases of --cases=`cases` named in `only` (';'-separated; empty: all); UserError for an
  unknown group or name, listing the known ones."""
  from nanotext.errors import UserError
  if cases not in CASES:
    raise UserError(f"--cases={cases}: choose one of {', '.join(CASES)}")
  names = [n.strip() for n in only.split(";") if n.strip()]
  known = [c[0] for c in CASES[cases]]
  unknown = [n for n in names if n not in known]
  if unknown:
    raise UserError(f"--only: no case '{unknown[0]}' in --cases={cases}; its cases: "
                    f"{'; '.join(known)}")
  return [c for c in CASES[cases] if not names or c[0] in names]


def main(argv):
  from nanotext.errors import UserError
  f = flags.FLAGS
  if len(argv) > 1:
    raise UserError(f"unexpected argument '{argv[1]}'; {USAGE}")
  chosen = select(f.cases, f.only)
  import jax
  from nanotext import topology, wiring
  devices = jax.devices()
  where = f"{jax.devices()[0].platform} ({len(devices)} devices)"
  if f.topology:
    devices = topology.devices(topology.parse(f.topology))
    where = f"{f.topology} ({devices[0].device_kind}, compiled with libtpu, not run)"
  print(f"Estimate vs compiled, bytes per device, {where}:\n")
  print("| case | program | estimate | compiled | estimate / compiled | compile |")
  print("| --- | --- | --- | --- | --- | --- |")
  from nanotext.memory import gib
  for name, path, overrides, n in chosen:
    if n > len(devices):
      print(f"| {name} | - | needs {n} devices, there are {len(devices)} (on the CPU: "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n}) | | | |")
      continue
    run = wiring.prepare(path, overrides + ["data.source=synthetic", "data.tokenizer=none",
                                            "data.eot_id=0", "train.eval_seq_len=0"],
                         devices=devices[:n], capacity=2**60)
    for program, est in (("train", run.memory.train), ("eval", run.memory.eval)):
      t0 = time.perf_counter()
      try:
        got, _ = compiled_bytes(run, program)
      except Exception as e:  # noqa: BLE001 -- an overflow without a parsable size
        print(f"| {name} | {program} | {gib(est.total)} | failed: {str(e)[:60]} | | |")
        continue
      print(f"| {name} | {program} | {gib(est.total)} | {gib(got)} | {est.total / got:.2f} | "
            f"{time.perf_counter() - t0:.0f} s |", flush=True)


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import bench_cli
  define_flags()
  bench_cli.run(main, USAGE, __doc__)
