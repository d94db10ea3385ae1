"""What a compiled program's optimized HLO says: its instructions, collectives and launches.

`kernels(text)` walks the program as a device runs it (the entry computation, and the bodies of
loops times their trip counts: nanotext/hlo_loops.py) and sorts each launch into a kind: GEMM
calls (cuBLAS, FP8 among them; on TPU the convolution fusions), custom kernels (Pallas as Triton
on GPU, Mosaic on TPU), cuDNN calls, fusions, scatters, collectives, copies, with the FLOPs and
bytes each moves. nanotext/roofline.py prices them."""

import dataclasses
import json
import math
import re

from nanotext.hlo_conv import conv_flops
from nanotext.hlo_loops import runs, trip_count

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "c64": 8, "c128": 16}
_SHAPE_RE = re.compile(r"\b([a-z]+[0-9][a-z0-9]*|pred)\[([0-9,]*)\]")
_COLLECTIVE_RE = re.compile("(" + "|".join(COLLECTIVES) + ")(-start|-done)?")
_COMMENT_RE = re.compile(r"/\*.*?\*/")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$", re.S)
_INSTR_START = re.compile(r"^\s+(ROOT\s+)?%?[\w.\-]+\s*=\s")
_HEAD_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
# Instructions that launch nothing: bookkeeping, control flow (their bodies are walked) and the
# second half of an async pair.
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "call",
         "conditional", "after-all", "add-dependency", "opt-barrier", "partition-id",
         "replica-id", "copy-done", "send-done", "recv-done", "async-done", "async-update",
         "domain", "iota"} | {c + "-done" for c in COLLECTIVES}
# Custom calls of libtpu's own that launch no kernel: scratch space, notes on gather indices.
_FREE_CALLS = {"AllocateBuffer", "AssumeGatherIndicesInBound", "GatherScatterIndicesBitpacked"}


def shape_bytes(text: str) -> int:
  """Bytes of every array shape in an HLO type string, e.g. '(f32[64,128]{1,0}, bf16[8])'."""
  total = 0
  for dtype, dims in _SHAPE_RE.findall(text):
    n = math.prod(int(d) for d in dims.split(",") if d)
    total += n * dtype_bytes(dtype)
  return int(total)


def dtype_bytes(dtype: str) -> float:
  return _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)


def shapes(text: str) -> list:
  """[(dtype, dims)] of every array in an HLO type string."""
  return [(dtype, tuple(int(d) for d in dims.split(",") if d))
          for dtype, dims in _SHAPE_RE.findall(text)]


def collectives(hlo_text: str) -> dict:
  """{op: {'count', 'bytes'}} of the collectives one step runs (a loop's as often as it goes
  round: hlo_loops.runs); bytes are per-device results.

  An async pair counts once: `-start` adds to the count and its `-done` (whose type is exactly
  the result, while the start's tuple also holds the operands) adds the bytes.
  """
  comps, entry = parse(hlo_text)
  times = runs(comps, entry)
  out = {op: {"count": 0, "bytes": 0} for op in COLLECTIVES}
  for name, instrs in comps.items():
    n = times.get(name, 1)  # a computation nothing reaches: once, as written
    for ins in instrs:
      if m := _COLLECTIVE_RE.fullmatch(ins.opcode):
        out[m.group(1)]["count"] += n if m.group(2) != "-done" else 0
        out[m.group(1)]["bytes"] += n * shape_bytes(ins.type) if m.group(2) != "-start" else 0
  return out


@dataclasses.dataclass(frozen=True)
class Instr:
  """One HLO instruction: its result type, opcode, operand names and the attribute text."""
  name: str
  type: str
  opcode: str
  operands: tuple
  attrs: str
  args: str = ""  # the text inside the parentheses (a parameter's number)
  root: bool = False

  def attr(self, key: str) -> str:
    """The value of `key=...` (a computation name or a bare word), '' if absent."""
    m = re.search(r"\b" + re.escape(key) + r"=%?([\w.\-$]+)", self.attrs)
    return m.group(1) if m else ""

  def config(self) -> dict:
    """The backend_config JSON ({} where there is none or it is not JSON)."""
    i = self.attrs.find("backend_config={")
    if i < 0:
      return {}
    text = _balanced(self.attrs, i + len("backend_config="), "{", "}")
    try:
      return json.loads(text)
    except ValueError:
      return {}


def _balanced(text: str, start: int, open_: str, close: str) -> str:
  """text[start:] up to and including the bracket that closes the one at `start`."""
  depth = 0
  for i in range(start, len(text)):
    if text[i] == open_:
      depth += 1
    elif text[i] == close:
      depth -= 1
      if depth == 0:
        return text[start:i + 1]
  return text[start:]


def _instr(line: str):
  m = _INSTR_RE.match(_COMMENT_RE.sub("", line))
  if not m:
    return None
  name, rest = m.group(2), m.group(3)
  if rest.startswith("("):
    type_ = _balanced(rest, 0, "(", ")")
  else:
    type_ = rest.split(" ", 1)[0]
  rest = rest[len(type_):].lstrip()
  op = re.match(r"([\w\-]+)\(", rest)
  if not op:
    return None
  args = _balanced(rest, len(op.group(1)), "(", ")")
  operands = tuple(re.findall(r"%([\w.\-]+)", args))
  return Instr(name, type_, op.group(1), operands, rest[len(op.group(1)) + len(args):],
               args[1:-1], bool(m.group(1)))


def parse(text: str) -> tuple:
  """({computation name: [Instr]}, entry name) of an HLO module's text (an instruction may span
  lines: TPU kernels carry multi-line configs)."""
  comps, entry, current, lines = {}, "", None, []

  def flush():
    if lines:
      ins = _instr(" ".join(lines))
      if ins is not None:
        current.append(ins)
      lines.clear()
  for line in text.splitlines():
    if current is None:
      m = _HEAD_RE.match(line)
      if m:
        current = comps.setdefault(m.group(2), [])
        entry = m.group(2) if m.group(1) else entry
      continue
    if line.strip() == "}":
      flush()
      current = None
    elif _INSTR_START.match(line):
      flush()
      lines.append(line)
    elif lines:
      lines.append(line.strip())
  return comps, entry


@dataclasses.dataclass
class Kernel:
  """One launch (per step: `count` of them where a loop repeats it)."""
  name: str
  kind: str  # gemm, gemm-fp8, custom, cudnn, fusion, scatter, collective, copy, other
  flops: float
  bytes: float
  largest: int  # elements of its largest operand or result
  dims: frozenset = frozenset()  # every dimension size of the arrays it touches whole
  count: int = 1
  math: str = "bf16"  # the peak its FLOPs run at: bf16, fp8, f32
  op: str = ""  # the jax op that made it (op_name(ins)), '' where the HLO does not say
  fast_accum: bool = False  # an FP8 GEMM at the default precision: cuBLASLt's fast accumulation
  own: bool = False  # a GEMM of our own: a Pallas kernel named *_gemm (model/kernels)


def kernels(text: str, parsed=None) -> list:
  """[Kernel] of every launch of one step of a compiled program (`parsed`: parse(text))."""
  comps, entry = parsed or parse(text)
  out = []

  def walk(name: str, times: int) -> None:
    instrs = comps.get(name, [])
    types = {i.name: i.type for i in instrs}
    for ins in instrs:
      if ins.opcode == "while":
        trips = trip_count(ins, instrs, comps) or 1  # unknown: once (hlo_loops.loops)
        walk(ins.attr("body"), times * trips)
        walk(ins.attr("condition"), times * (trips + 1))
        continue
      if ins.opcode == "call":
        walk(ins.attr("to_apply"), times)
        continue
      if ins.opcode == "conditional":
        walk(branches(ins)[0], times)  # one branch runs; the first stands for all
        continue
      if ins.opcode in _FREE or (ins.opcode == "custom-call"
                                 and custom_call_target(ins) in _FREE_CALLS):
        continue
      k = _kernel(ins, types, comps)
      k.count = times
      out.append(k)
  walk(entry, 1)
  return out


def branches(ins: Instr) -> list:
  """The computations a conditional may run, in order."""
  if "branch_computations" in ins.attrs:
    return re.findall(r"%([\w.\-]+)", ins.attrs.split("branch_computations=")[-1].split("}")[0])
  return [ins.attr("true_computation"), ins.attr("false_computation")]


def _kernel(ins: Instr, types: dict, comps: dict) -> Kernel:
  operand_types = [types.get(o, "") for o in ins.operands]
  called = comps.get(ins.attr("calls"), [])
  # The library call a fusion wraps (XLA 0.11's dynamic-slice fusion: a cuBLAS call reading a
  # slice of its operand in place, the head's GEMM in a loop over slices), else the call itself.
  call = next((i for i in called if i.opcode == "custom-call"), None) \
      if ins.opcode == "fusion" and "custom_fusion" in ins.attrs else ins
  cublas = call is not None and call.opcode == "custom-call" and \
      "cublas" in custom_call_target(call)
  # A cuBLAS result comes with a workspace buffer: not data the kernel touches.
  results = _first(ins.type) if cublas else ins.type
  if ins.opcode == "fusion":
    moved, touched = _fusion_bytes(ins, operand_types, called, results)
  else:  # an array passed twice (a kernel reading two parts of it) is read once at most
    touched = [results] + [types.get(o, "") for o in dict.fromkeys(ins.operands)]
    moved = sum(shape_bytes(t) for t in touched)
  arrays = [d for t in touched for _, d in shapes(t)]
  largest = max((math.prod(d) for d in arrays), default=0)
  dims = frozenset(n for d in arrays for n in d)
  kind, flops, math_kind, fast, own = "other", 0.0, "bf16", False, False
  if cublas:
    target = custom_call_target(call)
    inner = {i.name: i.type for i in called}
    call_types = [inner.get(o, "") for o in call.operands] if call is not ins else operand_types
    flops = _gemm_flops(call, call_types)
    math_kind = "fp8" if "f8" in target else _math(call_types[:2])
    kind = "gemm-fp8" if math_kind == "fp8" else "gemm"
    precision = call.config().get("gemm_backend_config", {}).get("precision_config", {})
    fast = kind == "gemm-fp8" and set(precision.get("operand_precision", [])) <= {"DEFAULT"} \
        and precision.get("algorithm", "ALG_UNSET") == "ALG_UNSET"
  elif mkn := _own_gemm(ins, operand_types):  # [M, K] x [K, N] and whatever its epilogue writes
    math_kind, own = _math(operand_types[:2]), True
    kind, flops = "gemm-fp8" if math_kind == "fp8" else "gemm", 2.0 * math.prod(mkn)
  elif ins.opcode == "custom-call":
    # Pallas (Triton on GPU, Mosaic on TPU) and other opaque kernels
    kind = "cudnn" if custom_call_target(ins).startswith("__cudnn") else "custom"
  elif ins.opcode == "fusion":
    # Its instructions and those of a fusion libtpu nests in it (a score matmul under softmax)
    inner = called + [j for i in called if i.opcode == "fusion"
                      for j in comps.get(i.attr("calls"), [])]
    typed = {i.name: i.type for i in inner}
    dots = [i for i in inner if i.opcode in ("dot", "convolution")]
    if "scatter" in {i.opcode for i in called}:
      kind = "scatter"
    elif dots:
      kind, flops = "gemm", sum(_dot_flops(i, typed) for i in dots)
      math_kind = _math([typed.get(o, "") for i in dots for o in i.operands[:2]])
    else:
      kind = "fusion"
  elif ins.opcode in ("dot", "convolution"):
    kind, flops = "gemm", _dot_flops(ins, types)
    math_kind = _math(operand_types[:2])
  elif ins.opcode == "scatter":
    kind = "scatter"
  elif any(ins.opcode.startswith(c) for c in COLLECTIVES):
    kind = "collective"
  elif ins.opcode in ("copy", "copy-start"):
    kind = "copy"
  return Kernel(ins.name, kind, flops, moved, largest, dims, math=math_kind, op=op_name(ins),
                fast_accum=fast, own=own)


def _own_gemm(ins: Instr, operand_types) -> tuple:
  """(M, K, N) of a Pallas kernel whose name ends in _gemm, its first two operands matrices
  [M, K] and [K, N] or [N, K] (kernels/relu2_mlp.py's gradient); () for any other instruction."""
  if ins.opcode != "custom-call" or not re.search(r'\bname = "\w+_gemm"', ins.attrs):
    return ()
  dims = [shapes(t)[0][1] if shapes(t) else () for t in operand_types[:2]]
  if len(dims) != 2 or any(len(d) != 2 for d in dims):
    return ()
  (m, k), b = dims
  return (m, k, b[1]) if b[0] == k else (m, k, b[0]) if b[1] == k else ()


def op_name(ins: Instr, jit: bool = False) -> str:
  """The jax op an instruction came from (its op_name metadata unescaped; `jit`: with the jit)."""
  m = re.search(r'op_name="' + ("" if jit else r"(?:jit\([^)]*\)/)?") + r'([^"]*)"', ins.attrs)
  return re.sub(r"\\(.)", r"\1", m.group(1)) if m else ""  # batch[\\'inputs\\'] in the text


def custom_call_target(ins: Instr) -> str:
  m = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
  return m.group(1) if m else ""


def _first(type_: str) -> str:
  """A type's first array as a type string (a cuBLAS result without its workspace)."""
  m = _SHAPE_RE.search(type_)
  return m.group(0) if m else ""


def _math(operand_types) -> str:
  dtypes = {d for t in operand_types for d, _ in shapes(t)}
  if any(d.startswith("f8") for d in dtypes):
    return "fp8"
  return "f32" if dtypes and dtypes <= {"f32", "f64"} else "bf16"


def _gemm_flops(ins: Instr, operand_types) -> float:
  """2 * output elements * contracted size of a cuBLAS call (its backend config says which)."""
  dims = ins.config().get("gemm_backend_config", {}).get("dot_dimension_numbers", {})
  lhs = shapes(operand_types[0])[0][1] if operand_types and shapes(operand_types[0]) else ()
  k = math.prod(lhs[int(i)] for i in dims.get("lhs_contracting_dimensions", [])
                if int(i) < len(lhs))
  out = shapes(ins.type)[0][1] if shapes(ins.type) else ()
  return 2.0 * math.prod(out) * k


def _dot_flops(ins: Instr, types: dict) -> float:
  """2 * output elements * contracted size of a dot (a convolution: its real multiply-adds)."""
  out = shapes(ins.type)
  if not out or not ins.operands:
    return 0.0
  lhs = shapes(types.get(ins.operands[0], ""))
  if not lhs:
    return 0.0
  if ins.opcode == "dot":
    m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
    idx = [int(i) for i in m.group(1).split(",") if i] if m else []
    k = math.prod(lhs[0][1][i] for i in idx if i < len(lhs[0][1]))
  else:  # convolution: the window positions that meet input (libtpu's dots: nanotext/hlo_conv.py)
    rhs = shapes(types.get(ins.operands[1], "")) if len(ins.operands) > 1 else []
    return conv_flops(ins.attrs, lhs[0][1], rhs[0][1], out[0][1]) if rhs else 0.0
  return 2.0 * math.prod(out[0][1]) * k


def _fusion_bytes(ins: Instr, operand_types, called, results: str = "") -> tuple:
  """(bytes a fusion moves, the types it touches whole): its result (`results` where that is not
  the whole of its type: a wrapped cuBLAS call's workspace) and what it reads of each operand (an
  operand only sliced or gathered from inside, maybe after a convert, counts what is picked, at
  the operand's width; each output that updates a buffer in place counts its update twice)."""
  root = next((i for i in called if i.root), called[-1] if called else None)
  outs = [] if root is None else list(root.operands) if root.opcode == "tuple" else [root.name]
  # The buffers its outputs (a multi-output fusion's tuple elements) update in place, each's update
  dus = {i.operands[0]: i for i in called if i.name in outs and i.opcode == "dynamic-update-slice"}
  params = {i.name: int(i.args) for i in called if i.opcode == "parameter" and i.name not in dus}
  types = {i.name: i.type for i in called}
  users = {}
  for i in called:
    for o in i.operands:
      users.setdefault(o, []).append(i)
  read, touched = 0.0, []
  for pname, index in params.items():
    picked = _picked(pname, users, types)
    if picked is None:
      touched.append(operand_types[index] if index < len(operand_types) else "")
      read += shape_bytes(touched[-1])
    else:
      read += picked
  if dus:  # the other outputs whole, each update twice (read and written), not its buffer
    updates = [types.get(u.operands[1], "") for u in dus.values()]
    whole = [types.get(o, "") for o in outs if o not in {u.name for u in dus.values()}]
    written, touched = sum(map(shape_bytes, whole + 2 * updates)), touched + whole + updates
  else:
    results = results or ins.type
    written, touched = shape_bytes(results), touched + [results]
  return read + written, touched


_VIEWS = ("convert", "bitcast", "reshape", "copy", "bitcast-convert")


def _picked(name: str, users: dict, types: dict, scale: float = 1.0):
  """Bytes read of value `name` when every use only slices or gathers from it (through views);
  None when some use reads it whole. `scale`: bytes in memory per byte of `name`'s type (a
  slice of a bfloat16 parameter converted to float32 inside the fusion reads half its size)."""
  total = 0.0
  for u in users.get(name, []) or [None]:
    if u is None:
      return None
    if u.opcode in ("slice", "dynamic-slice", "gather") and u.operands[0] == name:
      total += shape_bytes(u.type) * scale
    elif u.opcode in _VIEWS:
      if u.opcode == "convert":  # the bytes in memory stay the source's width
        src, dst = shapes(types.get(name, ""))[:1], shapes(u.type)[:1]
        if src and dst:
          scale *= dtype_bytes(src[0][0]) / dtype_bytes(dst[0][0])
      sub = _picked(u.name, users, types, scale)
      if sub is None:
        return None
      total += sub
    else:
      return None
  return total
