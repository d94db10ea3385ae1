"""Test setup: 8 fake CPU devices (set before jax is imported) and shared helpers."""

import os
import subprocess
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The float32 agreement tests (1e-5 tolerances) assume full float32 matmuls: the CPU's default,
# not a GPU's (TF32-like there: 1.4e-3 apart). JAX_PLATFORMS=cuda pytest runs them as written.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(REPO, "configs", "base.yml")
SPEEDRUN = os.path.join(REPO, "configs", "speedrun.yml")

# A model small enough that a few steps take well under a second on 2 cores.
TINY = ["model.num_layers=2", "model.d_model=64", "model.num_heads=2", "model.head_dim=32",
        "model.vocab_size=512", "model.align=0", "train.batch_size=8", "train.seq_len=32",
        "train.steps=4", "train.log_every=1", "train.eval_every=2", "train.eval_batches=2",
        "train.eval_seq_len=0",
        "data.source=synthetic", "data.tokenizer=none", "data.eot_id=0",
        "metrics.tensorboard=false",
        "checkpoint.every=0"]


def run_cli(*args, env=None, timeout=300):
  """Run `python -m ARGS...` from the repo root; returns the CompletedProcess."""
  full_env = dict(os.environ, **(env or {}))
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=full_env,
                        capture_output=True, text=True, timeout=timeout)


def one_line_error(proc, *needles):
  """Assert a CLI run failed with exit 2 and one `nanotext: error:` line holding `needles`."""
  assert proc.returncode == 2, (proc.stdout, proc.stderr)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("nanotext: error:"), proc.stderr
  for n in needles:
    assert n in lines[0], lines[0]


@pytest.fixture
def tiny():
  return list(TINY)


def pytest_collection_modifyitems(config, items):
  """`gpu`-marked tests run only where jax has a GPU backend (JAX_PLATFORMS=cuda pytest -m gpu)."""
  import jax
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs a GPU: run with JAX_PLATFORMS=cuda")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
