"""Block-sparse flash attention for NVIDIA GPUs in Pallas (Triton lowering; interpret mode
elsewhere), for the record's mask: causal, sliding windows (token or block-granular) and
documents, with the window a runtime input if need be.

Block tables (kernels/block_tables.py), computed each call from the segment ids and the window,
give every query tile the range of key tiles that can hold a key it may see, and every key tile
the range of query tiles that may see one of its keys; each kernel loops over exactly that range
(a dynamic trip count) and masks token by token inside it. Work is O(T x window) and nothing
[T, T] exists, forward or backward. The forward is an online softmax over key tiles that saves
each query's logsumexp; the backward recomputes the probabilities from it in two kernels, one
writing a query tile's dq (over key tiles), one a key tile's dk and dv (over query tiles), with
the softmax's row term an XLA pass before them. On an H200 (benchmarks/RESULTS.md, 2026-12-04)
5dffda6's two kernels of this design took 16.1 ms of the record's step where one kernel holding
both kinds of program, the row term computed inside from the output, took 20.3 (though on paper
it read the tiles once where two kernels read them twice); that one kernel is now the backward
of `flash_gpu_qkv_attention`, and of q, k and v only opted in (per_device.OWN_KERNELS
"flash_gpu_one_backward"), for an A/B. These two kernels themselves are not yet timed on a GPU.

`flash_gpu_qkv_attention` takes q, k and v raw from the merged QKV projection's output: the
kernels normalise and rotate q and k as they load a tile (QK-norm and rotary embeddings,
kernels/qk_rope.py's arithmetic, roundings included) and mix the value embedding into v, and the
backward writes the three gradients through the norm, rotation and mix straight into the
gradient of the projection's output: no pass of their own over q, k or v either way. On an
H200 that made the record's step 1.55x slower (each key tile normalised and rotated again for
every query tile that reads it), so the attention layer takes it only opted in
(per_device.OWN_KERNELS). What one program does is in kernels/flash_gpu_programs.py.

Tiles are `block_q` x `block_k` tokens; T must be a multiple of both, head_dim a power of two.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from nanotext import sharding
from nanotext.model import rope as rotary
from nanotext.model.kernels import flash_gpu_programs as programs
from nanotext.model.kernels.block_tables import key_tiles, query_tiles
from nanotext.model.kernels.flash_gpu_programs import Tiles
from nanotext.model.kernels.per_device import opted_in, platform


# Shared memory one block may use on an H100 (232,448 bytes; Triton refuses a kernel past it)
SHARED_BYTES = 227 * 1024


def tile_bytes(head_dim: int, dtype, tiles: Tiles = Tiles()) -> int:
  """Bytes of the tiles one program holds in shared memory: the forward's query tile and a key
  and a value tile; the backward's query and output-gradient tiles and a key and a value tile."""
  rows = max(tiles.block_q + 2 * tiles.block_k, 2 * tiles.block_q_bwd + 2 * tiles.block_k_bwd)
  return rows * head_dim * jnp.dtype(dtype).itemsize


def problem(seq_len: int, head_dim: int, tiles: Tiles = Tiles(), seq_key: str = "train.seq_len",
            dtype=None):
  """None if the kernel can run this (0 = unknown), else why not, for a UserError. `dtype`
  (None: not compiled for a GPU) is the model's, whose tiles must fit in shared memory."""
  step = max(tiles.block_q, tiles.block_k, tiles.block_q_bwd, tiles.block_k_bwd)
  if seq_len and seq_len % step:
    return f"cannot tile {seq_key}={seq_len}: it is not a multiple of {step}"
  if head_dim and (head_dim < 16 or head_dim & (head_dim - 1) or head_dim > 256):
    return f"cannot tile model.head_dim={head_dim}: it must be a power of two from 16 to 256"
  if head_dim and dtype is not None and tile_bytes(head_dim, dtype, tiles) > SHARED_BYTES:
    name = jnp.dtype(dtype).name
    return (f"cannot hold model.head_dim={head_dim} at model.dtype={name} in shared memory: its "
            f"{name} tiles take {tile_bytes(head_dim, dtype, tiles) // 1024} KiB where an H100 "
            f"gives a block {SHARED_BYTES // 1024} KiB (bfloat16, or float32 up to head_dim 128, "
            "fit)")
  return None


def flash_gpu_attention(q_BTHK, k_BTHK, v_BTHK, *, scale: float, window=0, segment_ids_BT=None,
                        block: int = 0, tiles: Tiles = Tiles()):
  """Causal attention within documents (`segment_ids_BT` [B, T], ids never decreasing along a
  row) and a window (int or traced int32; 0 = none) of tokens, or with `block` > 0 of whole
  `block`-token blocks (the record's block mask); per device under a mesh."""
  cfg = _config(q_BTHK.shape, scale, block, tiles, 0.0, q_BTHK.dtype)
  return _attention(cfg, (q_BTHK, k_BTHK, v_BTHK), (), (),
                    *_mask(segment_ids_BT, window, q_BTHK.shape), ())


def flash_gpu_qkv_attention(qkv_BT3HK, freq, eps: float, lambdas=None, value_embed_BTHK=None, *,
                            scale: float, window=0, segment_ids_BT=None, block: int = 0,
                            tiles: Tiles = Tiles()):
  """flash_gpu_attention of rope(rms_norm(q)), rope(rms_norm(k)) (rotary frequencies `freq`,
  model/rope.py) and v, or with `lambdas` (float32) lambdas[0] v + lambdas[1] value_embed (the
  second term where one is given; layers.scaled_sum's arithmetic), from the merged projection's
  output [B, T, 3, H, K] as it lies. The gradient of qkv is one array, written by the kernel."""
  shape = qkv_BT3HK.shape[:2] + qkv_BT3HK.shape[3:]
  theta_TK = rotary.angles(shape[1], freq)  # the XLA path's angles, so its cos and sin
  tables = tuple(lax.stop_gradient(f(theta_TK)) for f in (jnp.cos, jnp.sin))
  extra = () if value_embed_BTHK is None else (value_embed_BTHK,)
  coef = () if lambdas is None else (jnp.asarray(lambdas, jnp.float32)[:1 + len(extra)],)
  cfg = _config(shape, scale, block, tiles, eps, qkv_BT3HK.dtype)
  return _attention(cfg, (qkv_BT3HK,), coef, extra, *_mask(segment_ids_BT, window, shape),
                    tables)


def _config(shape_BTHK, scale, block, tiles, eps, dtype) -> programs.Config:
  interpret = platform() != "gpu"  # the interpreter has no shared memory to run out of
  if why := problem(shape_BTHK[1], shape_BTHK[-1], tiles, dtype=None if interpret else dtype):
    raise ValueError(f"flash_gpu: {why}")
  return programs.Config(float(scale), block, tiles, interpret, float(eps))


def _mask(segment_ids_BT, window, shape_BTHK):
  """(segment ids [B, T] int32, window [1] int32): no documents is one document."""
  if segment_ids_BT is None:
    segment_ids_BT = jnp.zeros(shape_BTHK[:2], jnp.int32)
  return segment_ids_BT.astype(jnp.int32), jnp.asarray(window, jnp.int32).reshape(1)


def _tables(seg_BT, window, cfg: programs.Config):
  """Block tables of the forward kernel and of the backward's dq and dk/dv programs."""
  t, w, b = cfg.tiles, window[0], cfg.window_block
  return (key_tiles(seg_BT, w, block_q=t.block_q, block_k=t.block_k, window_block=b),
          key_tiles(seg_BT, w, block_q=t.block_q_bwd, block_k=t.block_k_bwd, window_block=b),
          query_tiles(seg_BT, w, block_q=t.block_q_bwd, block_k=t.block_k_bwd, window_block=b))


def _whole(x, part=None):
  """The whole rows [T, K] of one batch row and head (program (i, b, h): head h mod H) of x
  [B, T, H, K], or of qkv [B, T, 3, H, K]'s part `part` (None: all three, [T, 3, K])."""
  H, T, K = x.shape[-2], x.shape[1], x.shape[-1]
  if x.ndim == 4:
    return pl.BlockSpec((None, T, None, K), lambda i, b, h: (b, 0, h % H, 0))
  if part is None:
    return pl.BlockSpec((None, T, 3, None, K), lambda i, b, h: (b, 0, 0, h % H, 0))
  return pl.BlockSpec((None, T, None, None, K), lambda i, b, h: (b, 0, part, h % H, 0))


def _entry(n: int):
  """Program (i, b, h)'s entry of a [B, n] block table (the last for i past it)."""
  return pl.BlockSpec((None, 1), lambda i, b, h: (b, jnp.minimum(i, n - 1)))


def _common(T: int, K: int, H: int, coef, rope):
  """Specs of the window, segment ids [B, T], per-row statistics [B, H, T], the mix's
  coefficients and rope tables."""
  return dict(window=pl.BlockSpec((1,), lambda i, b, h: (0,)),
              seg=pl.BlockSpec((None, T), lambda i, b, h: (b, 0)),
              stat=pl.BlockSpec((None, None, T), lambda i, b, h: (b, h % H, 0)),
              coef=tuple(pl.BlockSpec(c.shape, lambda i, b, h: (0,)) for c in coef),
              rope=tuple(pl.BlockSpec((T, K // 2), lambda i, b, h: (0, 0)) for _ in rope))


def _call(kernel, cfg, grid, in_specs, out_specs, out_shape, name, head_dim: int, dtype,
          **kw):
  """pallas_call with the Triton settings (interpreted off GPU). Wide tiles are loaded one
  stage ahead, not two: float32 ones, or 256-wide heads with the rotation tables beside them
  (240 KiB of shared memory where an H100 has 227: shakespeare.yml's backward, speedrun.yml's
  forward)."""
  warps = cfg.tiles.num_warps or (4 if head_dim <= 128 else 8)
  wide = jnp.dtype(dtype).itemsize > 2 or head_dim > 128
  return pl.pallas_call(
      functools.partial(kernel, cfg=cfg, **kw), grid=grid, in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape, interpret=cfg.interpret, name=name,
      compiler_params=plgpu.CompilerParams(num_warps=warps,
                                           num_stages=1 if wide else cfg.tiles.num_stages))


# Logical axes of the kernels' operands under a mesh (each runs per device: sharding.per_device)
BY_RANK = {5: ("batch", None, None, "act_heads", None),  # qkv
           4: ("batch", None, "act_heads", None),  # rows of q, k, v and their gradients
           3: ("batch", "act_heads", None),  # per-row statistics
           2: ("batch", None),  # segment ids and block tables
           1: (None,)}  # window, the mix's coefficients
PARTIALS = ("batch", "act_heads", None, None)  # [B, H, sources, key tiles]


def _axes(path, x):
  """Logical axes of an operand or output named by its top-level key: the rope tables whole,
  the mix's partial sums [B, H, sources, key tiles], else by rank (BY_RANK)."""
  key = path[0].key
  if key == "rope":
    return (None, None)
  return PARTIALS if key == "coef" and x.ndim == 4 else BY_RANK[x.ndim]


def _per_device(local, ins: dict, outs: dict):
  """local(ins) -> a dict like `outs` (ShapeDtypeStructs), per device (_axes split both)."""
  leaves, tree = jax.tree_util.tree_flatten_with_path(ins)
  out_leaves, out_tree = jax.tree_util.tree_flatten_with_path(outs)
  flat = lambda *a: tuple(jax.tree.leaves(local(jax.tree.unflatten(tree, a))))
  got = sharding.per_device(flat, tuple(x for _, x in leaves),
                            tuple(_axes(p, x) for p, x in leaves),
                            [_axes(p, x) for p, x in out_leaves],
                            out_shape=[x.shape for _, x in out_leaves])
  return jax.tree.unflatten(out_tree, got)


def _forward(cfg, ins: dict):
  """{"out": [B, T, H, K], "lse": [B, H, T] float32} of the kernels' inputs `ins`."""
  q = ins["q"]
  B, T, H, K = q.shape[:2] + q.shape[-2:]
  bq = cfg.tiles.block_q

  def local(x):
    rows, heads = x["seg"].shape[0], x["q"].shape[-2]  # this device's batch rows and heads
    sp = _common(T, K, heads, x["coef"], x["rope"])
    (lo, hi), = x["tables"]
    return dict(zip(("out", "lse"), _call(
        programs.forward, cfg, (T // bq, rows, heads),
        [sp["window"], _entry(T // bq), _entry(T // bq), sp["seg"], _whole(x["q"], 0),
         _whole(x["k"], 1), tuple(_whole(v, 2) for v in x["values"]), sp["coef"], sp["rope"]],
        [pl.BlockSpec((None, bq, None, K), lambda i, b, h: (b, i, h, 0)),
         pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i))],
        [jax.ShapeDtypeStruct((rows, T, heads, K), q.dtype),
         jax.ShapeDtypeStruct((rows, heads, T), jnp.float32)],
        "flash_gpu_forward", K, q.dtype)(x["window"], lo, hi, x["seg"], x["q"], x["k"], x["values"],
                                x["coef"], x["rope"])))

  return _per_device(local, ins, {"out": jax.ShapeDtypeStruct((B, T, H, K), q.dtype),
                                  "lse": jax.ShapeDtypeStruct((B, H, T), jnp.float32)})


def _backward_two(cfg, ins: dict):
  """The gradients {"q", "k", "v"} of attention of q, k and v as given: a dq kernel and a dk/dv
  kernel, each query's softmax row term delta = sum_k do o an XLA pass before them."""
  q, T, t = ins["q"], ins["seg"].shape[1], cfg.tiles
  delta = jnp.einsum("bthk,bthk->bht", ins["do"].astype(jnp.float32),
                     ins["out"].astype(jnp.float32))

  def local(x):
    rows, heads, K = x["seg"].shape[0], x["q"].shape[-2], x["q"].shape[-1]
    sp = _common(T, K, heads, (), ())

    def call(kernel, n, table, outs, name):
      return _call(kernel, cfg, (n, rows, heads),
                   [sp["window"], _entry(n), _entry(n), sp["seg"], _whole(x["q"]),
                    _whole(x["k"]), (_whole(x["values"][0]),), _whole(x["do"]), sp["stat"],
                    sp["stat"]],
                   [_whole(o) for o in outs],
                   [jax.ShapeDtypeStruct(o.shape, o.dtype) for o in outs], name, K, q.dtype)(
                       x["window"], *table, x["seg"], x["q"], x["k"], x["values"], x["do"],
                       x["lse"], x["delta"])

    (key_lo, key_hi), (query_lo, query_hi) = x["tables"]
    dq, = call(programs.backward_dq, T // t.block_q_bwd, (key_lo, key_hi), [x["q"]],
               "flash_gpu_dq")
    dk, dv = call(programs.backward_dkv, T // t.block_k_bwd, (query_lo, query_hi),
                  [x["k"], x["values"][0]], "flash_gpu_dkv")
    return {"q": dq, "k": dk, "v": dv}

  ins = dict({n: a for n, a in ins.items() if n != "out"}, delta=delta)
  outs = {"q": q, "k": ins["k"], "v": ins["values"][0]}
  return _per_device(local, ins, {n: jax.ShapeDtypeStruct(a.shape, a.dtype)
                                  for n, a in outs.items()})


def _backward(cfg, ins: dict):
  """The gradients {"q", "k", "v"}, or {"qkv"} where q and k are the merged projection's
  output, and with the mix's coefficients {"sources", "coef"} (see programs.backward): one
  kernel."""
  q, T, t = ins["q"], ins["seg"].shape[1], cfg.tiles
  nq, nk = T // t.block_q_bwd, T // t.block_k_bwd

  def shapes(x, rows, heads):
    """The outputs' shapes: [rows, T, heads, K] arrays as x's."""
    if x["q"].ndim == 4:
      out = {n: jax.ShapeDtypeStruct(x[n].shape, x[n].dtype) for n in ("q", "k")}
      out["v"] = jax.ShapeDtypeStruct(x["values"][0].shape, x["values"][0].dtype)
      return out
    out = {"qkv": jax.ShapeDtypeStruct(x["q"].shape, x["q"].dtype),
           "sources": tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in x["values"][1:])}
    if x["coef"]:
      out["coef"] = jax.ShapeDtypeStruct((rows, heads, len(x["values"]), nk), jnp.float32)
    return out

  def local(x):
    rows, heads, K = x["seg"].shape[0], x["q"].shape[-2], x["q"].shape[-1]
    sp = _common(T, K, heads, x["coef"], x["rope"])
    out = shapes(x, rows, heads)
    specs = jax.tree.map(_whole, {n: o for n, o in out.items() if n != "coef"})
    if "coef" in out:
      specs["coef"] = pl.BlockSpec((None, None) + out["coef"].shape[2:],
                                   lambda i, b, h: (b, h % heads, 0, 0))
    (key_lo, key_hi), (query_lo, query_hi) = x["tables"]
    return _call(
        programs.backward, cfg, (max(nq, nk), rows, 2 * heads),
        [sp["window"], _entry(nq), _entry(nq), _entry(nk), _entry(nk), sp["seg"],
         _whole(x["q"], 0), _whole(x["k"], 1), tuple(_whole(v, 2) for v in x["values"]),
         sp["coef"], sp["rope"], _whole(x["do"]), _whole(x["out"]), sp["stat"]],
        [specs], [out], "flash_gpu_backward", K, q.dtype, heads=heads)(
            x["window"], key_lo, key_hi, query_lo, query_hi, x["seg"], x["q"], x["k"],
            x["values"], x["coef"], x["rope"], x["do"], x["out"], x["lse"])[0]

  return _per_device(local, ins, shapes(ins, q.shape[0], q.shape[-2]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(cfg, x, coef, extra, seg, window, rope):
  """Attention of x = (q, k, v), or of x = (qkv,) with v mixed by `coef` with the `extra`
  sources (see flash_gpu_qkv_attention)."""
  return _attention_fwd(cfg, x, coef, extra, seg, window, rope)[0]


def _inputs(x, coef, extra, seg, window, rope) -> dict:
  """The kernels' operands: q, k, v's sources and the rest."""
  q, k, v = (x[0],) * 3 if len(x) == 1 else x
  return {"q": q, "k": k, "values": (v, *extra), "coef": coef, "seg": seg, "window": window,
          "rope": rope}


def _attention_fwd(cfg, x, coef, extra, seg, window, rope):
  ins = _inputs(x, coef, extra, seg, window, rope)
  tables = _tables(seg, window, cfg)
  got = _forward(cfg, dict(ins, tables=tables[:1]))
  return got["out"], (x, coef, extra, seg, window, rope, tables[1:], got["out"], got["lse"])


def _attention_bwd(cfg, res, do):
  x, coef, extra, seg, window, rope, tables, out, lse = res
  # q, k and v as given: two kernels (the module's docstring says why) unless opted in to
  # one; the merged projection's output: one
  two = len(x) == 3 and not opted_in("flash_gpu_one_backward")
  backward = _backward_two if two else _backward
  grads = backward(cfg, dict(_inputs(x, coef, extra, seg, window, rope), tables=tables, do=do,
                             out=out, lse=lse))
  if len(x) == 3:
    dx = (grads["q"], grads["k"], grads["v"])
  else:
    dx = (sharding.constrain(grads["qkv"], BY_RANK[5]),)
  dcoef = (grads["coef"].sum(axis=(0, 1, 3)),) if coef else ()
  return dx, dcoef, tuple(grads.get("sources", ())), None, None, tuple(None for _ in rope)


_attention.defvjp(_attention_fwd, _attention_bwd)
