"""What a compiled program's HLO text says: collectives by kind, with their bytes."""

import math
import re

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
                "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
                "c64": 8, "c128": 16}
_SHAPE_RE = re.compile(r"\b([a-z]+[0-9][a-z0-9]*|pred)\[([0-9,]*)\]")
_OP_RE = re.compile(r"=\s*([^=]*?)\s(" + "|".join(COLLECTIVES) + r")(-start|-done)?\(")
_COMMENT_RE = re.compile(r"/\*.*?\*/")


def shape_bytes(text: str) -> int:
  """Bytes of every array shape in an HLO type string, e.g. '(f32[64,128]{1,0}, bf16[8])'."""
  total = 0
  for dtype, dims in _SHAPE_RE.findall(text):
    n = math.prod(int(d) for d in dims.split(",") if d)
    total += n * _DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
  return int(total)


def collectives(hlo_text: str) -> dict:
  """{op: {'count', 'bytes'}} for each collective in HLO text; bytes are per-device results.

  An async pair counts once: `-start` adds to the count and its `-done` (whose type is exactly
  the result, while the start's tuple also holds the operands) adds the bytes.
  """
  out = {op: {"count": 0, "bytes": 0} for op in COLLECTIVES}
  for line in hlo_text.splitlines():
    m = _OP_RE.search(_COMMENT_RE.sub("", line))  # long tuples carry /*index=5*/ comments
    if not m:
      continue
    result, op, suffix = m.groups()
    if suffix != "-done":
      out[op]["count"] += 1
    if suffix != "-start":
      out[op]["bytes"] += shape_bytes(result)
  return out
