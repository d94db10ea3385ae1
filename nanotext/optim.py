"""optax optimizers: AdamW baseline, or Muon for hidden matrices with Adam groups for the rest.

Parameter groups are the `role` each parameter is given where the model makes it
(nanotext.model.layers.ROLES): matrix (Muon), embed, head and scalar (Adam groups). A matrix of
more than 2 dims is a stack: [3, embed, heads] (merged QKV) is three hidden matrices and
[layers, embed, mlp] (model.scan_layers) one per layer, each orthogonalised alone.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nanotext import config, config_file, sharding
from nanotext.errors import UserError
from nanotext.model.kernels.per_device import platform
from nanotext.model.layers import matmul

# Keller Jordan's quintic Newton-Schulz coefficients (modded-nanogpt `zeropower_via_newtonschulz5`).
NS_COEFFS = (3.4445, -4.7750, 2.0315)
# Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932): one quintic per step,
# optimal for 5 steps with safety factor 2e-2 and cushion 2, as modded-nanogpt's later records use
# them (`polar_express_coeffs`). optax (0.2.8, and its main branch as of 2026-08) has no such
# preset (`_NS_COEFFS_PRESET_DICT` holds only 'standard' and 'dion'), hence the table here.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.02  # the coefficients assume X / (1.02 * ||X||_F): spectral norm < 1


CHOICES = {"name": ("adamw", "muon"), "muon_layout": ("distributed", "replicated", "sharded"),
           "muon_ns_coeffs": ("jordan", "polar_express"), "muon_scale": ("fan_out", "rows")}


def check_config(o, d_model: int, fresh=True) -> None:
  """The optim section: optimizer and Muon choices, schedule fractions, one head lr; `fresh`:
  no weight decay under muon (a saved run that set it trained without it, and resumes so)."""
  config.check_choices("optim", o, CHOICES)
  derived = o.head_lr_record / d_model ** 0.5  # what config.finalize sets head_lr to
  if o.head_lr_record and o.head_lr not in (derived, _default_head_lr()):
    raise UserError(f"optim.head_lr={o.head_lr} would be replaced by optim.head_lr_record="
                    f"{o.head_lr_record} / sqrt(model.d_model) = {derived:.6g}: set "
                    "optim.head_lr_record=0 to train with your head_lr")
  if fresh and o.name == "muon" and o.weight_decay:  # an ablation of it trained two identical runs
    raise UserError(f"optim.weight_decay={o.weight_decay} is read only by optim.name=adamw (the "
                    "muon recipe, the record's, has no weight decay): leave it 0 under muon")
  if not 0 < o.muon_layer_decay <= 1:
    raise UserError(f"optim.muon_layer_decay={o.muon_layer_decay} must be in (0, 1] (1 = off)")
  for key in ("cooldown_frac", "final_lr_frac", "muon_momentum", "muon_momentum_start"):
    if not 0 <= o[key] <= 1:
      raise UserError(f"optim.{key}={o[key]} must be in [0, 1]")
  for key in ("beta1", "beta2"):  # Adam's bias correction divides by 1 - beta**step
    if not 0 <= o[key] < 1:
      raise UserError(f"optim.{key}={o[key]} must be in [0, 1)")
    if np.float32(o[key]) == 1:  # the step runs in float32: 1 - beta**step is 0 there
      raise UserError(f"optim.{key}={o[key]} is 1.0 in float32, where Adam divides by "
                      f"1 - {key}**step: give at most {float(np.nextafter(np.float32(1), 0))}")
  tiny = float(np.finfo(np.float32).tiny)  # below it float32 (flushing subnormals) holds 0
  for key in ("eps", "head_eps"):  # Adam divides by sqrt(v) + eps: 0/0 where a gradient is 0
    if (o[key] or key == "eps") and o[key] < tiny:
      raise UserError(f"optim.{key}={o[key]} is 0 in float32, where Adam divides by sqrt(v) + "
                      f"{key} (NaN params where a gradient is 0): give at least {tiny:.3g}")


def _default_head_lr() -> float:
  return config_file.read(config.SCHEMA_PATH)["optim"]["head_lr"]


def group_labels(state):
  """Tree of optimizer groups (each parameter's `role`, set where it is made) of an nnx State."""
  labels = jax.tree.map(lambda v: v.get_metadata()["role"], state,
                        is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(labels) if isinstance(labels, nnx.State) else labels


def schedule_values(optim_cfg, total_steps: int) -> tuple:
  """(total steps, cooldown steps) of a run of `total_steps`, as Python floats: the numbers the
  schedule divides by (the train step takes them as an argument, `lr_factor`)."""
  span = optim_cfg.cooldown_frac * total_steps  # cooldown steps, fractional as the record's
  return float(total_steps), float(int(span) if optim_cfg.cooldown_whole_steps else span)


def lr_factor(optim_cfg, total_steps, xp=jnp):
  """Schedule multiplier: linear warmup, constant, then linear cooldown to final_lr_frac.

  The cooldown is the last cooldown_frac of the run's progress, as the record's get_lr
  (train_gpt.py 587b45fb): final + (1 - final) * min(1, (1 - step / total) / cooldown_frac),
  here (total - step) / (cooldown_frac * total) (the same float32 values as before when that
  product is whole). Rounding the product to whole steps moves the cooldown's rates whenever it
  is fractional (at 12 steps 0.82 for the record's 0.85 at step 8), but is the JAX port's
  schedule (int(N * 0.4) warmdown steps): optim.cooldown_whole_steps.
  `total_steps` is an int, or inside the train step its float32 [2] argument holding
  schedule_values (so runs that differ only in train.steps share one compiled program; the
  values are the same float32 numbers either way). `xp` is jnp inside optax, or numpy for
  host-side logging (no device work, no compilation).
  """
  warmup = optim_cfg.warmup_steps
  if isinstance(total_steps, (int, np.integer)):
    total, span = schedule_values(optim_cfg, int(total_steps))
  else:
    total, span = total_steps[0], total_steps[1]
  final = optim_cfg.final_lr_frac

  def factor(step):
    step = xp.asarray(step, xp.float32)
    up = xp.minimum(1.0, (step + 1) / warmup) if warmup else 1.0
    if isinstance(span, float):
      frac_left = xp.clip((total - step) / span, 0.0, 1.0) if span else 1.0
    else:  # traced: no cooldown where it is 0 steps long
      frac_left = xp.where(span > 0, xp.clip((total - step) / xp.where(span > 0, span, 1.0),
                                             0.0, 1.0), 1.0)
    down = final + (1 - final) * frac_left
    return up * down
  return factor


def scaled(factor, peak: float):
  return lambda step: peak * factor(step)


def muon_momentum(optim_cfg):
  """Muon momentum schedule: linear from momentum_start to momentum over the warmup steps."""
  n, lo, hi = optim_cfg.muon_momentum_warmup, optim_cfg.muon_momentum_start, optim_cfg.muon_momentum
  if not n:
    return lambda step: jnp.asarray(hi, jnp.float32)
  return lambda step: lo + (hi - lo) * jnp.clip(jnp.asarray(step, jnp.float32) / n, 0.0, 1.0)


def ns_coefficients(optim_cfg) -> tuple:
  """Newton-Schulz coefficients (Python floats) for optim.muon_ns_coeffs: (a, b, c) or per step.

  polar_express takes its first muon_ns_steps quintics (the last repeats beyond five) and folds
  the safety factor into the first: p(X / s) with p = aX + bXX'X + c(XX')^2X equals the quintic
  (a / s, b / s^3, c / s^5) of X, so the plain Frobenius normalisation can stay as it is.
  """
  if optim_cfg.muon_ns_coeffs == "jordan":
    return tuple(NS_COEFFS)
  n = optim_cfg.muon_ns_steps
  table = [POLAR_EXPRESS_COEFFS[min(i, len(POLAR_EXPRESS_COEFFS) - 1)] for i in range(n)]
  s = POLAR_EXPRESS_SAFETY
  a, b, c = table[0]
  table[0] = (a / s, b / s ** 3, c / s ** 5)
  return tuple(table)


def newton_schulz(g, coeffs, steps: int, dtype=jnp.bfloat16, eps: float = 1e-7):
  """Orthogonalise a 2-D g as the record's `zeropower_via_newtonschulz5`.

  Only the matmuls run in `dtype` (accumulating in float32); the coefficients stay float32 and
  every elementwise combination is computed in float32 and rounded to `dtype` once, as PyTorch
  does for bf16 tensors times Python floats (rounding (3.4445, -4.775, 2.0315) to bf16 instead
  makes updates 2-2.4% larger). g is [in, out]; the record's weights are [out, in] and it works
  on the wide orientation, transposing when out > in: here, unless in < out (square included).
  """
  per_step = [coeffs] * steps if isinstance(coeffs[0], (int, float)) else list(coeffs)[:steps]
  f32 = jnp.float32
  mm = lambda a, b: jnp.matmul(a, b, preferred_element_type=f32)
  x = g.astype(f32)
  transpose = x.shape[0] >= x.shape[1]
  x = x.T if transpose else x
  x = (x / (jnp.linalg.norm(x) + eps)).astype(dtype)
  # The iterations as one loop body, compiled once per matrix shape (unrolled, they were most
  # of a TPU train program's optimizer compile). One quintic for every step (the record's):
  # its coefficients are constants of the body; a per-step schedule is the loop's input. A GPU
  # unrolls them: it compiles them in seconds, and its loops wait on the host between trips.
  same = all(tuple(t) == tuple(per_step[0]) for t in per_step)
  unroll = max(1, len(per_step)) if platform() == "gpu" else 1

  def step(x, abc):
    a, b, c = (float(v) for v in per_step[0]) if same else abc
    A = matmul(x, x.T)  # rounded once, as mm(x, x.T).astype(dtype): a GPU's GEMM writes dtype
    B = (b * A.astype(f32) + c * mm(A, A)).astype(dtype)
    return (a * x.astype(f32) + mm(B, x)).astype(dtype), None
  x = jax.lax.scan(step, x, jnp.asarray(per_step, f32), unroll=unroll)[0] if per_step else x
  return x.T if transpose else x


def scale_by_muon(optim_cfg) -> optax.GradientTransformation:
  """Muon on [in, out] matrices, as modded-nanogpt computes it.

  Differences from `optax.contrib.scale_by_muon`: the momentum is a schedule (warmup) and is not
  bias-corrected (the speedrun's `buf.lerp_(g, 1 - m)`; Nesterov `g.lerp_(buf, m)`), Newton-Schulz
  runs its matmuls in bfloat16 with float32 coefficients (`newton_schulz`), and updates are
  scaled by sqrt(max(1, fan_out / fan_in)). A [..., in, out] stack (merged QKV, scanned layers)
  is that many matrices, each orthogonalised and scaled on its own, as the record's qkv_w.
  """
  momentum = muon_momentum(optim_cfg)
  coeffs = ns_coefficients(optim_cfg)
  ns_dtype = jnp.bfloat16 if optim_cfg.muon_bf16 else jnp.float32

  def init(params):
    return {"count": jnp.zeros([], jnp.int32),
            "mu": jax.tree.map(jnp.zeros_like, params)}

  def update(updates, state, params=None):
    del params
    m = momentum(state["count"])
    f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
    # In float32, stored in the buffer's dtype: a bfloat16 momentum (param_dtype bfloat16) must
    # come back bfloat16, or the next step's compiled program refuses its own state.
    mu = jax.tree.map(lambda b, g: b + (1 - m) * (g - b), f32(state["mu"]), f32(updates))
    look = jax.tree.map(lambda g, b: g + m * (b - g), f32(updates), mu) \
        if optim_cfg.muon_nesterov else mu
    mu = jax.tree.map(lambda new, old: new.astype(old.dtype), mu, state["mu"])
    out = orthogonalize_all(look, optim_cfg.muon_layout,
                            lambda x: newton_schulz(x, coeffs, optim_cfg.muon_ns_steps, ns_dtype))
    out = jax.tree_util.tree_map_with_path(
        lambda path, y, x: y.astype(x.dtype) * aspect_scale(x.shape, optim_cfg.muon_scale,
                                                            stored_out_in(path)), out, look)
    return out, {"count": state["count"] + 1, "mu": mu}

  return optax.GradientTransformation(init, update)


def stored_out_in(path) -> bool:
  """Whether the parameter at `path` is stored [..., out, in]: model.fused_qkv's attn/qkv (its own
  parameter, no `kernel` below it). Every other matrix (Linear, merged QKV [3, in, out], either
  under a scanned [L, ...] stack) is [..., in, out]."""
  keys = [getattr(k, "key", None) for k in path[-2:]]
  return keys == ["attn", "qkv"]


def aspect_scale(shape, rule: str, out_in: bool = False) -> float:
  """Muon's per-matrix update scale sqrt(max(1, r)) for a matrix (or a stack of them), stored
  [in, out], or [out, in] where `out_in` (model.fused_qkv: `stored_out_in`).

  fan_out: r = fan_out / fan_in of the matrix whatever its layout (the record's
  `max(1, p.size(-2) / p.size(-1))` on its [out, in] weights): fused QKV [3*H*K, D] gets
  sqrt(3 H K / D). rows: r = rows / cols of the matrix as stored, as modded-nanogpt-jax computes
  it on its own layout (MLP weights [in, out], c_qkv [out, in]; nanotext's model.fused_qkv is
  stored [out, in] like that c_qkv), so its MLP input gets 1 and its MLP output 2.
  """
  rows, cols = shape[-2], shape[-1]
  fan_in, fan_out = (cols, rows) if out_in else (rows, cols)
  r = fan_out / fan_in if rule == "fan_out" else rows / cols
  return float(np.sqrt(max(1.0, r)))


def layer_decay(decay: float) -> optax.GradientTransformation:
  """Layer-wise learning-rate decay: the updates of block i times decay^(L - 1 - i).

  The last block keeps the full rate and each block below it one more factor of `decay`. Blocks
  are found by path: `blocks/<i>/...` (unrolled; L = the largest i + 1), or `blocks/...` with
  the layers on the leading axis (model.scan_layers). Other parameters are left as they are.
  """
  def block_of(path):
    """'stack' for a scanned block parameter, its index for an unrolled one, else None."""
    for a, k in zip(path, path[1:]):
      if getattr(a, "key", None) == "blocks":
        key = getattr(k, "key", getattr(k, "idx", None))
        return key if isinstance(key, int) else "stack"
    return None

  def update(updates, state, params=None):
    del params
    flat, treedef = jax.tree_util.tree_flatten_with_path(updates)
    blocks = [block_of(p) for p, _ in flat]
    top = max([b for b in blocks if isinstance(b, int)], default=0)
    def scaled_leaf(u, b):
      if b is None:
        return u
      if b == "stack":  # [L, ...]: layer l gets decay^(L - 1 - l)
        f = float(decay) ** np.arange(u.shape[0] - 1, -1, -1)
        return u * jnp.asarray(f, u.dtype).reshape((-1,) + (1,) * (u.ndim - 1))
      return u * float(decay) ** (top - b)
    out = [scaled_leaf(u, b) for (_, u), b in zip(flat, blocks)]
    return jax.tree.unflatten(treedef, out), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def orthogonalize_all(tree, layout: str, ortho):
  """Apply `ortho` to every matrix of a tree, placing the work by `layout`.

  sharded: each matrix keeps its parameter's sharding and XLA partitions the Newton-Schulz
  matmuls (collectives inside every iteration). replicated: every device gathers every matrix
  and orthogonalises all of them (no collectives in the loop, all the compute everywhere).
  distributed: same-shape matrices are stacked and the stack is split over all devices, so each
  orthogonalises a share and the results go back to the parameters' sharding (the speedrun's
  distributed Muon): gathered whole under pure data parallelism, sent to their shards under FSDP.
  A leaf of more than 2 dims is a stack of [in, out] matrices (merged QKV [3, in, out], scanned
  layers [L, in, out] or [L, 3, in, out]): each is orthogonalised on its own.
  """
  def per_matrix(x):
    f = ortho
    for _ in range(x.ndim - 2):  # one vmap per leading stack axis
      f = jax.vmap(f)
    return f(x)
  if layout == "sharded":
    return jax.tree.map(per_matrix, tree)
  if layout == "replicated":
    # Its results pinned whole too: left free, XLA took the parameters' sharding (FSDP) back into
    # the Newton-Schulz iterations, collectives in every one, as the sharded layout's.
    return jax.tree.map(lambda x: sharding.replicate(per_matrix(sharding.replicate(x))), tree)
  leaves, treedef = jax.tree.flatten(tree)
  # Every leaf joins the group of its matrix shape as a run of matrices, so q, k, v of a merged
  # [3, D, HK] (or L layers' worth) go with the other [D, HK] matrices, items of one spread
  # stack; a leaf is one slice of the stack, not one per layer (ops independent of depth).
  groups = {}
  for i, x in enumerate(leaves):
    groups.setdefault((x.shape[-2:], x.dtype), []).append(i)
  out = [None] * len(leaves)
  n_dev = sharding.spread_count()
  # Pure data parallelism: no weight axis split (the mesh axes they map to, each counted once,
  # number one device), so each device holds every gradient whole.
  whole = sharding.active_count(sharding.WEIGHT_AXES) == 1
  for (shape, _), items in groups.items():
    parts = [leaves[i].reshape((-1,) + shape) for i in items]
    stack = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    pad = -stack.shape[0] % n_dev  # whole matrices per device; zero matrices orthogonalise to zero
    stack = jnp.pad(stack, ((0, pad), (0, 0), (0, 0))) if pad else stack
    if whole:  # each device slices its share of the stack from the gradients it holds
      stack = sharding.replicate(stack)
    done = jax.vmap(ortho)(sharding.spread_leading(stack))
    # Whole on every device only where the parameters are; else each result goes straight to its
    # parameter's shards (all-to-alls under FSDP), not gathered whole for the update to slice.
    done = sharding.replicate(done) if whole else done
    start = 0
    for i, part in zip(items, parts):
      out[i] = done[start:start + part.shape[0]].reshape(leaves[i].shape)
      start += part.shape[0]
  return jax.tree.unflatten(treedef, out)


def _adam(optim_cfg, lr, eps=None):
  eps = optim_cfg.eps if eps is None else eps
  return in_float32(optax.adam(lr, b1=optim_cfg.beta1, b2=optim_cfg.beta2, eps=eps))


def in_float32(tx) -> optax.GradientTransformation:
  """tx computed in float32, its state stored in the parameters' dtype.

  As PyTorch's fused Adam on the record's bf16 embeddings: moments kept in bf16, arithmetic in
  float32 (bf16 arithmetic would also round the betas: 0.8 -> 0.80078).
  """
  up = lambda tree: jax.tree.map(
      lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

  def update(updates, state, params=None):
    new_updates, new_state = tx.update(up(updates), up(state), up(params))
    return new_updates, jax.tree.map(lambda n, o: n.astype(o.dtype), new_state, state)

  return optax.GradientTransformation(tx.init, update)


def make_optimizer(optim_cfg, labels, total_steps, grad_scale=1) -> optax.GradientTransformation:
  """The optimizer named by optim.name, over params whose groups are given by `labels`, for a
  run of `total_steps` (an int, or the train step's schedule argument: `lr_factor`).

  `grad_scale`: the gradients it is given are this many times the mean token loss's (the row
  length under train.loss_reduction=row_sum), so optim.grad_clip bounds the mean loss's gradient
  norm, the one logged as grad_norm, whichever reduction steps.
  """
  factor = lr_factor(optim_cfg, total_steps)
  clip = [optax.clip_by_global_norm(optim_cfg.grad_clip * grad_scale)] \
      if optim_cfg.grad_clip else []
  if optim_cfg.name == "adamw":
    decay_mask = jax.tree.map(lambda g: g in ("matrix", "embed", "head"), labels)
    # Arithmetic in float32, moments in the parameters' dtype, as the muon recipe's Adam groups.
    tx = in_float32(optax.adamw(scaled(factor, optim_cfg.lr), b1=optim_cfg.beta1,
                                b2=optim_cfg.beta2, eps=optim_cfg.eps,
                                weight_decay=optim_cfg.weight_decay, mask=decay_mask))
    return optax.chain(*clip, tx)
  transforms = {
      "matrix": optax.chain(scale_by_muon(optim_cfg),
                            *([layer_decay(optim_cfg.muon_layer_decay)]
                              if optim_cfg.muon_layer_decay != 1 else []),
                            optax.scale_by_learning_rate(scaled(factor, optim_cfg.muon_lr))),
      "embed": _adam(optim_cfg, scaled(factor, optim_cfg.embed_lr)),
      "head": _adam(optim_cfg, scaled(factor, optim_cfg.head_lr), optim_cfg.head_eps or None),
      "scalar": _adam(optim_cfg, scaled(factor, optim_cfg.scalar_lr)),
  }
  used = set(jax.tree.leaves(labels))
  transforms = {k: v for k, v in transforms.items() if k in used}
  return optax.chain(*clip, optax.multi_transform(transforms, labels))


def current_lr(optim_cfg, total_steps: int, step: int) -> float:
  """The peak-scaled learning rate at `step` (Muon's for the muon recipe), for logging."""
  peak = optim_cfg.muon_lr if optim_cfg.name == "muon" else optim_cfg.lr
  return float(peak * lr_factor(optim_cfg, total_steps, xp=np)(step))
