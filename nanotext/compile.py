"""Fit before you fly: `python -m nanotext.compile CONFIG [key=value ...] --topology=NAME
[--programs=all] [--json=FILE] [--hlo_dir=DIR] [--min_headroom=0.1] [--peak] [--passes=N]`.

Compiles every program a run would compile (the train programs: one per attention-window stage, or
one for all stages with a kernel that takes the windows at run time; and the eval programs, one per
window stage validation runs at with train.eval_windows=step, or one for all of them) for a
TPU slice (libtpu) or a GPU host (the jax CUDA plugin), on any machine, and prints per program the
memory per device against what the device lets a program use, analytic and XLA FLOPs, the
collectives, the kernel inventory (launches by kind, passes over logits-sized arrays) and a
roofline estimate of the step (with --peak, the values alive at its peak; with --passes, the
estimate's slowest non-GEMM passes by jax op), then one verdict line. Exit 0 if every program
fits with the headroom asked for; 2 (one line naming the bytes and the keys that help) if one
does not; 1 if one fails to compile.
"""

import json
import math
import os
import re
import time

from absl import flags

from nanotext import gpus, hlo_memory, metrics, probes, roofline, topology
from nanotext.compile_report import describe, gib, verdict
from nanotext.errors import UserError, fail, os_error
from nanotext.fileio import atomic_write
from nanotext.hlo import collectives
from nanotext.program_names import check_programs, is_eval, programs, select


def define_flags():
  """The CLI's flags (defined only when run as a program, so importers keep their own)."""
  flags.DEFINE_string("topology", "", "What to compile for: a TPU slice (v6e-8, v5p-16) or GPUs "
                      "on one host (h100, h100-8, h200, a100-80gb, b200).")
  flags.DEFINE_string("programs", "all", "Which programs: all, or a comma list of first, last "
                      "(train window stages), eval (the final evaluation's), or program names "
                      "as printed (train@1792, eval@1792).")
  flags.DEFINE_string("json", "", "Write one JSON record per program to this file.")
  flags.DEFINE_string("hlo_dir", "", "Write each program's optimized HLO text to DIR/NAME.hlo "
                      "and XLA's dumps (buffer assignment, memory-usage report) to DIR/NAME/.")
  flags.DEFINE_bool("peak", False, "Also print the largest values alive at each program's peak, "
                    "from a live-range walk of its scheduled HLO (where the memory goes).")
  flags.DEFINE_integer("passes", 0, "Also list the N slowest non-GEMM passes of each program's "
                       "step estimate by jax op (ms, launches, MiB a launch moves): where its "
                       "time goes beyond GEMMs and custom kernels.")
  flags.DEFINE_float("min_headroom", 0.10, "Fraction of HBM a program must leave free to count "
                     "as fitting: the compiler's accounting leaves out runtime buffers and "
                     "fragmentation.")


_OOM_RE = re.compile(r"required for HLO temporaries \(([0-9.]+)([KMGT])\) exceeds available "
                     r"HBM \(([0-9.]+)([KMGT])\)")
_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def abstract_batch(run, evaluation: bool = False) -> dict:
  """ShapeDtypeStructs of one global batch (validation rows are train.eval_seq_len long),
  sharded as the data pipeline delivers it."""
  import jax
  t = run.cfg.train
  shape = (t.batch_size, (t.eval_seq_len or t.seq_len) if evaluation else t.seq_len)
  spec = jax.ShapeDtypeStruct(shape, jax.numpy.int32, sharding=run.batch_sharding)
  return {"inputs": spec, "targets": spec}


def compile_program(run, name, program, memory_bytes: int, min_headroom: float = 0.0,
                    peaks=None, hlo_dir: str = "", peak: bool = False) -> dict:
  """Compile one program (a window_schedule.Program) for the run's devices; its record. An HBM
  overflow, or a failure at any stage (`error`, `stage`: trace, lowering, XLA), is one too."""
  from nanotext import gpus, trainer
  from nanotext.programs import compile_showing, windows_args
  state = run.abstract_state()
  rec = {"name": name, "hbm_bytes_per_chip": memory_bytes, "platform": run.backend}
  if run.memory is not None:  # nanotext.memory's estimate, beside what the compiler says
    rec["estimate_bytes_per_chip"] = planned_bytes(run, name, program)
  train = not is_eval(name)
  if not train:
    jitted = trainer.make_eval_step(run, program.windows, runtime=program.runtime)
    args = (state["params"], abstract_batch(run, evaluation=True))
  else:
    jitted = trainer.make_train_step(run, program.windows, program.seq_len,
                                     runtime=program.runtime)
    args = (state, abstract_batch(run))
  args += windows_args(run, program)
  options = gpus.COMPILER_OPTIONS if run.backend == "gpu" else None
  if hlo_dir:  # XLA's own dumps, as options: libtpu reads no XLA_FLAGS
    options = dict(options or {}, xla_dump_to=f"{hlo_dir}/{name}", xla_dump_hlo_as_text=True)
  t0, cpu0 = time.perf_counter(), time.process_time()
  stage = "trace"
  try:
    traced = jitted.trace(*args)
    stage = "lowering"
    lowered = traced.lower()
    stage = "XLA"
    compiled = compile_showing(lowered, run.backend, options, f"compiling {name}")
  except UserError:
    raise
  except Exception as e:  # noqa: BLE001 -- an overflow or a failure is this program's result
    rec["compile_s"] = time.perf_counter() - t0
    m = _OOM_RE.search(str(e))
    if "RESOURCE_EXHAUSTED" in str(e) and m:
      rec.update(fits=False, overflow=True,
                 total_bytes_per_chip=int(float(m.group(1)) * _UNITS[m.group(2)]),
                 hbm_bytes_per_chip=int(float(m.group(3)) * _UNITS[m.group(4)]))
    else:
      rec.update(fits=False, error=_first_line(e), stage=stage)
    return rec
  # Wall seconds, and this process's CPU seconds (what the compile cost whatever else runs).
  rec["compile_s"], rec["compile_cpu_s"] = time.perf_counter() - t0, time.process_time() - cpu0
  if hlo_dir:
    path = os.path.join(hlo_dir, f"{name}.hlo")
    try:  # (atomic_write makes the folder)
      atomic_write(path, [compiled.as_text().encode()])
    except OSError as e:
      raise os_error(e, f"cannot write --hlo_dir file '{path}'") from None
  rec.update(measure(compiled, peaks, *logits_size(run, program, train),
                     attention_flops(run, program, train), peak=peak))
  rec["headroom"] = 1.0 - rec["total_bytes_per_chip"] / memory_bytes
  rec["fits"] = rec["headroom"] >= min_headroom
  rec["flops_analytic_per_chip"] = analytic_flops(run, program, train=train)
  return rec


def planned_bytes(run, name: str, program) -> int:
  """The memory plan's estimate of one program: the eval step, the train step at its widest
  stage, or a shorter train.seq_len_start stage at its own row length (the plan chooses remat
  and loss chunks for the widest; a shorter stage's program is smaller)."""
  plan, t = run.memory, run.cfg.train
  if is_eval(name):
    return plan.eval.total
  if not program.seq_len or program.seq_len >= t.seq_len:
    return plan.train.total
  from nanotext import memory
  model = memory.model_of(run.cfg, run.backend, dict(run.mesh.shape),
                          gpus.gemm_workspace(run.mesh.devices.flat[0]))
  return model.train(run.cfg.model.remat, t.loss_chunk, program.seq_len).total


def _first_line(e: Exception) -> str:
  lines = [l.strip() for l in str(e).splitlines() if l.strip()]
  return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def measure(compiled, peaks=None, logits=0, logits_bytes=0.0, vocab=0, custom_flops=0.0,
            peak=False) -> dict:
  """Per-chip memory, XLA's FLOPs and bytes, collectives, Mosaic kernels; with `peaks` the
  roofline.inventory of the kernels (every pass by jax op, slowest first), with `peak` what is
  alive at the peak (hlo_memory)."""
  mem = compiled.memory_analysis()
  rec = {k: int(getattr(mem, f"{k}_size_in_bytes")) for k in
         ("argument", "output", "alias", "temp", "generated_code")}
  # Donated inputs come back as outputs in the same buffers (alias): count them once.
  rec["total_bytes_per_chip"] = (rec["argument"] + rec["output"] - rec["alias"] + rec["temp"]
                                 + rec["generated_code"])
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost or {}
  # Not optimal_seconds: with a topology description instead of chips it comes out negative.
  rec["flops_xla_per_chip"] = float(cost.get("flops", float("nan")))
  rec["bytes_accessed_per_chip"] = float(cost.get("bytes accessed", float("nan")))
  text = compiled.as_text()
  rec["collectives"] = collectives(text)
  rec["tpu_custom_calls"] = text.count('custom_call_target="tpu_custom_call"')
  if peaks is not None:
    rec["kernels"] = roofline.inventory(text, peaks, logits_elements=logits,
                                   logits_bytes=logits_bytes, vocab=vocab,
                                   custom_flops=custom_flops, top=None)
  if peak:
    rec["live_peak_bytes"], rec["live_at_peak"] = hlo_memory.record(text)
  return rec


def logits_size(run, program, train: bool) -> tuple:
  """(elements of the logits one head kernel works on, bytes of one device's whole bf16
  [tokens, vocab] logits over the step's micro-batches, vocab per device) in train or eval
  `program` (a sequence-length warmup stage cuts each row into train.seq_len // its rows)."""
  from nanotext import sharding
  from nanotext.model.head_loss import slices
  t, m = run.cfg.train, run.cfg.model
  length = program.seq_len or (t.seq_len if train else (t.eval_seq_len or t.seq_len))
  cut = max(1, t.seq_len // length) if train else 1
  # Micro-batches, one after another: a warmup stage's step runs cut times as many.
  passes = t.grad_accum * cut if train else max(1, t.eval_accum)
  every = max(1, t.batch_size // sharding.shard_count(("batch",), run.rules, dict(run.mesh.shape)))
  rows = max(1, every * cut // passes)
  vocab = m.vocab_size // sharding.shard_count(("act_vocab",), run.rules, dict(run.mesh.shape))
  chunk = t.loss_chunk if train else t.eval_loss_chunk
  positions = chunk if 0 < chunk < length else length
  per_slice = rows * positions * vocab // slices(rows, positions, vocab, run.backend)
  return per_slice, every * cut * length * vocab * 2, vocab


def attention_flops(run, program, train: bool) -> float:
  """Analytic attention FLOPs per device of one step of `program` (forward, x3 for training):
  what the custom attention kernels compute, which their HLO does not show."""
  cfg = run.cfg
  length = program.seq_len if train else (cfg.train.eval_seq_len or cfg.train.seq_len)
  tokens = cfg.train.batch_size * (cfg.train.seq_len if train else length)
  per_token = metrics.attention_flops_per_token(cfg.model, length, program.windows)
  return per_token * tokens * (3 if train else 1) / run.mesh.size


def analytic_flops(run, program, *, train: bool) -> float:
  """Model FLOPs per chip of one step (6N + attention per token; forward only for eval) at the
  program's windows (with runtime windows, their bounds: its largest step)."""
  cfg = run.cfg
  tokens = cfg.train.batch_size * (cfg.train.seq_len if train else program.seq_len)
  per_token = metrics.flops_per_token(cfg.model, program.seq_len, program.windows)
  return per_token * tokens / run.mesh.size / (1 if train else 3)


def run_compile(path, overrides, target_name, which="all", min_headroom=0.10, log=print,
                hlo_dir="", peak=False, passes=0):
  """Build the run for the target and compile the selected programs; (run, target, records)."""
  from nanotext import rundir, sharding, wiring
  from nanotext.model.kernels.dispatch import config_impl
  target = topology.parse(target_name)
  devices = topology.devices(target)
  # A saved run's config.yml compiles as it resumes: a fresh start's own rules are not its.
  cfg = wiring.load(path, overrides, not rundir.has_checkpoint(os.path.dirname(path)))
  select(programs(cfg, config_impl(cfg, devices[0].platform)), which)  # before plan and build
  try:
    run = wiring.from_config(cfg, devices=devices, checked=True, log=log)
  except sharding.MeshSizeError as e:  # v4-8 counts TensorCores: 4 devices, not a mesh of 8
    cores = getattr(getattr(target, "chip", None), "cores_per_chip", 1)
    if cores == 1:
      raise
    raise UserError(f"{e} ({target.name} names {len(devices) * cores} TensorCores: "
                    f"{len(devices)} chips of {cores}, each chip one device)") from None
  t, note = run.cfg.train, sharding.unused_note(run.mesh, run.rules, run.axes)
  log(f"compiling {path} for {target.name} ({len(devices)} x {devices[0].device_kind}, "
      f"{gib(target.memory_bytes)} each: {target.memory_what}): mesh {sharding.describe(run.mesh)}"
      f"{note}, attention {run.impl}, {t.batch_size} x {t.seq_len} tokens per step, grad_accum "
      f"{t.grad_accum}, remat {run.cfg.model.remat}, loss_chunk {t.loss_chunk}")
  if run.cfg.attention.impl == "auto" and run.impl == "xla" and isinstance(target, gpus.GpuHost):
    from nanotext.model.kernels import cudnn
    why = cudnn.problem(run.cfg.model.head_dim, run.cfg.train.seq_len)
    if why:  # e.g. no cuDNN library on this host: the GPU itself would run another program
      log(f"note: attention auto took xla, as cuDNN's attention does not build here ("
          f"{why.splitlines()[0][:120]}); where it does, auto takes cudnn")
  log(run.memory.line())
  chosen = select(programs(run.cfg, run.impl), which)
  run.memory.require(*{"eval" if is_eval(name) else "train" for name, _, _ in chosen})
  recs = []
  for name, program, steps in chosen:
    rec = compile_program(run, name, program, target.memory_bytes, min_headroom, target.peaks,
                          hlo_dir, peak)
    rec.update(steps=steps, windows=list(program.windows), runtime_windows=program.runtime,
               seq_len=program.seq_len, target=target.name)
    recs.append(rec)
    log(describe(rec, passes))
  return run, target, recs


USAGE = ("usage: python -m nanotext.compile CONFIG [key=value ...] --topology=NAME "
         "[--programs=all] [--json=FILE] [--hlo_dir=DIR] [--min_headroom=0.1] [--peak] "
         "[--passes=N]")


def precheck(args):
  """The flags, the target's name and the config, checked before jax loads."""
  from nanotext import cli, config
  f = flags.FLAGS
  if not args or not cli.names_config(args[0]):
    raise UserError(f"no config file given; {USAGE}")
  if not f.topology:
    raise UserError(f"--topology is required; known: {', '.join(topology.known())}")
  if not 0 <= f.min_headroom < 1:
    raise UserError(f"--min_headroom={f.min_headroom} must be in [0, 1)")
  if f.passes < 0:
    raise UserError(f"--passes={f.passes} must be 0 (none listed) or more")
  if isinstance(topology.parse(f.topology), gpus.GpuHost):
    gpus.pool_fraction()  # a bad value: before the CUDA plugin fails on it with other words
  check_programs(config.load(args[0], args[1:]), f.programs)
  if f.json:  # before minutes of compiling, not after
    probes.replaceable(f.json, "--json")
    probes.writable_dir(os.path.dirname(os.path.abspath(f.json)), "the folder of --json")
  if f.json and os.path.realpath(f.json) in {c for c, _ in config.file_chain(args[0])}:
    raise UserError(f"--json '{f.json}' is the config file it compiles (or one it inherits "
                    "from): give the JSON file another path")
  if f.json and f.hlo_dir and os.path.abspath(f.json) == os.path.abspath(f.hlo_dir):
    raise UserError(f"--json and --hlo_dir are both '{f.json}': give the JSON file another path")
  if f.hlo_dir:
    probes.writable_dir(f.hlo_dir, "--hlo_dir")


def finite(x):
  """`x` with every NaN or infinity in it as None: JSON has no NaN (XLA gives no cost for a GPU)."""
  if isinstance(x, dict):
    return {k: finite(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [finite(v) for v in x]
  return None if isinstance(x, float) and not math.isfinite(x) else x


def main(args):
  """The CLI: `args` are CONFIG and its overrides (absl has taken the flags)."""
  f = flags.FLAGS
  run, target, recs = run_compile(args[0], args[1:], f.topology, f.programs, f.min_headroom,
                                  lambda s: print(s, flush=True), f.hlo_dir, f.peak, f.passes)
  if f.json:  # whole or not at all: a full disk is one line, no half-written file
    try:
      atomic_write(f.json, [(json.dumps(finite(rec), allow_nan=False) + "\n").encode()
                            for rec in recs])
    except OSError as e:
      raise os_error(e, f"cannot write --json '{f.json}'") from None
  ok, line = verdict(recs, target.name, f.min_headroom)
  if any(r.get("error") for r in recs):
    fail(line, 1)
  if not ok:
    from nanotext.memory_plan import keys_that_help
    bad = ["eval" if is_eval(r["name"]) else "train" for r in recs if not r["fits"]]
    fail(f"{line}; try {keys_that_help(run.cfg, dict(run.mesh.shape), bad)}")
  print(line)


if __name__ == "__main__":
  from nanotext import cli
  # This process only compiles: it never opens the host's accelerators (chips a run may be using).
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  define_flags()
  cli.run(main, USAGE, __doc__, jax=True, precheck=precheck)
