"""Step benchmark on any backend (made for the GPU): `python benchmarks/gpu_step.py CONFIG
[key=value ...] [--steps 10] [--repeats 3] [--schedule] [--trace] [--json FILE] [--hlo FILE]`.

Builds the run exactly as training does (wiring), on synthetic batches, and prints one table:
compile time per train program, time from start to the first finished step, the step time at
the final attention windows (median of --repeats windows of --steps steps), with --schedule the
mean step over every step of the window schedule (train.steps, each step on its own stage's
program, as the trainer runs them), tokens/s, MFU against the device's peak, peak device memory
(the allocator's peak where the backend reports one, else the compiled program's), and with
--trace the top kernels by time from a profiler trace of --trace_steps steps, each with the jax
op it came from. --hlo FILE writes the timed program's HLO as the device compiled it.

The record's figures on one H100 (train_gpt.py @ 587b45fb, one 49,152-token row per step): 124.9
ms at the final windows, 115.2 ms over a 150-step schedule, 88 s to the first step, 29.7 GiB.
"""

import collections
import glob
import gzip
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

T_START = time.perf_counter()


def measure(path, overrides, *, steps=10, repeats=3, warmup=2, schedule=False, trace_steps=0,
            top=12, hlo="") -> dict:
  """Compile and time a config's train step(s) on synthetic data; see the module docstring."""
  import jax
  from nanotext import metrics, trainer, window_schedule, wiring
  from nanotext.programs import compile_train_steps

  run = wiring.prepare(path, list(overrides) + ["data.source=synthetic"])
  run.memory.require("train")  # one line, before anything traces, where the step cannot fit
  cfg = run.cfg
  state = run.init_state()
  batch = trainer.global_batch(run, next(run.train_iter()))
  n = cfg.train.steps
  final = window_schedule.step_stage(cfg, n - 1)
  lines = []  # the trainer's own line per compiled program: name and seconds
  programs = compile_train_steps(run, state, batch, range(n) if schedule else [n - 1],
                                log=lines.append)
  first_stage = window_schedule.step_stage(cfg, 0) if schedule else final
  state, m = programs(first_stage, state, batch)
  jax.block_until_ready(m)
  to_first_step = time.perf_counter() - T_START
  step = lambda state: programs(final, state, batch)
  for _ in range(warmup):
    state, m = step(state)
  jax.block_until_ready(m)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(steps):
      state, m = step(state)
    jax.block_until_ready(m)
    times.append((time.perf_counter() - t0) / steps)
  step_s = statistics.median(times)
  schedule_s = None
  if schedule:
    t0 = time.perf_counter()
    for k in range(n):
      state, m = programs(window_schedule.step_stage(cfg, k), state, batch)
    jax.block_until_ready(m)
    schedule_s = (time.perf_counter() - t0) / n
  final_exec = programs.execs[programs.plan[final]]
  text = final_exec.as_text()
  if hlo:
    with open(hlo, "w") as f:
      f.write(text)
  kernels, gaps, sources = (top_kernels(step, state, trace_steps, top, op_names(text))
                            if trace_steps else ([], None, {}))
  tokens = cfg.train.batch_size * cfg.train.seq_len
  flops = metrics.flops_per_token(cfg.model, final[1], final[0]) * tokens
  peak = metrics.peak_flops(cfg.metrics, jax.devices()) * jax.device_count()
  return {"config": " ".join([path, *overrides]), "backend": jax.default_backend(),
          "device": jax.devices()[0].device_kind, "devices": jax.device_count(),
          "jax": jax.__version__, "params": run.num_params, "attention": run.impl,
          "compiled": lines,
          "to_first_step_s": to_first_step, "step_s": step_s, "step_s_all": times,
          "schedule_step_s": schedule_s, "tokens_per_s": tokens / step_s,
          "mfu": flops / step_s / peak, "peak_flops": peak, "peak_bytes": peak_bytes(final_exec),
          "kernels": kernels, "traced": bool(trace_steps), "gaps": gaps,
          "kernel_ops": {name: sources[name] for name, _, _ in kernels if name in sources},
          "estimate": estimate(run, text)}


def estimate(run, text: str) -> dict | None:
  """nanotext.compile's roofline estimate of the program just timed (its HLO text), for the
  device it ran on (None where the device's peaks are unknown, e.g. a CPU)."""
  import jax
  from nanotext import compile as nt_compile, gpus, roofline, topology
  kind = jax.devices()[0].device_kind
  gpu, chip = gpus.of_kind(kind), topology.chip_of_kind(kind)
  if gpu is None and chip is None:
    return None
  peaks = gpu.peaks if gpu else roofline.Peaks(bf16=chip.peak_flops, bandwidth=chip.hbm_bw)
  train = [p for p in nt_compile.programs(run.cfg, run.impl) if p[2]]  # eval programs: no steps
  program = max(train, key=lambda p: p[2][1])[1]
  return roofline.inventory(text, peaks, **dict(zip(
      ("logits_elements", "logits_bytes", "vocab"), nt_compile.logits_size(run, program, True))),
      custom_flops=nt_compile.attention_flops(run, program, True))


def peak_bytes(compiled) -> int:
  """The allocator's peak on device 0 where reported (GPU, TPU), else the program's own size."""
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    return int(stats["peak_bytes_in_use"])
  mem = compiled.memory_analysis()
  return int(mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
             - mem.alias_size_in_bytes) if mem is not None else 0


def op_names(text: str) -> dict:
  """{instruction name: the jax op that made it} of a compiled program's HLO text (its op_name
  metadata, the jit's name dropped; "" where it has none), each name also as a GPU trace names
  the instruction's kernel (`loop_convert_fusion.23` -> `loop_convert_fusion_23`)."""
  from nanotext import hlo
  out = {}
  for ins in (i for comp in hlo.parse(text)[0].values() for i in comp):
    out[ins.name] = hlo.op_name(ins)
    out.setdefault(ins.name.replace(".", "_"), out[ins.name])
  return out


def kernel_sources(events: list, ops: dict) -> dict:
  """{kernel name: the jax op it ran} for a trace's kernels: through the HLO op a device event
  names in its args (cuBLAS and other library kernels), else the instruction of the kernel's own
  name (XLA's fusions); kernels matched by neither are left out."""
  out = {}
  for e in events:
    name = e.get("name", "")
    if e.get("ph") != "X" or name in out:
      continue
    hlo = (e.get("args") or {}).get("hlo_op", "")
    source = ops.get(hlo) or ops.get(name)
    if source:
      out[name] = source
  return out


def top_kernels(step, state, n_steps: int, top: int, ops: dict) -> tuple:
  """([(name, ms per step, share)] of the `top` kernels by time in a profiler trace of n steps,
  stream_gaps of the trace, kernel_sources of the trace with `ops` (op_names)).

  Reads jax.profiler's perfetto trace: device kernels where the trace has a device process
  (GPU/TPU: '/device:...'), else the spans named after one of the program's instructions `ops`,
  on whichever host thread ran them (CPU: XLA's pool, or the caller's thread for small programs).
  """
  import jax
  with tempfile.TemporaryDirectory() as where:
    with jax.profiler.trace(where, create_perfetto_trace=True):
      for _ in range(n_steps):
        state, m = step(state)
      jax.block_until_ready(m)
    files = glob.glob(os.path.join(where, "**", "perfetto_trace.json.gz"), recursive=True)
    if not files:
      return [], None, {}
    with gzip.open(files[0]) as f:
      events = json.load(f)
  events = events.get("traceEvents", events) if isinstance(events, dict) else events
  return (kernel_table(events, n_steps, top, set(ops)), stream_gaps(events, n_steps),
          kernel_sources(events, ops))


def stream_gaps(events: list, n_steps: int) -> dict | None:
  """{'kernels', 'busy_ms', 'gap_ms'} per step on the device's streams: kernels run, time in
  them, and idle time between one kernel's end and the next one's start on the same stream
  (launch overhead and host syncs: what a roofline estimate cannot see). None without device
  streams (a CPU trace)."""
  device = {e.get("pid") for e in events if e.get("ph") == "M" and e.get("name") ==
            "process_name" and e.get("args", {}).get("name", "").startswith("/device:")}
  streams = collections.defaultdict(list)
  for e in events:
    if e.get("ph") == "X" and e.get("pid") in device:
      streams[(e["pid"], e.get("tid"))].append((float(e.get("ts", 0)), float(e.get("dur", 0))))
  if not streams:
    return None
  busy = gap = count = 0.0
  for spans in streams.values():
    spans.sort()
    count += len(spans)
    busy += sum(d for _, d in spans)
    end = spans[0][0]
    for ts, dur in spans:
      gap += max(0.0, ts - end)
      end = max(end, ts + dur)
  return {"kernels": count / n_steps, "busy_ms": busy / 1e3 / n_steps,
          "gap_ms": gap / 1e3 / n_steps}


def kernel_table(events: list, n_steps: int, top: int, ops: set = frozenset()) -> list:
  """Aggregate a Chrome/perfetto trace's complete events into the top kernels (see top_kernels)."""
  procs = {e.get("pid"): e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  device = {p for p, name in procs.items() if name.startswith("/device:")}
  def counted(e):
    if device:
      return e.get("pid") in device
    # On the host the runtime logs its own spans around the ops, and control flow (`while.N`)
    # spans the ops inside it: only the program's other instructions count.
    name = e.get("name", "")
    return name in ops and not name.startswith(("while", "call", "conditional"))
  total = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and counted(e):
      total[e.get("name", "?")] += float(e.get("dur", 0.0))
  all_us = sum(total.values()) or 1.0
  return [(name, us / 1e3 / n_steps, us / all_us) for name, us in total.most_common(top)]


def table(r: dict) -> str:
  """The result as one markdown table."""
  gib = lambda b: f"{b / 2**30:.2f} GiB"
  rows = [("config", f"`{r['config']}`"),
          ("device", f"{r['device']} x {r['devices']} ({r['backend']}, jax {r['jax']})"),
          ("parameters / attention kernel", f"{r['params']:,} / {r['attention']}")]
  rows += [("compile", line.replace("compiled ", "")) for line in r["compiled"]]
  rows += [("start to first step", f"{r['to_first_step_s']:.1f} s"),
           ("step at the final windows (median)",
            f"{1e3 * r['step_s']:.1f} ms ({', '.join(f'{1e3 * t:.1f}' for t in r['step_s_all'])})")]
  if r["schedule_step_s"] is not None:
    rows.append(("step over the window schedule (mean)", f"{1e3 * r['schedule_step_s']:.1f} ms"))
  rows += [("tokens/s", f"{r['tokens_per_s']:,.0f}"),
           ("MFU", f"{100 * r['mfu']:.1f}% of {r['peak_flops'] / 1e12:,.3f} TFLOP/s"),
           ("peak memory (device 0)", gib(r["peak_bytes"]))]
  est = r.get("estimate")
  if est:
    rows.append(("roofline estimate of the step (not a measurement)",
                 f"{1e3 * est['estimate_s']:.1f} ms, {est['launches']} launches "
                 f"({est['estimate_s'] / r['step_s']:.0%} of the measured step)"))
  gaps = r.get("gaps")
  if gaps:
    rows.append(("kernels per step (trace)", f"{gaps['kernels']:.0f}: {gaps['busy_ms']:.1f} ms "
                 f"in kernels, {gaps['gap_ms']:.1f} ms between them"))
  sources = r.get("kernel_ops", {})
  rows += [(f"kernel: `{name[:60]}`", f"{ms:.2f} ms/step ({100 * share:.1f}%)" +
            (f", from `{op_tail(sources[name])}`" if sources.get(name) else ""))
           for name, ms, share in r["kernels"]]
  if r.get("traced") and not r["kernels"]:
    # XLA's CPU runtime does not always name its ops in the trace (seen: 8 host devices, a
    # program compiled earlier in the process); GPU and TPU traces have device streams.
    rows.append(("kernels", "none named in the profiler trace"))
  return "\n".join(["| what | value |", "| --- | --- |"] + [f"| {a} | {b} |" for a, b in rows])


USAGE = ("usage: python benchmarks/gpu_step.py CONFIG [key=value ...] [--steps N] [--schedule] "
         "[--trace] [--json FILE] [--hlo FILE] [--own_kernels NAMES|all]")


def main(argv):
  from absl import flags, logging
  from nanotext.errors import UserError, fail
  from nanotext.model.kernels import per_device
  logging.set_verbosity(logging.WARNING)  # the profiler logs its file writes at INFO
  f = flags.FLAGS
  if len(argv) < 2:
    fail(f"no CONFIG given; {USAGE}")
  try:
    import bench_cli
    bench_cli.at_least(1, steps=f.steps, repeats=f.repeats, trace_steps=f.trace_steps)
    bench_cli.at_least(0, warmup=f.warmup, top=f.top)
    for flag in ("json", "hlo"):
      if f[flag].value:
        bench_cli.writable_file(f[flag].value, f"--{flag}")
    with per_device.opting_in(*own_kernels(f.own_kernels)):
      r = measure(argv[1], argv[2:], steps=f.steps, repeats=f.repeats, warmup=f.warmup,
                  schedule=f.schedule, trace_steps=f.trace_steps if f.trace else 0, top=f.top,
                  hlo=f.hlo)
  except UserError as e:
    fail(str(e))
  print(table(r))
  if f.json:
    with open(f.json, "w") as out:
      json.dump(r, out, indent=1)


def op_tail(source: str, width: int = 80) -> str:
  """The end of an op's name path (jit(step)/.../dot_general) in about `width` characters, cut
  where a '/' separates two names, not inside one; '.../' marks what was left out."""
  if len(source) <= width:
    return source
  tail = source[-width:]
  cut = tail.find("/")
  return ".../" + (tail[cut + 1:] if 0 <= cut < len(tail) - 1 else tail)


def own_kernels(names: str) -> tuple:
  """--own_kernels as names of per_device.OWN_KERNELS ("all": every one); a wrong name is a
  UserError naming them."""
  from nanotext.errors import UserError
  from nanotext.model.kernels import per_device
  own = per_device.OWN_KERNELS
  chosen = own if names == "all" else tuple(n for n in names.split(",") if n)
  if set(chosen) - set(own):
    raise UserError(f"--own_kernels={names}: choose from {', '.join(own)} or all")
  return chosen


def define_flags():
  from absl import flags
  flags.DEFINE_integer("steps", 10, "Timed steps per repeat.")
  flags.DEFINE_integer("repeats", 3, "Timed repeats (the median is reported).")
  flags.DEFINE_integer("warmup", 2, "Untimed steps after compilation.")
  flags.DEFINE_bool("schedule", False, "Also run every step of the window schedule once.")
  flags.DEFINE_bool("trace", False, "Profile --trace_steps steps and list the top kernels.")
  flags.DEFINE_integer("trace_steps", 3, "Steps in the profiler trace.")
  flags.DEFINE_integer("top", 12, "Kernels listed.")
  flags.DEFINE_string("json", "", "Also write the result as JSON to this file.")
  flags.DEFINE_string("own_kernels", "", "Comma-separated nanotext kernels a run takes only "
                      "opted in (model/kernels/per_device.OWN_KERNELS), or all: an A/B of them.")
  flags.DEFINE_string("hlo", "", "Also write the timed program's HLO text (as the device "
                      "compiled it: its kernels' names are the trace's) to this file.")


if __name__ == "__main__":
  define_flags()
  import bench_cli
  bench_cli.run(main, USAGE, __doc__)
