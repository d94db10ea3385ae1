"""The train step, the eval step and the training loop."""

import concurrent.futures
import contextlib
import dataclasses
import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from nanotext import checkpoint, metrics, optim, sharding
from nanotext.model import GPT, attention, count_params
from nanotext.errors import UserError
from nanotext.model.attention import resolve_impl, segment_ids_from_tokens


class CompileCounter:
  """Counts XLA backend compilations (via jax.monitoring) while `active`."""

  _EVENT = "/jax/core/compile/backend_compile_duration"

  def __init__(self):
    self.count, self.active = 0, False
    jax.monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event, duration, **kwargs):
    del duration, kwargs
    if self.active and event == self._EVENT:
      self.count += 1


@dataclasses.dataclass
class Setup:
  """Everything built from the config once: model structure, optimizer, shardings."""
  cfg: object
  mesh: object
  rules: tuple
  graphdef: object
  create_model: object
  tx: object
  state_shardings: dict
  batch_sharding: NamedSharding
  num_params: int
  eot_id: int | None  # set when attention.doc_mask: documents start at this token


def build(cfg, mesh, backend: str) -> Setup:
  """Abstract model -> logical specs -> shardings and optimizer, without allocating anything."""
  rules = sharding.parse_rules(cfg.mesh.rules)
  impl = resolve_impl(cfg.attention.impl, backend, head_dim=cfg.model.head_dim,
                      seq_len=cfg.train.seq_len)
  eot_id = doc_mask_eot(cfg) if cfg.attention.doc_mask else None
  def create_model():
    return GPT(cfg.model, cfg.attention, impl=impl, rngs=nnx.Rngs(cfg.seed))
  graphdef, abstract = nnx.split(nnx.eval_shape(create_model))
  specs = sharding.param_specs(abstract).to_pure_dict()
  labels = optim.group_labels(specs)
  tx = optim.make_optimizer(cfg.optim, labels, cfg.train.steps)
  is_spec = lambda x: isinstance(x, P)
  param_sh = jax.tree.map(lambda s: NamedSharding(mesh, sharding.logical_to_spec(tuple(s), rules)),
                          specs, is_leaf=is_spec)
  replicated = NamedSharding(mesh, P())
  abstract_params = abstract.to_pure_dict()
  opt_shapes = jax.eval_shape(tx.init, abstract_params)
  opt_sh = sharding.like_params(opt_shapes, param_sh, abstract_params, replicated)
  state_sh = {"step": replicated, "params": param_sh, "opt_state": opt_sh}
  return Setup(cfg, mesh, rules, graphdef, create_model, tx, state_sh,
               sharding.batch_sharding(mesh, rules), count_params(abstract_params), eot_id)


def doc_mask_eot(cfg) -> int:
  """The end-of-text id that separates documents for attention.doc_mask."""
  from nanotext.data.tokenizer import known_eot_id
  eot = cfg.data.eot_id if cfg.data.eot_id >= 0 else known_eot_id(cfg.data.tokenizer)
  if eot is None:
    raise UserError("attention.doc_mask=true needs an end-of-text id: set data.eot_id or a "
                    "data.tokenizer that has one")
  return int(eot)


def init_state(setup: Setup):
  """Create params and optimizer state directly in their shardings (no host copy)."""
  def init():
    params = nnx.state(setup.create_model()).to_pure_dict()
    return {"step": jnp.zeros([], jnp.int32), "params": params,
            "opt_state": setup.tx.init(params)}
  return jax.jit(init, out_shardings=setup.state_shardings)()


def state_from_params(setup: Setup, params):
  """A step-0 state around given params, with a fresh optimizer state (load_params_from)."""
  def init(params):
    return {"step": jnp.zeros([], jnp.int32), "params": params, "opt_state": setup.tx.init(params)}
  return jax.jit(init, out_shardings=setup.state_shardings)(params)


def abstract_state(setup: Setup):
  """ShapeDtypeStructs of the train state carrying its target shardings (for restore)."""
  shapes = jax.eval_shape(lambda: {
      "step": jnp.zeros([], jnp.int32),
      "params": (p := nnx.state(setup.create_model()).to_pure_dict()),
      "opt_state": setup.tx.init(p)})
  return checkpoint.abstract_with_shardings(shapes, setup.state_shardings)


def loss_fn(graphdef, params, inputs_BT, targets_BT, eot_id=None, windows=None):
  """Mean next-token cross-entropy; with `eot_id`, attention stays within documents.

  `windows`: per-layer sliding windows (static ints) of one schedule stage; None = the final ones.
  """
  segments_BT = None if eot_id is None else segment_ids_from_tokens(inputs_BT, eot_id)
  logits_BTV = nnx.merge(graphdef, params)(inputs_BT, segments_BT, windows)
  with jax.named_scope("loss"):
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT).mean()


def step_windows(cfg, step: int) -> tuple:
  """Per-layer windows, as the kernels see them, of 0-based train step `step`.

  Steps whose windows agree (e.g. every window >= train.seq_len, i.e. plain causal) share a
  compiled program; step == train.steps gives the final windows.
  """
  w = attention.windows_at(cfg.attention, cfg.model.num_layers, step, cfg.train.steps)
  return attention.effective_windows(w, cfg.train.seq_len)


def make_train_step(setup: Setup, windows=None):
  """jit(state, batch) -> (state, metrics), state donated, with gradient accumulation.

  `windows` (a tuple of static per-layer ints, one attention.window_schedule stage) is baked into
  the program: each distinct tuple is its own executable, compiled before the loop starts.

  A step whose loss or gradient norm is not finite leaves params and optimizer state as they
  were when train.on_nonfinite=skip (selected on device: no host sync); with abort the host
  stops the run when it reads the step's metrics, before that state is checkpointed.
  """
  accum, graphdef, tx = setup.cfg.train.grad_accum, setup.graphdef, setup.tx
  skip = setup.cfg.train.on_nonfinite == "skip"
  nan_step = setup.cfg.train.debug_nan_step

  def objective(p, x, y, poison):
    loss = loss_fn(graphdef, p, x, y, setup.eot_id, windows)
    return loss if poison is None else loss * poison
  grad_fn = jax.value_and_grad(objective)

  def micro_batches(a_BT):
    # Row r goes to micro-batch r % accum, so each device's rows spread over all micro-batches.
    b, t = a_BT.shape
    a = a_BT.reshape(b // accum, accum, t).swapaxes(0, 1)
    return sharding.constrain(a, (None, "batch", "length"))

  def step_fn(state, batch):
    # Testing hook: train.debug_nan_step=N makes step N's loss (and so its gradients) NaN.
    poison = None if nan_step < 0 else \
        jnp.where(state["step"] + 1 == nan_step, jnp.nan, 1.0).astype(jnp.float32)
    with sharding.use_rules(setup.rules, setup.mesh):
      params = state["params"]
      if accum == 1:
        loss, grads = grad_fn(params, batch["inputs"], batch["targets"], poison)
      else:
        def body(carry, xy):
          loss, grads = grad_fn(params, *xy, poison)
          return jax.tree.map(jnp.add, carry, (loss, grads)), None
        zeros = (jnp.zeros([], jnp.float32), jax.tree.map(jnp.zeros_like, params))
        xs = (micro_batches(batch["inputs"]), micro_batches(batch["targets"]))
        (loss, grads), _ = jax.lax.scan(body, zeros, xs)
        loss, grads = loss / accum, jax.tree.map(lambda g: g / accum, grads)
      grad_norm = optax.global_norm(grads)
      updates, opt_state = tx.update(grads, state["opt_state"], params)
      new_params = optax.apply_updates(params, updates)
      if skip:
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jnp.where(finite, new, old)
        new_params = jax.tree.map(keep, new_params, params)
        opt_state = jax.tree.map(keep, opt_state, state["opt_state"])
    new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}
    return new_state, {"loss": loss, "grad_norm": grad_norm}

  batch_sh = {"inputs": setup.batch_sharding, "targets": setup.batch_sharding}
  return jax.jit(step_fn, in_shardings=(setup.state_shardings, batch_sh),
                 out_shardings=(setup.state_shardings, None), donate_argnums=0)


def make_eval_step(setup: Setup):
  """jit(params, batch) -> mean loss, at the final windows of the schedule.

  One eval program for the whole run; the last evaluation equals the record's, which evaluates
  at the current window and so at the full one after the last step.
  """
  def eval_fn(params, batch):
    with sharding.use_rules(setup.rules, setup.mesh):
      return loss_fn(setup.graphdef, params, batch["inputs"], batch["targets"], setup.eot_id)
  batch_sh = {"inputs": setup.batch_sharding, "targets": setup.batch_sharding}
  return jax.jit(eval_fn, in_shardings=(setup.state_shardings["params"], batch_sh))


def global_batch(setup: Setup, local: dict) -> dict:
  """Global jax.Arrays sharded along `batch`, built from this process's rows."""
  return {k: jax.make_array_from_process_local_data(setup.batch_sharding, np.asarray(v))
          for k, v in local.items()}


def compile_train_steps(setup: Setup, state, batch, steps) -> dict:
  """AOT-compile one train program per distinct window tuple that `steps` (0-based) need.

  Tracing runs one after another; XLA compilations run in a thread pool, since they are
  independent and release the GIL (many schedule stages on a many-core host).
  """
  needed = list(dict.fromkeys(step_windows(setup.cfg, s) for s in steps))  # in order of use
  lowered = {w: make_train_step(setup, w).lower(state, batch) for w in needed}
  workers = max(1, min(len(lowered), os.cpu_count() or 1))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    futures = {w: pool.submit(low.compile) for w, low in lowered.items()}
    return {w: f.result() for w, f in futures.items()}


class Profiler:
  """jax.profiler trace of profile.steps steps, from the one run after profile.start_step steps.

  Every process traces its own devices; with several processes each writes under
  DIR/process_I (processes sharing a host would otherwise overwrite one <host>.xplane.pb).
  Open DIR (or one process's folder) with TensorBoard's profile plugin or XProf.
  """

  def __init__(self, cfg, log):
    p = cfg.profile
    self.first = p.start_step if p.steps > 0 and p.start_step >= 0 else None
    self.last = None if self.first is None else p.start_step + p.steps - 1
    self.dir = p.dir or os.path.join(cfg.output_dir, "profile")
    if jax.process_count() > 1:
      self.dir = os.path.join(self.dir, f"process_{jax.process_index()}")
    self.log, self.tracing = log, False

  def step(self, step: int):
    """Context around 0-based step `step`: starts the trace at the first and annotates steps."""
    if self.first is not None and step == self.first and not self.tracing:
      jax.profiler.start_trace(self.dir)
      self.tracing = True
    if not self.tracing:
      return contextlib.nullcontext()
    return jax.profiler.StepTraceAnnotation("train", step_num=step)

  def after(self, step: int, state) -> None:
    """Stops the trace after the last traced step, once its device work has finished."""
    if self.tracing and step >= self.last:
      jax.block_until_ready(state)
      self.stop()

  def stop(self) -> None:
    if self.tracing:
      jax.profiler.stop_trace()
      self.tracing = False
      # Logged with the 1-based step numbers of the metric lines.
      self.log(f"profile of steps {self.first + 1}..{self.last + 1} written to {self.dir}")


class NonFiniteError(RuntimeError):
  """A non-finite loss or gradient norm under train.on_nonfinite=abort: exit status 1."""


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


class Preemption:
  """While active, SIGTERM and SIGINT only set a flag; the loop saves and exits at a step end."""

  SIGNALS = (signal.SIGTERM, signal.SIGINT)

  def __init__(self, log_every: int):
    self.received, self.log_every, self._previous = None, log_every, {}

  def __enter__(self):
    # signal.signal works only in the main thread; elsewhere (a library caller) keep defaults.
    if threading.current_thread() is threading.main_thread():
      for sig in self.SIGNALS:
        self._previous[sig] = signal.signal(sig, self._on_signal)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)
    self._previous = {}

  def _on_signal(self, signum, frame):
    del frame
    self.received = signal.Signals(signum).name

  def requested(self, step: int) -> bool:
    """True when this run must stop after `step`; all processes agree on the step."""
    if jax.process_count() == 1:
      return self.received is not None
    if step % self.log_every:  # a host collective only on logging steps, not every step
      return False
    from jax.experimental import multihost_utils
    flags = multihost_utils.process_allgather(np.int32(self.received is not None))
    self.received = self.received or ("SIGTERM" if np.any(flags) else None)
    return self.received is not None


class Monitor:
  """Reads finished steps' metrics late, checks them finite, counts skips, writes log rows."""

  def __init__(self, setup: Setup, writer, log, counter, *, start_step: int, skipped: int):
    cfg, t_cfg = setup.cfg, setup.cfg.train
    self.setup, self.writer, self.log, self.counter = setup, writer, log, counter
    self.tokens_per_step = t_cfg.batch_size * t_cfg.seq_len
    self._flops = {}  # per-layer windows -> FLOPs per step (the schedule changes them)
    self.peak = cfg.metrics.peak_flops * jax.device_count()
    self.clock = [start_step, time.perf_counter()]  # last reported step and when it was read
    self.unverified = []  # [(step, device metrics)] not yet read back
    self.skipped, self.last_loss, self.verified = skipped, float("nan"), start_step

  def flops_per_step(self, step: int) -> float:
    """Training FLOPs of (1-based) step `step`, at its schedule stage's windows."""
    cfg = self.setup.cfg
    windows = step_windows(cfg, step - 1)
    if windows not in self._flops:
      self._flops[windows] = metrics.flops_per_token(cfg.model, cfg.train.seq_len,
                                                     windows) * self.tokens_per_step
    return self._flops[windows]

  def add(self, step: int, dev) -> None:
    self.unverified.append((step, dev))

  def is_log_step(self, step: int) -> bool:
    return step % self.setup.cfg.train.log_every == 0 or step == 1

  def flush_if_logging(self) -> None:
    """Read back the pending steps if one of them is a logging step (one step late)."""
    if any(self.is_log_step(s) for s, _ in self.unverified):
      self.flush()

  def flush(self, final: bool = False) -> None:
    """Read every pending step (blocking on the newest); abort on a non-finite one."""
    if not self.unverified:
      return
    pending, self.unverified = self.unverified, []
    values = jax.device_get([dev for _, dev in pending])
    last = pending[-1][0]
    for (step, _), v in zip(pending, values):
      loss, grad_norm = float(v["loss"]), float(v["grad_norm"])
      finite = np.isfinite(loss) and np.isfinite(grad_norm)
      if not finite and self.setup.cfg.train.on_nonfinite == "abort":
        raise NonFiniteError(
            f"step {step} has a non-finite {'loss' if not np.isfinite(loss) else 'gradient norm'}"
            f" (loss {loss}, grad_norm {grad_norm}); stopped before checkpointing it, the newest "
            f"checkpoint is the last finite state (train.on_nonfinite=skip skips such steps)")
      self.skipped += not finite
      self.verified = step
      if finite:
        self.last_loss = loss
      if self.is_log_step(step) or (final and step == last):
        self._row(step, loss, grad_norm)

  def _row(self, step: int, loss: float, grad_norm: float) -> None:
    now = time.perf_counter()
    steps, dt = step - self.clock[0], now - self.clock[1]
    self.clock[:] = [step, now]
    tok_s = steps * self.tokens_per_step / dt if dt > 0 else 0.0
    flops = self.flops_per_step(step)
    mfu = tok_s / self.tokens_per_step * flops / self.peak if self.peak else 0.0
    cfg = self.setup.cfg
    lr = optim.current_lr(cfg.optim, cfg.train.steps, step - 1)
    row = {"loss": loss, "lr": lr, "tokens_per_sec": tok_s, "mfu": mfu, "grad_norm": grad_norm,
           "compiles": self.counter.count, "skipped_steps": self.skipped}
    if cfg.attention.window_schedule:
      row["attn_window"] = attention.long_window(cfg.attention, step - 1, cfg.train.steps)
    self.writer.write(step, row)
    skips = f" | {self.skipped} skipped" if self.skipped else ""
    self.log(f"step {step:>6d}/{cfg.train.steps} | loss {loss:.4f} | lr {lr:.2e} | "
             f"{tok_s:,.0f} tok/s | mfu {100 * mfu:.1f}%{skips}")


def train(setup: Setup, state, train_iter, val_batches, *, writer, manager, start_step: int,
          config_dict: dict, log=print, skipped_steps: int = 0) -> LoopResult:
  """Run steps start_step..train.steps: log one step late, evaluate, checkpoint, and stop
  cleanly (save, then return) on SIGTERM/SIGINT."""
  cfg = setup.cfg
  t_cfg = cfg.train
  counter = CompileCounter()

  # Compile ahead of time so that compile time is reported apart and the loop cannot retrace.
  t0 = time.perf_counter()
  first = global_batch(setup, next(train_iter))
  data_state = train_iter.get_state()  # batches consumed through the step about to run
  # Every window tuple of the schedule is its own program: all of them are compiled here, so a
  # window change in the loop only switches executables.
  train_execs = compile_train_steps(setup, state, first, range(start_step, t_cfg.steps))
  eval_exec = make_eval_step(setup).lower(state["params"], val_batches[0]).compile() \
      if val_batches else None
  compile_s = time.perf_counter() - t0
  programs = len(train_execs) + (eval_exec is not None)
  log(f"compiled {len(train_execs)} train step program(s)"
      f"{' and the eval step' if eval_exec is not None else ''} ({programs} in all) in "
      f"{compile_s:.1f} s")
  mon = Monitor(setup, writer, log, counter, start_step=start_step, skipped=skipped_steps)
  profiler = Profiler(cfg, log)

  def evaluate(params):
    losses = [eval_exec(params, b) for b in val_batches]
    return float(np.mean(jax.device_get(losses)))

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
  with Preemption(t_cfg.log_every) as preemption, contextlib.ExitStack() as stack:
    stack.callback(profiler.stop)  # a trace in progress is written even if the loop fails
    counter.active = True
    for step in range(start_step, t_cfg.steps):
      done = step + 1
      with profiler.step(step):
        state, step_metrics = train_execs[step_windows(cfg, step)](state, batch)
      saved_state = data_state
      if done < t_cfg.steps:
        batch = global_batch(setup, next(train_iter))  # overlaps with the step just dispatched
        data_state = train_iter.get_state()
      profiler.after(step, state)
      mon.flush_if_logging()
      mon.add(done, step_metrics)
      if (t_cfg.eval_every and done % t_cfg.eval_every == 0 and done < t_cfg.steps
          and eval_exec is not None):
        val_loss = evaluate(state["params"])
        writer.write(done, {"val_loss": val_loss})
        log(f"step {done:>6d} | val_loss {val_loss:.4f}")
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
      val_loss = evaluate(state["params"])
      writer.write(t_cfg.steps, {"val_loss": val_loss})
      log(f"step {t_cfg.steps:>6d} | val_loss {val_loss:.4f} (final)")
    if start_step < t_cfg.steps:
      save(t_cfg.steps, state, data_state)
  log(f"compilations inside the training loop: {counter.count}")
  return LoopResult(state, mon.last_loss, val_loss, counter.count, compile_s,
                    skipped_steps=mon.skipped, programs=programs)
