"""What watches the training loop: compilations, metrics read late, signals, the profiler."""

import collections
import contextlib
import os
import signal
import threading
import time

import jax
import numpy as np

from nanotext import config, metrics, optim, signals
from nanotext import window_schedule


ON_NONFINITE = ("abort", "skip")


def check_config(t) -> None:
  """The train section's choices: what a non-finite step does (Monitor acts on it), and the
  windows validation runs at (window_schedule.eval_windows) and the loss the step's gradient is
  of (trainer)."""
  config.check_choices("train", t, {"on_nonfinite": ON_NONFINITE,
                                    "eval_windows": ("final", "step"),
                                    "loss_reduction": ("mean", "row_sum")})


class StartupClock:
  """Seconds of each start-up phase, for the one `start-up:` line logged before the first step."""

  def __init__(self, start: float | None = None):
    self.start = self.mark = time.perf_counter() if start is None else start
    self.phases = {}

  def lap(self, phase: str) -> None:
    """Charge the time since the previous lap to `phase`."""
    now = time.perf_counter()
    self.phases[phase] = self.phases.get(phase, 0.0) + now - self.mark
    self.mark = now

  def line(self, notes: dict | None = None) -> str:
    """'start-up: imports 2.1 s, ..., compile 12.8 s (2 programs); 17.5 s in all'."""
    notes = notes or {}
    parts = [f"{k} {v:.1f} s" + (f" ({notes[k]})" if k in notes else "")
             for k, v in self.phases.items()]
    return f"start-up: {', '.join(parts)}; {self.mark - self.start:.1f} s in all"


class CompileCounter:
  """Counts XLA backend compilations (via jax.monitoring) while `active`: those of the thread
  that made it (the loop's), not another run's in a thread beside it (a sweep) or other code's.
  One listener for the process, whatever the number of runs (each run added one before)."""

  _EVENT = "/jax/core/compile/backend_compile_duration"
  _by_thread = {}  # thread id -> the newest counter made there
  _listening = False

  def __init__(self):
    self.count, self.active = 0, False
    CompileCounter._by_thread[threading.get_ident()] = self
    if not CompileCounter._listening:
      jax.monitoring.register_event_duration_secs_listener(CompileCounter._on_event)
      CompileCounter._listening = True

  @staticmethod
  def _on_event(event, duration, **kwargs):
    del duration, kwargs
    counter = CompileCounter._by_thread.get(threading.get_ident())
    if counter is not None and counter.active and event == CompileCounter._EVENT:
      counter.count += 1


class Profiler:
  """jax.profiler trace of profile.steps steps, from the one run after profile.start_step steps.

  Every process traces its own devices; with several processes each writes under
  DIR/process_I (processes sharing a host would otherwise overwrite one <host>.xplane.pb).
  Open DIR (or one process's folder) with TensorBoard's profile plugin or XProf.
  """

  def __init__(self, cfg, log, start_step: int = 0):
    p = cfg.profile
    self.first = p.start_step if p.steps > 0 and p.start_step >= 0 else None
    self.last = None if self.first is None else p.start_step + p.steps - 1
    # one of the two set alone traced nothing and said nothing (a start past the end says so)
    if p.steps > 0 and p.start_step < 0:
      log(f"profile.steps={p.steps} with profile.start_step={p.start_step} (off): no profile is "
          "written; set profile.start_step (0 = from the first step)")
    elif p.steps <= 0 and p.start_step >= 0:
      log(f"profile.start_step={p.start_step} with profile.steps={p.steps} (off): no profile is "
          "written; set profile.steps to the number of steps to trace")
    if self.first is not None and self.last < start_step:  # resumed past it: traced, or not
      log(f"profile.start_step={p.start_step} with profile.steps={p.steps} lies before the "
          f"step this run resumes from ({start_step}, counted from 0): no profile is written")
      self.first = self.last = None
    elif self.first is not None and self.first < start_step:  # the rest of it, from here
      self.first = start_step
    self.dir = p.dir or os.path.join(cfg.output_dir, "profile")
    if jax.process_count() > 1:
      self.dir = os.path.join(self.dir, f"process_{jax.process_index()}")
    self.log, self.tracing, self.traced = log, False, None
    if self.first is not None and self.first >= cfg.train.steps:
      log(f"profile.start_step={p.start_step} is past the run's last step (train.steps="
          f"{cfg.train.steps}, counted from 0): no profile is written")

  def step(self, step: int):
    """Context around 0-based step `step`: starts the trace at the first and annotates steps."""
    if self.first is not None and step == self.first and not self.tracing:
      jax.profiler.start_trace(self.dir)
      self.tracing = True
    if not self.tracing:
      return contextlib.nullcontext()
    self.traced = step
    return jax.profiler.StepTraceAnnotation("train", step_num=step)

  def after(self, step: int, state, paused=contextlib.nullcontext) -> None:
    """Stops the trace after the last traced step, once its device work has finished; writing
    it is inside `paused()` (Monitor.paused: not training time, it halved tokens/s for 10 rows).
    """
    if self.tracing and step >= self.last:
      jax.block_until_ready(state)
      with paused():
        self.stop()

  def stop(self) -> None:
    if self.tracing:
      jax.profiler.stop_trace()
      self.tracing = False
      # Logged with the 1-based step numbers of the metric lines.
      # The last step traced: before self.last where the run ended first.
      self.log(f"profile of steps {self.first + 1}..{self.traced + 1} written to {self.dir}")


class NonFiniteError(RuntimeError):
  """A non-finite loss or gradient norm under train.on_nonfinite=abort: exit status 1."""


class Preemption:
  """While active, SIGTERM and SIGINT only set a flag; the loop saves and exits at a step end.

  Before the first step there is nothing to save: with `on_early_stop` set, a signal stops the
  process at once (even mid-compilation, which can take minutes), after that callback has put
  output_dir back as it was; it returns the line printed. Inside `deferred()` (while output_dir
  is being changed) the stop waits for the block's end. A second Ctrl-C stops at once.
  """

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, on_early_stop=None):
    self.received, self._previous, self._depth, self._agree = None, {}, 0, None
    self.on_early_stop = on_early_stop  # signal name -> message; runs in the signal handler
    self.training = False  # set once the first step is dispatched
    self._deferring, self._pending = 0, None
    self._watched, self._stopping = None, threading.Lock()

  def __enter__(self):
    # Re-entrant: train.run holds it for the whole run, the loop enters it again.
    self._depth += 1
    # signal.signal works only in the main thread; elsewhere (a library caller) keep defaults.
    if self._depth == 1 and jax.process_count() > 1:  # compiled now, not in the loop
      self._agree = Agreement()
    if self._depth == 1 and threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._on_signal)
      self._watched = signals.owned_by(self._on_watched_signal)
      self._watched.__enter__()
    return self

  def __exit__(self, *exc):
    self._depth -= 1
    if self._depth:
      return
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}
    if self._watched is not None:
      self._watched.__exit__(None, None, None)
      self._watched = None

  def begin_training(self) -> None:
    """From the first step on, a signal asks for a checkpoint and a clean stop."""
    self.training = True

  @contextlib.contextmanager
  def deferred(self):
    """A block that changes output_dir: an early stop waits for its end."""
    self._deferring += 1
    try:
      yield
    finally:
      self._deferring -= 1
      if not self._deferring and self._pending is not None and not self.training:
        self._stop_now(self._pending)

  def _on_signal(self, signum, frame):
    del frame
    if self.received == "SIGINT" and signum == signal.SIGINT and self._previous:
      if not signals.watching():  # a library caller (a notebook): Python's own Ctrl-C
        raise KeyboardInterrupt
      # Ctrl-C again: do not wait for the save (a hung file system would never return); the
      # step being written is discarded, the newest complete one stays. Only SIGINT: a
      # launcher may deliver SIGTERM twice, and preemption must get its checkpoint.
      signals.say(2, "nanotext: error: a second SIGINT: stopped without waiting for the "
                     "checkpoint being written (an earlier complete one, if any, is kept)")
      os._exit(128 + signum)
    if self.training or self.on_early_stop is None:
      self.received = signal.Signals(signum).name
    elif self._deferring:
      self._pending = signum
    else:
      self._stop_now(signum)

  def _on_watched_signal(self, signum: int) -> None:
    """The signal as the watching thread sees it (signals.py): before the first step it stops
    the run at once even while the main thread is inside a long call into XLA, which would
    put off the handler above until that call returned."""
    if not self.training and self.on_early_stop is not None and not self._deferring:
      self._stop_now(signum)

  def _stop_now(self, signum: int) -> None:
    """Put output_dir back, print one line, exit 128 + signal (the shell's status for it).

    os._exit: compile threads cannot be joined, and nothing is left to flush. The line is
    written with os.write: the signal may have landed inside a print to the same stream.
    The handler in the main thread and the watching thread may both get here: one stops.
    A library caller's process (train.run in a notebook) is not ended: the exception Python
    raises for the signal unwinds the run (output_dir put back as after any failure)."""
    if not signals.watching():
      raise KeyboardInterrupt if signum == signal.SIGINT else signals.Terminated()
    self._stopping.acquire()  # never released: the first caller ends the process
    name = signal.Signals(signum).name
    try:
      message = self.on_early_stop(name)
    except Exception as e:  # pylint: disable=broad-except  # still exit: never hang here
      message = f"stopped by {name} before the first step ({type(e).__name__}: {e})"
    signals.say(2, f"nanotext: error: {message}")
    os._exit(128 + signum)

  def requested(self) -> bool:
    """True when this run must stop after the step just dispatched; all processes agree on the
    step, one step after the signal (it was the next logging step: a SIGTERM at log_every=300
    trained on for 81 s, past a cloud's grace period). Called once per step."""
    if self._agree is None:
      return self.received is not None
    if self._agree(self.received is not None):
      self.received = self.received or "SIGTERM"
      return True
    return False


class Agreement:
  """Whether any process holds a flag, agreed by all one step late: each call dispatches a
  reduction of the processes' flags over every device and reads the one dispatched by the call
  before (no wait for the step in flight; every process reads the same value at the same call).
  """

  def __init__(self):
    by_process = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))  # local: a block
    mesh = jax.sharding.Mesh(np.array(by_process), ("p",))
    self.sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("p"))
    flags = jax.ShapeDtypeStruct((jax.device_count(),), np.int32, sharding=self.sharding)
    self.reduce = jax.jit(lambda f: f.max(), out_shardings=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec())).lower(flags).compile()
    self.pending = None

  def __call__(self, flag: bool) -> bool:
    agreed = self.pending is not None and bool(np.asarray(self.pending.addressable_data(0)))
    local = np.full((jax.local_device_count(),), int(flag), np.int32)
    self.pending = None if agreed else self.reduce(
        jax.make_array_from_process_local_data(self.sharding, local, (jax.device_count(),)))
    return agreed


RATE_STEPS = 10  # tokens/s and MFU are over the last max(this, train.log_every) steps


class Monitor:
  """Reads finished steps' metrics late, checks them finite, counts skips, writes log rows."""

  def __init__(self, run, writer, log, counter, *, start_step: int, skipped: int, windows_of):
    cfg, t_cfg = run.cfg, run.cfg.train
    self.windows_of = windows_of  # 0-based step -> per-layer attention windows
    self.run, self.writer, self.log, self.counter = run, writer, log, counter
    self.tokens_per_step = t_cfg.batch_size * t_cfg.seq_len
    self._flops = {}  # (per-layer windows, row length) -> FLOPs per step (schedules change them)
    devices = list(run.mesh.devices.flat)  # the run's devices, not all
    self.peak = metrics.peak_flops(cfg.metrics, devices) * len(devices)
    own = metrics.default_peak_flops(devices)
    # An older nanotext saved its own in config.yml; it may also be set by hand there or on this
    # start's command line, which the config does not tell apart (config.yml was named for both)
    if start_step and cfg.metrics.peak_flops not in (0, own):
      log(f"mfu is against metrics.peak_flops={cfg.metrics.peak_flops:.4g} per device, as given "
          f"on the command line or in the run's config.yml (set there by hand, or by an older "
          f"nanotext); these devices' own is {own:.4g}: metrics.peak_flops=0 takes it")
    # (step, when it was read) of the rows in the rate's window: steps are read in bursts
    # (a pause of the host lets the device run ahead), so a rate over one step could be 3x high
    # (the third: seconds paused for evals and saves by then, which the rates leave out)
    self.paused_s = 0.0
    self.reads = collections.deque([(start_step, time.perf_counter(), 0.0)])
    self.start = self.reads[0]  # for the ETA: the loop's own pace, evals and saves included
    self.eta_from = None  # (step, time) of the first row, the ETA's start after it
    self.rate_steps = max(RATE_STEPS, t_cfg.log_every)
    self.said_peak = False
    self.unverified = []  # [(step, device metrics)] not yet read back
    self._last = self._rowed = None  # (step, loss, grad_norm) read last; the last step rowed
    self.skipped, self.last_loss, self.verified = skipped, float("nan"), start_step
    self.saved = start_step if start_step else None  # the newest checkpoint's step (the loop's)

  def flops_per_step(self, step: int) -> float:
    """Training FLOPs of (1-based) step `step`, at its schedule stage's windows and row length."""
    cfg = self.run.cfg
    stage = (self.windows_of(step - 1), window_schedule.seq_len_at(cfg.train, step - 1))
    if stage not in self._flops:
      self._flops[stage] = metrics.flops_per_token(cfg.model, stage[1],
                                                   stage[0]) * self.tokens_per_step
    return self._flops[stage]

  @contextlib.contextmanager
  def paused(self):
    """Time spent inside (an eval, a checkpoint save) is not training: tokens/s and MFU leave
    it out (a row after a save read 10x low at log_every=1); the ETA keeps it."""
    began = time.perf_counter()
    try:
      yield
    finally:
      self.paused_s += time.perf_counter() - began

  def add(self, step: int, dev) -> None:
    self.unverified.append((step, dev))

  def is_log_step(self, step: int) -> bool:
    return step % self.run.cfg.train.log_every == 0 or step == 1

  def flush_if_logging(self) -> None:
    """Read back the pending steps if one of them is a logging step (one step late)."""
    if any(self.is_log_step(s) for s, _ in self.unverified):
      self.flush()

  def flush(self, final: bool = False) -> None:
    """Read every pending step (blocking on the newest); abort on a non-finite one. `final`:
    the run ends here, so its last step gets a row (the flush of a save or an eval before it
    read that step: a preempted run's rows ended before the step it stopped at)."""
    if not self.unverified:
      if final and self._last is not None and self._last[0] != self._rowed:
        self._row(*self._last)
      return
    pending, self.unverified = self.unverified, []
    values = jax.device_get([dev for _, dev in pending])
    last = pending[-1][0]
    for (step, _), v in zip(pending, values):
      loss, grad_norm = float(v["loss"]), float(v["grad_norm"])
      finite = np.isfinite(loss) and np.isfinite(grad_norm)
      if not finite and self.run.cfg.train.on_nonfinite == "abort":
        what = "loss" if not np.isfinite(loss) else "gradient norm"
        then = ("no checkpoint was saved before it: rerun" if self.saved is None else
                f"the newest checkpoint (step {self.saved}) is the last finite state: resume")
        raise NonFiniteError(
            f"step {step} has a non-finite {what} (loss {loss}, grad_norm {grad_norm}); stopped "
            f"before checkpointing it, and {then} with train.on_nonfinite=skip to skip such steps")
      self.skipped += not finite
      self.verified, self._last = step, (step, loss, grad_norm)
      if finite:
        self.last_loss = loss
      if self.is_log_step(step) or (final and step == last):
        self._row(step, loss, grad_norm)

  def _row(self, step: int, loss: float, grad_norm: float) -> None:
    self._rowed = step
    now = time.perf_counter()
    self.reads.append((step, now, self.paused_s))
    while len(self.reads) > 2 and step - self.reads[1][0] >= self.rate_steps:
      self.reads.popleft()
    steps = step - self.reads[0][0]
    dt = now - self.reads[0][1] - (self.paused_s - self.reads[0][2])
    tok_s = steps * self.tokens_per_step / dt if dt > 0 else 0.0
    flops = self.flops_per_step(step)
    mfu = tok_s / self.tokens_per_step * flops / self.peak if self.peak else 0.0
    if mfu > 1 and not self.said_peak:
      self.said_peak = True
      self.log(f"mfu above 100%: these devices beat metrics.peak_flops "
               f"({self.peak / self.run.mesh.devices.size:.3g} FLOP/s each); set it to theirs")
    cfg = self.run.cfg
    lr = optim.current_lr(cfg.optim, cfg.train.steps, step - 1)
    row = {"loss": loss, "lr": lr, "tokens_per_sec": tok_s, "mfu": mfu, "grad_norm": grad_norm,
           "compiles": self.counter.count, "skipped_steps": self.skipped}
    if cfg.attention.window_schedule:
      row["attn_window"] = window_schedule.long_window(cfg.attention, step - 1, cfg.train.steps)
    since = self.eta_from or self.start  # past the first row: its step's warm-up left out
    done, elapsed = step - since[0], now - since[1]
    row["eta_sec"] = elapsed / done * (cfg.train.steps - step) if done > 0 else 0.0
    self.eta_from = self.eta_from or (step, now)
    self.writer.write(step, row)
    skips = f" | {self.skipped} skipped" if self.skipped else ""
    self.log(f"step {step:>6d}/{cfg.train.steps} | loss {loss:.4f} | lr {lr:.2e} | "
             f"{tok_s:,.0f} tok/s | mfu {f'{100 * mfu:.1f}%' if mfu <= 1 else '>100%'} | eta "
             f"{metrics.duration(row['eta_sec'])}{skips}")
