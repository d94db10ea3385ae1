"""The memory plan on a TPU sizes arrays as its layouts pad them (nanotext.memory.tpu_bytes)."""

import jax
import pytest

from conftest import BASE, TINY, mesh_sizes
from nanotext import memory, wiring

pytestmark = pytest.mark.fast


def test_an_array_is_padded_only_where_no_layout_avoids_it():
  """libtpu's v5e program of a d_model 64 model: [B, T, 64] laid out T minor, unpadded; a small
  matrix and a vector pad to 8 x 128 tiles; splash's per-head operands keep head_dim 32 minor."""
  assert memory.tpu_bytes((576, 2048, 64), 4) == 576 * 2048 * 64 * 4
  assert memory.tpu_bytes((8, 64), 4) == 8 * 128 * 4
  assert memory.tpu_bytes((1, 49152, 6, 1), 4) == 49152 * 8 * 4  # sizes of 1 take no tile
  assert memory.tpu_bytes((64,), 4) == 128 * 4 and memory.tpu_bytes((), 2) == 128 * 2
  assert memory.tpu_bytes((0, 64), 4) == 0
  assert memory.per_head_bytes((576, 2048, 2, 32), 4) == 4 * 576 * 2048 * 2 * 32 * 4


def test_a_tpu_plan_counts_the_attention_kernels_padded_operands():
  """d_model 64, head_dim 32: the kernel's residuals and the eval's q, k, v and output are 4x
  their size on a TPU (planned 0.92 and 0.47 of the compiler without; 1.03 and 0.87 with, at
  576 rows of 2,048 on a v5e); a GPU's are not padded."""
  cfg = wiring.prepare(BASE, TINY + ["train.seq_len=256"], devices=jax.devices()[:1]).cfg
  tpu, gpu = memory.Model(cfg, "tpu", mesh_sizes()), memory.Model(cfg, "gpu", mesh_sizes())
  rows, length, heads = 8, 256, 2
  assert tpu.stand_in and tpu.impl == "splash"  # traced as the blocked kernel
  one = rows * length * heads * 32 * 4  # one float32 [8, 256, 2, 32]
  lse = rows * heads * length * 4
  assert tpu.flash_residuals(rows, length) == 2 * (4 * one + lse)
  assert gpu.flash_residuals(rows, length) == 2 * (one + lse)
  assert tpu.kernel_operands(rows, length) == 4 * 4 * one + rows * length * 64 * 4
  assert gpu.kernel_operands(rows, length) == 0
  assert tpu.eval(0).total >= tpu.kernel_operands(rows, length)
