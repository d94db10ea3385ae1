"""The train step, the eval step and the training loop."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from nanotext import checkpoint, metrics, optim, sharding
from nanotext.model import GPT, count_params
from nanotext.model.attention import resolve_impl


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


def build(cfg, mesh, backend: str) -> Setup:
  """Abstract model -> logical specs -> shardings and optimizer, without allocating anything."""
  rules = sharding.parse_rules(cfg.mesh.rules)
  impl = resolve_impl(cfg.attention.impl, backend)
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
               sharding.batch_sharding(mesh, rules), count_params(abstract_params))


def init_state(setup: Setup):
  """Create params and optimizer state directly in their shardings (no host copy)."""
  def init():
    params = nnx.state(setup.create_model()).to_pure_dict()
    return {"step": jnp.zeros([], jnp.int32), "params": params,
            "opt_state": setup.tx.init(params)}
  return jax.jit(init, out_shardings=setup.state_shardings)()


def abstract_state(setup: Setup):
  """ShapeDtypeStructs of the train state carrying its target shardings (for restore)."""
  shapes = jax.eval_shape(lambda: {
      "step": jnp.zeros([], jnp.int32),
      "params": (p := nnx.state(setup.create_model()).to_pure_dict()),
      "opt_state": setup.tx.init(p)})
  return checkpoint.abstract_with_shardings(shapes, setup.state_shardings)


def loss_fn(graphdef, params, inputs_BT, targets_BT):
  """Mean next-token cross-entropy."""
  logits_BTV = nnx.merge(graphdef, params)(inputs_BT)
  return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, targets_BT).mean()


def make_train_step(setup: Setup):
  """jit(state, batch) -> (state, metrics), state donated, with gradient accumulation."""
  accum, graphdef, tx = setup.cfg.train.grad_accum, setup.graphdef, setup.tx
  grad_fn = jax.value_and_grad(lambda p, x, y: loss_fn(graphdef, p, x, y))

  def micro_batches(a_BT):
    # Row r goes to micro-batch r % accum, so each device's rows spread over all micro-batches.
    b, t = a_BT.shape
    a = a_BT.reshape(b // accum, accum, t).swapaxes(0, 1)
    return sharding.constrain(a, (None, "batch", "length"))

  def step_fn(state, batch):
    with sharding.use_rules(setup.rules, setup.mesh):
      params = state["params"]
      if accum == 1:
        loss, grads = grad_fn(params, batch["inputs"], batch["targets"])
      else:
        def body(carry, xy):
          loss, grads = grad_fn(params, *xy)
          return jax.tree.map(jnp.add, carry, (loss, grads)), None
        zeros = (jnp.zeros([], jnp.float32), jax.tree.map(jnp.zeros_like, params))
        xs = (micro_batches(batch["inputs"]), micro_batches(batch["targets"]))
        (loss, grads), _ = jax.lax.scan(body, zeros, xs)
        loss, grads = loss / accum, jax.tree.map(lambda g: g / accum, grads)
      updates, opt_state = tx.update(grads, state["opt_state"], params)
      new_params = optax.apply_updates(params, updates)
    new_state = {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}
    return new_state, {"loss": loss, "grad_norm": optax.global_norm(grads)}

  batch_sh = {"inputs": setup.batch_sharding, "targets": setup.batch_sharding}
  return jax.jit(step_fn, in_shardings=(setup.state_shardings, batch_sh),
                 out_shardings=(setup.state_shardings, None), donate_argnums=0)


def make_eval_step(setup: Setup):
  """jit(params, batch) -> mean loss."""
  def eval_fn(params, batch):
    with sharding.use_rules(setup.rules, setup.mesh):
      return loss_fn(setup.graphdef, params, batch["inputs"], batch["targets"])
  batch_sh = {"inputs": setup.batch_sharding, "targets": setup.batch_sharding}
  return jax.jit(eval_fn, in_shardings=(setup.state_shardings["params"], batch_sh))


def global_batch(setup: Setup, local: dict) -> dict:
  """Global jax.Arrays sharded along `batch`, built from this process's rows."""
  return {k: jax.make_array_from_process_local_data(setup.batch_sharding, np.asarray(v))
          for k, v in local.items()}


@dataclasses.dataclass
class LoopResult:
  state: dict
  last_loss: float
  val_loss: float
  compiles_in_loop: int
  compile_seconds: float


def train(setup: Setup, state, train_iter, val_batches, *, writer, manager, start_step: int,
          config_dict: dict, log=print) -> LoopResult:
  """Run steps start_step..train.steps: log one step late, evaluate, checkpoint."""
  cfg = setup.cfg
  t_cfg = cfg.train
  tokens_per_step = t_cfg.batch_size * t_cfg.seq_len
  flops_per_step = metrics.flops_per_token(cfg.model, t_cfg.seq_len, cfg.attention.window) \
      * tokens_per_step
  peak = cfg.metrics.peak_flops * jax.device_count()
  counter = CompileCounter()

  # Compile ahead of time so that compile time is reported apart and the loop cannot retrace.
  t0 = time.perf_counter()
  first = global_batch(setup, next(train_iter))
  step_exec = make_train_step(setup).lower(state, first).compile()
  eval_exec = make_eval_step(setup).lower(state["params"], val_batches[0]).compile() \
      if val_batches else None
  compile_s = time.perf_counter() - t0
  log(f"compiled train and eval steps in {compile_s:.1f} s")

  def evaluate(params):
    losses = [eval_exec(params, b) for b in val_batches]
    return float(np.mean(jax.device_get(losses)))

  def save(step, state):
    if manager is not None:
      active, counter.active = counter.active, False  # orbax compiles its own transfers
      checkpoint.save(manager, step, state, {"iterator": train_iter.get_state()}, config_dict)
      counter.active = active

  pending = None  # (step, device metrics) read one step late
  last_loss, val_loss = float("nan"), float("nan")
  clock = [start_step, time.perf_counter()]  # last reported step and when it was read
  counter.active = True
  batch = first
  for step in range(start_step, t_cfg.steps):
    state, step_metrics = step_exec(state, batch)
    if step + 1 < t_cfg.steps:
      batch = global_batch(setup, next(train_iter))  # overlaps with the step just dispatched
    if pending is not None:
      loss = _report(pending, setup, writer, log, clock, flops_per_step, tokens_per_step, peak,
                     counter.count, force=False)
      last_loss = last_loss if loss is None else loss
    pending = (step + 1, step_metrics)
    done = step + 1
    if (t_cfg.eval_every and done % t_cfg.eval_every == 0 and done < t_cfg.steps
        and eval_exec is not None):
      val_loss = evaluate(state["params"])
      writer.write(done, {"val_loss": val_loss})
      log(f"step {done:>6d} | val_loss {val_loss:.4f}")
    if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done < t_cfg.steps:
      save(done, state)
  if pending is not None:
    last_loss = _report(pending, setup, writer, log, clock, flops_per_step, tokens_per_step,
                        peak, counter.count, force=True)
  counter.active = False
  if eval_exec is not None:
    val_loss = evaluate(state["params"])
    writer.write(t_cfg.steps, {"val_loss": val_loss})
    log(f"step {t_cfg.steps:>6d} | val_loss {val_loss:.4f} (final)")
  if start_step < t_cfg.steps:
    save(t_cfg.steps, state)
  log(f"compilations inside the training loop: {counter.count}")
  return LoopResult(state, last_loss, val_loss, counter.count, compile_s)


def _report(pending, setup, writer, log, clock, flops_per_step, tokens_per_step, peak, compiles,
            *, force):
  """Fetch a finished step's metrics and log them if it is a logging step; returns its loss.

  Throughput covers the steps since the last report; `clock` is [that step, its time].
  """
  step, dev = pending
  t_cfg = setup.cfg.train
  if not force and step % t_cfg.log_every and step != 1:
    return None
  values = jax.device_get(dev)  # waits for this step only; the next one is already queued
  now = time.perf_counter()
  steps, dt = step - clock[0], now - clock[1]
  clock[:] = [step, now]
  tok_s = steps * tokens_per_step / dt if dt > 0 else 0.0
  mfu = tok_s / tokens_per_step * flops_per_step / peak if peak else 0.0
  lr = optim.current_lr(setup.cfg.optim, t_cfg.steps, step - 1)
  loss = float(values["loss"])
  writer.write(step, {"loss": loss, "lr": lr, "tokens_per_sec": tok_s, "mfu": mfu,
                      "grad_norm": float(values["grad_norm"]), "compiles": compiles})
  log(f"step {step:>6d}/{t_cfg.steps} | loss {loss:.4f} | lr {lr:.2e} | "
      f"{tok_s:,.0f} tok/s | mfu {100 * mfu:.1f}%")
  return loss
