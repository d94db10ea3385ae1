"""The multiply-adds of a compiled convolution, counting only the window positions that meet input.

XLA's TPU compiler writes some dots as convolutions whose window stands in for a batch dimension:
the input dilated by the window's size (`lhs_dilate=8x4`, attention's batch and heads) or padded
on both sides by one less than it (`size=64 pad=63_63`), so that most window positions land on a
hole or on padding. Counting each output element times its whole kernel counts those too, the
batch times over; here, as in XLA's cost analysis, a position counts only where it reads a real
input element.
"""

import math
import re


def conv_flops(attrs: str, lhs: tuple, rhs: tuple, out: tuple) -> float:
  """2 x the multiply-adds of a convolution: its output's batch and feature elements x the kernel's
  input features x, per spatial dimension, the (output, window) position pairs that read real
  input. `attrs`: its attribute text (window, dim_labels); `lhs`, `rhs`, `out`: the dims of its
  input, kernel and result."""
  m = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", attrs)
  if not m or [len(d) for d in m.groups()] != [len(lhs), len(rhs), len(out)] \
      or "i" not in m.group(2):
    return 0.0
  ls, ks, os_ = m.groups()
  spatial = sorted((c for c in ks if c.isdigit()), key=int)
  w = re.search(r"window=\{([^}]*)\}", attrs)
  fields = dict(f.split("=", 1) for f in w.group(1).split() if "=" in f) if w else {}

  def field(key: str, d: int, default: str) -> str:
    values = fields.get(key, "").split("x")
    return values[d] if d < len(values) and values[d] else default
  pairs = 1
  for d, s in enumerate(spatial):
    stride, low = int(field("stride", d, "1")), int(field("pad", d, "0_0").split("_")[0])
    pairs *= _pairs(lhs[ls.index(s)], rhs[ks.index(s)], out[os_.index(s)], stride, low,
                    int(field("lhs_dilate", d, "1")), int(field("rhs_dilate", d, "1")))
  rest = math.prod(n for c, n in zip(os_, out) if not c.isdigit())
  return 2.0 * rest * rhs[ks.index("i")] * pairs


def _pairs(n: int, size: int, out: int, stride: int, low: int, lhs_dilate: int,
           rhs_dilate: int) -> int:
  """How many (output, window) position pairs of one spatial dimension read a real input element:
  output o and window k read position o * stride + k * rhs_dilate - low of the input dilated by
  lhs_dilate, real where it is a multiple of lhs_dilate within (n - 1) * lhs_dilate."""
  if min(n, size, out, stride, lhs_dilate, rhs_dilate) <= 0:
    return 0
  period = lhs_dilate // math.gcd(stride, lhs_dilate)  # of the o whose input is on the grid
  total = 0
  for k in range(size):
    b = k * rhs_dilate - low
    first, last = max(0, -(b // stride)), min(out - 1, ((n - 1) * lhs_dilate - b) // stride)
    on = next((o for o in range(first, first + period) if (o * stride + b) % lhs_dilate == 0),
              None)
    total += len(range(on, last + 1, period)) if on is not None else 0
  return total
