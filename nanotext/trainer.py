"""The train step, the eval step and the training loop."""

import concurrent.futures
import contextlib
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from nanotext import checkpoint, metrics, sharding
from nanotext.wiring import Run, new_state
from nanotext.watch import CompileCounter, Monitor, Preemption, Profiler, StartupClock
from nanotext.model.kernels.dispatch import takes_runtime_window
from nanotext.model.loss import loss_fn
from nanotext.window_schedule import (eval_plan, eval_points, eval_windows, plan, stages,
                                      step_stage, step_windows)


def make_train_step(run: Run, windows=None, seq_len: int = 0, runtime: bool = False):
  """jit(state, batch) -> (state, metrics), state donated, with gradient accumulation.

  `windows` (a tuple of static per-layer ints, one attention.window_schedule stage) and
  `seq_len` (a train.seq_len_start warmup length; 0 = the batch's) are baked into the program.
  With `runtime`, the step is jit(state, batch, windows [layers] int32) and `windows` are their
  static bounds: one program for every window stage (kernels/dispatch.takes_runtime_window).
  Shorter rows are the batch's rows cut into pieces (same tokens, targets still the next token),
  run in micro-batches of as many rows as at full length (modded-nanogpt-jax's fixed
  micro-batch).
  train.loss_reduction=row_sum steps on the gradient of each row's summed loss (the record's).

  A step whose loss or gradient norm is not finite leaves params and optimizer state as they
  were when train.on_nonfinite=skip (selected on device: no host sync); with abort the host
  stops the run when it reads the step's metrics, before that state is checkpointed.
  """
  accum, graphdef, tx = run.cfg.train.grad_accum, run.graphdef, run.tx
  skip = run.cfg.train.on_nonfinite == "skip"
  row_sum = run.cfg.train.loss_reduction == "row_sum"

  def objective(p, x, y, live):
    loss = loss_fn(graphdef, p, x, y, run.eot_id, windows, run.cfg.train.loss_chunk,
                   per_row=row_sum, runtime_windows=live)
    # row_sum steps on each row's summed loss (mean over rows); the metric stays the token mean.
    return loss, loss / x.shape[1] if row_sum else loss
  grad_fn = jax.value_and_grad(objective, has_aux=True)

  def micro_batches(a_BT, accum):
    # Row r goes to micro-batch r % accum, so each device's rows spread over all micro-batches.
    b, t = a_BT.shape
    a = a_BT.reshape(b // accum, accum, t).swapaxes(0, 1)
    return sharding.constrain(a, (None, "batch", "act_length"))

  def step_fn(state, batch, *runtime_windows):
    live = runtime_windows[0] if runtime_windows else None
    B, T = batch["inputs"].shape
    cut = T // seq_len if seq_len and seq_len < T else 1
    n_micro = accum * cut
    if cut > 1:  # each row's tokens as `cut` consecutive rows; they stay on their device
      batch = {k: sharding.constrain(v.reshape(B * cut, T // cut), ("batch", "act_length"))
               for k, v in batch.items()}
    with sharding.use_rules(run.rules, run.mesh):
      params = state["params"]
      if n_micro == 1:
        (_, loss), grads = grad_fn(params, batch["inputs"], batch["targets"], live)
      else:
        def body(carry, xy):
          (_, loss), grads = grad_fn(params, *xy, live)
          return jax.tree.map(jnp.add, carry, (loss, grads)), None
        zeros = (jnp.zeros([], jnp.float32), jax.tree.map(jnp.zeros_like, params))
        xs = (micro_batches(batch["inputs"], n_micro), micro_batches(batch["targets"], n_micro))
        (loss, grads), _ = jax.lax.scan(body, zeros, xs)
        loss, grads = loss / n_micro, jax.tree.map(lambda g: g / n_micro, grads)
      # The logged norm is of the mean loss's gradient, whichever loss_reduction steps.
      grad_norm = optax.global_norm(grads) / (T // cut if row_sum else 1)
      updates, opt_state = tx.update(grads, state["opt_state"], params)
      new_params = optax.apply_updates(params, updates)
      if skip:
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jnp.where(finite, new, old)
        new_params = jax.tree.map(keep, new_params, params)
        opt_state = jax.tree.map(keep, opt_state, state["opt_state"])
    metrics = {"loss": loss, "grad_norm": grad_norm}
    return new_state(state["step"] + 1, new_params, opt_state), metrics

  batch_sh = {"inputs": run.batch_sharding, "targets": run.batch_sharding}
  return jax.jit(step_fn, in_shardings=(run.state_shardings, batch_sh) + _windows_sh(run, runtime),
                 out_shardings=(run.state_shardings, None), donate_argnums=0)


def make_eval_step(run: Run, windows=None, runtime: bool = False):
  """jit(params, batch) -> mean loss at per-layer `windows` (None: the final ones), with the
  evaluation head (no FP8, as the record's eval mode); with `runtime`, jit(params, batch,
  windows [layers] int32) and `windows` their static bounds."""
  def eval_fn(params, batch, *runtime_windows):
    with sharding.use_rules(run.rules, run.mesh):
      return loss_fn(run.graphdef, params, batch["inputs"], batch["targets"], run.eot_id,
                     windows, chunk=run.cfg.train.eval_loss_chunk, train=False,
                     runtime_windows=runtime_windows[0] if runtime_windows else None)
  batch_sh = {"inputs": run.batch_sharding, "targets": run.batch_sharding}
  return jax.jit(eval_fn, in_shardings=(run.state_shardings["params"], batch_sh)
                 + _windows_sh(run, runtime))


def _windows_sh(run: Run, runtime: bool) -> tuple:
  """The sharding of a runtime windows argument (replicated), if the program takes one."""
  return (NamedSharding(run.mesh, P()),) if runtime else ()


def windows_args(run: Run, program) -> tuple:
  """The abstract windows argument of `program` (a window_schedule.Program) for lowering: an
  int32 [layers] where it takes its windows at run time, else nothing."""
  return tuple(jax.ShapeDtypeStruct((run.cfg.model.num_layers,), jnp.int32, sharding=sh)
               for sh in _windows_sh(run, program.runtime))


def global_batch(run: Run, local: dict) -> dict:
  """Global jax.Arrays sharded along `batch`, built from this process's rows."""
  return {k: jax.make_array_from_process_local_data(run.batch_sharding, np.asarray(v))
          for k, v in local.items()}


@dataclasses.dataclass
class Programs:
  """Compiled step programs and the one serving each stage (windows, row length): calling it
  with a stage runs that program, giving it the stage's windows where it takes them at run time."""
  plan: dict     # stage -> window_schedule.Program
  execs: dict    # Program -> compiled executable
  windows: dict  # per-layer windows -> replicated int32 [layers] device array (runtime programs)

  def __call__(self, stage, *args):
    program = self.plan[stage]
    return self.execs[program](*args, *((self.windows[stage[0]],) if program.runtime else ()))

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
    make = make_train_step if kind == "train" else make_eval_step
    for p in dict.fromkeys(stage_plan.values()):
      t0 = time.perf_counter()
      static = (p.windows, p.seq_len) if kind == "train" else (p.windows,)
      lowered[kind, p] = make(run, *static, runtime=p.runtime).lower(*args, *windows_args(run, p))
      seconds[kind, p] = time.perf_counter() - t0
      todo.append((kind, p))

  def compile_one(key):
    t0 = time.perf_counter()
    return lowered[key].compile(), time.perf_counter() - t0

  with_len = {kind: len({p.seq_len for k, p in todo if k == kind}) > 1 for kind, _, _ in jobs}
  execs = {kind: {} for kind, _, _ in jobs}
  workers = max(1, min(len(todo), os.cpu_count() or 1))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    futures = {pool.submit(compile_one, key): key for key in todo}
    for future in concurrent.futures.as_completed(futures):
      kind, p = futures[future]
      execs[kind][p], secs = future.result()
      log(f"compiled {kind} ({p.describe(with_len[kind])}) in {seconds[kind, p] + secs:.1f} s")
  n_layers, replicated = run.cfg.model.num_layers, NamedSharding(run.mesh, P())
  out = []
  for kind, stage_plan, _ in jobs:
    # Each stage's windows on the devices once, before the loop (no transfer per step).
    windows = {w: jax.make_array_from_callback((n_layers,), replicated,
                                               lambda i, w=w: np.asarray(w, np.int32)[i])
               for (w, _), p in stage_plan.items() if p.runtime}
    out.append(Programs(stage_plan, execs[kind], windows))
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


@dataclasses.dataclass
class LoopResult:
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
  log(f"compiled {len(train_execs)} train step program(s){evals_said} ({programs} in all) in "
      f"{compile_s:.1f} s")
  if clock is not None:
    clock.lap("compile")
    log(clock.line({"compile": f"{programs} programs"}))

  def evaluate(params, done):
    stage = (eval_windows(cfg, done), t_cfg.eval_seq_len or t_cfg.seq_len)
    losses = [eval_execs(stage, params, b) for b in val_batches]
    return float(np.mean(jax.device_get(losses)))

  if at_start:  # the record validates the initial weights too (outside its timed steps)
    row = metrics.val_row(evaluate(state["params"], 0), bytes_per_token)
    writer.write(0, row)
    log(f"step {0:>6d} | {metrics.val_text(row)}")
  mon = Monitor(run, writer, log, counter, start_step=start_step, skipped=skipped_steps,
                windows_of=lambda step: step_windows(cfg, step))
  profiler = Profiler(cfg, log)

  def save(step, state, data_state):
    # Only a state whose every step was read back finite may reach disk.
    mon.flush()
    if manager is not None:
      active, counter.active = counter.active, False  # orbax compiles its own transfers
      checkpoint.save(manager, step, state, {"iterator": data_state,
                                             "skipped_steps": mon.skipped}, config_dict)
      counter.active = active

  val_loss = float("nan")
  batch = first
  preemption = preemption or Preemption(t_cfg.log_every)
  with preemption, contextlib.ExitStack() as stack:
    stack.callback(profiler.stop)  # a trace in progress is written even if the loop fails
    counter.active = True
    preemption.begin_training()  # a signal from here on saves and stops; before, it just stops
    for step in range(start_step, t_cfg.steps):
      done = step + 1
      with profiler.step(step):
        state, step_metrics = train_execs(step_stage(cfg, step), state, batch)
      saved_state = data_state
      if done < t_cfg.steps:
        batch = global_batch(run, next(train_iter))  # overlaps with the step just dispatched
        data_state = train_iter.get_state()
      profiler.after(step, state)
      mon.flush_if_logging()
      mon.add(done, step_metrics)
      if (t_cfg.eval_every and done % t_cfg.eval_every == 0 and done < t_cfg.steps
          and eval_exec is not None):
        val_loss = evaluate(state["params"], done)
        row = metrics.val_row(val_loss, bytes_per_token)
        writer.write(done, row)
        log(f"step {done:>6d} | {metrics.val_text(row)}")
      stop = done < t_cfg.steps and preemption.requested(done)
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
    if eval_exec is not None:
      val_loss = evaluate(state["params"], t_cfg.steps)
      row = metrics.val_row(val_loss, bytes_per_token)
      writer.write(t_cfg.steps, row)
      log(f"step {t_cfg.steps:>6d} | {metrics.val_text(row)} (final)")
    if start_step < t_cfg.steps:
      save(t_cfg.steps, state, data_state)
  log(f"compilations inside the training loop: {counter.count}")
  return LoopResult(state, mon.last_loss, val_loss, counter.count, compile_s,
                    skipped_steps=mon.skipped, programs=programs)
