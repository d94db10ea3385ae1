"""A minimal hand-written GPT-2 train step in plain JAX + optax: the overhead benchmark's reference.

No flax, no config, no sharding: parameters are a dict of arrays, the model is a function, and the
step is one jitted, donated function. It computes the same math as nanotext's configs/base.yml
(learned positions, pre-LN blocks with LayerNorm, GELU MLP, tied head, AdamW with warmup and
cooldown and global-norm clipping), so nanotext's step time divided by this one's is the cost of
the framework. `benchmarks/overhead.py` checks that both give the same loss on the same params.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class Hparams:
  """Model shape and AdamW settings (the configs/base.yml keys of the same names)."""
  vocab_size: int = 8192
  num_layers: int = 4
  d_model: int = 256
  num_heads: int = 4
  head_dim: int = 64
  mlp_dim: int = 1024
  seq_len: int = 256
  lr: float = 3e-3
  beta1: float = 0.9
  beta2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  warmup_steps: int = 20
  cooldown_frac: float = 0.4
  final_lr_frac: float = 0.1
  total_steps: int = 200


def init_params(key, hp: Hparams) -> dict:
  """GPT-2 init: N(0, 0.02) weights, output projections scaled by 1/sqrt(2 * layers)."""
  d, hk, f = hp.d_model, hp.num_heads * hp.head_dim, hp.mlp_dim
  keys = iter(jax.random.split(key, 2 + 6 * hp.num_layers))
  normal = lambda shape, std=0.02: std * jax.random.normal(next(keys), shape, jnp.float32)
  proj_std = 0.02 / (2 * hp.num_layers) ** 0.5
  zeros, ones = (lambda n: jnp.zeros((n,), jnp.float32)), (lambda n: jnp.ones((n,), jnp.float32))
  blocks = [{
      "ln1_scale": ones(d), "ln1_bias": zeros(d),
      "wq": normal((d, hk)), "bq": zeros(hk), "wk": normal((d, hk)), "bk": zeros(hk),
      "wv": normal((d, hk)), "bv": zeros(hk), "wo": normal((hk, d), proj_std), "bo": zeros(d),
      "ln2_scale": ones(d), "ln2_bias": zeros(d),
      "w_fc": normal((d, f)), "b_fc": zeros(f), "w_proj": normal((f, d), proj_std),
      "b_proj": zeros(d),
  } for _ in range(hp.num_layers)]
  return {"wte": normal((hp.vocab_size, d)), "wpe": normal((hp.seq_len, d)), "blocks": blocks,
          "lnf_scale": ones(d), "lnf_bias": zeros(d)}


def layer_norm(x, scale, bias, eps=1e-5):
  mean = x.mean(-1, keepdims=True)
  var = jnp.square(x - mean).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + eps) * scale + bias


def forward(params, tokens_BT, hp: Hparams):
  """Logits [B, T, V] in float32."""
  B, T = tokens_BT.shape
  x = params["wte"][tokens_BT] + params["wpe"][:T][None]
  for p in params["blocks"]:
    h = layer_norm(x, p["ln1_scale"], p["ln1_bias"])
    heads = lambda w, b: (h @ w + b).reshape(B, T, hp.num_heads, hp.head_dim)
    att = jax.nn.dot_product_attention(heads(p["wq"], p["bq"]), heads(p["wk"], p["bk"]),
                                       heads(p["wv"], p["bv"]), is_causal=True,
                                       implementation="xla")
    x = x + att.reshape(B, T, -1) @ p["wo"] + p["bo"]
    h = layer_norm(x, p["ln2_scale"], p["ln2_bias"])
    x = x + jax.nn.gelu(h @ p["w_fc"] + p["b_fc"]) @ p["w_proj"] + p["b_proj"]
  x = layer_norm(x, params["lnf_scale"], params["lnf_bias"])
  return x @ params["wte"].T


def loss_fn(params, inputs_BT, targets_BT, hp: Hparams):
  """Mean next-token cross-entropy."""
  logp = jax.nn.log_softmax(forward(params, inputs_BT, hp), axis=-1)
  return -jnp.take_along_axis(logp, targets_BT[..., None], axis=-1).mean()


def schedule(hp: Hparams):
  """Linear warmup to lr, constant, then linear cooldown over the last steps to final_lr_frac."""
  cooldown = int(round(hp.cooldown_frac * hp.total_steps))
  peak, parts, bounds = hp.lr, [], []
  if hp.warmup_steps:
    # Step s of the warmup runs at lr * (s + 1) / warmup, as nanotext's schedule.
    parts.append(optax.linear_schedule(peak / hp.warmup_steps, peak, max(hp.warmup_steps - 1, 1)))
    bounds.append(hp.warmup_steps)
  parts.append(optax.constant_schedule(peak))
  if cooldown:
    bounds.append(hp.total_steps - cooldown)
    parts.append(optax.linear_schedule(peak, peak * hp.final_lr_frac, cooldown))
  return optax.join_schedules(parts, bounds)


def make_optimizer(hp: Hparams) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW decaying only matrices and embeddings (not gains, biases)."""
  decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
  adamw = optax.adamw(schedule(hp), b1=hp.beta1, b2=hp.beta2, eps=hp.eps,
                      weight_decay=hp.weight_decay, mask=decay_mask)
  return optax.chain(optax.clip_by_global_norm(hp.grad_clip), adamw) if hp.grad_clip else adamw


def make_train_step(hp: Hparams, tx: optax.GradientTransformation):
  """jit(params, opt_state, inputs, targets) -> (params, opt_state, loss, grad_norm), donated."""
  def step(params, opt_state, inputs_BT, targets_BT):
    loss, grads = jax.value_and_grad(loss_fn)(params, inputs_BT, targets_BT, hp)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, optax.tree.norm(grads)
  return jax.jit(step, donate_argnums=(0, 1))
