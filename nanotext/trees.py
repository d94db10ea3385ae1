"""Generic helpers for parameter trees: dotted flat names, scan-stacked blocks, filling a template.

A low module: it imports nothing from nanotext but `errors`, so checkpoint, convert and generate
can all lean on it without importing one another.
"""

import jax
import numpy as np

from nanotext.errors import UserError


def path_name(path) -> str:
  """'blocks.0.attn.q.kernel' for a pytree key path (dict keys may be ints or strings; a
  namedtuple's field is its name, as a saved tree's metadata keys it)."""
  return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def shapes(tree) -> dict:
  """{path_name: shape} of a tree's leaves: a saved tree's metadata and the live tree alike."""
  return {path_name(p): tuple(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def flatten(params) -> dict:
  """Parameter tree -> {dotted name: array}."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return {path_name(p): v for p, v in leaves}


def int_keys(tree):
  """A restored tree in the model's key types: saved trees key an nnx.List's items by strings
  ('0', '1', '10', ...), the model's tree by ints in order, so each dict whose keys are all
  digit strings is keyed by ints, in numeric order (merged by position, string order would
  permute 11 or more layers)."""
  if not isinstance(tree, dict):
    return tree
  if tree and all(isinstance(k, str) and k.isdigit() for k in tree):
    return {int(k): int_keys(tree[k]) for k in sorted(tree, key=int)}
  return {k: int_keys(v) for k, v in tree.items()}


def is_stacked(flat: dict) -> bool:
  """Whether flat names hold model.scan_layers blocks ('blocks.mlp.fc.kernel' [L, ...]) rather
  than one layer each ('blocks.0.mlp.fc.kernel')."""
  return any(n.startswith("blocks.") and not n.split(".")[1].isdigit() for n in flat)


def unstack_blocks(flat: dict) -> dict:
  """Stacked 'blocks.*' arrays [L, ...] as one 'blocks.{i}.*' array per layer."""
  out = {}
  for name, value in flat.items():
    if name.startswith("blocks."):
      out.update({f"blocks.{i}.{name[7:]}": value[i] for i in range(value.shape[0])})
    else:
      out[name] = value
  return out


def stack_blocks(flat: dict, num_layers: int | None = None) -> dict:
  """Inverse of `unstack_blocks`; every name needs layers 0 .. num_layers - 1 (by default as
  many as the deepest one has)."""
  out, layers = {}, {}
  for name, value in flat.items():
    if name.startswith("blocks."):
      i, rest = name[7:].split(".", 1)
      layers.setdefault(rest, {})[int(i)] = value
    else:
      out[name] = value
  n = num_layers if num_layers is not None else \
      max((max(b) + 1 for b in layers.values()), default=0)
  for rest, by_layer in layers.items():
    if sorted(by_layer) != list(range(n)):
      raise UserError(f"blocks.*.{rest}: layers {sorted(by_layer)} cannot stack into "
                      f"model.num_layers={n} (model.scan_layers=true)")
    out[f"blocks.{rest}"] = np.stack([np.asarray(by_layer[i]) for i in range(n)])
  return out


def fill(template, flat: dict, what: str, cast: bool = True):
  """A tree shaped like `template` (ShapeDtypeStructs with shardings) holding `flat`'s arrays,
  cast to the template's dtypes unless `cast` is false.

  Every template leaf must have a value of its shape and every value must be used, so a mapping
  that drifts from the model fails loudly instead of training on half-initialised weights.
  """
  flat = dict(flat)
  def one(path, sds):
    name = path_name(path)
    if name not in flat:
      raise UserError(f"{what} has no value for nanotext parameter '{name}' {tuple(sds.shape)}")
    value = np.asarray(flat.pop(name))
    if value.shape != tuple(sds.shape):
      raise UserError(f"{what}: '{name}' has shape {value.shape}, the nanotext model expects "
                      f"{tuple(sds.shape)}")
    return jax.device_put(cast_checked(value, sds.dtype, name, what) if cast else value,
                          getattr(sds, "sharding", None))
  out = jax.tree_util.tree_map_with_path(one, template)
  if flat:
    raise UserError(f"{what}: parameters with no place in the nanotext model: "
                    f"{', '.join(sorted(flat)[:5])}")
  return out


def beyond_range(value, dtype) -> bool:
  """Whether a cast of the array `value` (numpy or jax) to the float `dtype` makes a finite value
  infinite (float64 into float32, float32 into bfloat16, bfloat16 or int32 into float16)."""
  return _narrows(value.dtype, dtype) and _overflowed(value, _cast(value, dtype))


def cast_checked(value, dtype, name: str, what: str):
  """`value` cast to `dtype`; a UserError naming parameter `name` (of `what`) where a finite
  value turned infinite."""
  cast = _cast(value, dtype)
  if _narrows(value.dtype, dtype) and _overflowed(value, cast):
    raise UserError(f"{what}: '{name}' holds values beyond {np.dtype(dtype)}'s range, which would "
                    f"be read as infinite; give values {np.dtype(dtype)} holds")
  return cast


def _cast(value, dtype):
  with np.errstate(over="ignore"):  # the overflow is looked for after
    return value.astype(dtype)


def _narrows(source, target) -> bool:
  """Whether `source` holds finite values beyond the largest of the float dtype `target`."""
  if not jax.numpy.issubdtype(target, jax.numpy.floating):
    return False
  info = jax.numpy.finfo if jax.numpy.issubdtype(source, jax.numpy.floating) else jax.numpy.iinfo
  return bool(jax.numpy.issubdtype(source, jax.numpy.number)) and \
      float(info(source).max) > float(jax.numpy.finfo(target).max)


def _overflowed(value, cast) -> bool:
  """Whether `cast`, `value` in a float dtype of a smaller range, holds an infinity `value` does
  not."""
  if isinstance(value, jax.Array):  # sharded, perhaps over processes: reduced where it lies
    return bool(_new_infinities(value, cast))
  return bool((np.isinf(cast) & np.isfinite(value)).any())


@jax.jit
def _new_infinities(value, cast):
  return (jax.numpy.isinf(cast) & jax.numpy.isfinite(value)).any()
