"""The train step and the eval step, as jitted programs of a Run (programs.py compiles them ahead
of time, loop.py runs them)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from nanotext import sharding
from nanotext.wiring import Run, new_state
from nanotext.model.loss import loss_fn


def make_train_step(run: Run, windows=None, seq_len: int = 0, runtime: bool = False):
  """A TrainStep: (state, batch) -> (state, metrics), state donated, with gradient accumulation.

  `windows` (a tuple of static per-layer ints, one attention.window_schedule stage) and
  `seq_len` (a train.seq_len_start warmup length; 0 = the batch's) are baked into the program.
  With `runtime`, the step is jit(state, batch, windows [layers] int32) and `windows` are their
  static bounds: one program for every window stage (kernels/dispatch.takes_runtime_window).
  Shorter rows are the batch's rows cut into pieces (same tokens, targets still the next token),
  run in micro-batches of as many rows as at full length (modded-nanogpt-jax's fixed
  micro-batch).
  train.loss_reduction=row_sum steps on the gradient of each row's summed loss (the record's).

  A step whose loss or gradient norm is not finite leaves params and optimizer moments as they
  were (its step counts advance) when train.on_nonfinite=skip (selected on device: no host
  sync); with abort the host stops the run when it reads the step's metrics, before that state
  is checkpointed.
  """
  accum, graphdef = run.cfg.train.grad_accum, run.graphdef
  skip = run.cfg.train.on_nonfinite == "skip"
  row_sum = run.cfg.train.loss_reduction == "row_sum"

  def objective(p, x, y, live):
    loss = loss_fn(graphdef, p, x, y, run.eot_id, windows, run.cfg.train.loss_chunk,
                   per_row=row_sum, runtime_windows=live)
    # row_sum steps on each row's summed loss (mean over rows); the metric stays the token mean.
    return loss, loss / x.shape[1] if row_sum else loss
  grad_fn = jax.value_and_grad(objective, has_aux=True)

  def step_fn(state, batch, schedule, *runtime_windows):
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
      # The logged norm is of the mean loss's gradient, whichever loss_reduction steps, and
      # optim.grad_clip bounds that norm: row_sum's gradient is the row length times it.
      grad_scale = T // cut if row_sum else 1
      grad_norm = optax.tree.norm(grads) / grad_scale
      tx = run.tx_at(schedule, grad_scale)
      updates, opt_state = tx.update(grads, state["opt_state"], params)
      new_params = optax.apply_updates(params, updates)
      if skip:
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jnp.where(finite, new, old)
        new_params = jax.tree.map(keep, new_params, params)
        # The step counts advance (integer leaves): every schedule (lr, Muon's momentum) stays
        # on the loop's step, as the windows and the logged lr are; kept, each skip put the
        # optimizer a step behind them for good.
        opt_state = jax.tree.map(lambda new, old: new if jnp.issubdtype(new.dtype, jnp.integer)
                                 else keep(new, old), opt_state, state["opt_state"])
    metrics = {"loss": loss, "grad_norm": grad_norm}
    return new_state(state["step"] + 1, new_params, opt_state), metrics

  batch_sh = {"inputs": run.batch_sharding, "targets": run.batch_sharding}
  return TrainStep(jax.jit(step_fn, in_shardings=(run.state_shardings, batch_sh,
                                                  schedule_spec(run).sharding)
                           + windows_sharding(run, runtime),
                           out_shardings=(run.state_shardings, None), donate_argnums=0), run)


def micro_batches(a_BT, accum: int):
  """[B, T] -> [accum, B / accum, T]: row r in micro-batch r % accum, so each device's rows
  spread over all micro-batches (a scan step takes its share of every device's rows)."""
  b, t = a_BT.shape
  a = a_BT.reshape(b // accum, accum, t).swapaxes(0, 1)
  return sharding.constrain(a, (None, "batch", "act_length"))


class TrainStep:
  """The jitted train step, called, traced and lowered as (state, batch[, windows]): it supplies
  the program's schedule argument, the run's float32 [train.steps, cooldown steps]
  (Run.schedule), so that runs differing only in train.steps share one compiled program. A
  compiled step takes it explicitly: compiled(state, batch, schedule_of(run)[, windows])."""

  def __init__(self, jitted, run: Run):
    self.jitted, self.run, self._schedule = jitted, run, None

  def __call__(self, state, batch, *windows):
    if self._schedule is None:
      self._schedule = schedule_of(self.run)
    return self.jitted(state, batch, self._schedule, *windows)

  def trace(self, state, batch, *windows):
    return self.jitted.trace(state, batch, schedule_spec(self.run), *windows)

  def lower(self, state, batch, *windows):
    return self.jitted.lower(state, batch, schedule_spec(self.run), *windows)


def schedule_spec(run: Run) -> jax.ShapeDtypeStruct:
  """The train step's schedule argument, abstract: float32 [2], replicated."""
  return jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(run.mesh, P()))


def schedule_of(run: Run) -> jax.Array:
  """The run's schedule argument on its devices (no transfer per step)."""
  spec, values = schedule_spec(run), run.schedule()
  return jax.make_array_from_callback(spec.shape, spec.sharding, lambda i: values[i])


def make_eval_step(run: Run, windows=None, runtime: bool = False):
  """jit(params, batch) -> mean loss at per-layer `windows` (None: the final ones), with the
  evaluation head (no FP8, as the record's eval mode); with `runtime`, jit(params, batch,
  windows [layers] int32) and `windows` their static bounds. train.eval_accum > 1: the rows in
  as many forward passes one after another, their means averaged (equal token counts: the
  batch's mean)."""
  accum = max(1, run.cfg.train.eval_accum)  # -1 (auto) is resolved by the memory plan

  def eval_fn(params, batch, *runtime_windows):
    live = runtime_windows[0] if runtime_windows else None
    loss = lambda x, y: loss_fn(run.graphdef, params, x, y, run.eot_id, windows,
                                chunk=run.cfg.train.eval_loss_chunk, train=False,
                                runtime_windows=live)
    with sharding.use_rules(run.rules, run.mesh):
      if accum == 1:
        return loss(batch["inputs"], batch["targets"])
      xs = (micro_batches(batch["inputs"], accum), micro_batches(batch["targets"], accum))
      total, _ = jax.lax.scan(lambda s, xy: (s + loss(*xy), None), jnp.zeros([], jnp.float32),
                              xs)
      return total / accum
  batch_sh = {"inputs": run.batch_sharding, "targets": run.batch_sharding}
  return jax.jit(eval_fn, in_shardings=(run.state_shardings["params"], batch_sh)
                 + windows_sharding(run, runtime))


def windows_sharding(run: Run, runtime: bool) -> tuple:
  """The sharding of a runtime windows argument (replicated), if the program takes one."""
  return (NamedSharding(run.mesh, P()),) if runtime else ()


def every_process(local: list) -> list:
  """The validation batches' targets of every process, for a figure of the whole set (val_bpb
  of process 0's rows alone was another set's: 4.084 for 4.066 where the batch is split)."""
  if jax.process_count() == 1:
    return local
  from jax.experimental import multihost_utils
  return [{"targets": np.asarray(multihost_utils.process_allgather(np.asarray(b["targets"]),
                                                                   tiled=True))} for b in local]


def global_batch(run: Run, local: dict) -> dict:
  """Global jax.Arrays sharded along `batch`, built from this process's rows (its group's share:
  sharding.row_groups; without the global shape jax took a batch replicated across processes
  for one split between them, and trained on half of it, mixed)."""
  groups = sharding.row_groups(run.batch_sharding, run.cfg.train.batch_size)[1]
  return {k: jax.make_array_from_process_local_data(
      run.batch_sharding, np.asarray(v), (len(v) * groups,) + np.shape(v)[1:])
          for k, v in local.items()}


def dispatch_each(run: Run, fn, items) -> list:
  """[fn(x) for x in items], dispatched ahead on accelerators; on CPU each program waits for the
  one before, since XLA:CPU's collectives deadlock (a rendezvous aborts the process) once more
  independent programs are in flight than its threads run at once (train.eval_batches=64 on 8
  devices)."""
  out = []
  for x in items:
    if out and run.backend == "cpu":
      jax.block_until_ready(out[-1])
    out.append(fn(x))
  return out
