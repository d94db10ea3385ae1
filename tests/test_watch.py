"""What watches the loop: late metrics (Monitor), signals (Preemption), compiles, the profiler."""

import contextlib
import functools
import os
import signal
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE, TINY
from nanotext import metrics, optim, watch, wiring, window_schedule

pytestmark = pytest.mark.fast

LATE = ["train.steps=6", "train.log_every=2"]
SCHEDULE = ["attention.window=32", "attention.window_start=16", "attention.window_block=16",
            "attention.window_schedule=true", "train.steps=4"]


@functools.lru_cache(maxsize=None)
def prepared(*overrides, devices=8):
  return wiring.prepare(BASE, TINY + list(overrides), devices=jax.devices()[:devices])


class Rows:
  """A metrics writer that keeps its rows."""

  def __init__(self):
    self.rows = []

  def write(self, step, values):
    self.rows.append((step, dict(values)))

  def steps(self):
    return [s for s, _ in self.rows]


class Clock:
  """Stands in for the time module inside watch.py: perf_counter is set by the test."""

  def __init__(self):
    self.now = 100.0

  def perf_counter(self):
    return self.now


def dev(loss, grad_norm=1.0):
  return {"loss": jnp.float32(loss), "grad_norm": jnp.float32(grad_norm)}


def monitor(*overrides, skipped=0, start_step=0, devices=8):
  run = prepared(*overrides, devices=devices)
  rows, lines = Rows(), []
  mon = watch.Monitor(run, rows, lines.append, types.SimpleNamespace(count=3),
                      start_step=start_step, skipped=skipped,
                      windows_of=lambda step: window_schedule.step_windows(run.cfg, step))
  return mon, rows, lines


@pytest.fixture
def reads(monkeypatch):
  """How many pending steps each jax.device_get reads back, one entry per call."""
  calls, real = [], jax.device_get
  def device_get(x):
    calls.append(len(x))
    return real(x)
  monkeypatch.setattr(jax, "device_get", device_get)
  return calls


def test_monitor_reads_metrics_one_step_late_on_log_steps(reads):
  """Pending steps are read back only when one of them is a logging step (1 and every 2nd)."""
  mon, rows, _ = monitor(*LATE)
  mon.add(1, dev(5.0))
  assert rows.rows == [] and reads == []  # added, not read
  mon.flush_if_logging()  # step 1 always logs
  assert rows.steps() == [1] and reads == [1] and mon.verified == 1
  mon.add(2, dev(4.0))
  mon.flush_if_logging()
  mon.add(3, dev(3.0))
  mon.flush_if_logging()  # 3 is no logging step: nothing is read
  assert rows.steps() == [1, 2] and reads == [1, 1] and mon.verified == 2
  assert [s for s, _ in mon.unverified] == [3]
  mon.add(4, dev(2.0))
  mon.flush_if_logging()  # 3 and 4 in one read; a row only for 4
  assert rows.steps() == [1, 2, 4] and reads == [1, 1, 2] and mon.verified == 4
  assert mon.unverified == [] and mon.last_loss == 2.0
  mon.flush_if_logging()  # nothing pending
  assert reads == [1, 1, 2]
  mon.add(5, dev(1.5))
  mon.flush(final=True)  # the final flush writes the last step even off the log interval
  assert rows.steps() == [1, 2, 4, 5] and rows.rows[-1][1]["loss"] == 1.5


def test_the_final_flush_writes_the_last_step_read_by_an_earlier_flush():
  """A preempted run's save read its last step back (no row: no log step) before the final
  flush, which found nothing pending: the run's rows ended before the step it stopped at."""
  mon, rows, _ = monitor(*LATE)
  mon.add(1, dev(5.0))
  mon.add(3, dev(3.0))
  mon.flush()  # the save's: 3 is no logging step
  assert rows.steps() == [1]
  mon.flush(final=True)
  mon.flush(final=True)  # once
  assert rows.steps() == [1, 3] and rows.rows[-1][1]["loss"] == 3.0


def test_monitor_abort_names_the_nonfinite_step():
  """Under on_nonfinite=abort a NaN loss at step 3 raises when 3 is read, naming step 3."""
  mon, rows, _ = monitor(*LATE)
  assert mon.run.cfg.train.on_nonfinite == "abort"
  mon.add(2, dev(4.0))
  mon.flush_if_logging()
  mon.add(3, dev(float("nan")))
  mon.flush_if_logging()  # not read yet: no error
  mon.add(4, dev(2.0))
  with pytest.raises(watch.NonFiniteError, match=r"step 3 has a non-finite loss"):
    mon.flush_if_logging()
  assert mon.verified == 2 and rows.steps() == [2]  # nothing after the bad step was recorded


def test_monitor_abort_on_nonfinite_grad_norm():
  """An infinite gradient norm with a finite loss also aborts, and says so."""
  mon, _, _ = monitor(*LATE)
  mon.add(1, dev(3.0, float("inf")))
  with pytest.raises(watch.NonFiniteError, match=r"step 1 has a non-finite gradient norm.*"
                     "no checkpoint was saved before it: rerun with train.on_nonfinite=skip"):
    mon.flush()


def test_monitor_skip_counts_nonfinite_steps():
  """Under on_nonfinite=skip bad steps are counted (on top of a resumed count), never the loss."""
  mon, rows, lines = monitor(*LATE, "train.on_nonfinite=skip", skipped=2)
  mon.add(1, dev(5.0))
  mon.add(2, dev(float("nan")))
  mon.flush_if_logging()
  mon.add(3, dev(3.0, float("inf")))
  mon.add(4, dev(2.5))
  mon.flush_if_logging()
  assert mon.skipped == 4 and mon.verified == 4 and mon.last_loss == 2.5
  assert [(s, r["skipped_steps"]) for s, r in rows.rows] == [(1, 2), (2, 3), (4, 4)]
  assert np.isnan(rows.rows[1][1]["loss"])  # the row shows what happened
  assert lines[-1].endswith("| 4 skipped")


def test_monitor_row_values(monkeypatch):
  """A row holds loss, lr, tokens/s, MFU from the FLOP count, grad norm, compiles, skips."""
  clock = Clock()
  monkeypatch.setattr(watch, "time", clock)
  mon, rows, lines = monitor(*LATE, start_step=0)
  run = mon.run
  cfg = run.cfg
  clock.now += 0.5
  mon.add(1, dev(5.0, 0.75))
  mon.flush_if_logging()
  clock.now += 1.0  # one step in one second
  mon.add(2, dev(4.0, 0.5))
  mon.add(3, dev(3.5, 0.5))
  mon.flush_if_logging()
  clock.now += 4.0  # two steps (3 and 4) in four seconds
  mon.add(4, dev(3.0, 0.25))
  mon.flush_if_logging()
  tokens = 8 * 32
  assert mon.tokens_per_step == tokens
  (s1, r1), (s2, r2), (s4, r4) = rows.rows
  assert (s1, s2, s4) == (1, 2, 4)
  assert set(r1) == {"loss", "lr", "tokens_per_sec", "mfu", "grad_norm", "compiles",
                     "skipped_steps", "eta_sec"}  # no attn_window without a schedule
  assert r1["loss"] == 5.0 and r1["grad_norm"] == 0.75 and r4["grad_norm"] == 0.25
  assert r1["compiles"] == 3 and r1["skipped_steps"] == 0
  # Rates since the start while fewer than watch.RATE_STEPS steps are read.
  assert [r["tokens_per_sec"] for r in (r1, r2, r4)] == pytest.approx(
      [tokens / 0.5, 2 * tokens / 1.5, 4 * tokens / 5.5])
  # The ETA: the pace since the first row, whose step (compile-free, but the first run of the
  # program) took 6x a later one in a 4,000-step tiny run
  assert [r["eta_sec"] for r in (r1, r2, r4)] == pytest.approx([0.5 * 5, 1.0 * 4, 5.0 / 3 * 2])
  assert r1["lr"] == optim.current_lr(cfg.optim, 6, 0)
  assert r2["lr"] == optim.current_lr(cfg.optim, 6, 1) > r1["lr"]  # still warming up
  assert r4["lr"] == optim.current_lr(cfg.optim, 6, 3)
  peak = metrics.CPU_PEAK_FLOPS  # the 8 CPU devices share the machine's (metrics.peak_flops=0)
  flops = metrics.flops_per_token(cfg.model, 32) * tokens
  assert [r["mfu"] for r in (r1, r2, r4)] == pytest.approx(
      [2 * flops / peak, 4 / 3 * flops / peak, 8 / 11 * flops / peak])
  assert lines[1].startswith("step      2/6 | loss 4.0000 | lr ")
  assert "341 tok/s" in lines[1] and "skipped" not in lines[1]


def test_monitor_rates_span_steps_not_one_burst(monkeypatch):
  """log_every=1 rated each step alone: steps read back in a burst (the device ran ahead
  while the host paused) gave one row 1,482,528 tok/s and mfu 481%. Rates span the last
  watch.RATE_STEPS steps; an mfu over 100% is a peak set too low, and the log says so once."""
  clock = Clock()
  monkeypatch.setattr(watch, "time", clock)
  mon, rows, lines = monitor("train.steps=30", "train.log_every=1", "metrics.peak_flops=1e4")
  for step in range(1, 26):
    clock.now += 0.001 if step in (13, 14) else 1.0  # 13 and 14 come back at once
    mon.add(step, dev(1.0))
    mon.flush_if_logging()
    mon.flush()
  tok_s = {s: r["tokens_per_sec"] for s, r in rows.rows}
  tokens = 8 * 32
  assert tok_s[5] == pytest.approx(tokens)
  assert tok_s[14] == pytest.approx(watch.RATE_STEPS * tokens / (watch.RATE_STEPS - 2 + 0.002))
  assert tok_s[25] == pytest.approx(tokens)  # the burst is out of the window
  assert max(tok_s.values()) < 1.3 * tokens
  assert all(r["mfu"] > 1 for _, r in rows.rows)  # the row keeps what was measured
  warned = [l for l in lines if l.startswith("mfu above 100%")]
  assert len(warned) == 1 and "metrics.peak_flops" in warned[0]
  assert all("mfu >100% |" in l for l in lines if l.startswith("step "))


def test_a_resume_says_when_its_mfu_is_against_a_saved_peak():
  """A config.yml an older nanotext wrote saved its devices' peak (125e9 here): resumed on other
  devices the MFU was against it unsaid (4x low). A resume says which peak it uses; a fresh run
  and a peak that is these devices' own say nothing."""
  own = metrics.CPU_PEAK_FLOPS / 8
  said = lambda lines: [l for l in lines if l.startswith("mfu is against")]
  _, _, lines = monitor("metrics.peak_flops=125e9", start_step=4)
  assert len(said(lines)) == 1 and "metrics.peak_flops=1.25e+11" in lines[0]
  assert f"own is {own:.4g}: metrics.peak_flops=0 takes it" in lines[0]
  # given here on the command line, as it may be: the note said config.yml held it
  assert "as given on the command line or in the run's config.yml" in lines[0]
  for overrides, start in ((["metrics.peak_flops=125e9"], 0), ([], 4),
                           ([f"metrics.peak_flops={own}"], 4)):
    assert not said(monitor(*overrides, start_step=start)[2])


def test_monitor_rates_leave_out_evals_and_saves(monkeypatch):
  """A checkpoint save or an eval between two rows is not training: tokens/s left it in (a row
  after a save read ~10x low at log_every=1); the ETA, the loop's own pace, keeps it."""
  clock = Clock()
  monkeypatch.setattr(watch, "time", clock)
  mon, rows, _ = monitor("train.steps=30", "train.log_every=1")
  for step in range(1, 13):
    clock.now += 1.0
    mon.add(step, dev(1.0))
    mon.flush()
    if step in (4, 8):
      with mon.paused():
        clock.now += 9.0
  tokens = 8 * 32
  assert [r["tokens_per_sec"] for _, r in rows.rows] == pytest.approx([tokens] * 12)
  # the 11 steps after the first row's took 29 s, pauses included
  assert rows.rows[-1][1]["eta_sec"] == pytest.approx(18 * 29 / 11)


@pytest.mark.parametrize("devices", [1, 8])
def test_monitor_mfu_is_against_the_runs_devices(devices):
  """The peak is that of the devices the run uses: the 8 fake CPU devices share one machine."""
  mon, _, _ = monitor(*LATE, devices=devices)
  assert mon.run.mesh.devices.size == devices
  assert mon.peak == pytest.approx(metrics.CPU_PEAK_FLOPS)


def test_monitor_attn_window_follows_the_schedule(monkeypatch):
  """With a window schedule each row carries its step's long window and FLOPs at its windows."""
  clock = Clock()
  monkeypatch.setattr(watch, "time", clock)
  mon, rows, _ = monitor(*SCHEDULE)
  cfg = mon.run.cfg
  for step in range(1, 5):
    clock.now += 1.0
    mon.add(step, dev(1.0))
    mon.flush_if_logging()
  want = [window_schedule.long_window(cfg.attention, s - 1, 4) for s in range(1, 5)]
  assert want == [16, 16, 16, 32]
  assert [r["attn_window"] for _, r in rows.rows] == want
  peak = metrics.CPU_PEAK_FLOPS  # the 8 CPU devices share the machine's (metrics.peak_flops=0)
  per_token = [r["mfu"] * peak / r["tokens_per_sec"] for _, r in rows.rows]
  assert per_token[0] == pytest.approx(metrics.flops_per_token(cfg.model, 32, (16, 16)))
  assert per_token[3] == pytest.approx(metrics.flops_per_token(cfg.model, 32, (0, 0)))
  assert per_token[0] < per_token[3]


def test_preemption_signals_set_received_and_handlers_come_back():
  """Inside the context SIGTERM and SIGINT only set `received`; the old handlers return after."""
  before = {sig: signal.getsignal(sig) for sig in watch.Preemption.SIGNALS}
  with watch.Preemption() as p:
    assert p.received is None and not p.requested()
    os.kill(os.getpid(), signal.SIGTERM)
    assert p.received == "SIGTERM"
    assert p.requested()  # one process: at once
    os.kill(os.getpid(), signal.SIGINT)
    assert p.received == "SIGINT"
  assert {sig: signal.getsignal(sig) for sig in watch.Preemption.SIGNALS} == before


def test_preemption_restores_a_custom_handler():
  """A handler installed before the context is the one in place after it."""
  seen = []
  previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
  try:
    with watch.Preemption():
      os.kill(os.getpid(), signal.SIGTERM)
    assert seen == []
    os.kill(os.getpid(), signal.SIGTERM)
    assert seen == [signal.SIGTERM]
  finally:
    signal.signal(signal.SIGTERM, previous)


def test_preemption_off_the_main_thread_leaves_handlers_alone():
  """signal.signal works only in the main thread: elsewhere the context changes nothing."""
  before = signal.getsignal(signal.SIGTERM)
  inside = []
  def body():
    with watch.Preemption() as p:
      inside.append(signal.getsignal(signal.SIGTERM))
      inside.append(p.requested())
  t = threading.Thread(target=body)
  t.start()
  t.join()
  assert inside == [before, False]


def test_compile_counter_counts_only_while_active():
  """A fresh jit compile counts while active; cached calls and inactive compiles do not."""
  counter = watch.CompileCounter()
  # numpy inputs: jnp.zeros of a new shape would itself compile a program.
  jax.jit(lambda x: x * 3 + 17)(np.zeros(3, np.float32)).block_until_ready()
  assert counter.count == 0
  counter.active = True
  f = jax.jit(lambda x: x * 5 - 23)
  f(np.zeros(5, np.float32)).block_until_ready()
  assert counter.count == 1
  f(np.ones(5, np.float32)).block_until_ready()  # same shape: the cached executable
  assert counter.count == 1
  f(np.zeros(7, np.float32)).block_until_ready()  # a new shape is a new program
  assert counter.count == 2
  counter.active = False
  f(np.zeros(9, np.float32)).block_until_ready()
  assert counter.count == 2


def test_profiler_off_by_default():
  """Without profile.steps no trace starts: every step gets a null context."""
  cfg = prepared(*LATE).cfg
  lines = []
  prof = watch.Profiler(cfg, lines.append)
  assert prof.first is None
  for step in range(3):
    ctx = prof.step(step)
    assert isinstance(ctx, contextlib.nullcontext)
    prof.after(step, None)
  prof.stop()
  assert not prof.tracing and lines == []
  assert prof.dir == os.path.join(cfg.output_dir, "profile")


def test_profiler_traces_its_steps(monkeypatch):
  """profile.start_step=1, steps=2: the trace starts at step 1 and stops after step 2."""
  calls = []
  monkeypatch.setattr(jax.profiler, "start_trace", lambda d: calls.append(("start", d)))
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: calls.append(("stop",)))
  monkeypatch.setattr(jax.profiler, "StepTraceAnnotation",
                      lambda name, step_num: contextlib.nullcontext(("annotate", step_num)))
  cfg = prepared(*LATE, "profile.start_step=1", "profile.steps=2", "profile.dir=/tmp/p").cfg
  lines = []
  prof = watch.Profiler(cfg, lines.append)
  got = []
  @contextlib.contextmanager
  def paused():  # the monitor's: writing the trace is not counted as training time
    calls.append("pause")
    yield
    calls.append("resume")
  for step in range(4):
    with prof.step(step) as ctx:
      got.append(ctx)
    prof.after(step, jnp.zeros(1), paused)
  assert got == [None, ("annotate", 1), ("annotate", 2), None]
  assert calls == [("start", "/tmp/p"), "pause", ("stop",), "resume"]
  assert lines == ["profile of steps 2..3 written to /tmp/p"]


def test_a_profile_past_the_runs_end_says_which_steps_it_holds(monkeypatch):
  """A 4-step run with profile.steps=10 said 'steps 2..11'; a start past the last step, or one
  of start_step and steps set alone, wrote nothing and said nothing."""
  monkeypatch.setattr(jax.profiler, "start_trace", lambda d: None)
  monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)
  cfg = prepared(*LATE, "train.steps=4", "profile.start_step=1", "profile.steps=10",
                 "profile.dir=/tmp/p").cfg
  lines = []
  prof = watch.Profiler(cfg, lines.append)
  for step in range(4):
    with prof.step(step):
      pass
    prof.after(step, jnp.zeros(1))
  prof.stop()  # as the loop ends
  assert lines == ["profile of steps 2..4 written to /tmp/p"]
  lines.clear()
  watch.Profiler(prepared(*LATE, "train.steps=4", "profile.start_step=4", "profile.steps=1").cfg,
                 lines.append)
  assert lines == ["profile.start_step=4 is past the run's last step (train.steps=4, counted "
                   "from 0): no profile is written"]
  # one of the two keys set alone traced nothing, without the line a late start gets
  for half, line in (("profile.steps=2", "profile.steps=2 with profile.start_step=-1 (off): no "
                      "profile is written; set profile.start_step (0 = from the first step)"),
                     ("profile.start_step=1", "profile.start_step=1 with profile.steps=0 (off): "
                      "no profile is written; set profile.steps to the number of steps to trace")):
    lines.clear()
    assert watch.Profiler(prepared(*LATE, half).cfg, lines.append).first is None
    assert lines == [line]
  lines.clear()
  watch.Profiler(prepared(*LATE).cfg, lines.append)  # both off: nothing to say
  assert lines == []
  # a run resumed past the window wrote none and said nothing; resumed inside it, the window's
  # rest is traced (it started only at start_step, never reached)
  lines.clear()
  late = watch.Profiler(prepared(*LATE, "profile.start_step=1", "profile.steps=2").cfg,
                        lines.append, start_step=3)
  assert late.first is None and lines == [
      "profile.start_step=1 with profile.steps=2 lies before the step this run resumes from "
      "(3, counted from 0): no profile is written"]
  inside = watch.Profiler(prepared(*LATE, "profile.start_step=1", "profile.steps=4").cfg,
                          lines.append, start_step=3)
  assert (inside.first, inside.last) == (3, 4)


def test_compile_counter_counts_its_own_thread_only():
  """A run's loop counted another run's compiles in a thread beside it (a sweep: 7 for a run
  that compiles none alone), and each run added a listener for the rest of the process."""
  from jax._src import monitoring
  registered = lambda: len(getattr(monitoring, "_event_duration_secs_listeners", ()))
  counter = watch.CompileCounter()
  counter.active = True
  listeners = registered()
  other = threading.Thread(target=lambda: jax.jit(lambda x: x * 7 + 29)(
      np.zeros(11, np.float32)).block_until_ready())
  other.start()
  other.join()
  assert counter.count == 0
  watch.CompileCounter()  # the next run's
  assert registered() == listeners  # (jax's private list; 0 == 0 where it has another name)
