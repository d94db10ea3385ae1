"""benchmarks/parallelism.py's tables, report files and plot, from its rows (one per layout)."""

from nanotext.hlo import COLLECTIVES

_SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "all-to-all": "A2A",
          "collective-permute": "CP"}
MIB = 2**20


# ---- compiled for a TPU slice ----

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
  """A markdown table: the header, then `row_text(r, mesh)` per layout (refused ones padded);
  the mesh cell says which of its axes shard nothing (a mislabelled layout otherwise)."""
  lines = _table_head(head)
  for r in rows:
    mesh = "×".join(map(str, r["shape"])) + r.get("unused", "")
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


# ---- measured on this host's devices ----

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
