"""Parameter init draws: the keys in creation order, each parameter's normal or uniform draw, and
`build`, which makes a model's draws as one threefry call over all of them.

XLA compiles a threefry draw (about 13 CPU kernels) for each distinct parameter shape: most of a
small model's init program (benchmarks/RESULTS.md, "Init draws in one threefry call"). `build`
traces the model once abstractly to learn its draws, makes them all at once (the same bits:
element i of a partitionable threefry draw depends only on its key and i) and builds the model
again from them. The values equal jax.random's in a compiled init, bit for bit
(tests/test_draws.py).
"""

import contextvars
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend.random import threefry2x32_p

# The draw is made whole on every device (it is not sharded like the parameters it fills), so
# models above this many drawn elements (the 124M-parameter speedrun's) draw each parameter.
MAX_FLAT = 2**26

_mode = contextvars.ContextVar("nanotext_draws", default=None)


class Keys:
  """Parameter init keys in creation order, nnx.Rngs(key)'s sequence (fold_in(key, 0), 1, ...)
  with its count a Python int. Under tracing (a model built in eval_shape or jit) nnx.Rngs
  stores a traced count per parameter, and flax's store looks up the tracer's `sharding`: an
  AttributeError whose message JAX formats from the traced program (the record's 12-layer model
  built in 0.18 s with it, 0.13 s without; benchmarks/build_time.py)."""

  def __init__(self, key):
    self.key, self.count = key, 0

  def params(self):
    key = jax.random.fold_in(self.key, self.count)
    self.count += 1
    return key

  def split(self) -> nnx.Rngs:
    """An nnx.Rngs at this point of the sequence, for nnx.split_rngs, which takes one key from
    it (counted here) and splits it."""
    rngs = nnx.Rngs(self.key)
    rngs.default.count.set_value(jnp.full(rngs.default.count.shape, self.count, jnp.uint32))
    self.count += 1
    return rngs


def draw(rngs, shape, std: float, dtype, dist: str):
  """std-normal or uniform(+-sqrt(3) std) values of `shape`: drawn now, or, inside `build`, the
  draw it made for this parameter (a Keys' parameter; nnx.Rngs' are drawn in place)."""
  mode = _mode.get()
  if mode is None or not isinstance(rngs, Keys):
    return direct(rngs.params(), shape, std, dtype, dist)
  spec = (rngs.count, tuple(shape), float(std), jnp.dtype(dtype).name, dist)
  rngs.count += 1
  return mode(spec)


def direct(key, shape, std: float, dtype, dist: str):
  """One parameter's draw with jax.random."""
  if dist == "uniform":
    bound = np.sqrt(3.0) * std
    return jax.random.uniform(key, shape, minval=-bound, maxval=bound).astype(dtype)
  return (std * jax.random.normal(key, shape)).astype(dtype)


def build(make, key):
  """make(Keys(key)), its Keys draws made as one threefry call (the model jax.random's draws
  would build, bit for bit)."""
  specs = []

  def record(spec):
    specs.append(spec)
    return jnp.zeros(spec[1], spec[3])
  token = _mode.set(record)
  try:
    nnx.eval_shape(lambda: make(Keys(key)))  # nothing drawn, nothing kept but `specs`
  finally:
    _mode.reset(token)
  if not specs or sum(math.prod(s[1]) for s in specs) > MAX_FLAT or not _flat_bits_agree(key):
    return make(Keys(key))
  values = iter(_flat(jax.random.key_data(key), tuple(specs)))

  def replay(spec):
    value = next(values)
    assert value.shape == spec[1] and value.dtype == spec[3], (value.shape, spec)
    return value
  token = _mode.set(replay)
  try:
    return make(Keys(key))
  finally:
    _mode.reset(token)


def _flat_bits_agree(key) -> bool:
  """Whether a flat draw gives jax.random's bits: a threefry key, partitionable counters."""
  return jax.config.jax_threefry_partitionable and \
      str(jax.random.key_impl(key)) == "threefry2x32"


@jax.jit(static_argnums=1)
def _flat(key_data, specs):
  """Every spec's (count, shape, std, dtype, dist) draw from one threefry call."""
  key = jax.random.wrap_key_data(key_data, impl="threefry2x32")
  counts = jnp.asarray([s[0] for s in specs], jnp.uint32)
  keys = jax.vmap(lambda c: jax.random.key_data(jax.random.fold_in(key, c)))(counts)
  order = sorted(range(len(specs)), key=lambda i: specs[i][4] != "normal")  # normals first
  sizes = [math.prod(specs[i][1]) for i in order]
  k1, k2 = (jnp.concatenate([jnp.broadcast_to(keys[i, j], (n,)) for i, n in zip(order, sizes)])
            for j in (0, 1))
  counter = jnp.concatenate([jax.lax.iota(jnp.uint32, n) for n in sizes])
  hi, lo = threefry2x32_p.bind(k1, k2, jnp.zeros_like(counter), counter)
  bits = hi ^ lo
  normals = sum(n for i, n in zip(order, sizes) if specs[i][4] == "normal")
  # jax.random.normal is sqrt(2) erfinv(u), u uniform in (-1, 1); XLA folds its sqrt(2) and
  # init's std into one float32 constant, so the product is rounded once, here as there.
  erfinv = jax.lax.erf_inv(_uniform(bits[:normals], np.nextafter(np.float32(-1), np.float32(0)), 1))
  out, offset = [None] * len(specs), 0
  for i, n in zip(order, sizes):
    _, shape, std, dtype, dist = specs[i]
    if dist == "normal":
      value = erfinv[offset:offset + n] * (np.float32(np.sqrt(2)) * np.float32(std))
    else:
      bound = np.float32(np.sqrt(3.0) * std)
      value = _uniform(bits[offset:offset + n], -bound, bound)
    out[i] = value.reshape(shape).astype(dtype)
    offset += n
  return out


def _uniform(bits, lo, hi):
  """float32 in [lo, hi) from 32 random bits, as jax.random.uniform makes them: 23 of the bits
  as the mantissa of a float in [1, 2)."""
  lo, hi = jnp.float32(lo), jnp.float32(hi)
  one = jax.lax.bitcast_convert_type(
      jax.lax.shift_right_logical(bits, jnp.uint32(9)) | jnp.uint32(0x3F800000), jnp.float32)
  return jnp.maximum(lo, (one - jnp.float32(1)) * (hi - lo) + lo)
