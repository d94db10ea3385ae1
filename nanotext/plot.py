"""Training curves: `python -m nanotext.plot RUN_DIR [RUN_DIR ...] --out=FILE.png`.

Reads each run's metrics.jsonl and draws one figure with four panels: loss and bits per byte,
against optimizer steps and against tokens seen. Train loss is a line, validation points are
markers joined by a dashed line, in the run's colour; several runs overlay for an ablation.
"""

import importlib
import json
import math
import os

from nanotext.errors import UserError, os_error
from nanotext import probes, rundir
from nanotext.outputs import staged_file

USAGE = "usage: python -m nanotext.plot RUN_DIR [RUN_DIR ...] --out=FILE.png [--title=TEXT]"


def read_run(run_dir: str) -> dict:
  """{'name', 'tokens_per_step', 'tokens_unknown' (why it is None), 'train': [(step, loss)],
  'val': [(step, loss, bpb|None)], 'skipped': [line numbers that are not metrics]}.

  A line that is not a metrics row (not UTF-8, not JSON, a step that is not a finite integer,
  a loss that is not a number; a run still writing its last line) is skipped and counted."""
  rundir.check_run_dir(run_dir, "run directory", holds="metrics.jsonl")
  path = os.path.join(run_dir, "metrics.jsonl")
  train, val, skipped = {}, {}, []
  try:
    with open(path, "rb") as f:
      for n, raw in enumerate(f, 1):
        if not raw.strip():
          continue
        row = _metrics_row(raw)
        if row is None:
          skipped.append(n)
          continue
        # A resumed run appends again from its checkpoint: the latest value of a step wins.
        step, loss, val_loss, bpb = row
        if loss is not None:
          train[step] = loss
        if val_loss is not None:
          val[step] = (val_loss, bpb)
  except OSError as e:
    raise os_error(e, f"cannot read '{path}'") from None
  tokens, unknown = _tokens_per_step(run_dir)
  return {"name": os.path.basename(os.path.normpath(run_dir)) or run_dir,
          "tokens_per_step": tokens, "tokens_unknown": unknown,
          "train": sorted(train.items()),
          "val": [(s, v, b) for s, (v, b) in sorted(val.items())],
          "skipped": skipped}


def _metrics_row(raw: bytes):
  """(step, loss, val_loss, val_bpb) of one metrics.jsonl line (None where absent), or None
  when the line is not a metrics row. A null value is a non-finite one (a skipped step's
  loss): drawn as a gap."""
  def number(x):
    if x is _ABSENT:
      return None
    if x is None:
      return math.nan
    if isinstance(x, bool) or not isinstance(x, (int, float)):
      raise ValueError(f"not a number: {x!r}")
    # no loss is that large: drawn as a gap, as NaN is (near 1e308 matplotlib's layout fails)
    return float(x) if abs(x) < MAX_VALUE else math.nan
  try:
    row = json.loads(raw.decode("utf-8"))
    step = row["step"]
    if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) \
        or step != int(step) or not 0 <= step <= MAX_STEP:  # 1e308 broke matplotlib's layout
      return None
    values = [number(row.get(k, _ABSENT)) for k in ("loss", "val_loss", "val_bpb")]
  except (ValueError, KeyError, TypeError, AttributeError, OverflowError):
    return None
  return (int(step), *values)


_ABSENT = object()
MAX_VALUE = 1e100
MAX_STEP = 2**53  # steps past it are no run's (and a float no longer counts them)


def _tokens_per_step(run_dir: str) -> tuple:
  """(train.batch_size * train.seq_len from the run's config.yml, ''), or (None, why not)."""
  from nanotext import config_file
  path = os.path.join(run_dir, "config.yml")
  if not os.path.lexists(path):
    return None, "no config.yml"
  try:
    cfg = config_file.read(path)
  except UserError:
    return None, "config.yml unreadable"
  try:
    return int(cfg["train"]["batch_size"]) * int(cfg["train"]["seq_len"]), ""
  except (KeyError, TypeError, ValueError, OverflowError):
    return None, "config.yml is empty" if not cfg else "no train.batch_size, seq_len in config.yml"


def tokens_unknown(runs: list) -> str:
  """Why no run of `runs` (from read_run) has its tokens per step; '' where one has."""
  if any(r["tokens_per_step"] is not None for r in runs):
    return ""
  why = {r["tokens_unknown"] for r in runs}
  return f"{why.pop() if len(why) == 1 else 'no readable config.yml'}: tokens per step unknown"


def _bpb_scale(run: dict) -> float | None:
  """Train loss (nats/token) -> bits per byte, from the run's own val_loss / val_bpb ratio."""
  for _, loss, bpb in run["val"]:
    if bpb and loss and math.isfinite(bpb / loss):
      return float(bpb) / loss
  return None


def isolated(points: list) -> list:
  """The (step, loss) points with a finite loss and no finite neighbour in the list (one row,
  or a row between skipped steps): a line through them is invisible."""
  ok = [v is not None and math.isfinite(v) for _, v in points]
  return [p for i, p in enumerate(points) if ok[i] and not (i and ok[i - 1])
          and not (i + 1 < len(ok) and ok[i + 1])]


def plot(runs: list, out: str, title: str = "") -> None:
  """Write the 2 x 2 figure of `runs` (from read_run) to `out` (format from its extension)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), sharey="row")
  plain = lambda text: text.replace("$", r"\$")  # not mathtext: '$x^$' was a traceback
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  any_bpb = False
  for i, run in enumerate(runs):
    color = colors[i % len(colors)]
    scale = _bpb_scale(run)
    any_bpb |= scale is not None
    for col, per in enumerate((1, run["tokens_per_step"])):
      if per is None:
        continue
      x = lambda s: s * per
      for row, f in enumerate((1.0, scale)):
        if f is None:
          continue
        ax = axes[row][col]
        if run["train"]:
          ax.plot([x(s) for s, _ in run["train"]], [v * f for _, v in run["train"]],
                  color=color, lw=1.2, alpha=0.8, label=plain(f"{run['name']} train"))
          alone = isolated(run["train"])  # a line of one point draws nothing
          ax.plot([x(s) for s, _ in alone], [v * f for _, v in alone], color=color, ls="none",
                  marker=".", ms=6)
        if run["val"]:
          ys = [(b if row and b else v * f) for _, v, b in run["val"]]
          ax.plot([x(s) for s, _, _ in run["val"]], ys, color=color, ls="--", marker="o",
                  ms=5, label=plain(f"{run['name']} val"))
          ax.annotate(f"{ys[-1]:.3f}", (x(run["val"][-1][0]), ys[-1]), textcoords="offset points",
                      xytext=(4, 6), fontsize=8, color=color)
  axes[0][0].set_ylabel("loss (nats/token)")
  axes[1][0].set_ylabel("bits per byte")
  for col, label in enumerate(("optimizer step", "tokens")):
    axes[1][col].set_xlabel(label)
    axes[0][col].set_xlabel(label)
  if not any_bpb:
    for ax in axes[1]:
      ax.text(0.5, 0.5, "no val_bpb in these runs", ha="center", va="center",
              transform=ax.transAxes, color="gray")
  if tokens_unknown(runs):
    for ax in axes[:, 1]:
      ax.text(0.5, 0.5, tokens_unknown(runs), ha="center", va="center", transform=ax.transAxes,
              color="gray")
  from matplotlib.ticker import EngFormatter
  for ax in axes[:, 1]:
    if ax.has_data():  # an empty panel's 0..1 axis read '0, 200m, ..., 1' tokens
      ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 300k tokens, not 300000
  for ax in axes.flat:
    ax.grid(alpha=0.3)
  handles, labels = axes[0][0].get_legend_handles_labels()
  if handles:
    axes[0][0].legend(handles, labels, fontsize=8)
  fig.suptitle(plain(title or "  vs  ".join(r["name"] for r in runs)), fontsize=11)
  if any_bpb:  # say how the train curve got into bits per byte
    fig.text(0.5, 0.005, "train bits per byte = train loss / ln 2 / the validation text's bytes "
             "per token", ha="center", fontsize=8, color="gray")
  fig.tight_layout(rect=(0, 0.02, 1, 1))
  try:
    with staged_file(os.path.abspath(out), force=True) as tmp:  # never half an image at --out
      fig.savefig(tmp, dpi=110, format=image_format(out))
  finally:
    plt.close(fig)


def image_format(out: str) -> str:
  """The image format of --out, from its extension (png when it has none)."""
  ext = os.path.splitext(out)[1][1:].lower()
  return ext or "png"


def check_out(out: str) -> None:
  """Refuse an --out matplotlib cannot write (its format) or this user cannot (its folder),
  before any run is read."""
  from matplotlib.figure import Figure
  kinds = Figure().canvas.get_supported_filetypes()
  if image_format(out) not in kinds:
    raise UserError(f"--out '{out}': '.{image_format(out)}' is not an image format matplotlib "
                    f"writes (one of: {', '.join(sorted(kinds))})")
  probes.writable_dir(os.path.dirname(os.path.abspath(out)), "the folder of --out")
  probes.replaceable(out, "--out")


def define_flags() -> None:
  """The CLI's flags (defined only when run as a program)."""
  from absl import flags
  flags.DEFINE_string("out", None, "Image to write (.png, .pdf, .svg, ...).")
  flags.DEFINE_string("title", "", "Title of the figure.")


def parse(runs, out, title) -> tuple:
  """(run dirs, out, title) from the command line, checked."""
  runs, out = [os.path.expanduser(r) for r in runs], out and os.path.expanduser(out)
  if not runs:
    raise UserError(f"no run directory given; {USAGE}")
  if not out:
    raise UserError(f"--out=FILE.png is required; {USAGE}")
  if os.path.isdir(out):
    raise UserError(f"--out '{out}' is a directory; give a file path such as curves.png")
  parent = above = os.path.dirname(os.path.abspath(out))
  while not os.path.lexists(above):
    above = os.path.dirname(above)
  if os.path.isfile(above):  # afile/x.png: the folder is there, as a file
    raise UserError(f"--out '{out}': '{above}' is a file, not a folder")
  if not os.path.isdir(parent):
    raise UserError(f"--out '{out}': folder '{parent}' does not exist")
  return runs, out, title


def main(args) -> None:
  """The CLI: `args` are the run directories (absl has taken --out and --title)."""
  from absl import flags
  runs, out, title = parse(args, flags.FLAGS.out, flags.FLAGS.title)
  try:
    importlib.import_module("matplotlib")
  except ImportError:
    raise UserError("plotting needs matplotlib: pip install matplotlib "
                    "(or pip install -e '.[plots]')") from None
  check_out(out)
  data = [read_run(r) for r in runs]
  if not any(d["train"] or d["val"] for d in data):
    if any(d["skipped"] for d in data):
      raise UserError("no line of the metrics.jsonl of any run given is a metrics row (each is "
                      "not JSON, or has no step): nothing to plot")
    raise UserError("the metrics.jsonl of every run given is empty: nothing to plot")
  for d, r in zip(data, runs):
    if d["skipped"]:
      lines = d["skipped"]
      print(f"{os.path.join(r, 'metrics.jsonl')}: skipped {len(lines)} line(s) that are not "
            f"metrics rows (line {lines[0]}{', ...' if len(lines) > 1 else ''})")
  plot(data, out, title)
  print(f"wrote {out}")
  for d in data:
    if d["val"]:
      s, v, b = d["val"][-1]
      bpb = f", val_bpb {b:.4f}" if b else ""
      print(f"{d['name']}: step {s} val_loss {v:.4f}{bpb}")


if __name__ == "__main__":
  from nanotext import cli
  define_flags()
  cli.run(main, USAGE, __doc__)
