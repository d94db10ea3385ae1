"""Parallelism ablation: `python benchmarks/parallelism.py CONFIG [key=value ...] [--layouts L]
[--steps K] [--out PREFIX]` (default PREFIX: parallelism_CONFIGNAME[_TOPOLOGY] in the current
directory; the committed tables are benchmarks/parallelism_*).

Runs the same model, data and seed (data.source=synthetic) under several mesh layouts and writes
`PREFIX.md` (a table) and `PREFIX.png` (bar plots). Per layout: compile time, median step time
and tokens/s, per-device bytes (exact params + optimizer state from the state arrays; arguments,
outputs, temporaries and aliased bytes from the executable's memory_analysis), the loss of each
of the first K steps, and the collectives in the compiled HLO (count, and bytes of their results
per device).

Layout syntax (`--layouts`): a comma list of layouts, each one or more `AXISn` terms joined by
`x`, AXIS in dp (mesh.data), fsdp (mesh.fsdp), tp (mesh.tensor); unnamed axes are 1 and the sizes
must multiply to the device count. Example for 8 devices: `dp8,fsdp8,tp8,fsdp4xtp2,dp2xfsdp2xtp2`
(the default on N devices: dpN, fsdpN, tpN, fsdp{N/2}xtp2, dp2xfsdp{N/4}xtp2 where they fit).
A layout this model cannot use (say heads not divisible by tp) becomes a row saying why.

With `--topology=v6e-8` (any nanotext.compile slice name) nothing runs here: each layout is
compiled for that TPU slice through nanotext.compile (`--programs`, default the last train
program) and `PREFIX.md` gets per-chip memory, collectives and bytes, FLOPs, and a roofline
step-time estimate from the chip's published peaks.
"""

import io
import math
import os
import re
import statistics
import sys
import time

from absl import flags

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(_HERE), _HERE]  # nanotext, and the report beside this file
from nanotext.hlo import collectives  # noqa: E402 -- after the sys.path line
from parallelism_report import plot, report, table, topology_report, topology_table  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The script's flags, defined only when it runs: tests import benchmarks into one registry."""
  flags.DEFINE_string("layouts", "", "Comma list like dp8,fsdp8,fsdp4xtp2; "
                      "empty = the defaults for this device count.")
  flags.DEFINE_integer("steps", 5, "Steps whose losses are recorded (also the warmup).")
  flags.DEFINE_integer("timed_steps", 3, "Steps per timed window.")
  flags.DEFINE_integer("repeats", 3, "Timed windows (the median is reported).")
  flags.DEFINE_string("out", "", "Output prefix (.md, .png); default parallelism_CONFIGNAME "
                      "in the current directory, plus _TOPOLOGY with --topology (a TPU table "
                      "never replaces the CPU run's).")
  flags.DEFINE_string(
      "topology", "", "Compile each layout for this TPU slice (e.g. v6e-8) through "
      "nanotext.compile instead of running it here: memory, collectives, FLOPs and a roofline "
      "estimate, no timing.")
  flags.DEFINE_string("programs", "last", "With --topology: which programs to "
                      "compile per layout (nanotext.compile --programs).")

AXES = {"dp": "data", "fsdp": "fsdp", "tp": "tensor"}


# ---- layouts ----

def parse_layout(text: str, num_devices: int | None = None) -> tuple:
  """'fsdp4xtp2' -> ('fsdp4xtp2', (data, fsdp, tensor)); UserError on bad syntax or size."""
  from nanotext.errors import UserError
  sizes = {"data": 1, "fsdp": 1, "tensor": 1}
  seen = set()
  for term in text.strip().lower().split("x"):
    m = re.fullmatch(r"(dp|fsdp|tp)([1-9][0-9]*)", term)
    if not m or m.group(1) in seen:
      raise UserError(f"layout '{text}' is not like dp8, fsdp4xtp2 or dp2xfsdp2xtp2 "
                      "(terms dpN, fsdpN, tpN joined by 'x', each axis at most once)")
    seen.add(m.group(1))
    sizes[AXES[m.group(1)]] = int(m.group(2))
  shape = (sizes["data"], sizes["fsdp"], sizes["tensor"])
  if num_devices is not None and math.prod(shape) != num_devices:
    raise UserError(f"layout '{text}' uses {math.prod(shape)} devices but there are "
                    f"{num_devices}")
  return layout_name(shape), shape


def layout_name(shape) -> str:
  """(2, 2, 2) -> 'dp2xfsdp2xtp2'; axes of size 1 are left out (all 1 -> 'dp1')."""
  terms = [f"{k}{n}" for k, n in zip(AXES, shape) if n > 1]
  return "x".join(terms) or "dp1"


def parse_layouts(text: str, num_devices: int) -> list:
  """A comma list of layouts (duplicates dropped); empty text -> the defaults."""
  from nanotext.errors import UserError
  if not text.strip():
    return default_layouts(num_devices)
  out = [parse_layout(t, num_devices) for t in text.split(",") if t.strip()]
  if not out:
    raise UserError(f"--layouts '{text}' names no layout")
  return _unique(out)


def default_layouts(n: int) -> list:
  """DP, FSDP, TP over all n devices, then the FSDPxTP and DPxFSDPxTP hybrids where they fit."""
  shapes = [(n, 1, 1), (1, n, 1), (1, 1, n)]
  if n % 2 == 0 and n >= 4:
    shapes.append((1, n // 2, 2))
  if n % 4 == 0 and n >= 8:
    shapes.append((2, n // 4, 2))
  return _unique([(layout_name(s), s) for s in shapes])


def _unique(layouts) -> list:
  seen, out = set(), []
  for name, shape in layouts:
    if shape not in seen:
      seen.add(shape)
      out.append((name, shape))
  return out


# ---- measurement ----

def _scalar(x) -> float:
  """A replicated scalar as a float, reading only a local shard (works on many hosts)."""
  import numpy as np
  return float(np.asarray(x.addressable_data(0)))


def _local_bytes(tree) -> int:
  """Bytes one device holds of a tree of jax.Arrays (first addressable shard of each leaf)."""
  import jax
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def measure_layout(path, overrides, name, shape, *, steps, timed_steps, repeats) -> dict:
  """Compile and run one layout; an invalid layout gives {'invalid': reason}."""
  from nanotext import programs, sharding, trainer, wiring
  from nanotext.errors import UserError

  row = {"layout": name, "shape": shape}
  mesh_kv = [f"mesh.{a}={n}" for a, n in zip(sharding.MESH_AXES, shape)]
  try:  # layout-dependent checks (mesh size, divisibility) make a row, not an exit
    setup = wiring.prepare(path, list(overrides) + mesh_kv)
  except UserError as e:
    return {**row, "invalid": str(e)}
  row["unused"] = sharding.unused_note(setup.mesh, setup.rules, setup.axes)  # in its mesh cell
  cfg, it = setup.cfg, setup.train_iter()
  batches = [trainer.global_batch(setup, next(it)) for _ in range(max(steps, 1))]
  try:
    state = setup.init_state()
    t0 = time.perf_counter()
    compiled = programs.compile_lowered(trainer.make_train_step(setup).lower(state, batches[0]),
                                        setup.backend)
    row["compile_s"] = time.perf_counter() - t0
    schedule = trainer.schedule_of(setup)
    step = lambda state, batch: compiled(state, batch, schedule)
    row["state_bytes"] = _local_bytes((state["params"], state["opt_state"]))
    row["losses"] = []
    for b in batches[:steps]:  # fresh data each step, like training; doubles as warmup
      state, m = step(state, b)
      row["losses"].append(_scalar(m["loss"]))
    row["step_s_all"] = _time_windows(step, state, batches[-1], timed_steps, repeats)
  except Exception as e:  # a layout that does not fit in device memory is a result
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    return {**row, "invalid": "out of memory: " + str(e).splitlines()[0][:200]}
  row["step_s"] = statistics.median(row["step_s_all"])
  row["tokens_per_s"] = cfg.train.batch_size * cfg.train.seq_len / row["step_s"]
  row["memory"] = _memory(compiled)
  row["collectives"] = collectives(compiled.as_text())
  return row


def _time_windows(step, state, batch, timed_steps, repeats) -> list:
  """Seconds per step of each timed window (the state is donated, so it is threaded through)."""
  import jax
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(timed_steps):
      state, m = step(state, batch)
    jax.block_until_ready((state, m))
    times.append((time.perf_counter() - t0) / timed_steps)
  return times


def _memory(compiled) -> dict:
  """Per-device argument / output / temporary / aliased bytes; NaN where the backend is silent."""
  mem = compiled.memory_analysis()
  keys = ("argument", "output", "temp", "alias")
  return {k: float(getattr(mem, f"{k}_size_in_bytes", float("nan")) if mem else float("nan"))
          for k in keys}


def measure(path, overrides, layouts, *, steps=5, timed_steps=3, repeats=3, log=None) -> list:
  """One row per layout; config errors common to all layouts raise UserError first."""
  from nanotext import wiring
  wiring.load(path, list(overrides))  # fail fast on keys and values before any compile
  over = list(overrides) + ["data.source=synthetic"]
  rows = []
  for name, shape in layouts:
    t0 = time.perf_counter()
    rows.append(measure_layout(path, over, name, shape, steps=steps, timed_steps=timed_steps,
                               repeats=repeats))
    if log:
      log(f"{name}: {rows[-1].get('invalid') or 'done'} ({time.perf_counter() - t0:.1f} s)")
  return rows


# ---- compiled for a TPU slice (no chips needed) ----

def measure_topology(path, overrides, slice_name, layouts, which="last", log=None,
                     on_row=None) -> list:
  """One row per layout and program, compiled for `slice_name` by nanotext.compile;
  `on_row(rows)` after each layout (full-size compiles take many minutes each)."""
  from nanotext import compile as nt_compile, config, sharding
  from nanotext.errors import UserError
  config.load(path, list(overrides))  # fail fast on keys and values before any compile
  rows = []
  for name, shape in layouts:
    row = {"layout": name, "shape": shape}
    mesh_kv = [f"mesh.{a}={n}" for a, n in zip(("data", "fsdp", "tensor"), shape)]
    t0 = time.perf_counter()
    try:
      run, sl, recs = nt_compile.run_compile(path, list(overrides) + mesh_kv, slice_name, which,
                                             min_headroom=0.0, log=lambda s: None)
    except UserError as e:  # a layout this model cannot use is a row saying why
      if "topology" in str(e) or "libtpu" in str(e):
        raise
      rows.append({**row, "invalid": str(e)})
      continue
    row["unused"] = sharding.unused_note(run.mesh, run.rules, run.axes)
    rows += [{**row, **rec, "chip": sl.chip} for rec in recs]
    if log:
      log(f"{name}: {len(recs)} program(s) ({time.perf_counter() - t0:.1f} s)")
    if on_row:
      on_row(rows)
  return rows


def default_out(config_path: str, topology: str) -> str:
  """parallelism_NAME[_TOPOLOGY] in the current directory: one per config and target (a TPU
  table never replaces a CPU run's), never the committed benchmarks/ tables unless asked for."""
  name = os.path.splitext(os.path.basename(config_path))[0]
  return f"parallelism_{name}" + (f"_{topology}" if topology else "")


def check_out(out: str, suffixes) -> None:
  """Refuse, before anything is measured, an output prefix whose files cannot be written."""
  from nanotext import probes
  from nanotext.errors import UserError
  for suffix in suffixes:
    if os.path.isdir(out + suffix):
      raise UserError(f"--out={out}: {out}{suffix} is a folder; name a file prefix")
  folder = os.path.dirname(os.path.abspath(out))
  if not os.path.isdir(folder):
    raise UserError(f"--out={out}: folder {folder} does not exist; create it or name another")
  probes.writable_dir(folder, "--out's folder")


def write(path: str, data) -> None:
  """`data` (text or bytes) to `path` whole: an interrupted write leaves the old file."""
  from nanotext import fileio
  fileio.atomic_write(path, [data.encode() if isinstance(data, str) else data])


def main(argv):
  if FLAGS.topology:  # only compiles: never open this host's accelerators
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  from nanotext.errors import UserError, fail
  if len(argv) < 2:
    fail(f"no CONFIG given; {USAGE}")
  try:
    if FLAGS.steps < 1 or FLAGS.timed_steps < 1 or FLAGS.repeats < 1:
      raise UserError("--steps, --timed_steps and --repeats must be at least 1")
    log = lambda s: print(s, file=sys.stderr, flush=True)
    out = FLAGS.out or default_out(argv[1], FLAGS.topology)
    check_out(out, (".md",) if FLAGS.topology else (".md", ".png"))
    if FLAGS.topology:
      from nanotext import topology
      chips = topology.parse(FLAGS.topology).num_chips
      command = " ".join(["python", *sys.argv])
      written = []

      def write_table(rows):
        write(out + ".md", topology_report(rows, command, FLAGS.topology))
        written[:] = [out + ".md"]
      rows = measure_topology(argv[1], argv[2:], FLAGS.topology,
                              parse_layouts(FLAGS.layouts, chips), FLAGS.programs, log=log,
                              on_row=write_table)
    else:
      layouts = parse_layouts(FLAGS.layouts, jax.device_count())
      rows = measure(argv[1], argv[2:], layouts, steps=FLAGS.steps,
                     timed_steps=FLAGS.timed_steps, repeats=FLAGS.repeats, log=log)
  except UserError as e:
    fail(str(e))
  if FLAGS.topology:
    print(topology_table(rows))
    print(f"wrote {written[0]}" if written else "no layout compiled; nothing written")
    return
  print(table(rows))
  if jax.process_index() == 0:  # one writer on many hosts
    command = " ".join(["python", *sys.argv])
    xla = os.environ.get("XLA_FLAGS")
    command = f"XLA_FLAGS={xla} {command}" if xla else command
    write(out + ".md", report(rows, command))
    png = io.BytesIO()
    plot(rows, png)
    write(out + ".png", png.getvalue())
    print(f"wrote {out}.md and {out}.png")


USAGE = ("usage: python benchmarks/parallelism.py CONFIG [key=value ...] [--layouts L] "
         "[--steps K] [--out PREFIX]")

if __name__ == "__main__":
  from nanotext import cli
  define_flags()
  cli.run(lambda args: main([sys.argv[0], *args]), USAGE, __doc__.split("\n\n", 1)[1])
