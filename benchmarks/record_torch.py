"""The speedrun record's training step re-derived in PyTorch: an independent reference for nanotext.

Written from reading modded-nanogpt train_gpt.py at 587b45fb (none of its code): `GPT` with its
parameter names (a state dict nanotext's export-torch writes loads with strict=True), Muon with
the quintic Newton-Schulz in bfloat16 (or float32 / float64), torch's fused Adam on the head
(lr 0.22), embeddings (0.6) and scalars (0.04), the stable-then-cooldown lr schedule, Muon's
momentum warmup, the sliding window grown in 128-token blocks, each row's summed loss (one row
per GPU, gradients averaged over rows) and the FP8 lm head. Where the record's GPU kernels cannot
run, they are emulated: FlexAttention's block mask as dense per-block strips (query block i reads
key blocks i - W + 1 .. i, token-causal inside one document), `torch._scaled_mm` as float32
matmuls of the float8 codes times the two float32 scales, the output rounded to bfloat16.

Two recipes: float32 throughout, or the record's (`dtype=torch.bfloat16`): bfloat16 embedding
tables and activations, float32 other parameters cast at each matmul. Elementwise mixes of a
float32 scalar and bf16 activations are computed in float32 and rounded once, as the record's
compiled model fuses them; embedding gradients are summed in float32 and rounded once, as its
compiled (and CUDA) embedding backward does. Importing this module has no side effects.
"""

import math

import numpy as np
import torch
import torch.nn.functional as F

BLOCK = 128                       # the record's BLOCK_SIZE: windows grow in blocks of 128 tokens
PATTERN = "LSSSLSSLSSSL"          # long / short window of each of the 12 layers
NO_ATTENTION = 7                  # the block without attention
HEAD_DIM = 128
ADAM_LR = {"head": 0.22, "embed": 0.6, "scalar": 0.04}
BETAS, ADAM_EPS = (0.8, 0.95), 1e-10
MUON_LR, NS_COEFFS, NS_STEPS = 0.05, (3.4445, -4.7750, 2.0315), 5
COOLDOWN_FRAC, FINAL_LR = 0.4, 0.1
MOMENTUM_START, MOMENTUM_END, MOMENTUM_WARMUP = 0.85, 0.95, 300
FINAL_WINDOW = 1728               # get_window_size_blocks: next multiple of 128 of 1728 * progress


# ----------------------------------------------------------------------------- schedules

def lr_factor(step: int, num_iterations: int) -> float:
  """get_lr: 1 until the last COOLDOWN_FRAC of training, then linear down to FINAL_LR."""
  x = step / num_iterations
  if x < 1 - COOLDOWN_FRAC:
    return 1.0
  w = (1 - x) / COOLDOWN_FRAC
  return w + (1 - w) * FINAL_LR


def muon_momentum(step: int) -> float:
  """Muon's momentum: 0.85 -> 0.95 linearly over the first 300 steps."""
  frac = min(step / MOMENTUM_WARMUP, 1)
  return (1 - frac) * MOMENTUM_START + frac * MOMENTUM_END


def window_blocks(step: int, num_iterations: int) -> int:
  """The long window in blocks at `step`: 1728 * progress rounded up to a multiple of 128
  (at least 128), in the record's float arithmetic."""
  v = FINAL_WINDOW * (step / num_iterations)
  return max(BLOCK, BLOCK * math.ceil(v / BLOCK)) // BLOCK


# ----------------------------------------------------------------------------- kernels

class _Lookup(torch.autograd.Function):
  """table[ids]; the backward sums the rows' gradients in float32, rounded once to the table."""

  @staticmethod
  def forward(ctx, table, ids):
    ctx.save_for_backward(ids)
    ctx.table_shape, ctx.table_dtype = table.shape, table.dtype
    return table[ids]

  @staticmethod
  def backward(ctx, g):
    ids, = ctx.saved_tensors
    acc = torch.zeros(ctx.table_shape, dtype=torch.float32, device=g.device)
    return acc.index_add_(0, ids, g.float()).to(ctx.table_dtype), None


def _to_fp8(x, scale, dtype):
  """x / scale as float8 codes, the division in float32 (the record's compiled cast)."""
  return (x.float() / scale).to(dtype)


class _FP8Matmul(torch.autograd.Function):
  """The record's FP8 lm head: x @ w.T from float8_e4m3fn codes (scales x_s, w_s), output bf16;
  the backward rounds the output gradient to float8_e5m2 (scale grad_s), input gradient bf16,
  weight gradient float32. Each product is a float32 sum of code products times both scales."""

  @staticmethod
  def forward(ctx, x, w, x_s, w_s, grad_s):
    x8, w8 = _to_fp8(x, x_s, torch.float8_e4m3fn), _to_fp8(w, w_s, torch.float8_e4m3fn)
    ctx.save_for_backward(x8, w8)
    ctx.scales = x_s, w_s, grad_s
    return (_scaled_mm(x8, w8.T, x_s, w_s)).to(torch.bfloat16)

  @staticmethod
  def backward(ctx, g):
    x8, w8 = ctx.saved_tensors
    x_s, w_s, grad_s = ctx.scales
    g8 = _to_fp8(g, grad_s, torch.float8_e5m2)
    grad_x = _scaled_mm(g8, w8, grad_s, w_s).to(torch.bfloat16)
    grad_w = _scaled_mm(g8.T, x8, grad_s, x_s)
    return grad_x, grad_w, None, None, None


def _scaled_mm(a8, b8, a_s, b_s):
  """torch._scaled_mm emulated: float32 accumulation of code products, times float32 scales."""
  scale = torch.tensor(a_s, dtype=torch.float32) * torch.tensor(b_s, dtype=torch.float32)
  return (a8.float() @ b8.float()) * scale.to(a8.device)


def matmul(a, b):
  """a @ b; bf16 operands give a bf16 product summed in float32 (a GPU's bf16 GEMM), computed
  off the GPU as a float32 matmul of the bf16 values (exact products), rounded once."""
  if a.dtype != torch.bfloat16 or a.is_cuda:
    return a @ b
  return (a.float() @ b.float()).to(torch.bfloat16)


def newton_schulz(G, dtype=torch.bfloat16, steps: int = NS_STEPS):
  """The record's quintic iteration on the last two dims (wide orientation), in `dtype`.

  Matmuls take and give `dtype`; each elementwise combination is computed in float32 and rounded
  once (the record's compiled function fuses them).
  """
  a, b, c = NS_COEFFS
  up = torch.float64 if dtype == torch.float64 else torch.float32
  X = G.to(dtype)
  tall = G.size(-2) > G.size(-1)
  if tall:
    X = X.mT
  X = (X.to(up) / (X.to(up).norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype)
  for _ in range(steps):
    A = matmul(X, X.mT)
    B = (b * A.to(up) + c * matmul(A, A).to(up)).to(dtype)
    X = (a * X.to(up) + matmul(B, X).to(up)).to(dtype)
  return X.mT if tall else X


def block_attention(q_THK, k_THK, v_THK, docs_T, window: int, scale: float = 0.12):
  """Attention under the record's block mask: query block i reads key blocks i - W + 1 .. i
  (W = max(1, window)), token-causal and inside one document. Scores and softmax in float32,
  probabilities rounded to v's dtype before the float32-accumulated product, output in q's dtype.
  """
  T, H, K = q_THK.shape
  assert T % BLOCK == 0, "rows are whole blocks of 128 tokens, as the record asserts"
  nb = T // BLOCK
  W = max(1, min(window, nb))
  pad = (W - 1) * BLOCK
  strip = lambda x: F.pad(x, (0, 0) * (x.dim() - 1) + (pad, 0)).unfold(0, W * BLOCK, BLOCK)
  k_NHKS, v_NHKS = strip(k_THK), strip(v_THK)  # [nb, H, K, W * BLOCK]: key block strips
  pos_NS = strip(torch.arange(T, device=q_THK.device) + 1) - 1  # -1 = padding
  doc_NS = strip(docs_T + 1) - 1
  pos_NQ, doc_NQ = torch.arange(T, device=q_THK.device).view(nb, BLOCK), docs_T.view(nb, BLOCK)
  mask_NQS = ((pos_NS[:, None] >= 0) & (pos_NS[:, None] <= pos_NQ[:, :, None])
              & (doc_NS[:, None] == doc_NQ[:, :, None]))
  s_NHQS = torch.einsum("nqhk,nhks->nhqs", q_THK.view(nb, BLOCK, H, K).float(), k_NHKS.float())
  s_NHQS = (s_NHQS * scale).masked_fill(~mask_NQS[:, None], float("-inf"))
  p_NHQS = s_NHQS.softmax(-1).to(v_THK.dtype).float()
  y = torch.einsum("nhqs,nhks->nqhk", p_NHQS, v_NHKS.float())
  return y.reshape(T, H, K).to(q_THK.dtype)


# ----------------------------------------------------------------------------- model

class _Linear(torch.nn.Module):
  """A bias-free weight [out, in] (float32), cast to the activations' dtype at the matmul."""

  def __init__(self, d_in, d_out):
    super().__init__()
    self.weight = torch.nn.Parameter(torch.zeros(d_out, d_in))

  def forward(self, x):
    return matmul(x, self.weight.to(x.dtype).T)


def _mix(weights, terms):
  """sum(w * t) in float32 (w a float32 scalar or a number), rounded once to the first term's
  dtype."""
  f32 = lambda w: w.float() if torch.is_tensor(w) else w
  return sum(f32(w) * t.float() for w, t in zip(weights, terms)).to(terms[0].dtype)


class RecordGPT(torch.nn.Module):
  """The record's GPT (12 layers, 128-wide heads, 3 value tables, U-net skips) at any width.

  `vocab`: the embedding tables' rows (the head has them rounded up to a multiple of 128);
  `eps`: F.rms_norm's epsilon on the activations (None: the record's own call, torch's default:
  finfo(float32).eps on float32 and, since January 2025, bf16 activations); `dtype`: the activations (bfloat16 also makes
  the embedding tables bf16, as the record); `fp8_head`: the head in FP8 while training.
  Parameters start at zero: the weights come from a state dict (`load_state`).
  """

  def __init__(self, vocab, d, eps=None, *, num_layers=12, dtype=torch.float32, fp8_head=False):
    super().__init__()
    assert d % HEAD_DIM == 0 and num_layers == len(PATTERN)
    P = lambda *shape: torch.nn.Parameter(torch.zeros(*shape))
    table = lambda: torch.nn.Embedding(vocab, d, dtype=torch.bfloat16 if dtype == torch.bfloat16
                                       else torch.float32)
    self.embed = table()
    self.value_embeds = torch.nn.ModuleList([table() for _ in range(3)])
    self.blocks = torch.nn.ModuleList()
    for i in range(num_layers):
      blk = torch.nn.Module()
      if i != NO_ATTENTION:
        blk.attn = torch.nn.Module()
        blk.attn.qkv_w, blk.attn.lambdas = P(3, d, d), P(2)
        blk.attn.c_proj = _Linear(d, d)
      blk.mlp = torch.nn.Module()
      blk.mlp.c_fc, blk.mlp.c_proj = _Linear(d, 4 * d), _Linear(4 * d, d)
      blk.lambdas = P(2)
      self.blocks.append(blk)
    self.lm_head = _Linear(d, -(-vocab // 128) * 128)
    self.skip_weights = P(num_layers // 2)
    self.eps, self.dtype, self.fp8_head = eps, dtype, fp8_head
    # The record's CastedLinear(..., x_s=sqrt(d)/448, w_s=24/448, grad_s=1/448): grad_s is for
    # a loss summed over the row (the per-token gradient, bounded by 1 / sqrt(d)).
    self.fp8_scales = (d ** 0.5 / 448, 24 / 448, 1 / 448)

  def norm(self, x):
    return F.rms_norm(x, (x.size(-1),), eps=self.eps)

  def rotate(self, x_THK):
    """Half-truncated rotary (base 1024), frequencies and angles in float32 as the record's."""
    T, _, K = x_THK.shape
    freq = (1 / 1024) ** torch.linspace(0, 1, steps=K // 4, dtype=torch.float32)
    freq = torch.cat([freq, freq.new_zeros(K // 4)]).to(x_THK.device)
    theta = torch.einsum("i,j->ij", torch.arange(T, dtype=torch.float32, device=x_THK.device), freq)
    cos, sin = theta.cos()[:, None], theta.sin()[:, None]
    a, b = x_THK.float().chunk(2, dim=-1)
    return torch.cat([a * cos + b * sin, b * cos - a * sin], -1).to(x_THK.dtype)

  def attention(self, blk, x_TD, ve_TD, docs_T, window):
    T = x_TD.size(0)
    qkv = matmul(x_TD, blk.qkv_w.flatten(0, 1).to(x_TD.dtype).T)
    q, k, v = qkv.view(T, -1, HEAD_DIM).chunk(3, 1)
    q, k = self.rotate(self.norm(q)), self.rotate(self.norm(k))
    lam = blk.lambdas
    v = _mix((lam[0],), (v,)) if ve_TD is None else _mix(lam, (v, ve_TD.view_as(v)))
    if T > 8192:  # long rows (a GPU check at the real shape): keep no strips for the backward
      y = torch.utils.checkpoint.checkpoint(block_attention, q, k, v, docs_T, window,
                                            use_reentrant=False)
    else:
      y = block_attention(q, k, v, docs_T, window)
    return blk.c_proj(y.reshape(T, -1))

  def hidden(self, tokens_T, window: int, eot: int):
    """The normalised final hidden states [T, D] of one row at a long window of `window` blocks."""
    docs_T = torch.cumsum(tokens_T == eot, 0)
    windows = {"L": window, "S": window // 2}
    tables = [self.embed] + list(self.value_embeds)
    x, *ve = (_Lookup.apply(t.weight, tokens_T).to(self.dtype) for t in tables)
    ve = ve + [None] * (len(self.blocks) - 6) + ve
    x = x0 = self.norm(x)
    skips, n = [], len(self.skip_weights)
    for i, blk in enumerate(self.blocks):
      if i >= n:
        x = _mix((1.0, self.skip_weights[i - n]), (x, skips.pop()))
      x = _mix(blk.lambdas, (x, x0))
      if hasattr(blk, "attn"):
        x = x + self.attention(blk.attn, self.norm(x), ve[i], docs_T, windows[PATTERN[i]])
      x = x + blk.mlp.c_proj(F.relu(blk.mlp.c_fc(self.norm(x))).square())
      if i < n:
        skips.append(x)
    return self.norm(x)

  def logits(self, x_TD):
    """30 * sigmoid(z / (7.5 sqrt(d))) in float32; z from the FP8 head when training with it."""
    if self.fp8_head and self.training:
      z = _FP8Matmul.apply(x_TD, self.lm_head.weight, *self.fp8_scales)
    else:
      z = self.lm_head(x_TD)
    return 30 * torch.sigmoid(z.float() / (7.5 * x_TD.size(-1) ** 0.5))

  def forward(self, tokens_T, window: int, eot: int, targets_T=None, loss_chunk: int = 0):
    """Logits [T, V] of one row, or with `targets_T` the row's summed cross-entropy (the
    record's reduction='sum'); `loss_chunk` > 0 recomputes the head chunk by chunk (memory)."""
    x = self.hidden(tokens_T, window, eot)
    if targets_T is None:
      return self.logits(x)
    xent = lambda x, y: F.cross_entropy(self.logits(x), y, reduction="sum")
    if not loss_chunk or loss_chunk >= len(tokens_T):
      return xent(x, targets_T)
    return sum(torch.utils.checkpoint.checkpoint(xent, xc, yc, use_reentrant=False)
               for xc, yc in zip(x.split(loss_chunk), targets_T.split(loss_chunk)))


# ----------------------------------------------------------------------------- optimizers

class Muon:
  """Muon on the blocks' matrices: momentum (lerp), Nesterov look-ahead, Newton-Schulz,
  update scaled by sqrt(max(1, rows / cols)) of each [out, in] weight."""

  def __init__(self, params, ns_dtype=torch.bfloat16):
    self.params, self.ns_dtype = list(params), ns_dtype
    self.buffers = [None] * len(self.params)

  @torch.no_grad()
  def step(self, lr: float, momentum: float):
    looks = []
    for i, p in enumerate(self.params):
      g = p.grad
      if self.buffers[i] is None:
        self.buffers[i] = torch.zeros_like(g)
      buf = self.buffers[i].lerp_(g, 1 - momentum)
      looks.append(g.lerp(buf, momentum))
    # Matrices of one shape go through Newton-Schulz as one batch (each normalised on its own,
    # as the record's batched iteration): the same numbers, a tenth of the CPU ops.
    by_shape = {}
    for i, p in enumerate(self.params):
      by_shape.setdefault(tuple(p.shape[-2:]), []).append(i)
    for shape, items in by_shape.items():
      stack = torch.cat([looks[i].reshape((-1,) + shape) for i in items])
      done = newton_schulz(stack, self.ns_dtype).split([looks[i].numel() // stack[0].numel()
                                                         for i in items])
      for i, u in zip(items, done):
        p = self.params[i]
        p.add_(u.reshape(p.shape).to(p.dtype), alpha=-lr * max(1, p.size(-2) / p.size(-1)) ** 0.5)


class Optimizers:
  """The record's two optimizers over a RecordGPT, stepped with its schedules."""

  def __init__(self, model: RecordGPT, num_iterations: int, ns_dtype=torch.bfloat16):
    named = dict(model.named_parameters())
    matrices = [p for n, p in named.items() if n.startswith("blocks.") and p.dim() >= 2]
    groups = {"head": [model.lm_head.weight],
              "embed": [p for n, p in named.items() if "embed" in n],
              "scalar": [p for p in named.values() if p.dim() < 2]}
    assert sum(map(len, groups.values())) + len(matrices) == len(named)
    self.adam = torch.optim.Adam([dict(params=ps, lr=ADAM_LR[k], initial_lr=ADAM_LR[k])
                                  for k, ps in groups.items()], betas=BETAS, eps=ADAM_EPS,
                                 fused=True)
    self.muon = Muon(matrices, ns_dtype)
    self.model, self.num_iterations = model, num_iterations

  def step(self, step: int):
    """Optimizer step `step` (0-based) on the gradients in .grad, which it then clears."""
    f = lr_factor(step, self.num_iterations)
    for group in self.adam.param_groups:
      group["lr"] = group["initial_lr"] * f
    self.adam.step()
    self.muon.step(MUON_LR * f, muon_momentum(step))
    self.model.zero_grad(set_to_none=True)


def train_step(model: RecordGPT, opt: Optimizers, rows, step: int, eot: int,
               loss_chunk: int = 0) -> float:
  """One training step on `rows` [(inputs, targets), ...], one row per GPU of the record: each
  row's summed loss, gradients averaged over rows. Returns the mean token loss."""
  model.train()
  window = window_blocks(step, opt.num_iterations)
  total = 0.0
  for inputs, targets in rows:
    loss = model(inputs, window, eot, targets, loss_chunk)
    loss.backward()
    total += loss.item() / len(inputs)
  if len(rows) > 1:
    for p in model.parameters():
      p.grad = (p.grad.float() / len(rows)).to(p.dtype)
  opt.step(step)
  return total / len(rows)


def load_state(model: RecordGPT, state: dict) -> None:
  """Load a {name: array or tensor} state dict (e.g. nanotext's export) strictly, each tensor
  converted to the model's dtype (bf16 arrays go through float32, which holds them exactly)."""
  own = model.state_dict()

  def as_torch(v):
    return v.float() if torch.is_tensor(v) else torch.from_numpy(np.array(v, np.float32))

  model.load_state_dict({k: as_torch(v).to(own[k].dtype if k in own else torch.float32)
                         for k, v in state.items()}, strict=True)
