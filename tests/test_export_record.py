"""export-torch against a PyTorch model written for this test from the record's `GPT`.

`RecordGPT` below re-derives the forward pass of modded-nanogpt train_gpt.py (587b45fb) from
reading it: parameter names and shapes as its state dict, rotary with half the frequencies zero,
QK-norm, value-embedding mixing, x0 lambdas, U-net skips, ReLU^2, 30 * sigmoid logits, and its
block mask (long window W blocks, short W // 2, document-causal inside) as a dense mask.
"""

import numpy as np
import pytest
from flax import nnx

from conftest import REPO, TINY, extra
from nanotext import train
from nanotext.convert.common import load_run
from nanotext.convert.torch_export import export_torch
from nanotext.model import GPT
from nanotext.window_schedule import layer_windows

torch = extra("torch")
F = torch.nn.functional
pytestmark = pytest.mark.torch

RECORD_CFG = f"{REPO}/configs/speedrun_record.yml"
# The record's module fixes 12 layers and 128-wide heads; everything else small.
DIMS = ["model.num_layers=12", "model.d_model=128", "model.num_heads=1", "model.head_dim=128",
        "model.mlp_dim=512", "model.vocab_size=512", "model.embed_rows=0", "model.dtype=float32",
        "train.seq_len=256", "train.steps=2", "train.eval_every=0", "train.eval_batches=1",
        "sample.max_new_tokens=0"]
PATTERN = "LSSSLSSLSSSL"  # the record's block_masks order


class RecordGPT(torch.nn.Module):
  """The record's GPT forward, re-derived; eps is its F.rms_norm default for the activations."""

  def __init__(self, vocab, L, d, eps):
    super().__init__()
    P = lambda *shape: torch.nn.Parameter(torch.zeros(*shape))
    self.embed = torch.nn.Embedding(vocab, d)
    self.value_embeds = torch.nn.ModuleList([torch.nn.Embedding(vocab, d) for _ in range(3)])
    self.blocks = torch.nn.ModuleList()
    for i in range(L):
      blk = torch.nn.Module()
      if i != 7:
        blk.attn = torch.nn.Module()
        blk.attn.qkv_w, blk.attn.lambdas = P(3, d, d), P(2)
        blk.attn.c_proj = torch.nn.Linear(d, d, bias=False)
      blk.mlp = torch.nn.Module()
      blk.mlp.c_fc = torch.nn.Linear(d, 4 * d, bias=False)
      blk.mlp.c_proj = torch.nn.Linear(4 * d, d, bias=False)
      blk.lambdas = P(2)
      self.blocks.append(blk)
    self.lm_head = torch.nn.Linear(d, -(-vocab // 128) * 128, bias=False)
    self.skip_weights = P(L // 2)
    self.eps = eps

  def norm(self, x):
    return F.rms_norm(x, (x.size(-1),), eps=self.eps)

  def rotate(self, x_THK):
    T, _, K = x_THK.shape
    freq = torch.cat([(1 / 1024) ** torch.linspace(0, 1, K // 4, dtype=torch.float64),
                      torch.zeros(K // 4, dtype=torch.float64)])
    theta = torch.arange(T, dtype=torch.float64)[:, None] * freq
    cos, sin = theta.cos()[:, None].float(), theta.sin()[:, None].float()
    a, b = x_THK.chunk(2, dim=-1)
    return torch.cat([a * cos + b * sin, b * cos - a * sin], -1)

  def mask(self, tokens, W, eot):
    T = len(tokens)
    docs = torch.cumsum(tokens == eot, 0)
    t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
    return (s <= t) & (docs[:, None] == docs[None, :]) & (t // 128 - s // 128 < max(W, 1))

  def forward(self, tokens, window_blocks, eot):
    T, d = len(tokens), self.embed.weight.shape[1]
    masks = {"L": self.mask(tokens, window_blocks, eot),
             "S": self.mask(tokens, window_blocks // 2, eot)}
    ve = [e(tokens) for e in self.value_embeds]
    ve = ve + [None] * (len(self.blocks) - 6) + ve
    x = x0 = self.norm(self.embed(tokens))
    skips, n = [], len(self.skip_weights)
    for i, blk in enumerate(self.blocks):
      if i >= n:
        x = x + self.skip_weights[i - n] * skips.pop()
      x = blk.lambdas[0] * x + blk.lambdas[1] * x0
      if hasattr(blk, "attn"):
        h = self.norm(x)
        q, k, v = (h @ blk.attn.qkv_w[j].T for j in range(3))
        q, k, v = (z.view(T, -1, 128) for z in (q, k, v))
        q, k = self.rotate(self.norm(q)), self.rotate(self.norm(k))
        lam = blk.attn.lambdas
        v = lam[0] * v + lam[1] * ve[i].view_as(v) if ve[i] is not None else lam[0] * v
        s = torch.einsum("thk,shk->hts", q, k) * 0.12
        s = s.masked_fill(~masks[PATTERN[i]][None], float("-inf"))
        y = torch.einsum("hts,shk->thk", s.softmax(-1), v).reshape(T, d)
        x = x + blk.attn.c_proj(y)
      x = x + blk.mlp.c_proj(F.relu(blk.mlp.c_fc(self.norm(x))).square())
      if i < n:
        skips.append(x)
    z = self.lm_head(self.norm(x))
    return 30 * torch.sigmoid(z / (7.5 * d ** 0.5))


@pytest.fixture(scope="module")
def record_run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("record") / "run")
  train.run(RECORD_CFG, TINY + DIMS + [f"output_dir={out}"], log=lambda s: None)
  return out


def test_exported_logits_match_the_records_module(record_run, tmp_path):
  from safetensors.torch import load_file
  out = str(tmp_path / "gpt.safetensors")
  export_torch(record_run, out, log=lambda s: None)
  cfg, _, params = load_run(record_run)
  m = cfg.model
  ref = RecordGPT(m.vocab_size, m.num_layers, m.d_model, m.norm_eps)
  ref.load_state_dict({k: v.float() for k, v in load_file(out).items()}, strict=True)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, m.vocab_size, 512)
  tokens[[0, 100, 300, 301]] = 0  # documents, one starting on a block boundary (eot id 0)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(m, cfg.attention, rngs=nnx.Rngs(0))))
  state.replace_by_pure_dict(params)  # by name: a restored tree's "10" sorts before "2"
  model = nnx.merge(graphdef, state)
  seg = np.cumsum(tokens == 0)[None].astype(np.int32)
  for W in (1, 3):  # the record's window in blocks: short layers W // 2 = 0 and 1
    windows = layer_windows(cfg.attention, m.num_layers, 128 * W)
    ours = np.asarray(model(tokens[None], seg, windows, train=False))[0]
    with torch.no_grad():
      theirs = ref(torch.as_tensor(tokens), W, 0).numpy()
    # The record's logits are ours plus 15 (30 sigmoid(z / 7.5) = 15 tanh(z / 15) + 15).
    print(f"W={W}: max abs logit difference {np.abs(theirs - 15 - ours).max():.2e}")
    np.testing.assert_allclose(theirs - 15, ours, atol=2e-4)
    assert np.abs(ours).max() > 1e-3  # a trained head, not the zero init
