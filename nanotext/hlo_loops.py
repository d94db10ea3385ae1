"""The trip count of a compiled while loop where its backend config does not state it.

XLA's GPU compiler writes known_trip_count into a counted loop's backend config; libtpu writes
none (the micro-batch loop of train.grad_accum, a scan over layers), so a reader that counts
such a body once prices a grad_accum=4 step at a quarter of its work. jax's scan and fori_loop
compile to one pattern, read here: a carried counter starts at a constant, the body adds a
constant, the condition compares it with a constant.
"""

import re


def loops(comps: dict) -> list:
  """[(name, trips, stated)] of every while loop of parsed HLO (nanotext.hlo.parse): its trip
  count (0 where nothing says) and whether its backend config states it (XLA's cost analysis
  counts a body once where it does not)."""
  return [(w.name, trip_count(w, instrs, comps), "known_trip_count" in w.config())
          for instrs in comps.values() for w in instrs if w.opcode == "while"]


_FLIP = {"LT": "GT", "LE": "GE", "GT": "LT", "GE": "LE", "NE": "NE"}


def trip_count(ins, instrs: list, comps: dict) -> int:
  """How many times while loop `ins` (an instruction of `instrs`) runs its body: its backend
  config's known_trip_count, else the counted loop jax's scan and fori_loop compile to (tuple
  element k starts at a constant, the body adds a constant to it, the condition compares it with
  a constant); 0 where neither says."""
  n = ins.config().get("known_trip_count", {}).get("n")
  if n is not None:
    return int(n)
  cond, body = comps.get(ins.attr("condition"), []), comps.get(ins.attr("body"), [])
  by, c_by, b_by = ({i.name: i for i in c} for c in (instrs, cond, body))
  root = _source(next((i for i in cond if i.root), None), c_by)
  direction = re.search(r"direction=(\w+)", root.attrs) if root else None
  if root is None or root.opcode != "compare" or not direction or len(root.operands) != 2:
    return 0
  sides = [_source(c_by.get(o), c_by) for o in root.operands]
  op = direction.group(1)
  if _constant(sides[0]) is not None:  # N > i is i < N
    sides, op = sides[::-1], _FLIP.get(op, "")
  k, limit = _element(sides[0], c_by), _constant(sides[1])
  init = _source(by.get(ins.operands[0] if ins.operands else ""), by)
  b_root = _source(next((i for i in body if i.root), None), b_by)
  if k is None or limit is None or init is None or init.opcode != "tuple" or b_root is None \
      or b_root.opcode != "tuple" or k >= min(len(init.operands), len(b_root.operands)):
    return 0
  start = _constant(_source(by.get(init.operands[k]), by))
  step = _source(b_by.get(b_root.operands[k]), b_by)
  if start is None or step is None or step.opcode != "add" or len(step.operands) != 2:
    return 0
  terms = [_source(b_by.get(o), b_by) for o in step.operands]
  if _element(terms[0], b_by) != k:
    terms = terms[::-1]
  inc = _constant(terms[1])
  if _element(terms[0], b_by) != k or not inc or inc < 0:
    return 0
  end = {"LT": limit, "LE": limit + 1, "NE": limit if inc == 1 else None}.get(op)
  return max(0, -(-(end - start) // inc)) if end is not None else 0


def _source(ins, by: dict):
  """The instruction a value comes from through copies, bitcasts and reshapes."""
  while ins is not None and ins.opcode in ("copy", "bitcast", "reshape") and ins.operands:
    ins = by.get(ins.operands[0])
  return ins


def _constant(ins):
  """The integer a scalar constant holds, None for anything else."""
  if ins is None or ins.opcode != "constant":
    return None
  try:
    return int(ins.args.strip())
  except ValueError:
    return None


def _element(ins, by: dict):
  """k where `ins` is element k of the computation's parameter (a loop's carried tuple)."""
  if ins is None or ins.opcode != "get-tuple-element" or not ins.operands:
    return None
  param = by.get(ins.operands[0])
  m = re.search(r"\bindex=(\d+)", ins.attrs)
  return int(m.group(1)) if m and param is not None and param.opcode == "parameter" else None


def runs(comps: dict, entry: str) -> dict:
  """{computation: how many times one step runs it} of parsed HLO, from `entry` down: a while
  body its trip count times (unknown: once), its condition once more, a conditional's first
  branch (as nanotext.hlo.kernels), whatever else an instruction calls as often as it runs."""
  out = {}

  def walk(name: str, times: int) -> None:
    out[name] = out.get(name, 0) + times
    instrs = comps.get(name, [])
    for ins in instrs:
      if ins.opcode == "while":
        trips = trip_count(ins, instrs, comps) or 1
        walk(ins.attr("body"), times * trips)
        walk(ins.attr("condition"), times * (trips + 1))
      elif ins.opcode == "conditional":
        first = re.search(r"(?:branch_computations=\{|true_computation=)%?([\w.\-]+)", ins.attrs)
        walk(first.group(1), times) if first else None
      else:
        for callee in re.findall(r"\b(?:calls|to_apply)=%?([\w.\-]+)", ins.attrs):
          walk(callee, times)
  if entry:
    walk(entry, 1)
  return out
