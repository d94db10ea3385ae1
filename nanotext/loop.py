"""The training loop: steps dispatched ahead, metrics read one step late, evaluation, saves, and
a clean stop on a signal."""

import contextlib
import dataclasses
import time

import jax
import numpy as np

from nanotext import checkpoint, metrics
from nanotext.programs import compile_all, train_plan
from nanotext.trainer import dispatch_each, global_batch
from nanotext.wiring import Run
from nanotext.watch import CompileCounter, Monitor, Preemption, Profiler, StartupClock
from nanotext.model.kernels.dispatch import takes_runtime_window
from nanotext.window_schedule import eval_plan, eval_points, eval_windows, step_stage, step_windows


@dataclasses.dataclass
class LoopResult:
  """What train() ran to: the state, the last finite train loss of a step it ran (nan where it
  ran none: a finished run started again) and the last val_loss (nan: none)."""
  state: dict
  last_loss: float
  val_loss: float
  compiles_in_loop: int
  compile_seconds: float
  preempted: bool = False
  skipped_steps: int = 0
  programs: int = 0  # executables compiled before the loop (train stages + eval)


def train(run: Run, state, train_iter, val_batches, *, writer, manager, start_step: int,
          config_dict: dict, log=print, skipped_steps: int = 0,
          preemption: Preemption | None = None,
          bytes_per_token: float | None = None, clock: StartupClock | None = None) -> LoopResult:
  """Run steps start_step..train.steps: log one step late, evaluate, checkpoint, and stop
  cleanly (save, then return) on SIGTERM/SIGINT (`preemption`: a caller's, covering more).
  `bytes_per_token` (of the validation targets) adds bits per byte to every eval; `clock`
  (the caller's start-up phases) gets the compile phase, and its line is logged before step 1."""
  cfg = run.cfg
  t_cfg = cfg.train
  counter = CompileCounter()

  first = global_batch(run, next(train_iter))
  data_state = train_iter.get_state()  # batches consumed through the step about to run
  if clock is not None:
    clock.lap("data")
  # Compile ahead of time so that compile time is reported apart and the loop cannot retrace.
  t0 = time.perf_counter()
  # Every program the schedule needs is compiled here (one for all window stages where the kernel
  # takes the windows at run time), so a window change in the loop only switches inputs or
  # executables.
  jobs = [("train", train_plan(run, range(start_step, t_cfg.steps)), (state, first))]
  at_start = t_cfg.eval_at_start and start_step == 0 and bool(val_batches)
  evals = eval_points(t_cfg, start_step)
  if val_batches:
    jobs.append(("eval", eval_plan(cfg, evals, takes_runtime_window(run.impl)),
                 (state["params"], val_batches[0])))
  train_execs, *rest = compile_all(run, jobs, log)
  eval_execs = rest[0] if rest else {}
  eval_exec = bool(eval_execs) or None
  compile_s = time.perf_counter() - t0
  programs = len(train_execs) + len(eval_execs)
  n_eval = len(eval_execs)
  evals_said = "" if not n_eval else " and the eval step" if n_eval == 1 else \
      f" and {n_eval} eval step programs"
  n_train = len(train_execs)
  trains = (f"{n_train} train step program{'s' if n_train > 1 else ''}" if n_train else
            "no train step program (no step left to train)")  # a finished run started again
  log(f"compiled {trains}{evals_said} ({programs} in all) in {compile_s:.1f} s")
  if clock is not None:
    clock.lap("compile")
    log(clock.line({"compile": f"{programs} program{'s' if programs != 1 else ''}"}))

  def evaluate(params, done):
    stage = (eval_windows(cfg, done), t_cfg.eval_seq_len or t_cfg.seq_len)
    losses = dispatch_each(run, lambda b: eval_execs(stage, params, b), val_batches)
    return float(np.mean(jax.device_get(losses)))

  start_row = None
  if at_start:  # the record validates the initial weights too (outside its timed steps)
    start_row = metrics.val_row(evaluate(state["params"], 0), bytes_per_token)
    log(f"step {0:>6d} | {metrics.val_text(start_row)}")
  mon = Monitor(run, writer, log, counter, start_step=start_step, skipped=skipped_steps,
                windows_of=lambda step: step_windows(cfg, step))
  profiler = Profiler(cfg, log, start_step)

  def save(step, state, data_state):
    # Only a state whose every step was read back finite may reach disk.
    mon.flush()
    if manager is not None:
      writer.sync()  # the rows up to `step` reach the disk before its checkpoint does
      active, counter.active = counter.active, False  # orbax compiles its own transfers
      with mon.paused():
        checkpoint.save(manager, step, state, {"iterator": data_state,
                                               "skipped_steps": mon.skipped}, config_dict)
      counter.active = active
      mon.saved = step

  val_loss = float("nan")
  batch = first
  preemption = preemption or Preemption()
  with preemption, contextlib.ExitStack() as stack:
    stack.callback(profiler.stop)  # a trace in progress is written even if the loop fails
    counter.active = True
    preemption.begin_training()  # a signal from here on saves and stops; before, it just stops
    writer.begin()  # a resumed run's rows past its step go, even if it stops before its first
    if start_row is not None:  # written once training began: a stop before it changes nothing
      writer.write(0, start_row)
    for step in range(start_step, t_cfg.steps):
      done = step + 1
      with profiler.step(step):
        state, step_metrics = train_execs(step_stage(cfg, step), state, batch)
      saved_state = data_state
      if done < t_cfg.steps:
        batch = global_batch(run, next(train_iter))  # overlaps with the step just dispatched
        data_state = train_iter.get_state()
      profiler.after(step, state, mon.paused)
      mon.flush_if_logging()
      mon.add(done, step_metrics)
      if (t_cfg.eval_every and done % t_cfg.eval_every == 0 and done < t_cfg.steps
          and eval_exec is not None):
        mon.flush()  # the steps evaluated are finite first (no val_loss nan row before an abort)
        with mon.paused():
          val_loss = evaluate(state["params"], done)
        row = metrics.val_row(val_loss, bytes_per_token)
        writer.write(done, row)
        log(f"step {done:>6d} | {metrics.val_text(row)}")
      stop = done < t_cfg.steps and preemption.requested()
      if done < t_cfg.steps and (stop or (cfg.checkpoint.every and
                                          done % cfg.checkpoint.every == 0)):
        save(done, state, saved_state)
      if stop:
        mon.flush(final=True)
        counter.active = False
        if manager is not None:
          checkpoint.wait(manager)
        log(f"received {preemption.received}: saved the checkpoint of step {done} and "
            "stopped; the same command resumes from it")
        return LoopResult(state, mon.last_loss, val_loss, counter.count, compile_s,
                          preempted=True, skipped_steps=mon.skipped, programs=programs)
    mon.flush(final=True)
    counter.active = False
    trained = start_step < t_cfg.steps  # a finished run started again has its row and step
    if eval_exec is not None:
      val_loss = evaluate(state["params"], t_cfg.steps)
      row = metrics.val_row(val_loss, bytes_per_token)
      writer.write(t_cfg.steps, row)  # not by a finished run started again (writer disabled)
      again = ("" if trained or writer.enabled else
               "; the run was complete: evaluated again, not recorded")
      log(f"step {t_cfg.steps:>6d} | {metrics.val_text(row)} (final{again})")
    if trained:
      save(t_cfg.steps, state, data_state)
  log(f"compilations inside the training loop: {counter.count}")
  if mon.skipped:  # each was said on its step's line; the total, where a reader looks last
    every = " (every one: the parameters are those the run started with)" \
        if mon.skipped >= t_cfg.steps else ""
    log(f"warning: {mon.skipped} of {t_cfg.steps} steps skipped for a non-finite loss or "
        f"gradient norm (train.on_nonfinite=skip){every}")
  return LoopResult(state, mon.last_loss, val_loss, counter.count, compile_s,
                    skipped_steps=mon.skipped, programs=programs)
