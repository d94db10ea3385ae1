"""The GPT family: classic GPT-2 and the speedrun block are the same module with config switches."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nanotext import sharding
from nanotext.model.attention import CausalSelfAttention
from nanotext.model.layers import Embed, Linear, Norm, init_array, param


class MLP(nnx.Module):
  """Two-layer MLP with GELU (GPT-2) or ReLU^2 (speedrun)."""

  def __init__(self, cfg, *, rngs):
    d, f = cfg.d_model, cfg.mlp_dim
    lin = dict(bias=cfg.bias, param_dtype=cfg.param_dtype, dtype=cfg.dtype, rngs=rngs)
    self.fc = Linear(d, f, ("embed", "mlp"), std=cfg.init_std or 0.5 / np.sqrt(d), **lin)
    proj_std = 0.0 if cfg.zero_init_proj else (cfg.init_std or 0.5 / np.sqrt(f)) / np.sqrt(
        2 * cfg.num_layers)
    self.proj = Linear(f, d, ("mlp", "embed"), std=proj_std, **lin)
    self.act = cfg.mlp_act

  def __call__(self, x_BTD):
    h_BTF = sharding.constrain(self.fc(x_BTD), ("batch", "length", "mlp"))
    h_BTF = jax.nn.gelu(h_BTF) if self.act == "gelu" else jnp.square(jax.nn.relu(h_BTF))
    return self.proj(h_BTF)


class Block(nnx.Module):
  """Pre-norm transformer block, optionally mixing the initial embedding x0 back in."""

  def __init__(self, cfg, attn_cfg, *, impl, rngs):
    self.ln1 = Norm(cfg.d_model, cfg.norm, param_dtype=cfg.param_dtype)
    self.attn = CausalSelfAttention(cfg, attn_cfg, impl=impl, rngs=rngs)
    self.ln2 = Norm(cfg.d_model, cfg.norm, param_dtype=cfg.param_dtype)
    self.mlp = MLP(cfg, rngs=rngs)
    # x <- lambdas[0] * x + lambdas[1] * x0 (modded-nanogpt), starting as the identity.
    self.lambdas = param(jnp.array([1.0, 0.0], cfg.param_dtype), (None,)) if cfg.x0_mix else None

  def __call__(self, x_BTD, x0_BTD, segment_ids_BT=None):
    if self.lambdas is not None:
      lam = self.lambdas.value.astype(x_BTD.dtype)
      x_BTD = lam[0] * x_BTD + lam[1] * x0_BTD
    x_BTD = x_BTD + self.attn(self.ln1(x_BTD), segment_ids_BT)
    x_BTD = x_BTD + self.mlp(self.ln2(x_BTD))
    return sharding.constrain(x_BTD, ("batch", "length", "embed"))


class GPT(nnx.Module):
  """Decoder-only transformer: tokens [B, T] -> logits [B, T, V] (float32)."""

  def __init__(self, cfg, attn_cfg, *, impl: str = "xla", rngs: nnx.Rngs):
    self.softcap = float(cfg.logit_softcap)
    self.embed = Embed(cfg.vocab_size, cfg.d_model, std=cfg.embed_std,
                       param_dtype=cfg.param_dtype, dtype=cfg.dtype, rngs=rngs)
    if cfg.positions == "learned":
      self.pos = param(init_array(rngs, (cfg.max_seq_len, cfg.d_model), cfg.embed_std,
                                  cfg.param_dtype), ("length", "embed"))
    else:
      self.pos = None
    # The speedrun normalises the embedding before the first block; GPT-2 does not.
    self.ln_embed = Norm(cfg.d_model, cfg.norm, param_dtype=cfg.param_dtype) \
        if cfg.norm == "rmsnorm" else None
    self.blocks = nnx.List([Block(cfg, attn_cfg, impl=impl, rngs=rngs)
                            for _ in range(cfg.num_layers)])
    self.ln_f = Norm(cfg.d_model, cfg.norm, param_dtype=cfg.param_dtype)
    if cfg.tie_embeddings:
      self.head = None
    else:
      std = 0.0 if cfg.zero_init_head else cfg.init_std or 0.5 / np.sqrt(cfg.d_model)
      self.head = Linear(cfg.d_model, cfg.vocab_size, ("embed", "vocab"), std=std, bias=False,
                         param_dtype=cfg.param_dtype, dtype=cfg.dtype, rngs=rngs)

  def __call__(self, tokens_BT, segment_ids_BT=None):
    """Logits; with `segment_ids_BT`, attention stays within each document."""
    x_BTD = self.embed(tokens_BT)
    if self.pos is not None:
      x_BTD = x_BTD + self.pos.value[: tokens_BT.shape[1]].astype(x_BTD.dtype)[None]
    if self.ln_embed is not None:
      x_BTD = self.ln_embed(x_BTD)
    x0_BTD = x_BTD
    for block in self.blocks:
      x_BTD = block(x_BTD, x0_BTD, segment_ids_BT)
    x_BTD = self.ln_f(x_BTD)
    logits_BTV = self.embed.attend(x_BTD) if self.head is None else self.head(x_BTD)
    logits_BTV = sharding.constrain(logits_BTV.astype(jnp.float32), ("batch", "length", "vocab"))
    c = self.softcap
    return c * jnp.tanh(logits_BTV / c) if c else logits_BTV


def count_params(state) -> int:
  """Number of parameters in a model state (abstract or concrete)."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
