"""export-torch against a PyTorch model written from the record's `GPT`.

`record_torch.RecordGPT` (benchmarks/record_torch.py) re-derives modded-nanogpt train_gpt.py
(587b45fb) from reading it: parameter names and shapes as its state dict, rotary with half the
frequencies zero, QK-norm, value-embedding mixing, x0 lambdas, U-net skips, ReLU^2, 30 * sigmoid
logits, and its block mask (long window W blocks, short W // 2, document-causal inside).
"""

import os
import sys

import numpy as np
import pytest
from flax import nnx

from conftest import REPO, TINY, extra, forward, saved_run
from nanotext.convert.common import load_run
from nanotext.convert.torch_export import export_torch
from nanotext.model import GPT
from nanotext.window_schedule import layer_windows

torch = extra("torch")
pytestmark = pytest.mark.torch
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from record_torch import RecordGPT  # noqa: E402

RECORD_CFG = f"{REPO}/configs/speedrun_record.yml"
# The record's module fixes 12 layers and 128-wide heads; everything else small.
DIMS = ["model.num_layers=12", "model.d_model=128", "model.num_heads=1", "model.head_dim=128",
        "model.mlp_dim=512", "model.vocab_size=512", "model.embed_rows=0", "model.dtype=float32",
        "train.seq_len=256", "train.steps=2", "train.eval_every=0", "train.eval_batches=1",
        "sample.max_new_tokens=0"]

@pytest.fixture(scope="module")
def record_run(tmp_path_factory):
  """A record-config run directory whose every parameter is off its init (the zero head and
  projections, the shared lambdas), as training leaves one, without compiling a train step."""
  out = str(tmp_path_factory.mktemp("record") / "run")
  saved_run(RECORD_CFG, TINY + DIMS, out, noise=0.02)
  return out


def test_exported_logits_match_the_records_module(record_run, tmp_path):
  from safetensors.torch import load_file
  out = str(tmp_path / "gpt.safetensors")
  export_torch(record_run, out, log=lambda s: None)
  cfg, _, params = load_run(record_run)
  m = cfg.model
  ref = RecordGPT(m.vocab_size, m.d_model, num_layers=m.num_layers)  # eps: the record's (None)
  ref.load_state_dict({k: v.float() for k, v in load_file(out).items()}, strict=True)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, m.vocab_size, 512)
  tokens[[0, 100, 300, 301]] = 0  # documents, one starting on a block boundary (eot id 0)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(m, cfg.attention, rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(state, params)  # by name: a restored tree's "10" sorts before "2"
  seg = np.cumsum(tokens == 0)[None].astype(np.int32)
  for W in (1, 3):  # the record's window in blocks: short layers W // 2 = 0 and 1
    windows = layer_windows(cfg.attention, m.num_layers, 128 * W)
    ours = forward(graphdef, state, tokens[None], seg, windows, train=False)[0]
    with torch.no_grad():
      theirs = ref(torch.as_tensor(tokens), W, 0).numpy()
    # The record's logits are ours plus 15 (30 sigmoid(z / 7.5) = 15 tanh(z / 15) + 15).
    print(f"W={W}: max abs logit difference {np.abs(theirs - 15 - ours).max():.2e}")
    np.testing.assert_allclose(theirs - 15, ours, atol=2e-4)
    assert np.abs(ours).max() > 1e-3  # a head off its zero init
