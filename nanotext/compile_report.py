"""What `python -m nanotext.compile` prints: one block per compiled program (memory, FLOPs,
collectives, the kernel inventory and the roofline estimate) and the verdict line."""

import math

from nanotext import hlo_memory, roofline

GIB = 2**30


def gib(b) -> str:
  """Bytes as GiB, or MiB below a tenth of one."""
  return f"{b / GIB:.2f} GiB" if b >= GIB / 10 else f"{b / 2**20:.1f} MiB"


def headroom(fraction: float) -> str:
  """A headroom as a percentage rounded down: 9.96% against 10% asked read "10.0%: does NOT
  fit"."""
  return f"{math.floor(1000 * fraction) / 10:.1f}% headroom"


def time_unit(seconds: float) -> tuple:
  """(scale, unit) to print `seconds` and its parts in: ms, or us under 0.05 ms (a small
  program's estimate read 0.0 ms)."""
  return (1e6, "us") if seconds < 5e-5 else (1e3, "ms")


def plural(n: int, word: str) -> str:
  """'1 kernel', '3 kernels'."""
  return f"{n} {word}" + "s" * (n != 1)


def _si(x) -> str:
  return "n/a" if x != x else f"{x:.3g}"


def describe(rec, passes: int = 0) -> str:
  """The lines printed for one program (`passes`: its slowest non-GEMM passes to list)."""
  steps = rec.get("steps")
  head = f"{rec['name']}" + (f" (steps {steps[0]}-{steps[1]})" if steps else "")
  if rec.get("error"):
    return f"{head}: FAILED at the {rec['stage']} stage after {rec['compile_s']:.1f} s: " \
        f"{rec['error']}"
  cpu = f", {rec['compile_cpu_s']:.0f} s of CPU" if "compile_cpu_s" in rec else ""
  head += f": compiled in {rec['compile_s']:.1f} s{cpu}"
  est = f" (planned {gib(rec['estimate_bytes_per_chip'])})" \
      if "estimate_bytes_per_chip" in rec else ""
  if rec.get("overflow"):
    return (f"{head}\n  memory per device  needs {gib(rec['total_bytes_per_chip'])}{est} of "
            f"{gib(rec['hbm_bytes_per_chip'])}: does NOT fit (the compiler refused it)")
  col = " | ".join(f"{k} {v['count']} ({v['bytes'] / 2**20:.1f} MiB)"
                   for k, v in rec["collectives"].items() if v["count"]) or "none"
  xla, inv = rec["flops_xla_per_chip"], rec.get("kernels", {})
  # A GPU executable has no cost analysis, and XLA's counts a loop body once where the loop's
  # config does not state its trip count (libtpu's): the FLOPs of the GEMMs in the HLO instead.
  if inv and (xla != xla or inv.get("unstated_loops") or inv.get("unknown_loops")):
    xla, what = inv["gemm_flops"], "GEMMs in the HLO"
  else:
    what = "XLA"
  ratio = f"({xla / rec['flops_analytic_per_chip']:.2f}x)"
  if inv.get("unknown_loops"):  # a ratio of a count that is short by an unknown factor misleads
    ratio = f"(no ratio: {inv['unknown_loops']} loop(s) of unknown trip count, counted once)"
  accessed = rec["bytes_accessed_per_chip"]
  accessed = f" | bytes accessed {_si(accessed)}" if accessed == accessed else ""
  verdict = "fits" if rec["fits"] else "does NOT fit"
  lines = [
      head,
      f"  memory per device  args {gib(rec['argument'])} | outputs {gib(rec['output'])} "
      f"(aliased {gib(rec['alias'])}) | temps {gib(rec['temp'])} | code "
      f"{gib(rec['generated_code'])} | total {gib(rec['total_bytes_per_chip'])}{est} of "
      f"{gib(rec['hbm_bytes_per_chip'])}, {headroom(rec['headroom'])}: {verdict}",
      f"  FLOPs per device   analytic {_si(rec['flops_analytic_per_chip'])} | {what} "
      f"{_si(xla)} {ratio}{accessed}",
      f"  collectives        {col}"]
  if "kernels" in rec:
    lines += kernel_lines(rec["kernels"], rec.get("platform", "gpu"))
    lines += pass_lines(rec["kernels"], passes, rec.get("platform", "gpu"))
  if "live_peak_bytes" in rec:
    lines += hlo_memory.lines(rec["live_peak_bytes"], rec["live_at_peak"], gib)
  return "\n".join(lines)


def kernel_lines(inv: dict, platform: str) -> list:
  """The kernel inventory and the roofline estimate of roofline.inventory, as printed (a TPU runs
  ops, not launches: its count includes scalar loop bookkeeping and DMA starts)."""
  g, fast = inv["gemm_calls"], inv.get("fp8_fast_accum", 0)  # cuBLASLt's fast accumulation
  own = inv.get("own_gemm_calls", {})  # GEMMs of nanotext's own kernels, in the counts by math

  def calls(math, name):
    notes = [f"{fast} fast-accumulating"] * bool(fast and math == "fp8") + \
        [f"{own[math]} Pallas"] * bool(own.get(math))
    return f"{g[math]} {name}" + (f" ({', '.join(notes)})" if notes else "")
  n = inv.get("unknown_loops", 0)
  unknown = f" (short: {n} loop(s) of unknown trip count counted once)" if n else ""
  scale, unit = time_unit(inv["estimate_s"])
  parts = " + ".join(f"{k} {scale * v:.1f}" for k, v in inv["estimate_parts_s"].items() if v)
  units = ("launch", "launches") if platform == "gpu" else ("op", "ops")
  top = inv["slowest_ops"][:3]
  top_scale, top_unit = time_unit(max((row[1] for row in top), default=0.0))
  slow = ", ".join(f"{op} {top_scale * s:.2f} {top_unit} ({n} {units[n != 1]})"
                   for op, s, n, _ in top)
  return [
      f"  kernels per step   {inv['launches']} {'launches' if platform == 'gpu' else 'ops'}: "
      f"GEMMs {calls('bf16', 'bf16')}, {calls('f32', 'f32')}, {calls('fp8', 'FP8')} | custom "
      f"(Pallas/Mosaic) "
      f"{inv['custom_kernels']} | cuDNN {inv['cudnn_calls']} | fusions {inv['fusions']} | "
      f"scatters {inv['scatters']} | collectives {inv['collective_launches']} | copies "
      f"{inv['copies']}",
      logits_line(inv),
      f"  step estimate      {scale * inv['estimate_s']:.1f} {unit}, a roofline lower bound, not "
      f"a measured time ({parts} {unit}){unknown}; slowest passes by jax op: {slow}",
      f"  not priced         {roofline.UNPRICED}"]


def logits_line(inv: dict) -> str:
  """How many passes over the logits the step makes besides the GEMMs that write them; none
  where the GEMMs reduce them in their own fusion (a TPU's chunked head: exp-sum in the GEMM)."""
  gemms = plural(inv["logits_gemms"], "GEMM")
  if inv["logits_gemms"] and not inv["logits_kernels"]:
    return f"  logits             no pass over the logits besides {gemms}: the loss is fused " \
        "into them"
  return (f"  logits             {inv['logits_passes']:.1f} passes over the logits by "
          f"{plural(inv['logits_kernels'], 'kernel')}, besides {gemms}")


def pass_lines(inv: dict, n: int, platform: str = "gpu") -> list:
  """With --passes=N: the estimate's N slowest non-GEMM passes by jax op, one line each (where
  a step's time goes beyond its GEMMs and custom kernels, every layer's launches as one)."""
  if not n:
    return []
  rows = inv["slowest_ops"][:n]
  units, one = ("launches", "a launch") if platform == "gpu" else ("ops", "an op")
  scale, unit = time_unit(inv["passes_s"])
  out = [f"  slowest passes     {len(rows)} of the non-GEMM {units}' {scale * inv['passes_s']:.1f} "
         f"{unit}, by jax op (every layer's as one): {unit}, {units}, MiB {one} moves"]
  out += [f"    {scale * sec:7.2f} {unit} {count:5d} x {moved / 2**20:9.1f} MiB  {op}"
          for op, sec, count, moved in rows]
  return out


def verdict(recs, target_name, min_headroom) -> tuple:
  """(ok, line): the summary line; `ok` is False if any program does not fit or failed."""
  failed = [r["name"] for r in recs if r.get("error")]
  if failed:
    return False, (f"{', '.join(failed)} failed to compile for {target_name} (the lines above "
                   "say at which stage)")
  worst = max(recs, key=lambda r: r["total_bytes_per_chip"])
  hbm = worst["hbm_bytes_per_chip"]
  if all(r["fits"] for r in recs):
    return True, (f"verdict: fits {target_name}: {len(recs)} program(s), largest {worst['name']} "
                  f"at {gib(worst['total_bytes_per_chip'])} of {gib(hbm)} per device "
                  f"({headroom(1 - worst['total_bytes_per_chip'] / hbm)}, "
                  f">= {100 * min_headroom:g}% asked)")
  bad = [r["name"] for r in recs if not r["fits"]]
  return False, (f"{', '.join(bad)}: needs up to {gib(worst['total_bytes_per_chip'])} per device "
                 f"but {target_name} has {gib(hbm)} and {100 * min_headroom:g}% is kept free")
