"""Does the flagship learn like the record? Per-step losses: FP8 head, bf16 head, PyTorch record.

  python benchmarks/learning_check.py [--config=configs/speedrun_record.yml] [--steps=150]
      [--set=key=value ...] [--torch=auto|on|off] [--torch_device=auto|cpu|cuda] [--plot=PNG]
  python benchmarks/learning_check.py --from_table=LOG [--plot=PNG]   # a past run's table again

From one initial state (nanotext's init of the config), the same rows for every run: nanotext
with model.fp8_head=true, nanotext with the head in the model dtype, and, where torch is
installed, benchmarks/record_torch.py (the record's training step re-derived, in its bf16 recipe
with the FP8 head) from the same weights (nanotext's export-torch mapping). train.steps is the
schedule's length (lr cooldown, window growth): --steps sets it, --run_steps runs only the
first steps of it (each window size of the schedule is its own compiled program). Prints a
markdown table of the losses and their relative differences (largest, mean, signed mean);
--plot draws the curves and the differences.

The real shape (one 49,152-token row per step, 150 steps of the window schedule, on one GPU):

  python benchmarks/learning_check.py --steps=150 --set=train.batch_size=1

Importing this module defines no flags and runs nothing; the tests use its helpers.
"""

import importlib.util
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "speedrun_record.yml")


def make_run(path: str, overrides, devices=None):
  """nanotext's Run of a config (one device by default: the record's per-GPU work)."""
  import jax
  from nanotext import wiring
  devices = jax.devices()[:1] if devices is None else devices
  return wiring.from_config(wiring.load(path, list(overrides)), devices=devices)


def rows_of(run, steps: int) -> list:
  """`steps` batches {"inputs", "targets"} [B, T] (numpy) from the run's training data."""
  it = run.train_iter()
  return [next(it) for _ in range(steps)]


def compile_nanotext(run, state, batches, log=None):
  """The trainer's Programs for steps 0..len(batches)-1 (called with window_schedule.step_stage)."""
  from nanotext import programs, trainer
  t0 = time.perf_counter()
  execs = programs.compile_train_steps(run, state, trainer.global_batch(run, batches[0]),
                                       range(len(batches)))
  if log:
    log(f"nanotext: {len(execs)} program(s) compiled in {time.perf_counter() - t0:.1f} s")
  return execs


def train_nanotext(run, state, batches, execs=None, log=None, after_step=None):
  """nanotext train steps 0.. on `batches` (with `execs` from compile_nanotext, else compiled
  here); returns (state, per-step mean token losses). `state` is donated; `after_step(step,
  state)` is called after each step."""
  from nanotext import trainer
  from nanotext.window_schedule import step_stage
  execs = compile_nanotext(run, state, batches, log) if execs is None else execs
  losses = []
  for step, b in enumerate(batches):
    state, metrics = execs(step_stage(run.cfg, step), state, trainer.global_batch(run, b))
    losses.append(float(metrics["loss"]))
    if after_step:
      after_step(step, state)
  return state, losses


def as_run_dtypes(run, params) -> dict:
  """A host params tree cast to `run`'s parameter dtypes (e.g. float32 tables -> bf16)."""
  import jax
  abstract = run.abstract_state()["params"]
  return jax.tree.map(lambda p, a: np.asarray(p).astype(a.dtype), params, abstract)


def host_params(state) -> dict:
  """The state's params as a host tree (survives the donation of `state`)."""
  import jax
  return jax.tree.map(np.asarray, jax.device_get(state["params"]))


def torch_state(run, params) -> dict:
  """nanotext params -> the record's state dict (numpy), via export-torch's mapping."""
  from nanotext.convert.torch_export import torch_state_dict
  return torch_state_dict(run.cfg, params)


def torch_choice(want: str, cfg, log=print) -> str:
  """"on" or "off": whether the torch column runs (--torch=`want`), decided before any training.
  With "auto" a column torch cannot give is left out with a one-line note; with "on" it is a
  UserError."""
  from nanotext.convert.torch_export import check_expressible
  from nanotext.errors import UserError
  if want == "off":
    return "off"
  try:
    if importlib.util.find_spec("torch") is None:
      raise UserError("PyTorch is not installed")
    check_expressible(cfg)
  except UserError as e:
    why = str(e)
    if want == "on":
      raise UserError(f"--torch=on: {why}; use --torch=off or --torch=auto") from None
    log(f"the record (torch) column is left out: {why}")
    return "off"
  return "on"


def make_reference(run, state: dict, *, dtype="bfloat16", fp8_head=True, ns_dtype="bfloat16",
                   device="cpu"):
  """(RecordGPT, Optimizers) of record_torch at `run`'s shape, holding `state` (torch names)."""
  import torch
  import record_torch
  m = run.cfg.model
  rows = m.embed_rows if m.embed_rows > 0 else m.vocab_size
  model = record_torch.RecordGPT(rows, m.d_model, num_layers=m.num_layers,
                                 dtype=getattr(torch, dtype), fp8_head=fp8_head)
  record_torch.load_state(model, state)
  model.to(device)
  opt = record_torch.Optimizers(model, run.cfg.train.steps, getattr(torch, ns_dtype))
  return model, opt


def train_reference(run, model, opt, batches, loss_chunk: int = 0, after_step=None) -> list:
  """record_torch train steps 0.. on the same batches (each row one GPU's); per-step losses.
  `after_step(step, model)` is called after each step."""
  import torch
  import record_torch
  dev = next(model.parameters()).device
  losses = []
  for step, b in enumerate(batches):
    rows = [(torch.as_tensor(x, dtype=torch.long, device=dev),
             torch.as_tensor(y, dtype=torch.long, device=dev))
            for x, y in zip(b["inputs"], b["targets"])]
    losses.append(record_torch.train_step(model, opt, rows, step, run.eot_id, loss_chunk))
    if after_step:
      after_step(step, model)
  return losses


def reference_params(model) -> dict:
  """A RecordGPT's parameters as float32 numpy arrays, by name."""
  return {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}


def max_rel(a, b, start: int = 0) -> float:
  """Largest |a - b| / |b| over steps start.."""
  a, b = np.asarray(a[start:], np.float64), np.asarray(b[start:], np.float64)
  return float(np.max(np.abs(a - b) / np.abs(b))) if len(a) else float("nan")


def table(columns: dict, reference: str, skip: int) -> str:
  """Markdown: one row per step, one column per run, then the largest relative differences
  from `reference` over every step and after the first `skip`."""
  names = list(columns)
  n = len(columns[names[0]])
  out = ["| step | " + " | ".join(names) + " |", "| --- " * (len(names) + 1) + "|"]
  out += [f"| {s + 1} | " + " | ".join(f"{columns[k][s]:.5f}" for k in names) + " |"
          for s in range(n)]
  out.append("")
  for k in names:
    if k != reference:
      line = f"max |{k} - {reference}| / {reference}: {max_rel(columns[k], columns[reference]):.2e}"
      if n > skip:
        line += f" (steps {skip + 1}-{n}: {max_rel(columns[k], columns[reference], skip):.2e})"
      d = np.asarray(columns[k], np.float64) / np.asarray(columns[reference], np.float64) - 1
      out.append(line + f"; mean {np.mean(np.abs(d)):.2e}, signed mean {np.mean(d):+.2e}")
  return "\n".join(out)


def read_table(path: str) -> dict:
  """The columns of a table this script printed (its log), by name."""
  lines = [ln.strip() for ln in open(path) if ln.startswith("| ")]
  if len(lines) < 3:
    from nanotext.errors import UserError
    raise UserError(f"'{path}' holds no table this script printed")
  names = [c.strip() for c in lines[0].strip("|").split("|")][1:]
  rows = [[float(c) for c in ln.strip("|").split("|")[1:]] for ln in lines[2:]]
  return {n: [r[i] for r in rows] for i, n in enumerate(names)}


def plot(columns: dict, reference: str, out: str, title: str) -> None:
  """The loss of every column per step, and each one's relative difference from `reference`."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True,
                                    gridspec_kw={"height_ratios": [2, 1]})
  steps = np.arange(1, len(columns[reference]) + 1)
  want = np.asarray(columns[reference], np.float64)
  for name, losses in columns.items():
    top.plot(steps, losses, label=name, lw=1.2)
    if name != reference:
      bottom.plot(steps, 100 * (np.asarray(losses) / want - 1), label=name, lw=1)
  top.set_ylabel("training loss")
  top.legend()
  top.set_title(title, fontsize=9)
  bottom.axhline(0, color="k", lw=0.6)
  bottom.set_ylabel(f"% from {reference}")
  bottom.set_xlabel("step")
  fig.tight_layout()
  fig.savefig(out, dpi=110)


USAGE = ("usage: python benchmarks/learning_check.py [--config=FILE] [--steps=150] "
         "[--set=key=value ...] [--torch=auto|on|off] [--plot=PNG] | --from_table=LOG")


def main(argv):
  from absl import flags
  FLAGS = flags.FLAGS
  import bench_cli
  from nanotext.errors import UserError, fail
  if len(argv) > 1:
    raise UserError(f"unexpected argument '{argv[1]}'; {USAGE}")
  if FLAGS.from_table:
    bench_cli.existing_file(FLAGS.from_table, "--from_table")
  bench_cli.at_least(1, steps=FLAGS.steps)
  bench_cli.at_least(0, run_steps=FLAGS.run_steps, skip=FLAGS.skip)
  if FLAGS.plot:
    bench_cli.writable_file(FLAGS.plot, "--plot")
  import jax
  if FLAGS.from_table:  # a past run's printed table: its summary (and --plot) again
    columns = read_table(FLAGS.from_table)
    reference = "record (torch)" if "record (torch)" in columns else "nanotext bf16 head"
    print(table(columns, reference, FLAGS.skip))
    if FLAGS.plot:
      plot(columns, reference, FLAGS.plot, FLAGS.title or FLAGS.from_table)
    return
  try:
    overrides = list(FLAGS.set) + [f"train.steps={FLAGS.steps}"]
    run_fp8 = make_run(FLAGS.config, overrides + ["model.fp8_head=true"])
    run_bf16 = make_run(FLAGS.config, overrides + ["model.fp8_head=false"])
    want_torch = torch_choice(FLAGS.torch, run_fp8.cfg)
  except UserError as e:
    fail(str(e))
  cfg = run_fp8.cfg
  print(f"{FLAGS.config} {' '.join(overrides)}: {cfg.train.batch_size} x {cfg.train.seq_len} "
        f"tokens/step, d_model {cfg.model.d_model}, {cfg.model.num_layers} layers, on "
        f"{jax.devices()[0].device_kind}", flush=True)
  batches = rows_of(run_fp8, FLAGS.run_steps or FLAGS.steps)
  params = host_params(run_fp8.init_state())
  columns = {}
  for name, run in (("nanotext FP8", run_fp8), ("nanotext bf16 head", run_bf16)):
    _, columns[name] = train_nanotext(run, run.state_from_params(params), batches, log=print)
    print(f"{name}: done", flush=True)
  if want_torch == "on":
    import torch
    device = FLAGS.torch_device
    if device == "auto":
      device = "cuda" if torch.cuda.is_available() else "cpu"
    model, opt = make_reference(run_fp8, torch_state(run_fp8, params), device=device)
    t0 = time.perf_counter()
    columns["record (torch)"] = train_reference(run_fp8, model, opt, batches,
                                                loss_chunk=cfg.train.loss_chunk and 4096)
    print(f"record (torch, {device}): {time.perf_counter() - t0:.0f} s", flush=True)
  reference = "record (torch)" if "record (torch)" in columns else "nanotext bf16 head"
  print(table(columns, reference, FLAGS.skip))
  if FLAGS.plot:
    plot(columns, reference, FLAGS.plot, FLAGS.title or (
        f"{FLAGS.config} {' '.join(overrides)} on {jax.devices()[0].device_kind}"))


if __name__ == "__main__":
  from absl import flags
  import bench_cli
  flags.DEFINE_string("config", CONFIG, "config file (the shipped record by default)")
  flags.DEFINE_integer("steps", 150, "the schedules' length (train.steps)")
  flags.DEFINE_integer("run_steps", 0, "steps to run (0: --steps), the first of the schedule")
  flags.DEFINE_multi_string("set", [], "a key=value override; repeatable")
  flags.DEFINE_enum("torch", "auto", ["auto", "on", "off"], "the PyTorch record reference")
  flags.DEFINE_enum("torch_device", "auto", ["auto", "cpu", "cuda"], "where it runs")
  flags.DEFINE_integer("skip", 5, "the first steps left out of the second difference")
  flags.DEFINE_string("plot", "", "also draw the curves and their differences to this PNG")
  flags.DEFINE_string("title", "", "the plot's title (default: the run)")
  flags.DEFINE_string("from_table", "", "read the columns from this script's printed table "
                      "(a log) instead of training")
  bench_cli.run(main, USAGE, __doc__)
