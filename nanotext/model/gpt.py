"""The GPT family: classic GPT-2 and the speedrun block are the same module with config switches."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nanotext import config, sharding
from nanotext.errors import UserError
from nanotext.window_schedule import model_windows, windows_differ
from nanotext.model import kv_cache
from nanotext.model.attention import CausalSelfAttention
from nanotext.model.head_loss import fp8_logits, head_loss_sum, weight_operand
from nanotext.model.kernels import relu2_mlp as relu2_kernels
from nanotext.model.kernels.dispatch import config_impl
from nanotext.model.draws import Keys
from nanotext.model.layers import (Embed, Linear, Norm, fp8_head_scales, init_array, lookup, param,
                                   proj_std, relu2_mlp, scaled_sum, weight_std)


CHOICES = {"positions": ("learned", "rope"), "norm": ("layernorm", "rmsnorm"),
           "mlp_act": ("gelu", "relu2"), "dtype": ("float32", "bfloat16"),
           "param_dtype": ("float32", "bfloat16"), "embed_dtype": ("", "float32", "bfloat16"),
           "init_dist": ("normal", "uniform"), "remat": ("none", "full", "dots", "auto"),
           "rope_freqs": ("linspace", "arange")}


def check_config(m, attn_cfg=None, cfg=None, fresh=True) -> None:
  """The model section's choices and the rules between its switches (UserError naming keys);
  with `attn_cfg`, also that model.scan_layers gets identical blocks (at `cfg`'s rows); `fresh`:
  also those of the parameters a fresh start draws."""
  config.check_choices("model", m, CHOICES)
  if attn_cfg is not None:
    check_scan(m, attn_cfg, cfg=cfg)
  if m.head_dim == 0 and m.d_model % m.num_heads:
    raise UserError(f"model.d_model={m.d_model} is not divisible by model.num_heads="
                    f"{m.num_heads}; set model.head_dim explicitly or change one of them")
  head_dim = m.head_dim or m.d_model // m.num_heads
  if m.positions == "rope" and head_dim % (4 if m.rope_truncate else 2):
    need = "a multiple of 4 with model.rope_truncate=true" if m.rope_truncate else "even"
    raise UserError(f"rotary embeddings need a head_dim {need}; got model.head_dim={head_dim}")
  layers = m.no_attention_layers
  if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers):
    raise UserError(f"model.no_attention_layers={layers!r} must be a list of 0-based layer "
                    "indices (non-negative integers)")
  if m.value_embeds and m.num_heads * head_dim != m.d_model:
    raise UserError(f"model.value_embeds={m.value_embeds} adds [vocab, d_model] tables to v, so it "
                    f"needs model.num_heads*model.head_dim={m.num_heads * head_dim} to equal "
                    f"model.d_model={m.d_model}")
  if m.embed_rows < -1 or m.embed_rows > m.vocab_size:
    raise UserError(f"model.embed_rows={m.embed_rows} must be 0 (= model.vocab_size), -1 (the "
                    f"tokenizer's vocabulary) or at most model.vocab_size={m.vocab_size}")
  if m.fused_qkv and (m.merged_qkv or m.bias):
    raise UserError("model.fused_qkv=true is one [3*heads*head_dim, d_model] matrix without bias: "
                    "set model.merged_qkv=false and model.bias=false")
  # a tied table is the embedding too (zero_init_head only draws a fresh start's parameters)
  for key in ("fp8_head", "zero_init_head") if fresh else ("fp8_head",):
    if m[key] and m.tie_embeddings:
      raise UserError(f"model.{key}=true needs an untied head (model.tie_embeddings=false)")


def check_scan(m, attn_cfg, fix="turn them off or set model.scan_layers=false", cfg=None) -> None:
  """model.scan_layers=true needs identical blocks: refuse (one line) the keys that differ them.
  Value embeddings on some layers, MLP-only layers, U-net skips between layers, the first
  layer's v carried to the others and windows that differ at the rows (`cfg`'s, else sampling's)
  make block i differ from block j; x0 lambdas, a learned attention scale and fused QKV stack
  like any other parameter (`fix`: the line's advice)."""
  if not m.scan_layers:
    return
  no_attn = [i for i in m.no_attention_layers if i < m.num_layers]
  bad = ["model.unet_skips=true"] if m.unet_skips else []
  bad += [f"model.value_embeds={m.value_embeds}"] if m.value_embeds else []
  bad += [f"model.no_attention_layers={no_attn}"] if no_attn else []
  bad += ["model.value_residual=true"] if m.value_residual else []  # layer 0's v feeds the rest
  if windows_differ(attn_cfg, m, cfg):  # windows covering every row are all plain causal
    bad.append(f"attention.window_pattern={attn_cfg.window_pattern!r}")
  if bad:
    raise UserError(f"model.scan_layers=true needs identical blocks; these make layers differ: "
                    f"{', '.join(bad)} ({fix})")


def abstract_model(cfg, backend: str):
  """(graphdef, abstract parameter State, attention kernel) of cfg's model on `backend`."""
  impl = config_impl(cfg, backend)
  build = lambda: GPT(cfg.model, cfg.attention, impl=impl, rngs=Keys(jax.random.key(cfg.seed)))
  graphdef, abstract = nnx.split(nnx.eval_shape(build))  # no arrays
  return graphdef, abstract, impl


def logical_sizes(m, train_cfg) -> dict:
  """{logical axis: (config key, size)} of the model's weights and activations, so sharding
  checks can name the key to change; act_* activations have their weight axis's size."""
  t = train_cfg
  batch_key = "train.batch_size / train.grad_accum" if t.grad_accum > 1 else "train.batch_size"
  sizes = {"embed": ("model.d_model", m.d_model), "heads": ("model.num_heads", m.num_heads),
           "mlp": ("model.mlp_dim", m.mlp_dim), "vocab": ("model.vocab_size", m.vocab_size),
           "length": ("model.max_seq_len", m.max_seq_len),
           "batch": (batch_key, t.batch_size // t.grad_accum),
           "act_length": ("train.seq_len", t.seq_len),
           "kv": ("model.head_dim", m.head_dim), "layers": ("model.num_layers", m.num_layers)}
  for name in ("embed", "heads", "mlp", "vocab", "kv"):
    sizes["act_" + name] = sizes[name]
  return sizes


def table_sizes(m) -> dict:
  """{logical axis: (config key, size)} of parameters that may differ from `logical_sizes`: the
  token tables' rows (model.embed_rows) beside the head's model.vocab_size."""
  return {"vocab": ("model.embed_rows", m.embed_rows)}


class MLP(nnx.Module):
  """Two-layer MLP with GELU (GPT-2) or ReLU^2 (speedrun)."""

  def __init__(self, cfg, *, rngs):
    d, f = cfg.d_model, cfg.mlp_dim
    lin = dict(bias=cfg.bias, param_dtype=cfg.param_dtype, dtype=cfg.dtype, rngs=rngs,
               dist=cfg.init_dist)
    self.fc = Linear(d, f, ("embed", "mlp"), std=weight_std(cfg, d), **lin)
    self.proj = Linear(f, d, ("mlp", "embed"), std=proj_std(cfg, f), **lin)
    self.act = cfg.mlp_act
    # The squared ReLU inside its GEMMs where kernels/relu2_mlp.py applies; not under
    # remat=dots, which would recompute the kernel's GEMM (its outputs are not dots).
    self.fusable = cfg.mlp_act == "relu2" and not cfg.bias and cfg.remat != "dots"

  def __call__(self, x_BTD):
    x = x_BTD.astype(self.fc.dtype)
    if self.fusable and relu2_kernels.applies(x, self.fc.kernel.get_value().shape[1]):
      w = lambda lin: lin.kernel.get_value().astype(lin.dtype)
      return relu2_mlp(x, w(self.fc), w(self.proj))
    h_BTF = sharding.constrain(self.fc(x_BTD), ("batch", "act_length", "act_mlp"))
    h_BTF = jax.nn.gelu(h_BTF) if self.act == "gelu" else jnp.square(jax.nn.relu(h_BTF))
    return self.proj(h_BTF)


class Block(nnx.Module):
  """Pre-norm transformer block, optionally mixing the initial embedding x0 back in."""

  def __init__(self, cfg, attn_cfg, *, impl, rngs, attention: bool = True):
    # attention=False: an MLP-only block (record: blocks.7 has no attention).
    norm = lambda: Norm(cfg.d_model, cfg.norm, param_dtype=cfg.param_dtype, **norm_eps(cfg))
    self.ln1 = norm() if attention else None
    self.attn = CausalSelfAttention(cfg, attn_cfg, impl=impl, rngs=rngs) if attention else None
    self.ln2 = norm()
    self.mlp = MLP(cfg, rngs=rngs)
    # x <- lambdas[0] * x + lambdas[1] * x0 (modded-nanogpt), starting as the identity.
    self.lambdas = param(jnp.array([1.0, 0.0], cfg.param_dtype), (None,), "scalar") \
        if cfg.x0_mix else None

  def __call__(self, x_BTD, x0_BTD, segment_ids_BT=None, window=None, ve_BTD=None, v1=None,
               runtime_window=None, kv=None):
    """(x, v1, kv): `window` (static int) overrides attention.window; `ve_BTD`: this layer's value
    embedding; `v1`: the first attention layer's v (model.value_residual), passed on;
    `runtime_window`: a traced window under the static bound `window` (see GPT.hidden); `kv`:
    this layer's key-value cache when sampling (see GPT.extend), returned written."""
    if self.lambdas is not None:
      lam = self.lambdas.get_value()
      x_BTD = scaled_sum((lam[0], lam[1]), (x_BTD, x0_BTD))
    if self.attn is not None:
      with jax.named_scope("attention"):
        y_BTD, v1, kv = self.attn(self.ln1(x_BTD), segment_ids_BT, window, ve_BTD, v1,
                                  runtime_window, kv)
        x_BTD = x_BTD + y_BTD
    with jax.named_scope("mlp"):
      x_BTD = x_BTD + self.mlp(self.ln2(x_BTD))
    return sharding.constrain(x_BTD, ("batch", "act_length", "act_embed")), v1, kv


class GPT(nnx.Module):
  """Decoder-only transformer: tokens [B, T] -> logits [B, T, V] (float32)."""

  def __init__(self, cfg, attn_cfg, *, impl: str = "xla", rngs: Keys | nnx.Rngs):
    self.softcap = float(cfg.logit_softcap)
    # The record keeps 50,257-row bf16 tables and pads only the head (to 50,304).
    rows = cfg.embed_rows if cfg.embed_rows > 0 else cfg.vocab_size  # -1 left by an unfinalized cfg
    table_dtype = cfg.embed_dtype or cfg.param_dtype
    self.embed = Embed(rows, cfg.d_model, std=cfg.embed_std, param_dtype=table_dtype,  # tied:
                       dtype=cfg.dtype, rngs=rngs, role="head" if cfg.tie_embeddings else "embed")
    if cfg.positions == "learned":
      self.pos = param(init_array(rngs, (cfg.max_seq_len, cfg.d_model), cfg.embed_std,
                                  cfg.param_dtype), ("length", "embed"), "embed")
    else:
      self.pos = None
    # The speedrun normalises the embedding before the first block; GPT-2 does not.
    self.ln_embed = Norm(cfg.d_model, cfg.norm, param_dtype=cfg.param_dtype, **norm_eps(cfg)) \
        if cfg.norm == "rmsnorm" else None
    # Per-layer windows when the caller names none: the pattern at the full (final) window.
    self.windows = model_windows(attn_cfg, cfg)
    if cfg.scan_layers:  # one Block whose parameters carry a leading `layers` axis
      check_scan(cfg, attn_cfg)
      self.blocks = stacked_blocks(cfg, attn_cfg, impl, rngs)
    else:
      no_attn = set(cfg.no_attention_layers)  # indices past the last layer do not apply
      self.blocks = nnx.List([Block(cfg, attn_cfg, impl=impl, rngs=rngs,
                                    attention=i not in no_attn) for i in range(cfg.num_layers)])
    self.scan_layers = cfg.scan_layers
    # Value embeddings: extra token tables mixed into v of the first and last layers.
    self.ve_layers = value_embed_layers(cfg.value_embeds, cfg.num_layers)
    self.value_embeds = nnx.List([
        Embed(rows, cfg.d_model, std=cfg.embed_std, param_dtype=table_dtype,
              dtype=cfg.dtype, rngs=rngs)
        for _ in range(min(cfg.value_embeds, cfg.num_layers // 2))])
    # U-net: the first L // 2 blocks' outputs come back, weighted, before the last L // 2 blocks
    # (one layer has none: no weights, where a 0-size array could not be checkpointed).
    skips = jnp.ones((cfg.num_layers // 2,), cfg.param_dtype)
    self.skip_weights = param(skips, (None,), "scalar") if cfg.unet_skips and len(skips) else None
    self.ln_f = Norm(cfg.d_model, cfg.norm, param_dtype=cfg.param_dtype, **norm_eps(cfg))
    if cfg.tie_embeddings:
      self.head = None
    else:
      std = 0.0 if cfg.zero_init_head else weight_std(cfg, cfg.d_model)
      self.head = Linear(cfg.d_model, cfg.vocab_size, ("embed", "vocab"), std=std, bias=False,
                         param_dtype=cfg.param_dtype, dtype=cfg.dtype, rngs=rngs, role="head")
    self.fp8_head = cfg.fp8_head
    self.remat = cfg.remat

  def __call__(self, tokens_BT, segment_ids_BT=None, windows=None, train: bool = True,
               runtime_windows=None):
    """Logits; with `segment_ids_BT`, attention stays within each document. `windows`: per-layer
    sliding windows (a tuple of static ints, e.g. one stage of attention.window_schedule); None =
    the configured pattern at attention.window. `train=False` (evaluation, sampling) computes the
    head in the model dtype, not FP8 (record: `use_fp8 and self.training`). `runtime_windows`:
    see `hidden`."""
    return self.logits(self.hidden(tokens_BT, segment_ids_BT, windows, runtime_windows),
                       train=train)

  def hidden(self, tokens_BT, segment_ids_BT=None, windows=None, runtime_windows=None):
    """The final normalised hidden states [B, T, D] that the head turns into logits.
    `runtime_windows` (int32 [num_layers], traced; 0 = causal): the windows applied, one program
    for every window stage, `windows` then being their static per-layer bounds (0 = none), which
    size the kernels' work (kernels/dispatch.takes_runtime_window says which kernels can)."""
    return self.ln_f(self._blocks(self._embed(tokens_BT), segment_ids_BT, windows,
                                  runtime_windows)[0])

  def extend(self, tokens_BT, caches: list, pos, last, segment_ids_BT=None):
    """(float32 logits [B, V] at chunk index `last`, caches): a chunk of tokens at positions pos,
    pos + 1, ... run after the context the key-value caches (kv_cache.empty) hold, each layer's
    keys and values written into them; `pos` a static 0 for a prompt, then traced. The layers'
    windows apply, and document masks with `segment_ids_BT` (counted from the context's start)."""
    caches = kv_cache.at(caches, pos)
    x_BTD, caches = self._blocks(self._embed(tokens_BT, pos), segment_ids_BT, caches=caches)
    x_B1D = self.ln_f(jax.lax.dynamic_slice_in_dim(x_BTD, last, 1, axis=1))
    return self.logits(x_B1D, train=False)[:, 0], caches

  def _embed(self, tokens_BT, pos=0):
    """The blocks' input [B, T, D] for tokens at positions pos, pos + 1, ..."""
    x_BTD, *ve = lookup((self.embed, *self.value_embeds), tokens_BT)
    if self.pos is not None:
      T, table = tokens_BT.shape[1], self.pos.get_value()
      table = table[:T] if isinstance(pos, int) else jax.lax.dynamic_slice_in_dim(table, pos, T)
      x_BTD = x_BTD + table.astype(x_BTD.dtype)[None]
    if self.ln_embed is not None:
      x_BTD = self.ln_embed(x_BTD)
    return x_BTD, ve

  def _blocks(self, embedded, segment_ids_BT=None, windows=None, runtime_windows=None,
              caches=None):
    """(the last block's output, caches written or None) of `_embed`'s (x, value embeddings)."""
    x_BTD, ve = embedded
    x0_BTD = x_BTD
    windows = self.windows if windows is None else tuple(windows)
    if self.scan_layers:
      return scan_blocks(self.blocks, self.remat, windows, x_BTD, x0_BTD, segment_ids_BT,
                         None if runtime_windows is None else runtime_windows[0], caches)
    L = len(self.blocks)
    n_skip = 0 if self.skip_weights is None else L // 2
    skips, v1, written = [], None, []
    for i, block in enumerate(self.blocks):
      if i >= L - n_skip:  # decoder half: the mirrored encoder output (a stack: last in, first out)
        skip = self.skip_weights.get_value()[i - (L - n_skip)]
        x_BTD = scaled_sum((1.0, skip), (x_BTD, skips.pop()))
      with jax.named_scope(f"block_{i}"):
        j = self.ve_layers[i]
        live = None if runtime_windows is None else runtime_windows[i]
        policy = self.remat if caches is None else "none"  # sampling: no backward pass
        x_BTD, v1, kv = remat_block(policy, windows[i])(
            block, x_BTD, x0_BTD, segment_ids_BT, None if j is None else ve[j], v1, live,
            None if caches is None else caches[i])
      written.append(kv)
      if i < n_skip:
        skips.append(x_BTD)
    return x_BTD, None if caches is None else written

  def head_weight(self):
    """The head's [D, V] weight: its kernel, or the tied token table transposed."""
    return self.embed.embedding.get_value().T if self.head is None else self.head.kernel.get_value()

  def loss_sum(self, x_BTD, targets_BT, loss_denominator: int = 0, train: bool = True,
               weight=None):
    """Summed float32 cross-entropy of the soft-capped logits of hidden states against targets, the
    head fused with its loss (model/head_loss.py). `loss_denominator`: the sum's divisor (0 = these
    tokens, a mean; model.loss), which sets the FP8 head's gradient scale; `train=False`: the head
    in the model dtype, not FP8; `weight`: loss_weight(train), made once (model.loss's chunks;
    None: the head makes its operand from head_weight())."""
    B, T, D = x_BTD.shape
    w_DV, b_DV = (self.head_weight(), None) if weight is None else weight
    dtype = self.embed.dtype if self.head is None else self.head.dtype
    fp8 = fp8_head_scales(D, loss_denominator or B * T) if self.fp8_head and train else None
    return head_loss_sum(x_BTD if fp8 else x_BTD.astype(dtype), w_DV, targets_BT,
                         softcap=self.softcap, fp8=fp8, fp8_scale=np.sqrt(D), b_DV=b_DV)

  def loss_weight(self, train: bool = True, gather: bool = False) -> tuple:
    """(head_weight(), the head matmul's operand made of it: head_loss.weight_operand's FP8 codes
    at train with model.fp8_head, else the weight in the model dtype; `gather` as its)."""
    w_DV = self.head_weight()
    D = w_DV.shape[0]
    fp8 = fp8_head_scales(D, 1) if self.fp8_head and train else None  # w's scale: any divisor
    dtype = self.embed.dtype if self.head is None else self.head.dtype
    return w_DV, weight_operand(w_DV, dtype, fp8, np.sqrt(D), gather)

  def logits(self, x_BTD, loss_denominator: int = 0, train: bool = True):
    """Soft-capped float32 logits of hidden states. `loss_denominator`: what the loss divides its
    summed token losses by (model.loss.cross_entropy; 0 = this call's tokens, a mean), which
    sets the FP8 head's gradient scale; `train=False`: the head in the model dtype, not FP8."""
    if self.head is None:
      logits_BTV = self.embed.attend(x_BTD)
    elif self.fp8_head and train:
      logits_BTV = fp8_logits(x_BTD, self.head.kernel.get_value(), loss_denominator)
    else:
      logits_BTV = self.head(x_BTD)
    logits_BTV = sharding.constrain(logits_BTV.astype(jnp.float32),
                                    ("batch", "act_length", "act_vocab"))
    c = self.softcap
    return c * jnp.tanh(logits_BTV / c) if c else logits_BTV


# model.remat: which activations of a block the backward pass keeps (the rest it recomputes).
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,  # only each block's inputs
    # Projection and MLP matmul outputs (no batch dims): the costly FLOPs are not redone.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_block(policy: str, window: int):
  """(block, x, x0, segments, ve, v1[, runtime window, kv]) -> (block output, v1, kv),
  rematerialised per model.remat; `window` is static (with a runtime window, its bound)."""
  def call(block, x_BTD, x0_BTD, segment_ids_BT, ve_BTD, v1, runtime_window=None, kv=None):
    return block(x_BTD, x0_BTD, segment_ids_BT, window, ve_BTD, v1, runtime_window, kv)
  if policy not in REMAT_POLICIES:  # none; or auto left unresolved (no train step: no backward)
    return call
  return nnx.remat(call, policy=REMAT_POLICIES[policy])


def stacked_blocks(cfg, attn_cfg, impl, rngs) -> Block:
  """num_layers Blocks created at once (nnx.vmap): each parameter gets a leading `layers` axis."""
  if isinstance(rngs, Keys):
    rngs = rngs.split()

  @nnx.split_rngs(splits=cfg.num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
  def make(rngs):
    return Block(cfg, attn_cfg, impl=impl, rngs=rngs)
  return make(rngs)


def scan_blocks(blocks: Block, policy: str, windows, x_BTD, x0_BTD, segment_ids_BT,
                runtime_window=None, caches=None):
  """(output, caches written or None) of stacked blocks run with lax.scan: one traced (and
  compiled) block body whatever the depth; every layer has the same window (`runtime_window`: a
  traced one under the static bound); `caches`: one kv_cache.KV per layer when sampling."""
  if len(set(windows)) > 1:
    raise UserError(f"model.scan_layers=true runs one window for every layer, got {windows}")
  graphdef, stacked = nnx.split(blocks)
  if caches is None:
    def body(x_BTD, layer):
      block = nnx.merge(graphdef, layer)
      return block(x_BTD, x0_BTD, segment_ids_BT, windows[0],
                   runtime_window=runtime_window)[0], None
    if policy in REMAT_POLICIES:
      body = jax.checkpoint(body, policy=REMAT_POLICIES[policy], prevent_cse=False)
    with jax.named_scope("blocks"):
      return jax.lax.scan(body, x_BTD, stacked)[0], None
  pos = caches[0].pos
  def cached(x_BTD, xs):
    layer, kv = xs
    x_BTD, _, kv = nnx.merge(graphdef, layer)(x_BTD, x0_BTD, segment_ids_BT, windows[0],
                                              kv=kv._replace(pos=pos))
    return x_BTD, kv._replace(pos=None)
  with jax.named_scope("blocks"):
    x_BTD, kvs = jax.lax.scan(cached, x_BTD, (stacked, jax.tree.map(
        lambda *layers: jnp.stack(layers), *[c._replace(pos=None) for c in caches])))
  return x_BTD, [kv_cache.KV(kvs.k[i], kvs.v[i], kvs.docs[i], pos) for i in range(len(caches))]


def norm_eps(cfg) -> dict:
  """Norm keyword for model.norm_eps (0: the module's default)."""
  return {"eps": cfg.norm_eps} if cfg.norm_eps else {}


def value_embed_layers(n: int, num_layers: int) -> tuple:
  """Value-embedding table of each layer (None = none): tables 0..m-1 on the first m layers and
  again on the last m, m = min(n, num_layers // 2) (record, n=3 of 12: 0 1 2 - - - - - - 0 1 2)."""
  m = min(n, num_layers // 2)
  return tuple(range(m)) + (None,) * (num_layers - 2 * m) + tuple(range(m))


def count_params(state) -> int:
  """Number of parameters in a model state (abstract or concrete)."""
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
