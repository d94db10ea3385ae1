"""What a fusing compiler (GPU, TPU) materialises of a jaxpr: its kept values, the residuals a
backward pass saves and the peak of live values in a forward pass (activations in memory.py)."""

import math
import re


# Primitives GPU and TPU compilers fuse into their consumers (elementwise math, casts, broadcasts,
# layout changes): a value made only by these is recomputed where it is used, never kept.
_FUSIBLE = frozenset("""abs add and atan2 broadcast_in_dim cbrt ceil clamp concatenate
    convert_element_type copy copy_p cos cosh div dynamic_slice eq erf erf_inv exp exp2 expand_dims
    expm1 floor ge gt imag integer_pow iota is_finite le log log1p logistic lt max min mul ne neg
    nextafter not or pad pow real reduce_precision rem reshape rev round rsqrt select_n shift_left
    shift_right_arithmetic shift_right_logical sign sin sinh slice split sqrt square squeeze
    stop_gradient sub tan tanh transpose xor""".split())
_CALLS = ("jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call", "shard_map")
# Fusible ops that a compiler repeats in each reader rather than store their result, however
# many read it. XLA's GPU compiler does so for casts, broadcasts, reshapes and slices (a float32
# copy of a bfloat16 value is kept as the bfloat16; the halves rotary embeddings split q and k
# into are read from q and k); its TPU compiler keeps such values when several ops read them
# (measured on the record's programs: estimates 0.79x the compiler's total otherwise).
REPEATED = {"gpu": frozenset("""convert_element_type broadcast_in_dim reshape squeeze expand_dims
    copy copy_p slice split""".split())}
# A forward pass on a GPU (peak_live, and the forward part of a train step, whose values the
# backward pass keeps: saved_residuals) is compiled with four more habits: XLA writes what a GEMM
# or a Pallas kernel reads (cuBLAS and Triton take their operands from memory: flash_gpu's value
# embeddings are looked up once and kept; a reshape of a stored value is the same buffer);
# it repeats in each reader an elementwise value made from one large stored value, which is alive
# there anyway (a softmax's masked scores and exponentials are recomputed from the scores by each
# of its fusions, and the probabilities the next matmul reads are stored once, as bfloat16); it
# fuses embedding lookups (gathers) into their readers (value embeddings read by two blocks are
# looked up in each; rows read by every block are stored as looked up, cast in each reader); and
# a GEMM's output added to the residual stream is the GEMM's sum (cuBLASLt's C with beta 1).
FORWARD = {"gpu": frozenset({"operands", "recomputed", "lookups", "sums"})}
# A TPU's forward pass keeps a block's output that two or more later blocks read (a U-net skip)
# twice: the value and a copy in another layout (`nanotext.compile --peak` on the speedrun
# configs' v6e-8 evals: two [262144, 1024] values for each of blocks 0-4).
SKIPS_TWICE = {"tpu"}


def _block(eqn):
  """The transformer block an eqn belongs to ('3'), None outside blocks or in scanned ones."""
  m = re.search(r"block_(\d+)", str(eqn.source_info.name_stack))
  return m.group(1) if m else None


def _primitives(eqn) -> frozenset:
  """The primitives `eqn` runs: itself, or for a call (jnp helpers such as where, pad, clip,
  relu and take are small calls) those of its body."""
  name = eqn.primitive.name
  if name in _CALLS:
    inner = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr", "fun_jaxpr") if k in eqn.params),
                 None)
    inner = getattr(inner, "jaxpr", inner)
    if inner is not None:
      return frozenset().union(*(_primitives(e) for e in inner.eqns))
  return frozenset({name})


class _Graph:
  """A jaxpr seen as a fusing compiler sees it: which values are materialised ("anchors")."""

  def __init__(self, jaxpr, repeated=frozenset(), forward=frozenset()):
    from jax.extend import core
    self.jaxpr, self.literal = jaxpr, core.Literal
    self.producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    self.uses, self.dot_operands = {}, set()
    for e in jaxpr.eqns:
      reads_whole = "operands" in forward and (e.primitive.name == "dot_general"
                                               or "pallas_call" in _primitives(e))
      for u in self.vars(e.invars):
        self.uses[u] = self.uses.get(u, 0) + 1
        if reads_whole:
          self.dot_operands.add(u)
    self.memo, self.decided, self.read = {}, {}, {}
    self.repeated, self.forward = frozenset(repeated), frozenset(forward)
    # A GEMM's output added to another value by its only reader: cuBLASLt's epilogue (C, beta 1)
    # writes the sum, so the sum is stored and the product is not.
    self.sums = {id(e) for e in jaxpr.eqns if "sums" in self.forward and e.primitive.name == "add"
                 and any(self.uses.get(u) == 1 and _gemm_output(self.producer.get(u), u)
                         for u in self.vars(e.invars))}

  def vars(self, xs):
    return [x for x in xs if not isinstance(x, self.literal)]

  def kept(self, e) -> bool:
    """Whether eqn `e`'s outputs are materialised: not fusible, or read by several ops (then
    computed once and stored, not recomputed in each reader: measured on TPU, the soft-capped
    float32 logits are kept beside the head's output), or, in a forward pass on GPU, by the
    rules of FORWARD."""
    if id(e) not in self.decided:
      self.decided[id(e)] = self._kept(e)
    return self.decided[id(e)]

  def _kept(self, e) -> bool:
    if id(e) in self.sums:
      return True
    ops = _primitives(e)
    lookup = "lookups" in self.forward and "gather" in ops and ops <= _FUSIBLE | {"gather"}
    if not (lookup or ops <= _FUSIBLE) or (any(v in self.dot_operands for v in e.outvars)
                                           and not self._view(e)):
      return True
    if lookup or all(self.uses.get(v, 0) <= 1 for v in e.outvars):
      return False
    if "recomputed" not in self.forward:
      return not ops <= self.repeated
    if self._large_anchors(e) == 1:
      return False  # recomputed by each reader from the one stored value it reads anyway
    return not ops <= self.repeated or self._from_lookup(e)

  def _view(self, e) -> bool:
    """Whether `e` only reshapes a stored value (XLA's bitcast: the same buffer)."""
    if e.primitive.name not in ("reshape", "squeeze", "expand_dims"):
      return False
    p = self.producer.get(e.invars[0]) if self.vars(e.invars[:1]) else None
    return p is not None and self.kept(p)

  def stored(self, v):
    """What is stored for kept value `v`: a widening cast of looked-up rows is stored as the rows
    (the compiler keeps the lookup and casts in each reader)."""
    e = self.producer.get(v)
    if "lookups" in self.forward and e is not None and \
        e.primitive.name == "convert_element_type" and self._from_lookup(e) \
        and e.invars[0].aval.dtype.itemsize < v.aval.dtype.itemsize:
      return e.invars[0]
    return v

  def _from_lookup(self, e) -> bool:
    """Whether `e` computes from an embedding lookup through values that are not stored (a
    lookup's normalised rows, read by every block, are stored once)."""
    for u in self.vars(e.invars):
      p = self.producer.get(u)
      if p is not None and not self.kept(p) and ("gather" in _primitives(p) or
                                                 self._from_lookup(p)):
        return True
    return False

  def looked_up(self, v) -> dict:
    """{v's stored rows: their eqn} for a value the backward pass keeps that is made from an
    embedding lookup through fused ops ({} for any other): a lookup fused into its readers is
    not repeated across the forward and backward passes; its rows are kept (speedrun.yml on one
    H100 under remat=full: the three value embeddings the rematted blocks take, 2.25 GiB, kept
    from the forward pass to the blocks' backward; counted as free, the plan took 51.8 GiB
    against 56.6 compiled)."""
    e = self.producer.get(v)
    if e is None or "lookups" not in self.forward or self.kept(e) or not (
        "gather" in _primitives(e) or self._from_lookup(e)):
      return {}
    return {self.stored(v): e}

  def _large_anchors(self, e) -> int:
    """How many of the stored values `e` is made from are at least a quarter its size."""
    size = lambda a: math.prod(a.shape) * a.dtype.itemsize
    own = max(size(v.aval) for v in e.outvars)
    found = {a for u in e.invars for a in self.anchors(u)}
    return sum(4 * size(a.aval) >= own for a in found)

  def arguments(self, e) -> set:
    """The jaxpr's arguments eqn `e` reads, directly or through ops fused into it."""
    if id(e) not in self.read:
      out = set()
      for u in self.vars(e.invars):
        p = self.producer.get(u)
        if p is None:
          out.add(u)
        elif not self.kept(p):
          out |= self.arguments(p)
      self.read[id(e)] = out
    return self.read[id(e)]

  def anchors(self, v) -> dict:
    """{materialised var: its eqn} that `v` is computed from through fusible ops."""
    if isinstance(v, self.literal) or v not in self.producer:
      return {}  # an argument (parameters, tokens) or a constant: counted elsewhere
    if v not in self.memo:
      e = self.producer[v]
      self.memo[v] = {v: e} if self.kept(e) else \
          {a: x for u in e.invars for a, x in self.anchors(u).items()}
    return self.memo[v]


def saved_residuals(fn, *args, backend: str = "", rematted: bool = False) -> list:
  """[(aval, producing eqn, fused anchors {var: eqn})] of what the backward pass of `fn(*args)`
  keeps: JAX's residuals, each with the materialised values `backend`'s compiler computes them
  from. `rematted`: `fn`'s blocks are rematted, so the looked-up rows they take are kept
  (_Graph.looked_up); without remat the compiler looks them up again where they are read."""
  import jax
  closed, shapes = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a), return_shape=True)(*args)
  g = _Graph(closed.jaxpr, REPEATED.get(backend, frozenset()), FORWARD.get(backend, frozenset()))
  n = len(jax.tree.leaves(shapes[1]))
  return [(v.aval, g.producer[v], g.anchors(v) or (g.looked_up(v) if rematted else {}))
          for v in g.vars(g.jaxpr.outvars[-n:]) if v in g.producer]


def _gemm_output(eqn, var) -> bool:
  """Whether `var` is the result of a dot_general: `eqn`'s own, or the one its call returns."""
  if eqn is None:
    return False
  if eqn.primitive.name == "dot_general":
    return True
  inner = next(iter(_inner(eqn)), None) if eqn.primitive.name in _CALLS else None
  if inner is None:
    return False
  out = inner.outvars[eqn.outvars.index(var)]
  return _gemm_output(next((e for e in inner.eqns if out in e.outvars), None), out)


def _inner(e) -> list:
  """The jaxprs an eqn runs (calls, scan and loop bodies, cond branches)."""
  out = []
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr", "body_jaxpr", "cond_jaxpr", "branches"):
    for j in e.params.get(key, ()) if key == "branches" else [e.params.get(key)]:
      j = getattr(j, "jaxpr", j)
      if j is not None and hasattr(j, "eqns"):
        out.append(j)
  return out


def peak_live(jaxpr, size_of, opaque=lambda eqn: False, backend: str = "",
              accumulated=lambda eqn: False, arg_bytes=None) -> float:
  """Most bytes of materialised values alive at once while `jaxpr` runs in program order
  on `backend` (its arguments not counted): a forward pass's working set. An `opaque` eqn counts
  its outputs only, not what runs inside it; an `accumulated` one holds its outputs twice while
  it runs (a sum of partial products and the next partial product). `arg_bytes` (one number per
  invar) are copies of arguments made where first read and freed after their last reader: an
  FSDP-sharded parameter gathered for the ops that use it."""
  g = _Graph(jaxpr, REPEATED.get(backend, frozenset()), FORWARD.get(backend, frozenset()))
  last, readers, twice = {}, {}, backend in SKIPS_TWICE
  copy = {v: b for v, b in zip(jaxpr.invars, arg_bytes or ()) if b}
  first = {}
  for i, e in enumerate(jaxpr.eqns):
    if g.kept(e):
      for u in e.invars:
        for a in g.anchors(u):
          last[a] = i
          if twice:
            readers.setdefault(a, set()).add(_block(e))
      for a in g.arguments(e) & copy.keys():
        first.setdefault(a, i)
        last[a] = i
  for u in jaxpr.outvars:
    for a in g.anchors(u):
      last[a] = len(jaxpr.eqns)
  dies, made = {}, {}
  for a, i in last.items():
    dies.setdefault(i, []).append(a)
  for a, i in first.items():
    made[i] = made.get(i, 0.0) + copy[a]
  copies = {a: 2 for a, blocks in readers.items()
            if _block(g.producer[a]) is not None
            and len(blocks - {None, _block(g.producer[a])}) > 1}
  bytes_of = lambda v: copy[v] if v in copy else size_of(g.stored(v).aval) * copies.get(v, 1)
  live = peak = 0.0
  for i, e in enumerate(jaxpr.eqns):
    if not g.kept(e):
      continue
    live += made.get(i, 0.0)
    size = sum(bytes_of(v) for v in e.outvars if v in last)
    inner = 0.0 if opaque(e) else \
        max((peak_live(j, size_of, opaque, backend, accumulated) for j in _inner(e)), default=0.0)
    peak = max(peak, live + inner + size * (2 if accumulated(e) else 1))
    live += size - sum(bytes_of(a) for a in dies.get(i, ()))
  return peak


def kept_bytes(residuals, size_of) -> list:
  """[(scope, bytes)] a fusing compiler keeps of `residuals`: per group of residuals computed
  from shared anchors, the cheaper of the residuals themselves and their anchors (a float32
  score matrix is kept as its bfloat16 probabilities; three elementwise functions of the
  logits as the logits once)."""
  parent = {}

  def find(x):
    while parent.setdefault(x, x) is not x:
      parent[x] = parent[parent[x]]
      x = parent[x]
    return x
  for i, (_, _, anchors) in enumerate(residuals):
    for var in anchors:
      parent[find(var)] = find(("residual", i))
  groups = {}
  for i, (aval, eqn, anchors) in enumerate(residuals):
    g = groups.setdefault(find(("residual", i)), [0.0, {}, eqn])
    g[0] += size_of(aval)
    g[1].update(anchors)
  out = []
  for own, anchors, eqn in groups.values():
    through = sum(size_of(v.aval) for v in anchors)
    out.append((scope(eqn), min(own, through)))
  return out


def scope(eqn) -> str:
  """'kernel' (inside an attention kernel), 'block' (a transformer block's), 'loss' or 'other',
  from the eqn's jax.named_scope."""
  stack = str(eqn.source_info.name_stack)
  if "attention_kernel" in stack:
    return "kernel"
  return "block" if re.search(r"block_\d|blocks", stack) else "loss" if "loss" in stack else \
      "other"
