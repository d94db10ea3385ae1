"""Memory per device of a run's train and eval programs, estimated from the config before anything
compiles (nanotext.memory_plan compares it with the devices and picks remat and loss chunks).

Parameters, optimizer state, gradients and the batch are exact: the abstract model's and
optimizer's shapes under mesh.rules. Activations come from the model too, traced abstractly (no
compilation, no allocation) at one device's rows: the train step's are what the backward pass of
`model.loss.loss_fn` saves under the remat policy and loss chunk; the eval step's, the most that is
alive at once in its forward pass. A fusing compiler (GPU, TPU) materialises only values made by
matmuls, reductions, gathers, kernels, and values that several ops read; chains of elementwise
ops are recomputed where used. The CPU compiler keeps what JAX saves (16-bit math in float32 under
jax 0.10) under any remat policy (measured). Attention and loss temporaries that are not saved are
added per kernel and chunk. Accuracy: tests/test_memory.py and benchmarks/memory_estimate.py.
"""

import dataclasses
import importlib.metadata
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from nanotext import config, optim, sharding, window_schedule
from nanotext.fusion import kept_bytes, peak_live, saved_residuals, scope
from nanotext.gpus import HOPPER_WORKSPACE
from nanotext.model import head_loss
from nanotext.model.gpt import abstract_model
from nanotext.model.kernels import blocked as ba, dispatch
from nanotext.model.kernels.per_device import building_for
from nanotext.model.loss import loss_fn

GIB = 2**30
# jax 0.10's CPU backend runs 16-bit math in float32 and keeps the float32 values; 0.11's keeps
# them 16-bit (tests/test_memory.py's CPU cases: train plans 1.27 and 1.63 of the compiler under
# 0.11.2 counted at float32, 0.96 and 1.24 counted as they are).
CPU_WIDENS_16BIT = tuple(map(int, importlib.metadata.version("jax").split(".")[:2])) < (0, 11)
REMATS = ("none", "dots", "full")  # cheapest first: what auto tries, in order
CHUNK = 256  # loss positions at a time when the logits do not fit whole (the speedrun's choice)
# The kernel facts are the kernel dispatch's. Flash-style kernels are traced as the blocked kernel
# (plain jnp, quick to trace at any length; the TPU and GPU kernels' tables are not), with the
# kernel's own residuals replaced by its output and log-sum-exp; all but flash_gpu, traced as
# itself (its Pallas calls trace anywhere, and it changes the layer around it: QK-norm, rotation
# and the value mix happen inside it).
DENSE_KERNELS, FLASH_KERNELS = dispatch.DENSE_IMPLS, dispatch.FLASH_IMPLS


def gib(n: float) -> str:
  """Bytes for people: '39.2 GiB', '96.0 MiB', '5.8 PiB'."""
  if n < GIB:
    return f"{n / 2**20:.1f} MiB"
  for unit in ("GiB", "TiB", "PiB", "EiB"):
    if n < 1000 * GIB or unit == "EiB":
      return f"{n / GIB:.1f} {unit}"
    n /= 1024
  return ""


@dataclasses.dataclass(frozen=True)
class Estimate:
  """Bytes per device of one program, term by term."""
  program: str  # "train step" | "eval step"
  terms: tuple  # ((name, bytes), ...), largest first

  @property
  def total(self) -> int:
    return sum(b for _, b in self.terms)

  def dominant(self) -> str:
    return self.terms[0][0]

  def describe(self) -> str:
    parts = ", ".join(f"{name} {gib(b)}" for name, b in self.terms if b >= self.total / 50)
    return f"{self.program} ~{gib(self.total)} ({parts})"


def _estimate(program: str, **terms) -> Estimate:
  return Estimate(program, tuple(sorted(((k.replace("_", " "), int(v)) for k, v in terms.items()
                                          if v), key=lambda kv: -kv[1])))


def nbytes(x) -> int:
  return int(math.prod(x.shape)) * x.dtype.itemsize


def tpu_bytes(shape, itemsize: int) -> int:
  """Bytes of an array as a TPU lays it out: in tiles of 8 sublanes by 128 lanes over the two
  dimensions its layout puts minor. The compiler picks those to pad least ([B, T, 64] is laid out
  T minor, unpadded); what a kernel takes in its own layout is sized by its caller (laid_out:
  attention's per-head operands keep head_dim minor)."""
  shape = [int(n) for n in shape if n != 1]  # a dimension of 1 is laid out anywhere: no tile
  if 0 in shape or len(shape) < 2:  # empty: nothing; one dimension: padded to 128 lanes
    return 0 if 0 in shape else -(-(shape[0] if shape else 1) // 128) * 128 * itemsize
  up = lambda n, m: -(-n // m) * m
  whole = math.prod(shape)
  return min(whole // (a * b) * up(a, 128) * up(b, 8)
             for i, a in enumerate(shape) for j, b in enumerate(shape) if i != j) * itemsize


def per_head_bytes(shape, itemsize: int) -> int:
  """Bytes of a [.., head_dim] value a TPU kernel takes with head_dim minor: padded to 128
  lanes (libtpu's splash operands, f32[576,2048,2,32]{3,1,2,0}: 4x their size)."""
  return math.prod(shape[:-1]) * -(-shape[-1] // 128) * 128 * itemsize


_MODELS: dict = {}


def head_matmul(eqn, d_model: int, vocab: int) -> bool:
  """Whether `eqn` is the head's matmul: [.., d_model] x [d_model, vocab] (either layout)."""
  if eqn.primitive.name != "dot_general":
    return False
  (_, contracted), _ = eqn.params["dimension_numbers"]
  rhs = eqn.invars[1].aval.shape
  return vocab in rhs and len(contracted) == 1 and rhs[contracted[0]] == d_model


def model_of(cfg, backend: str, mesh_sizes: dict, workspace: int = HOPPER_WORKSPACE) -> "Model":
  """Model(cfg, backend, mesh_sizes, workspace), kept for the next run of the same model and
  training (tests and benchmarks build many runs that differ only in where they write)."""
  t = cfg.train
  shapes = (t.batch_size, t.seq_len, t.grad_accum, t.eval_seq_len, t.seq_len_start,
            t.seq_len_step, t.loss_reduction)  # what in train decides sizes
  key = (cfg.model, cfg.attention, shapes, cfg.optim, cfg.mesh.rules, backend,
         tuple(sorted(mesh_sizes.items())), workspace if backend == "gpu" else 0)
  if key not in _MODELS:
    if len(_MODELS) >= 16:
      _MODELS.pop(next(iter(_MODELS)))
    _MODELS[key] = Model(cfg, backend, mesh_sizes, workspace)
  return _MODELS[key]


class Model:
  """One config's memory terms on a backend and mesh; traces cached per (remat, chunk).
  `workspace`: the bytes XLA gives each cuBLAS call on the GPU (gpus.gemm_workspace)."""

  def __init__(self, cfg, backend: str, mesh_sizes: dict, workspace: int = HOPPER_WORKSPACE):
    self.cfg, self.backend, self.mesh_sizes = cfg, backend, dict(mesh_sizes)
    self.workspace = workspace if backend == "gpu" else 0  # one held beside the peak (measured)
    self.graphdef, abstract, self.impl = abstract_model(cfg, backend)
    rules = sharding.parse_rules(cfg.mesh.rules)
    # A TPU runs a matmul whose contracting dimension is split over devices as a windowed
    # einsum, adding each device's partial product into an accumulator: the head's output is
    # held twice while it runs (modded_nanogpt_jax.yml's v6e-8 eval: two [16384, 50304] bf16
    # buffers at its peak, in the compiler's buffer assignment).
    self.head_accumulates = backend == "tpu" and \
        sharding.shard_count(("embed",), rules, mesh_sizes) > 1
    self.params = nnx.to_pure_dict(abstract)
    specs = nnx.to_pure_dict(sharding.param_specs(abstract))
    shards = jax.tree.map(lambda s: sharding.shard_count(tuple(s), rules, mesh_sizes), specs,
                          is_leaf=lambda x: isinstance(x, P))
    per_device = lambda tree, counts: sum(nbytes(x) / n for x, n in
                                          zip(jax.tree.leaves(tree), jax.tree.leaves(counts)))
    self.param_bytes = per_device(self.params, shards)
    split_only = sharding.as_compute_sees_weights(mesh_sizes)
    used = jax.tree.map(lambda s: sharding.shard_count(tuple(s), rules, split_only), specs,
                        is_leaf=lambda x: isinstance(x, P))
    self.gathered_leaves = [nbytes(x) / u - nbytes(x) / n for x, u, n in zip(
        jax.tree.leaves(self.params), jax.tree.leaves(used), jax.tree.leaves(shards))]
    self.gathered_bytes = sum(self.gathered_leaves)
    tx = optim.make_optimizer(cfg.optim, optim.group_labels(abstract), cfg.train.steps)
    opt = jax.eval_shape(tx.init, self.params)
    self.opt_bytes = per_device(opt, sharding.like_params(opt, shards, self.params, 1))
    t = cfg.train
    batch_shards = sharding.shard_count(("batch",), rules, mesh_sizes)
    self.rows = max(1, t.batch_size // t.grad_accum // batch_shards)  # per micro-batch
    self.eval_rows = max(1, t.batch_size // batch_shards)
    self.eval_len = t.eval_seq_len or t.seq_len
    self.split = {size: sharding.shard_count((name,), rules, mesh_sizes) for name, size in
                  (("act_heads", cfg.model.num_heads), ("act_mlp", cfg.model.mlp_dim),
                   ("act_vocab", cfg.model.vocab_size))}
    self._traces = {}

  def _gathered_at_loss(self) -> float:
    """FSDP-gathered bytes a GPU train step holds at its loss: the head's weight (the tied
    table) and one block's weights. XLA gathers each layer's weights for its GEMMs, frees them,
    and gathers them again for the backward (h100-8: the record's train step gathers 400 MiB in
    10 all-gathers, twice its bf16 weights; every parameter gathered at once was 1.24x the
    compiler for shakespeare.yml)."""
    tree = jax.tree.unflatten(jax.tree.structure(self.params), self.gathered_leaves)
    total = lambda t: sum(jax.tree.leaves(t))
    head = total(tree["embed" if self.cfg.model.tie_embeddings else "head"])
    blocks = tree["blocks"]  # {i: block} unrolled; scanned, one stack of num_layers blocks
    if self.cfg.model.scan_layers:
      return head + total(blocks) / self.cfg.model.num_layers
    return head + max(map(total, blocks.values()), default=0.0)

  def activation_bytes(self, aval) -> float:
    """Per device (traced at one device's rows): tensor-parallel dims split; a TPU's laid out."""
    shape = list(aval.shape)
    for size, n in self.split.items():
      if n > 1 and size in shape[1:] and size % n == 0:
        shape[shape.index(size, 1)] //= n
        break
    return self.laid_out(shape, aval.dtype.itemsize)

  def laid_out(self, shape, itemsize: int, per_head: bool = False) -> float:
    """Bytes of an array of `shape` on this backend: a TPU pads it to its tiles (`per_head`: a
    kernel's operand, head_dim minor)."""
    if self.backend == "tpu":
      return (per_head_bytes if per_head else tpu_bytes)(shape, itemsize)
    return math.prod(shape) * itemsize

  def stored_bytes(self, aval) -> float:
    """What a materialised value costs here: 16-bit math runs in float32 on jax 0.10's CPU."""
    cpu16 = self.backend == "cpu" and aval.dtype.itemsize == 2 and CPU_WIDENS_16BIT
    return self.activation_bytes(aval) * (2 if cpu16 else 1)

  def trace(self, remat: str, chunk: int, length: int = 0) -> dict:
    """{'block' (of it 'kernel', in the attention kernel), 'loss', 'other': bytes the backward
    keeps, per device} and 'per_block', for rows of `length` tokens (0: train.seq_len)."""
    key = (remat, chunk, length or self.cfg.train.seq_len)
    if key not in self._traces:
      self._traces[key] = self._trace(*key)
    return self._traces[key]

  def _trace(self, remat: str, chunk: int, length: int) -> dict:
    cfg = config.replace_sections(self.cfg, model={"remat": remat})
    graphdef = self.traced_model(remat)
    windows = window_schedule.step_windows(cfg, cfg.train.steps)  # the widest: the last stage
    eot = 0 if cfg.attention.doc_mask else None  # which id does not change any shape
    per_row = cfg.train.loss_reduction == "row_sum"

    def loss(params, inputs, targets):
      return loss_fn(graphdef, params, inputs, targets, eot, windows, chunk, per_row=per_row)
    tokens = jax.ShapeDtypeStruct((self.rows, length), jnp.int32)
    out = {"block": 0.0, "loss": 0.0, "other": 0.0, "kernel": 0.0}
    with building_for(self.backend):  # the target's program (matmuls, rotary, head slices)
      residuals = saved_residuals(loss, self.params, tokens, tokens, backend=self.backend,
                                  rematted=remat != "none")
    if self.backend == "cpu":  # kept as JAX saves them (stored_bytes: at float32 on jax 0.10)
      for aval, eqn, _ in residuals:
        out[scope(eqn)] += self.stored_bytes(aval)
    else:
      for where, size in kept_bytes(residuals, self.activation_bytes):
        out[where] += size
    if self.stand_in:
      out["kernel"] = self.flash_residuals(self.rows, length)
    out["block"] += out["kernel"]
    out["per_block"] = out["block"] / self.cfg.model.num_layers
    return out

  @property
  def stand_in(self) -> bool:
    """Whether the run's attention kernel is traced as the blocked kernel (FLASH_KERNELS)."""
    return self.impl in FLASH_KERNELS and self.impl != "flash_gpu"

  def traced_model(self, remat: str):
    """The graphdef traced for `remat`: the run's model, its kernel as blocked if it stands in."""
    if not self.stand_in and (remat == self.cfg.model.remat or remat == "none"
                              and self.cfg.model.remat == "auto"):
      return self.graphdef
    if ("model", remat) not in self._traces:  # built once: the eval's chunks and train's share it
      impl = "blocked" if self.stand_in else self.cfg.attention.impl
      cfg = config.replace_sections(self.cfg, model={"remat": remat}, attention={"impl": impl})
      self._traces[("model", remat)] = abstract_model(cfg, self.backend)[0]
    return self._traces[("model", remat)]

  def flash_residuals(self, rows: int, length: int) -> float:
    """What a flash-style kernel keeps over all layers: output and float32 log-sum-exp."""
    m = self.cfg.model
    heads = m.num_heads / self.split[m.num_heads]
    layers = m.num_layers - len({i for i in m.no_attention_layers if i < m.num_layers})
    out = self.laid_out((rows, length, heads, m.head_dim), np.dtype(m.dtype).itemsize, True)
    return layers * (out + self.laid_out((rows, heads, length), 4))

  def static(self) -> dict:
    """Terms that do not depend on remat or chunks: state and a step's batch."""
    t = self.cfg.train
    return {"parameters": self.param_bytes, "optimizer_state": self.opt_bytes,
            "gradients": self.param_bytes * (1 + (t.grad_accum > 1)),  # micro-batches': + a sum
            "gathered_parameters": self._gathered_at_loss() if self.backend == "gpu"
            else self.gathered_bytes, "batch": 2 * 4 * self.rows * t.grad_accum * t.seq_len,
            "gemm_workspace": self.workspace}

  def head_bytes(self, rows: int, length: int, chunk: int) -> float:
    """The head's working set in a train step beside what the backward keeps: with loss chunks
    one chunk's head output, recomputed, and on GPU and TPU the head's own slices
    (model/head_loss.py; the CPU compiler's float32 copies are what its kept values count)."""
    m = self.cfg.model
    chunked = 0 < chunk < length
    positions = chunk if chunked else length
    vocab = m.vocab_size // self.split[m.vocab_size]
    if self.backend == "cpu":
      return rows * positions * vocab * 4 if chunked else 0  # the chunk's float32 logits
    item = np.dtype(m.dtype).itemsize
    kernel = self.split[m.vocab_size] == 1 and head_loss.takes_kernel(
        rows, positions, m.d_model, vocab, m.dtype, m.logit_softcap, m.fp8_head, self.backend)
    return rows * positions * vocab * item * chunked + head_loss.working_bytes(
        rows, positions, vocab, item, m.fp8_head, self.backend, kernel)

  def head_outputs_freed(self, rows: int, length: int, chunk: int) -> float:
    """The kept head outputs z a one-device train step never holds at once. The loss's cotangent
    is known before the step runs, so each head slice's backward may run right after its forward
    and free its z; on one GPU XLA's schedule does (the record's H100 step holds one of its 12
    slices' z: all 12 planned 1.14x the compiler), and on one TPU without an FP8 head (a v6e,
    1,024 rows of 1,024: one of 8 slices' z; all 8 planned 39.3 GiB, 14.5 compiled). With
    collectives to overlap it holds several (the record on h100-8: 4 of 12, and 4 slices' FP8
    gradients), a TPU every slice's rounded gradient (speedrun.yml on v6e-8): those, the CPU and
    a chunked loss are planned as traced; so are more than head_loss.UNROLL slices, whose loop
    stacks every z (H100, 128 rows of 1,024: 2.3 GiB planned, 14.9 compiled)."""
    m, one_device = self.cfg.model, math.prod(self.mesh_sizes.values()) == 1
    freeing = self.backend == "gpu" or self.backend == "tpu" and not m.fp8_head
    if not (one_device and freeing) or 0 < chunk < length:
      return 0.0
    vocab = m.vocab_size // self.split[m.vocab_size]
    k = head_loss.slices(rows, length, vocab, self.backend)
    if k > head_loss.UNROLL:
      return 0.0
    return rows * length * vocab * np.dtype(m.dtype).itemsize * (k - 1) / k

  def attention_bytes(self, rows: int, length: int, train: bool) -> float:
    """Temporaries of one layer's attention kernel beyond its traced residuals."""
    m, a = self.cfg.model, self.cfg.attention
    heads = m.num_heads / self.split[m.num_heads]
    if self.impl in DENSE_KERNELS or self.impl == "cudnn" and a.doc_mask:
      scores = rows * heads * length * length * 4 * (0.5 if self.impl == "cpu" else 1)
      if self.impl == "cudnn":  # flash kernel; the document mask is a dense bf16 bias
        return rows * length * length * 2
      return scores * (2 if train else 1)  # backward: the scores' and probabilities' gradients
    if self.impl == "blocked":
      window = max(window_schedule.step_windows(self.cfg, self.cfg.train.steps))
      block = a.window_block if a.block_windows else ba.BLOCK
      nb = -(-length // block)
      per_block = rows * heads * block * ba.key_blocks(length, window, block, a.block_windows) \
          * block
      chunk = min(nb, max(1, ba.CHUNK_ELEMENTS // per_block)) * per_block
      return chunk * 4 * (4 if train else 2)  # scores, probabilities (+ their gradients)
    return 0.0  # flash-style kernels (splash, flash, cudnn): O(T) statistics, traced

  def train(self, remat: str, chunk: int, length: int = 0) -> Estimate:
    """The train step at its widest stage (final windows, full rows), or with `length` the
    program of a train.seq_len_start warmup length: micro-batches of as many rows, each of
    `length` tokens (trainer.make_train_step), at the final windows."""
    t = self.cfg.train
    length = length or t.seq_len
    cpu = self.backend == "cpu"  # its compiler undoes remat (measured): every policy as none
    kept = self.trace("none" if cpu else remat, chunk, length)
    stored = kept["block"] + kept["other"]
    # At the loss: every kept activation, the loss's and the head's working set. Later, in a
    # block's backward under remat: its recomputed activations and their gradients (a dense
    # kernel's scores and probabilities once: their gradients are attention_bytes').
    loss_peak = kept["loss"] - self.head_outputs_freed(self.rows, length, chunk) \
        + self.head_bytes(self.rows, length, chunk)
    plain, dense = self.trace("none", chunk, length), self.impl in DENSE_KERNELS
    recompute = 2 * plain["per_block"] - dense * plain["kernel"] / self.cfg.model.num_layers \
        if remat != "none" and not cpu else 0
    attention = self.attention_bytes(self.rows, length, train=True) + \
        self.kernel_operands(self.rows, length, train=True)
    work = max(loss_peak, recompute + attention)
    return _estimate("train step", activations=stored, logits_and_loss=work if work == loss_peak
                     else 0, recompute_and_attention=0 if work == loss_peak else work,
                     **self.static())

  def eval(self, chunk: int, accum: int = 1) -> Estimate:
    """The eval step: forward only, validation rows of train.eval_seq_len (`accum` passes of
    a share of them each, train.eval_accum), its working set from the traced program (the
    attention kernel's scores included)."""
    rows, length = self.eval_rows // accum, self.eval_len
    if ("eval", chunk, accum) not in self._traces:
      windows = window_schedule.step_windows(self.cfg, self.cfg.train.steps)
      eot = 0 if self.cfg.attention.doc_mask else None
      tokens = jax.ShapeDtypeStruct((rows, length), jnp.int32)
      # A forward pass alone recomputes nothing: the compiled eval is the same at every remat
      # policy, and peak_live would count a rematted block's output inside and outside its call.
      graphdef = self.traced_model("none")
      with building_for(self.backend):  # the target's head slices, not the host's
        closed = jax.make_jaxpr(lambda p, x, y: loss_fn(
            graphdef, p, x, y, eot, windows, chunk, train=False))(self.params, tokens, tokens)
      flash = self.impl in FLASH_KERNELS  # its outputs count, not the work traced inside
      m = self.cfg.model
      head = lambda e: self.head_accumulates and head_matmul(e, m.d_model, m.vocab_size)
      # A GPU's forward pass gathers each FSDP-sharded parameter for the ops that read it and
      # frees it after them (h100-8: the evals' all-gathers are per layer, 11-17 of them; all
      # parameters gathered at once was 1.17-1.18x the compiler); a TPU's is left at all at once.
      gathered = self.gathered_leaves if self.backend == "gpu" else None
      self._traces[("eval", chunk, accum)] = peak_live(
          closed.jaxpr, self.stored_bytes, lambda e: flash and scope(e) == "kernel", self.backend,
          accumulated=head, arg_bytes=gathered)
    return _estimate("eval step", parameters=self.param_bytes,
                     batch=2 * 4 * self.eval_rows * length,
                     gathered_parameters=0 if self.backend == "gpu" else self.gathered_bytes,
                     gemm_workspace=self.workspace,
                     activations_and_logits=max(self._traces[("eval", chunk, accum)],
                                                self.kernel_operands(rows, length)))

  def kernel_operands(self, rows: int, length: int, train: bool = False) -> float:
    """A TPU attention kernel's working set the traced program does not show, per-head arrays
    with head_dim minor: forward, q, k, v copied into that layout and its output, beside the
    residual stream; backward, the output's gradient copied in and dq, dk, dv. A d_model 64
    model's v5e programs peak there (f32[576,2048,2,32] padded 4x: four, 4.5 of eval's 5.5 GiB)."""
    if self.backend != "tpu" or self.impl not in FLASH_KERNELS:
      return 0.0
    m = self.cfg.model
    heads, item = m.num_heads // self.split[m.num_heads], np.dtype(m.dtype).itemsize
    stream = 0 if train else self.laid_out((rows, length, m.d_model), item)
    return 4 * self.laid_out((rows, length, heads, m.head_dim), item, True) + stream
