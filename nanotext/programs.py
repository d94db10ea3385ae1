"""Ahead-of-time step programs: which distinct programs a window schedule needs (`train_plan`),
compiled together before the loop (`compile_all`), and `Programs`, which runs the one serving
each stage. Shared by the loop and by compile.py. On a terminal, a status line counts the
seconds while XLA compiles (a record-shape program takes minutes on a TPU)."""

import concurrent.futures
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from nanotext import trainer
from nanotext.wiring import Run
from nanotext.model.kernels.dispatch import takes_runtime_window
from nanotext.window_schedule import plan, stages, step_stage

# Options every TPU program is compiled with, on a chip or for a description of one: libtpu
# generates a kernel that comes out the same as another once, and stores it once (speedrun.yml
# for v6e-8: program code 0.24 GiB -> 45 MiB per chip, and less compile time; RESULTS.md).
TPU_OPTIONS = {"xla_tpu_enable_deduplicated_calls": True}


def compile_lowered(lowered, backend: str, options: dict | None = None):
  """`lowered.compile()` with `options`, plus TPU_OPTIONS on a TPU; a libtpu that does not know
  one of those (another version) compiles without them."""
  extra = TPU_OPTIONS if backend == "tpu" else {}
  try:
    return lowered.compile(compiler_options={**(options or {}), **extra} or None)
  except Exception as e:  # noqa: BLE001 -- jax raises its runtime error type for an unknown option
    if not any(f"No such compile option: '{k}'" in str(e) for k in extra):
      raise
  return lowered.compile(compiler_options=options)


class StatusLine:
  """One line on a terminal, rewritten in place (`compiling 3 program(s): 1 done, 42 s`) and
  cleared before each log line; nothing where stdout is not a terminal (a log file, a pipe) or
  on any process but the first."""

  def __init__(self, stream=None):
    stream = sys.stdout if stream is None else stream
    try:
      tty = stream.isatty() and jax.process_index() == 0
    except (AttributeError, ValueError):  # no isatty, or a closed stream
      tty = False
    self.stream, self.width = (stream if tty else None), 0

  def show(self, text: str) -> None:
    self._write("\r" + text.ljust(self.width))
    self.width = len(text) if self.stream else 0

  def clear(self) -> None:
    if self.width:
      self._write("\r" + " " * self.width + "\r")
    self.width = 0

  def _write(self, text: str) -> None:
    if self.stream is None:
      return
    try:
      self.stream.write(text)
      self.stream.flush()
    except (OSError, ValueError):  # the terminal went away: the run goes on without the line
      self.stream = None


def wait_compiling(futures: dict, on_done, what: str, status: StatusLine | None = None) -> None:
  """Wait for `futures` ({future: key}), calling `on_done(key, result)` as each finishes, with
  the status line `what: N done, S s` (one future: `what: S s`) until the last, then cleared."""
  status = status or StatusLine()
  t0, pending, done = time.perf_counter(), set(futures), 0
  try:
    while pending:
      elapsed = f"{time.perf_counter() - t0:.0f} s"
      status.show(f"{what}: {done} done, {elapsed}" if len(futures) > 1 else f"{what}: {elapsed}")
      finished, pending = concurrent.futures.wait(
          pending, timeout=1.0, return_when=concurrent.futures.FIRST_COMPLETED)
      for future in finished:
        status.clear()
        done += 1
        on_done(futures[future], future.result())
  finally:
    status.clear()


def compile_showing(lowered, backend: str, options: dict | None, what: str):
  """compile_lowered in a worker thread while the main thread keeps the status line (`what: S
  s`); the compile's exceptions are raised here."""
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    future = pool.submit(compile_lowered, lowered, backend, options)
    wait_compiling({future: what}, lambda *_: None, what)
    return future.result()


def windows_args(run: Run, program) -> tuple:
  """The abstract windows argument of `program` (a window_schedule.Program) for lowering: an
  int32 [layers] where it takes its windows at run time, else nothing."""
  return tuple(jax.ShapeDtypeStruct((run.cfg.model.num_layers,), jnp.int32, sharding=sh)
               for sh in trainer.windows_sharding(run, program.runtime))


@dataclasses.dataclass
class Programs:
  """Compiled step programs and the one serving each stage (windows, row length): calling it
  with a stage runs that program, giving it the train step's schedule argument and the stage's
  windows where it takes them at run time."""
  plan: dict     # stage -> window_schedule.Program
  execs: dict    # Program -> compiled executable
  windows: dict  # per-layer windows -> replicated int32 [layers] device array (runtime programs)
  extra: tuple = ()  # train programs: (trainer.schedule_of(run),)

  def __call__(self, stage, *args):
    program = self.plan[stage]
    return self.execs[program](*args, *self.extra,
                               *((self.windows[stage[0]],) if program.runtime else ()))

  def __len__(self) -> int:
    return len(self.execs)


def compile_programs(run: Run, kind: str, stage_plan: dict, args, log=print) -> Programs:
  """AOT-compile each distinct program of `stage_plan` ({stage: Program}) for `args`, logging a
  line per program (name, seconds) as it finishes; `kind` is train or eval."""
  return compile_all(run, [(kind, stage_plan, args)], log)[0]


def compile_all(run: Run, jobs, log=print) -> list:
  """compile_programs for each (kind, stage_plan, args) of `jobs`, one Programs per job.

  Tracing runs one after another (the sharding rules in force while tracing are global); XLA
  compilations of every job run together in a thread pool, since they are independent and
  release the GIL (the train and eval programs on 2 cores, many schedule stages on many).
  """
  lowered, seconds, todo = {}, {}, []
  for kind, stage_plan, args in jobs:
    make = trainer.make_train_step if kind == "train" else trainer.make_eval_step
    for p in dict.fromkeys(stage_plan.values()):
      t0 = time.perf_counter()
      static = (p.windows, p.seq_len) if kind == "train" else (p.windows,)
      lowered[kind, p] = make(run, *static, runtime=p.runtime).lower(*args, *windows_args(run, p))
      seconds[kind, p] = time.perf_counter() - t0
      todo.append((kind, p))

  def compile_one(key):
    t0 = time.perf_counter()
    return compile_lowered(lowered[key], run.backend), time.perf_counter() - t0

  with_len = {kind: len({p.seq_len for k, p in todo if k == kind}) > 1 for kind, _, _ in jobs}
  execs = {kind: {} for kind, _, _ in jobs}
  workers = max(1, min(len(todo), os.cpu_count() or 1))

  def finished(key, result):
    kind, p = key
    execs[kind][p], secs = result
    log(f"compiled {kind} ({p.describe(with_len[kind])}) in {seconds[kind, p] + secs:.1f} s")

  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    futures = {pool.submit(compile_one, key): key for key in todo}
    wait_compiling(futures, finished, f"compiling {len(todo)} program(s)")
  n_layers, replicated = run.cfg.model.num_layers, NamedSharding(run.mesh, P())
  out = []
  for kind, stage_plan, _ in jobs:
    # Each stage's windows on the devices once, before the loop (no transfer per step).
    windows = {w: jax.make_array_from_callback((n_layers,), replicated,
                                               lambda i, w=w: np.asarray(w, np.int32)[i])
               for (w, _), p in stage_plan.items() if p.runtime}
    out.append(Programs(stage_plan, execs[kind], windows,
                        (trainer.schedule_of(run),) if kind == "train" else ()))
  return out


def compile_train_steps(run: Run, state, batch, steps, log=print) -> Programs:
  """The train programs that 0-based `steps` need, compiled: one per stage (windows, row length),
  or one per row length with a kernel that takes the windows at run time; called as
  `programs(window_schedule.step_stage(cfg, step), state, batch)`."""
  return compile_programs(run, "train", train_plan(run, steps), (state, batch), log)


def train_plan(run: Run, steps) -> dict:
  """{stage: Program} of the train programs that 0-based `steps` need."""
  if isinstance(steps, range) and steps.step == 1:
    needed = stages(run.cfg, steps.start, steps.stop)
  else:
    needed = list(dict.fromkeys(step_stage(run.cfg, s) for s in steps))  # in order of use
  return plan(needed, takes_runtime_window(run.impl))
