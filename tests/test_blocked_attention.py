"""Block-granular windows against the record's block rules, and the blocked (O(T x W)) kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_attention import forward_and_grads
from nanotext import window_schedule
from nanotext.model.kernels import splash
from nanotext.model.kernels.blocked import blocked_attention, key_blocks
from nanotext.model.kernels.dispatch import dot_product_attention, resolve_impl
from nanotext.model.kernels.masks import block_window_mask

B, H, K = 2, 2, 16
SCALE = 0.7 / np.sqrt(K)


def record_token_mask(docs_T, W: int, bs: int) -> np.ndarray:
  """[T, T] keys each query may see under the record's FlexAttention block mask.

  Written from the rules of train_gpt.py (587b45fb) `create_blockmasks`: a key block is 'any'
  (causal-or-diagonal and sharing a document with the query block) or 'all' (strictly earlier and
  both blocks inside one same document). Of the 'all' blocks the most recent min(n_all, W - 1)
  are kept, of the partial ones (any and not all) the most recent min(n_partial,
  max(W - n_all, 1)); kept partial blocks are token-masked causal + same document.
  """
  docs_T = np.asarray(docs_T)
  T = len(docs_T)
  nb = T // bs
  lo, hi = docs_T[::bs], docs_T[bs - 1::bs]
  i, j = np.arange(nb)[:, None], np.arange(nb)[None, :]
  any_ = (i >= j) & (lo[:, None] <= hi[None, :]) & (hi[:, None] >= lo[None, :])
  all_ = (i > j) & (lo[:, None] == hi[None, :]) & (hi[:, None] == lo[None, :])
  partial = any_ & ~all_
  mask = np.zeros((T, T), bool)
  t, s = np.arange(T)[:, None], np.arange(T)[None, :]
  token = (s <= t) & (docs_T[:, None] == docs_T[None, :])
  for qb in range(nb):
    n_all, n_part = int(all_[qb].sum()), int(partial[qb].sum())
    keep_all = max(0, min(n_all, W - 1))  # a negative block count (W = 0) reads no block
    keep_part = min(n_part, max(W - n_all, 1))
    kept = (list(np.flatnonzero(all_[qb])[::-1][:keep_all]) +
            list(np.flatnonzero(partial[qb])[::-1][:keep_part]))
    for kb in kept:
      rows, cols = slice(qb * bs, qb * bs + bs), slice(kb * bs, kb * bs + bs)
      mask[rows, cols] = token[rows, cols]
  return mask


def random_docs(T, rng, bs):
  """Document ids (cumulative end-of-text count) with short, long and block-aligned documents."""
  eot = rng.random(T) < rng.choice([0.002, 0.01, 0.05])
  eot[rng.choice(T // bs, 2) * bs] = True  # documents starting exactly on a block boundary
  return np.cumsum(eot)


@pytest.mark.fast
@pytest.mark.parametrize("seed", range(6))
def test_block_window_mask_equals_the_records_block_mask(seed):
  rng = np.random.default_rng(seed)
  bs, T = 16, 16 * 24
  docs = random_docs(T, rng, bs)
  same_doc = docs[:, None] == docs[None, :]
  for W in range(0, 27):  # the record's short window at its first size is W = 0
    ours = block_window_mask(T, max(1, W) * bs, bs) & same_doc
    np.testing.assert_array_equal(ours, record_token_mask(docs, W, bs), err_msg=f"W={W}")


def test_short_window_is_half_the_blocks_and_its_own_block_at_least():
  cfg = type("A", (), dict(window_block=128, window_pattern="LS", block_windows=True))()
  # record: sliding_window_num_blocks // 2 for 1..14 blocks; 0 blocks reads the own block only.
  for W in range(1, 15):
    assert window_schedule.short_window(cfg, 128 * W) == 128 * max(1, W // 2)


def test_keys_per_query_at_one_block():
  """The issue's count: at W = 1 a query sees (1 + 128) / 2 keys on average without documents."""
  mask = block_window_mask(1024, 128, 128)
  assert mask.sum(1).mean() == pytest.approx(64.5)


def inputs(T, seed=0, bs=16):
  keys = jax.random.split(jax.random.key(seed), 4)
  q, k, v, g = (jax.random.normal(kk, (B, T, H, K), jnp.float32) for kk in keys)
  rng = np.random.default_rng(seed)
  seg = np.stack([random_docs(T, rng, bs) for _ in range(B)]).astype(np.int32)
  return q, k, v, g, jnp.asarray(seg)


def reference(q, k, v, *, scale, mask_BTT):
  s = jnp.einsum("bthk,bshk->bhts", q, k, precision="highest") * scale
  p = jax.nn.softmax(jnp.where(mask_BTT[:, None], s, -jnp.inf), axis=-1)
  return jnp.einsum("bhts,bshk->bthk", p, v, precision="highest")


def ref_mask(T, seg, window, block):
  t, s = np.arange(T)[:, None], np.arange(T)[None, :]
  if block and window:
    m = block_window_mask(T, window, block)
  else:
    m = (s <= t) & ((t - s < window) if window else True)
  return jnp.asarray(m)[None] & (seg[:, :, None] == seg[:, None, :])


def out_and_grads(fn, q, k, v, g):
  """[out, dq, dk, dv] of fn (test_attention.forward_and_grads: one compiled program)."""
  out, grads = forward_and_grads(fn, q, k, v, g)
  return [out, *grads]


def assert_close(a, b, tol=2e-5):
  errs = [float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b)]
  assert max(errs) < tol, errs


# (T, window, block windows?, chunk_elements): token and block windows, whole-causal, a length
# that is no multiple of the block, and several chunks per row.
CASES = [(128, 0, False, 2**24), (128, 40, False, 2**24), (200, 40, False, 2**24),
         (128, 48, True, 2**24), (128, 16, True, 2**24), (256, 64, True, 3 * 16 * 16 * 4 * 4),
         (256, 37, False, 3 * 16 * 16 * 4 * 4)]


@pytest.mark.parametrize("T,window,blocks,chunk", CASES)
def test_blocked_matches_dense_reference(T, window, blocks, chunk):
  q, k, v, g, seg = inputs(T, seed=T + window)
  mask = ref_mask(T, seg, window, 16 if blocks else 0)
  ours = lambda q, k, v: blocked_attention(q, k, v, scale=SCALE, window=window,
                                           block_windows=blocks, segment_ids_BT=seg, block=16,
                                           chunk_elements=chunk)
  assert_close(out_and_grads(ours, q, k, v, g),
               out_and_grads(lambda q, k, v: reference(q, k, v, scale=SCALE, mask_BTT=mask),
                             q, k, v, g))


@pytest.mark.parametrize("impl", ["xla", "blocked"])
def test_dispatch_block_windows_match_reference(impl):
  T, window = 128, 32
  q, k, v, g, seg = inputs(T, seed=3)
  mask = ref_mask(T, seg, window, 16)
  fn = lambda q, k, v: dot_product_attention(q, k, v, impl=impl, scale=SCALE, window=window,
                                             segment_ids_BT=seg, block=16)
  assert_close(out_and_grads(fn, q, k, v, g),
               out_and_grads(lambda q, k, v: reference(q, k, v, scale=SCALE, mask_BTT=mask),
                             q, k, v, g))


def test_splash_block_windows_match_reference(monkeypatch):
  """Splash (interpret mode) with the lazily computed block-window mask and segment ids."""
  monkeypatch.setattr(splash, "block_size", lambda T: 128)
  T, window = 256, 128
  q, k, v, g, seg = inputs(T, seed=4)
  mask = ref_mask(T, seg, window, 64)
  fn = lambda q, k, v: dot_product_attention(q, k, v, impl="splash", scale=SCALE, window=window,
                                             segment_ids_BT=seg, block=64)
  assert_close(out_and_grads(fn, q, k, v, g),
               out_and_grads(lambda q, k, v: reference(q, k, v, scale=SCALE, mask_BTT=mask),
                             q, k, v, g), tol=5e-5)


@pytest.mark.fast
def test_auto_takes_blocked_for_block_or_long_windows():
  assert resolve_impl("auto", "cpu", seq_len=1024, window=256, block_windows=True) == "blocked"
  assert resolve_impl("auto", "cpu", seq_len=49152, window=1792) == "blocked"
  assert resolve_impl("auto", "cpu", seq_len=1024, window=256) == "cpu"
  assert resolve_impl("auto", "gpu", head_dim=12, seq_len=1024, window=256) == "xla"
  assert resolve_impl("auto", "cpu", seq_len=49152) == "xla"  # full causal: no window to exploit
  assert resolve_impl("auto", "tpu", seq_len=49152, window=1792, block_windows=True) == "splash"


def test_key_blocks():
  assert key_blocks(49152, 1792, 128, True) == 14
  assert key_blocks(49152, 128, 128, True) == 1
  assert key_blocks(49152, 129, 128, False) == 2
  assert key_blocks(1024, 0, 128, False) == 8


def temp_bytes(T, impl, window=256):
  """Compiled temporaries of forward + backward of one windowed attention over one row."""
  x = jax.ShapeDtypeStruct((1, T, 2, 64), jnp.float32)
  seg = jax.ShapeDtypeStruct((1, T), jnp.int32)
  def loss(q, k, v, seg):
    return dot_product_attention(q, k, v, impl=impl, scale=0.1, window=window,
                                 segment_ids_BT=seg, block=128).sum()
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
  return grad.lower(x, x, x, seg).compile().memory_analysis().temp_size_in_bytes


def test_blocked_memory_is_linear_in_T():
  small, large = temp_bytes(8192, "blocked"), temp_bytes(16384, "blocked")
  assert large / small < 2.2, (small, large)
  dense_small, dense_large = temp_bytes(2048, "xla"), temp_bytes(4096, "xla")
  assert dense_large / dense_small > 3.5, (dense_small, dense_large)  # the [T, T] path: T^2


def test_splash_block_window_tiles_equal_the_mask_and_are_quick_to_classify():
  """Splash classifies every tile of the [T, T] grid on the host: tiles outside the band or
  wholly inside it come from their corners, and every tile equals the computed mask."""
  from nanotext.model.kernels import splash
  T, window, wb, tile = 4096, 1792, 128, 512
  mask = splash._block_local_mask(T, window, wb)
  q, k = np.arange(T)[:, None], np.arange(T)[None, :]
  want = (k <= q) & (q // wb - k // wb < window // wb)
  for i in range(0, T, tile):
    for j in range(0, T, tile):
      got = mask[slice(i, i + tile), slice(j, j + tile)]
      assert np.array_equal(got, want[i:i + tile, j:j + tile]), (i, j)
  # The 262,144-token validation row's grid: 262,144 tiles, all but the band's from corners.
  long = splash._block_local_mask(262144, window, wb)
  at = lambda i, j: long[slice(i * tile, (i + 1) * tile), slice(j * tile, (j + 1) * tile)]
  assert not at(0, 1).any() and not at(100, 90).any()  # above the diagonal; past the window
  assert at(100, 99).all()  # wholly inside
  assert at(100, 100).any() and not at(100, 100).all()  # the diagonal: partial
