"""The one place that picks an attention kernel: `resolve_impl` for a config, then
`dot_product_attention` calls the chosen kernel with the mask it needs."""

import jax
import jax.numpy as jnp
import numpy as np

from nanotext import window_schedule
from nanotext.window_schedule import RUNTIME_WINDOW_IMPLS  # which kernels: see there
from nanotext.errors import UserError
from nanotext.model.kernels import cudnn, flash, flash_gpu, splash
from nanotext.model.kernels.blocked import blocked_attention
from nanotext.model.kernels.cpu import cpu_attention
from nanotext.model.kernels.einsum import einsum_attention
from nanotext.model.kernels.per_device import platform
from nanotext.model.kernels.xla import xla_attention

IMPLS = ("auto", "xla", "cudnn", "splash", "flash", "flash_gpu", "blocked", "cpu", "einsum")
# What each kernel holds, for the memory plan (nanotext/memory.py): dense ones score every [T, T]
# query-key pair; flash-style ones keep only their output and log-sum-exp for the backward pass
# (blocked, in neither, holds one chunk of query-key blocks at a time).
DENSE_IMPLS = ("xla", "einsum", "cpu")
FLASH_IMPLS = ("splash", "flash", "flash_gpu", "cudnn")
# Above this length a dense [T, T] mask/score per head is the cost that matters: `auto` takes the
# blocked kernel for windowed attention (at 4096, f32 scores are 64 MiB per head and example).
DENSE_MAX_T = 4096


def resolve_impl(impl: str, backend: str, *, head_dim: int = 0, seq_len: int = 0,
                 window: int = 0, block_windows: bool = False, doc_mask: bool = False,
                 seq_key: str = "train.seq_len", rows=(), dtype=None) -> str:
  """The concrete kernel for `attention.impl` on this backend (the one place that decides).

  `head_dim` and `seq_len` (0 = unknown) let `auto` check that the kernel accepts the model's
  shapes: on TPU it is splash when the sequence length tiles into 128-wide blocks; on GPU,
  windowed or document-masked attention is flash_gpu (block-sparse) when it tiles the shapes;
  elsewhere, windowed attention (`window` > 0) is blocked when the windows are block-granular
  (cuDNN and jax's xla path have no such mask) or the sequence is longer than DENSE_MAX_T;
  otherwise on CPU up to DENSE_MAX_T tokens the cpu kernel (faster there than xla's full score
  matrix), on GPU cudnn when a trial trace of cuDNN flash attention succeeds, else xla.
  `seq_key` names the key of `seq_len` in the errors; `rows` [(length, key)] are the other row
  lengths the run's programs take: `auto` takes a kernel that tiles every one, and a kernel
  named is refused for the first it cannot take, naming its key. `dtype` (None: unknown) is
  the model's: flash_gpu's tiles at it must fit a GPU's shared memory.
  """
  if impl not in IMPLS:
    raise UserError(f"attention.impl={impl!r} is not one of {', '.join(IMPLS)}")
  every = [(seq_len, seq_key), *((n, key) for n, key in rows if n != seq_len)]
  if impl == "auto":
    return _auto(backend, head_dim, seq_len, list(dict.fromkeys(n for n, _ in every)), window,
                 block_windows, doc_mask, dtype)
  for n, key in every:
    _check(impl, backend, head_dim, n, key, window, block_windows, dtype)
  return impl


def _auto(backend, head_dim, seq_len, lens, window, block_windows, doc_mask, dtype) -> str:
  """resolve_impl's `auto`: the first kernel of its list that takes every row length `lens`."""
  if backend == "tpu" and all(n % splash.LANES == 0 for n in lens):
    return "splash"
  if (backend == "gpu" and (window or doc_mask) and head_dim and seq_len
      and all(flash_gpu.problem(n, head_dim, dtype=dtype) is None for n in lens)):
    return "flash_gpu"
  if window and (block_windows or seq_len > DENSE_MAX_T):
    return "blocked"
  if backend == "cpu" and seq_len <= DENSE_MAX_T:  # it unrolls T / 128 query blocks
    return "cpu"
  if backend == "gpu" and all(cudnn.problem(head_dim, n) is None for n in lens):
    return "cudnn"
  return "xla"


def _check(impl, backend, head_dim, seq_len, seq_key, window, block_windows, dtype) -> None:
  """A UserError, naming the key to change, where kernel `impl` cannot take these shapes."""
  if impl in ("cudnn", "cpu") and block_windows and window:
    raise UserError(f"attention.impl={impl} cannot express block-granular windows "
                    "(attention.block_windows=true); use attention.impl=blocked or auto")
  if (impl, backend) in (("splash", "gpu"), ("flash", "gpu"), ("flash_gpu", "tpu")):
    other = "TPU" if backend == "gpu" else "GPU"
    raise UserError(f"attention.impl={impl} is a {other} kernel: on a {backend.upper()} it runs in "
                    "Pallas's interpreter (a test mode, far slower); use attention.impl=auto")
  if impl == "cudnn":
    if backend != "gpu":
      raise UserError(f"attention.impl=cudnn needs an NVIDIA GPU with cuDNN, but the backend is "
                      f"{backend}; use attention.impl=xla or auto")
    problem = cudnn.problem(head_dim, seq_len)
    if problem is not None:
      raise UserError(f"attention.impl=cudnn is not usable on backend {backend} "
                      f"(head_dim={head_dim or 'unknown'}, {seq_key}={seq_len or 'unknown'}): "
                      f"{problem}; use attention.impl=xla or auto")
  if impl == "splash" and seq_len:
    splash.block_size(seq_len, seq_key)  # a UserError early for a length it cannot tile
  if impl == "flash" and (problem := flash.problem(seq_len, head_dim, window, seq_key)):
    other = "splash, " if window else ""  # splash tiles what flash tiles, and windows too
    raise UserError(f"attention.impl=flash {problem}; use attention.impl={other}blocked or auto")
  if impl == "flash_gpu" and (problem := flash_gpu.problem(  # shared memory: a GPU's only
      seq_len, head_dim, seq_key=seq_key, dtype=dtype if backend == "gpu" else None)):
    raise UserError(f"attention.impl=flash_gpu {problem}; use attention.impl=blocked or auto")


def config_impl(cfg, backend: str) -> str:
  """The kernel of a loaded config's attention on `backend`, one that takes every row length
  its programs take (the warmup's, validation's, and the sampler's once its context slides, of
  model.max_seq_len tokens): `auto` picks it, a kernel named is refused in one UserError naming
  the key of a length it cannot take."""
  a, t, m = cfg.attention, cfg.train, cfg.model
  rows = window_schedule.row_keys(t) + ([(m.max_seq_len, "model.max_seq_len")]
                                        if m.max_seq_len else [])
  # a kernel named is checked against the windows its programs apply: one covering its rows is
  # plain causal attention, which flash computes
  window = a.window if a.impl == "auto" else window_schedule.applied_window(cfg)
  return resolve_impl(a.impl, backend, head_dim=m.head_dim or m.d_model // m.num_heads,
                      seq_len=t.seq_len, window=window, block_windows=a.block_windows,
                      doc_mask=a.doc_mask, rows=rows, dtype=m.dtype)


# Pallas kernels and the platform each is compiled for; elsewhere Pallas interprets it
PALLAS_PLATFORM = {"splash": "tpu", "flash": "tpu", "flash_gpu": "gpu"}


def interpreted(impl: str, backend: str, sep: str = "") -> str:
  """'' where kernel `impl` runs compiled on `backend`, else `sep` and a note that it runs in
  Pallas's interpreter (taken where asked for, on CPU: the tests' mode), for start-up lines."""
  if PALLAS_PLATFORM.get(impl, backend) == backend:
    return ""
  return (f"{sep}attention {impl} (Pallas interpret mode on {backend.upper()}: a test mode, far "
          "slower)")


def takes_runtime_window(impl: str) -> bool:
  """Whether kernel `impl` (resolved, not auto) takes the window as a runtime input, so that one
  program serves every stage of a window schedule."""
  return impl in RUNTIME_WINDOW_IMPLS


def _static_window(window, T: int) -> int:
  """The static window checked; 0 for one covering the whole sequence (plain causal)."""
  if not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window < 0:
    raise TypeError(f"window must be a static non-negative Python int, got {window!r}")
  return 0 if window >= T else int(window)


def _runtime(impl: str, runtime_window) -> dict:
  """The kernel keyword for a runtime window, if one is given and the kernel takes it."""
  if runtime_window is None:
    return {}
  if not takes_runtime_window(impl):
    raise ValueError(f"attention.impl={impl} needs a static window; ask takes_runtime_window")
  return {"runtime_window": jnp.asarray(runtime_window, jnp.int32)}


def qkv_attention(qkv_BT3HK, freq, eps: float, lambdas=None, value_embed_BTHK=None, *,
                  scale: float, window: int = 0, segment_ids_BT=None, block: int = 0,
                  runtime_window=None):
  """dot_product_attention through flash_gpu from the merged projection's output [B, T, 3, H,
  K], q and k QK-normalised and rotated and v mixed with the value embedding inside its kernels
  (kernels/flash_gpu.py, flash_gpu_qkv_attention); the mask as there."""
  T, head_dim = qkv_BT3HK.shape[1], qkv_BT3HK.shape[-1]
  window = _static_window(window, T)
  resolve_impl("flash_gpu", platform(), head_dim=head_dim, seq_len=T, dtype=qkv_BT3HK.dtype)
  live = _runtime("flash_gpu", runtime_window)
  return flash_gpu.flash_gpu_qkv_attention(
      qkv_BT3HK, freq, eps, lambdas, value_embed_BTHK, scale=scale,
      window=live.get("runtime_window", window), segment_ids_BT=segment_ids_BT, block=block)


def dot_product_attention(q_BTHK, k_BTHK, v_BTHK, *, impl: str, scale: float, window: int = 0,
                          segment_ids_BT=None, block: int = 0, runtime_window=None):
  """Causal attention, optionally windowed and/or document-masked, through the selected kernel.

  A query at t sees keys s <= t, also only keys with the same segment id when `segment_ids_BT`
  [B, T] is given, and with `window` > 0: keys t - window < s (block = 0, token-exact), or, with
  `block` > 0, keys in blocks t // block - W + 1 .. t // block, W = max(1, window // block) (the
  record's block mask). `window` must be a static Python int: it shapes the kernel's mask (and
  splash's block-sparsity tables). With `runtime_window` (a traced int32 scalar, 0 = no window;
  only kernels that `takes_runtime_window`), that is the window applied and `window` its static
  bound (0 = none): one compiled program serves every window up to the bound.
  """
  T = q_BTHK.shape[1]
  window = _static_window(window, T)
  if impl == "auto":
    impl = resolve_impl(impl, jax.default_backend(), head_dim=q_BTHK.shape[-1], seq_len=T,
                        window=window, block_windows=bool(block),
                        doc_mask=segment_ids_BT is not None, dtype=q_BTHK.dtype)
  args = (q_BTHK, k_BTHK, v_BTHK)
  live = _runtime(impl, runtime_window)
  if impl == "blocked":
    return blocked_attention(*args, scale=scale, window=window, block_windows=bool(block),
                             segment_ids_BT=segment_ids_BT, **({"block": block} if block else {}),
                             **live)
  if impl == "xla":
    return xla_attention(*args, scale=scale, window=window, segment_ids_BT=segment_ids_BT,
                         block=block, **live)
  if impl == "cpu":
    if block and (window or live):
      resolve_impl("cpu", "cpu", window=window or 1, block_windows=True)  # raises the UserError
    return cpu_attention(*args, scale=scale, window=window, segment_ids_BT=segment_ids_BT, **live)
  if impl == "cudnn":
    if block and window:
      resolve_impl("cudnn", "gpu", window=window, block_windows=True)  # raises the UserError
    return cudnn.cudnn_attention(*args, scale=scale, window=window, segment_ids_BT=segment_ids_BT)
  if impl == "splash":
    return splash.splash_attention(*args, scale=scale, window=window,
                                   segment_ids_BT=segment_ids_BT, block=block)
  if impl == "flash":
    resolve_impl("flash", platform(), head_dim=q_BTHK.shape[-1], seq_len=T, window=window)
    return flash.flash_attention(*args, scale=scale, segment_ids_BT=segment_ids_BT)
  if impl == "flash_gpu":
    resolve_impl("flash_gpu", platform(), head_dim=q_BTHK.shape[-1], seq_len=T,
                 dtype=q_BTHK.dtype)
    return flash_gpu.flash_gpu_attention(
        *args, scale=scale, window=live.get("runtime_window", window),
        segment_ids_BT=segment_ids_BT, block=block)
  if impl == "einsum":
    return einsum_attention(*args, scale=scale, window=window, segment_ids_BT=segment_ids_BT,
                            block=block, **live)
  raise UserError(f"attention.impl={impl!r} is not one of {', '.join(IMPLS)}")
