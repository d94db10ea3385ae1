"""Parallelism ablation: `python benchmarks/parallelism.py CONFIG [key=value ...] [--layouts L]
[--steps K] [--out PREFIX]`.

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

import math
import os
import re
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanotext.hlo import COLLECTIVES, collectives  # noqa: E402 -- after the sys.path line

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The script's flags, defined only when it runs: tests import benchmarks into one registry."""
  flags.DEFINE_string("layouts", "", "Comma list like dp8,fsdp8,fsdp4xtp2; "
                      "empty = the defaults for this device count.")
  flags.DEFINE_integer("steps", 5, "Steps whose losses are recorded (also the warmup).")
  flags.DEFINE_integer("timed_steps", 3, "Steps per timed window.")
  flags.DEFINE_integer("repeats", 3, "Timed windows (the median is reported).")
  flags.DEFINE_string("out", "benchmarks/parallelism_base", "Output prefix (.md, .png).")
  flags.DEFINE_string(
      "topology", "", "Compile each layout for this TPU slice (e.g. v6e-8) through "
      "nanotext.compile instead of running it here: memory, collectives, FLOPs and a roofline "
      "estimate, no timing.")
  flags.DEFINE_string("programs", "last", "With --topology: which programs to "
                      "compile per layout (nanotext.compile --programs).")

AXES = {"dp": "data", "fsdp": "fsdp", "tp": "tensor"}
_SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
          "collective-permute": "CP"}
MIB = 2**20


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
  from nanotext import compile as nt_compile, config
  from nanotext.errors import UserError
  config.load(path, list(overrides))  # fail fast on keys and values before any compile
  rows = []
  for name, shape in layouts:
    row = {"layout": name, "shape": shape}
    mesh_kv = [f"mesh.{a}={n}" for a, n in zip(("data", "fsdp", "tensor"), shape)]
    t0 = time.perf_counter()
    try:
      _, sl, recs = nt_compile.run_compile(path, list(overrides) + mesh_kv, slice_name, which,
                                           min_headroom=0.0, log=lambda s: None)
    except UserError as e:  # a layout this model cannot use is a row saying why
      if "topology" in str(e) or "libtpu" in str(e):
        raise
      rows.append({**row, "invalid": str(e)})
      continue
    rows += [{**row, **rec, "chip": sl.chip} for rec in recs]
    if log:
      log(f"{name}: {len(recs)} program(s) ({time.perf_counter() - t0:.1f} s)")
    if on_row:
      on_row(rows)
  return rows


def roofline_s(row) -> tuple:
  """(compute s, HBM s, estimate s) per step from the chip's published peaks: an estimate."""
  chip = row["chip"]
  # The model's FLOPs: XLA's count sees a loop body once (the chunked loss) and no Mosaic kernel.
  compute = max(row["flops_analytic_per_chip"], row["flops_xla_per_chip"]) / chip.peak_flops
  memory = row["bytes_accessed_per_chip"] / chip.hbm_bw
  return compute, memory, max(compute, memory)


def _table_head(head: str) -> list:
  """A markdown table's header line and its separator."""
  return [head, "|" + " --- |" * head.count(" | ") + " --- |"]


def _invalid_row(r, mesh: str, head: str) -> str:
  """A row for a layout the config refused, padded to the header's columns."""
  return f"| {r['layout']} | {mesh} | invalid: {r['invalid']} |" + " |" * (head.count(" | ") - 2)


def _markdown(head: str, rows, row_text) -> str:
  """A markdown table: the header, then `row_text(r, mesh)` per layout (refused ones padded)."""
  lines = _table_head(head)
  for r in rows:
    mesh = "×".join(map(str, r["shape"]))
    lines.append(_invalid_row(r, mesh, head) if "invalid" in r else row_text(r, mesh))
  return "\n".join(lines)


def _counts(col: dict) -> str:
  """'ag 3 rs 2': the non-zero collective counts by short name."""
  return " ".join(f"{_SHORT[k]} {v['count']}" for k, v in col.items() if v["count"])


def topology_table(rows) -> str:
  """Markdown: per layout and program, memory per chip, collectives, FLOPs, roofline estimate."""
  head = ("| layout | data×fsdp×tensor | program | total GiB/chip (of HBM) | args GiB | temps GiB "
          "| collectives (count) | collective MiB/step | XLA TFLOP/chip | analytic TFLOP/chip "
          "| GB accessed/chip | est. compute ms | est. HBM ms | **roofline estimate ms** "
          "| compile s |")
  def row(r, mesh):
    hbm = f"{r['total_bytes_per_chip'] / 2**30:.2f} ({r['hbm_bytes_per_chip'] / 2**30:.2f})"
    if r.get("overflow"):
      return f"| {r['layout']} | {mesh} | {r['name']} | {hbm}: does not fit |" + " |" * 11
    col = r["collectives"]
    compute, memory, est = roofline_s(r)
    return (f"| {r['layout']} | {mesh} | {r['name']} | {hbm} | {r['argument'] / 2**30:.2f} "
            f"| {r['temp'] / 2**30:.2f} | {_counts(col) or 'none'} "
            f"| {sum(v['bytes'] for v in col.values()) / MIB:.1f} "
            f"| {r['flops_xla_per_chip'] / 1e12:.2f} | {r['flops_analytic_per_chip'] / 1e12:.2f} "
            f"| {r['bytes_accessed_per_chip'] / 1e9:.1f} | {1e3 * compute:.1f} "
            f"| {1e3 * memory:.1f} | {1e3 * est:.1f} | {r['compile_s']:.0f} |")
  return _markdown(head, rows, row)


def topology_report(rows, command: str, slice_name: str) -> str:
  from nanotext import topology
  chip = topology.parse(slice_name).chip
  return "\n".join([
      f"# Parallelism ablation compiled for {slice_name}", "", f"Command: `{command}`", "",
      f"Each layout compiled by `nanotext.compile` for {slice_name} on a CPU host (libtpu); "
      "nothing ran. Memory is the compiler's per-chip accounting (arguments + outputs - aliased "
      "+ temporaries + code); collective MiB is the summed result size of each collective in "
      "the HLO per chip, an op inside a loop counted once.", "",
      f"The roofline columns are an ESTIMATE, not a measurement: FLOPs per chip (the larger of "
      f"the analytic and XLA's counts: XLA counts a loop body once and sees no Mosaic kernel) "
      f"over the published dense bf16 peak ({chip.peak_flops / 1e12:.0f} TFLOP/s), and XLA's "
      f"bytes accessed over the published HBM bandwidth ({chip.hbm_bw / 1e9:.0f} GB/s), the "
      "larger of the two; it leaves out communication, kernel efficiency and overlap, and the "
      "bytes share XLA's loop undercount.", "",
      topology_table(rows), ""])


# ---- reporting ----

def _mib(x) -> str:
  return "n/a" if x != x else f"{x / MIB:.2f}"


def table(rows) -> str:
  """The main markdown table, one row per layout."""
  head = ("| layout | data×fsdp×tensor | compile s | step ms | tokens/s | params+opt MiB/dev "
          "| args MiB | outputs MiB | temps MiB | alias MiB | final loss | collectives "
          "(count) | collective MiB/step |")
  def row(r, mesh):
    mem, col = r["memory"], r["collectives"]
    return (f"| {r['layout']} | {mesh} | {r['compile_s']:.1f} | {1e3 * r['step_s']:.0f} "
            f"| {r['tokens_per_s']:,.0f} | {_mib(r['state_bytes'])} | {_mib(mem['argument'])} "
            f"| {_mib(mem['output'])} | {_mib(mem['temp'])} | {_mib(mem['alias'])} "
            f"| {r['losses'][-1]:.6f} | {_counts(col) or 'none'} "
            f"| {_mib(sum(v['bytes'] for v in col.values()))} |")
  return _markdown(head, rows, row)


def loss_table(rows) -> str:
  """Loss of every recorded step per layout, and the largest relative spread across layouts."""
  ok = [r for r in rows if "invalid" not in r and r["losses"]]
  if not ok:
    return ""
  steps = len(ok[0]["losses"])
  lines = ["| step | " + " | ".join(r["layout"] for r in ok) + " | max rel. spread |",
           "| --- |" + " --- |" * (len(ok) + 1)]
  for i in range(steps):
    vals = [r["losses"][i] for r in ok]
    spread = (max(vals) - min(vals)) / abs(min(vals)) if min(vals) else float("nan")
    lines.append(f"| {i + 1} | " + " | ".join(f"{v:.6f}" for v in vals) + f" | {spread:.1e} |")
  return "\n".join(lines)


def device_description() -> str:
  import jax
  d = jax.devices()[0]
  return (f"{jax.device_count()} × {d.device_kind} ({jax.default_backend()}, "
          f"{jax.process_count()} process(es)), jax {jax.__version__}")


def report(rows, command: str) -> str:
  """The markdown file: command, devices, caveat, the table and the per-step losses."""
  parts = [
      "# Parallelism ablation", "", f"Command: `{command}`", "", f"Devices: {device_description()}",
      "",
      "Caveat: on fake CPU devices all 'devices' share the same cores and memory and collectives "
      "are memory copies, so CPU timings say nothing about accelerator communication; the byte "
      "and collective columns are what carries over.", "",
      "Memory columns are per device. params+opt is exact (the state arrays' shards); args, "
      "outputs, temps and alias come from the compiled step's memory_analysis (args include the "
      "batch; outputs alias the donated state). Collective MiB is the summed result size of each "
      "collective in the HLO, per device, counting an op inside a loop once.", "",
      table(rows), "", "Loss per step (same seed and data in every layout):", "",
      loss_table(rows), ""]
  return "\n".join(parts)


def plot(rows, path: str) -> None:
  """Three bar panels: step time, per-device state+temporaries, collective bytes by kind."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = [r["layout"] for r in rows]
  ok = ["invalid" not in r for r in rows]
  get = lambda f: [f(r) if good else 0.0 for r, good in zip(rows, ok)]
  x = range(len(rows))
  fig, axes = plt.subplots(1, 3, figsize=(16, 5))
  axes[0].bar(x, get(lambda r: 1e3 * r["step_s"]), color="tab:blue")
  axes[0].set(title="step time (median)", ylabel="ms")
  state = get(lambda r: r["state_bytes"] / MIB)
  temps = get(lambda r: r["memory"]["temp"] / MIB)
  axes[1].bar(x, state, label="params + opt state", color="tab:green")
  axes[1].bar(x, temps, bottom=state, label="temporaries", color="tab:orange")
  axes[1].set(title="per-device memory", ylabel="MiB")
  axes[1].legend()
  bottom = [0.0] * len(rows)
  for op in COLLECTIVES:
    vals = get(lambda r: r["collectives"][op]["bytes"] / MIB)
    if any(vals):
      axes[2].bar(x, vals, bottom=bottom, label=op)
      bottom = [b + v for b, v in zip(bottom, vals)]
  axes[2].set(title="collective result bytes per step (per device)", ylabel="MiB")
  if any(bottom):
    axes[2].legend()
  for ax in axes:
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    for i, good in enumerate(ok):
      if not good:  # say why a bar is missing instead of drawing a misleading zero
        ax.text(i, 0.03, "invalid", transform=ax.get_xaxis_transform(), ha="center",
                va="bottom", rotation=90, color="tab:red")
  fig.suptitle(f"parallelism ablation: {device_description()}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  if FLAGS.topology:  # only compiles: never open this host's accelerators
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  from nanotext.errors import UserError, fail
  if len(argv) < 2:
    fail("usage: python benchmarks/parallelism.py CONFIG [key=value ...] [--layouts L] "
         "[--steps K] [--out PREFIX]")
  try:
    if FLAGS.steps < 1 or FLAGS.timed_steps < 1 or FLAGS.repeats < 1:
      raise UserError("--steps, --timed_steps and --repeats must be at least 1")
    log = lambda s: print(s, file=sys.stderr, flush=True)
    if FLAGS.topology:
      from nanotext import topology
      chips = topology.parse(FLAGS.topology).num_chips
      command = " ".join(["python", *sys.argv])
      def write(rows):
        with open(FLAGS.out + ".md", "w") as f:
          f.write(topology_report(rows, command, FLAGS.topology))
      rows = measure_topology(argv[1], argv[2:], FLAGS.topology,
                              parse_layouts(FLAGS.layouts, chips), FLAGS.programs, log=log,
                              on_row=write)
    else:
      layouts = parse_layouts(FLAGS.layouts, jax.device_count())
      rows = measure(argv[1], argv[2:], layouts, steps=FLAGS.steps,
                     timed_steps=FLAGS.timed_steps, repeats=FLAGS.repeats, log=log)
  except UserError as e:
    fail(str(e))
  if FLAGS.topology:
    print(topology_table(rows))
    return
  print(table(rows))
  if jax.process_index() == 0:  # one writer on many hosts
    command = " ".join(["python", *sys.argv])
    xla = os.environ.get("XLA_FLAGS")
    command = f"XLA_FLAGS={xla} {command}" if xla else command
    os.makedirs(os.path.dirname(os.path.abspath(FLAGS.out)), exist_ok=True)
    with open(FLAGS.out + ".md", "w") as f:
      f.write(report(rows, command))
    plot(rows, FLAGS.out + ".png")


if __name__ == "__main__":
  define_flags()
  app.run(main)
