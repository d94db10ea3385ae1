"""What a compiled program holds at once: a live-range walk over its scheduled HLO (the entry
computation in the order XLA runs it), to read where a program's memory goes (`nanotext.compile
--peak`). A reading aid, not the compiler's figure: it sees neither how buffer assignment packs
buffers nor its fragmentation, so the compiler's temporaries are usually larger."""

import dataclasses
import math
import re

from nanotext import hlo

# Values that are other values' buffers: views, tuples, loop state, the end of an async pair.
_ALIASES = {"bitcast", "get-tuple-element", "tuple", "opt-barrier", "while", "call",
            "conditional", "add-dependency", "domain"}
_VIEWS = {"bitcast", "get-tuple-element", "tuple"}
_NOT_TEMPORARY = {"parameter", "constant", "after-all", "partition-id", "replica-id"}
_SPACE = re.compile(r"\bS\((\d+)\)")
_TILED = re.compile(r"\s*([a-z]+[0-9][a-z0-9]*|pred)\[([0-9,]*)\]\{([0-9,]*):T\(([0-9,]+)\)")
ROWS = 8  # values listed by nanotext.compile --peak


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One value alive at the peak."""
  bytes: int
  opcode: str
  type: str
  op_name: str  # the jax op that made it (metadata), '' if none


def peak(text: str) -> tuple:
  """(bytes, [Buffer] largest first, adding up to bytes) of the most the entry computation of
  scheduled HLO `text` holds at once, beyond its arguments; a loop, call or branch adds its
  body's own peak while it runs, and an instruction its unread outputs (scratch, such as a
  cuBLAS workspace): each a row of its own."""
  comps, entry = hlo.parse(text)
  return _peak(comps, entry, {})


def record(text: str) -> tuple:
  """(peak bytes, [[bytes, opcode, jax op], ...] of the ROWS largest values alive there): what
  nanotext.compile --peak keeps in a program's JSON record."""
  top, alive = peak(text)
  return top, [[b.bytes, b.opcode, b.op_name] for b in alive[:ROWS]]


def lines(top: int, rows: list, gib) -> list:
  """The lines nanotext.compile --peak prints for `record`'s values (`gib` formats bytes), the
  values beyond them as one line: they add up to the peak."""
  rest = top - sum(b for b, _, _ in rows)
  return [f"  alive at the peak  {gib(top)} by a walk of the schedule (buffer assignment's "
          "packing not seen), largest first:"] + \
      [f"    {gib(b):>10}  {op:<14} {name or '(no jax op)'}" for b, op, name in rows] + \
      [f"    {gib(rest):>10}  {'':<14} (the other values alive)"] * (rest > 0)


def _elements(type_: str) -> list:
  """The top-level element types of a tuple type ([type_] for an array)."""
  if not type_.startswith("("):
    return [type_]
  out, depth, start = [], 0, 1
  for i, c in enumerate(type_):
    depth += c in "([{"
    depth -= c in ")]}"
    if (c == "," and depth == 1) or (c == ")" and depth == 0):
      out.append(type_[start:i].strip())
      start = i + 1
  return [t for t in out if t]


def _device_bytes(type_: str) -> int:
  """Bytes of an array type in the device's main memory: 0 for one a TPU keeps on chip (its
  layout names a memory space, `S(1)`: VMEM; the compiler's HBM figures leave those out), and
  a TPU's as its layout's tile pads it (`{3,1,2,0:T(8,128)}`: the minor dimension to 128, the next
  to 8; a d_model 64 model's v5e eval walked to 2.39 GiB unpadded, 5.21 padded, compiled 5.50)."""
  space = _SPACE.search(type_)
  if space and space.group(1) != "0":
    return 0
  m = _TILED.match(type_)
  if not m:
    return hlo.shape_bytes(type_)
  dims = [int(d) for d in m.group(2).split(",") if d]
  order = [int(d) for d in m.group(3).split(",") if d]
  tile = [int(t) for t in m.group(4).split(",")][::-1]  # minor first
  for axis, t in zip(order, tile):
    dims[axis] = -(-dims[axis] // t) * t
  return int(math.prod(dims) * hlo.dtype_bytes(m.group(1)))


def _buffers(ins) -> dict:
  """{(name, index): bytes} of the buffers `ins` allocates (one per tuple element; an async
  start's operands are not new, its result is)."""
  parts = _elements(ins.type)
  if ins.opcode.endswith("-start") and len(parts) > 1:
    sizes = [_device_bytes(t) for t in parts]
    k = max(range(len(parts)), key=sizes.__getitem__)
    return {(ins.name, k): sizes[k]}
  return {(ins.name, k): _device_bytes(t) for k, t in enumerate(parts)}


def _in_place(ins, comps) -> int:
  """1 + the operand a dynamic-update-slice (alone, or the root of a fusion) writes into, 0 if
  `ins` is no such update."""
  if ins.opcode == "dynamic-update-slice":
    return 1
  if ins.opcode != "fusion":
    return 0
  body = comps.get(ins.attr("calls"), [])
  root = next((i for i in body if i.root), None)
  if root is None or root.opcode != "dynamic-update-slice":
    return 0
  target = next((i for i in body if i.name == root.operands[0]), None)
  if target is None or target.opcode != "parameter":
    return 0
  k = int(target.args.strip() or 0)
  return k + 1 if k < len(ins.operands) else 0


def _inner(comps, ins, memo) -> tuple:
  """(peak, computation) of what `ins` runs inside it (loop body, called computation, largest
  branch); (0, '') where it runs nothing."""
  names = []
  if ins.opcode == "while":
    names = [ins.attr("body")]
  elif ins.opcode == "call":
    names = [ins.attr("to_apply")]
  elif ins.opcode == "conditional":
    names = hlo.branches(ins)
  return max(((_peak(comps, n, memo)[0], n) for n in names if n in comps), default=(0, ""))


def _peak(comps, name, memo) -> tuple:
  if name in memo:
    return memo[name]
  memo[name] = (0, [])  # a computation that (oddly) reaches itself counts nothing more
  instrs = comps.get(name, [])
  owners, made, sizes = {}, {}, {}  # value -> buffers it is; buffer -> instr; buffer -> bytes
  for ins in instrs:
    if ins.opcode == "get-tuple-element" and ins.operands and ins.operands[0] in made:
      k = int(ins.attr("index") or 0)  # one element of a multi-output instruction
      owners[ins.name] = {(ins.operands[0], k)}
    elif ins.opcode in _ALIASES or ins.opcode.endswith("-done"):
      owners[ins.name] = set().union(*(owners.get(o, set()) for o in ins.operands))
    elif k := _in_place(ins, comps):  # writes into the buffer it updates
      owners[ins.name] = set(owners.get(ins.operands[k - 1], ()))
    elif ins.opcode in _NOT_TEMPORARY:
      owners[ins.name] = set()
    else:
      new = _buffers(ins)
      owners[ins.name], made[ins.name] = set(new), ins
      sizes.update(new)
  last = {}
  for i, ins in enumerate(instrs):
    if ins.opcode in _VIEWS:
      continue  # a view reads nothing: its readers read its buffers (one tuple element, say)
    for o in ins.operands:
      for b in owners.get(o, ()):
        last[b] = i
  for ins in instrs:
    if ins.root:  # the outputs live to the end
      for b in owners.get(ins.name, ()):
        last[b] = len(instrs)
  dies = {}
  for b, i in last.items():
    dies.setdefault(i, []).append(b)
  alive, live, best, at = {}, 0, 0, {}
  for i, ins in enumerate(instrs):
    scratch = 0  # elements nothing reads (a cuBLAS workspace): alive while `ins` runs
    name = hlo.op_name(ins, jit=True)
    if ins.name in made:
      for b in owners[ins.name]:
        if b not in last:
          scratch += sizes[b]
          continue
        if not sizes[b]:
          continue  # on chip
        alive[b] = Buffer(sizes[b], ins.opcode, _elements(ins.type)[b[1]],
                          name)
        live += sizes[b]
    inner, body = _inner(comps, ins, memo)
    if live + scratch + inner > best:  # what runs now is listed too, so the rows add up
      op = name or ins.name
      best, at = live + scratch + inner, dict(alive)
      if scratch:
        at["scratch"] = Buffer(scratch, ins.opcode, "", f"workspace of {op} (never read)")
      if inner:
        at["inner"] = Buffer(inner, ins.opcode, "", f"peak inside {body} ({op})")
    for b in dies.get(i, ()):
      if b in alive:
        live -= alive.pop(b).bytes
  memo[name] = (best, sorted(at.values(), key=lambda b: -b.bytes))
  return memo[name]
