"""Checksums of a checkpoint's arrays: computed on the devices where the arrays are, saved as a
step's `integrity` item, compared on every restore (truncated files, bytes overwritten in place)."""

import json
import os

import jax
import jax.numpy as jnp

from nanotext.errors import UserError


class Damaged(UserError):
  """A checkpoint step that does not restore or does not match its checksums."""


def _words(x):
  """x's bits as uint32, elementwise (so a sharded array stays sharded: no gather)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = x.dtype.itemsize
  if size == 4:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  if size in (1, 2):
    small = jax.lax.bitcast_convert_type(x, jnp.uint8 if size == 1 else jnp.uint16)
    return small.astype(jnp.uint32)
  w = jax.lax.bitcast_convert_type(x, jnp.uint32)  # 8 bytes: [..., 2] words
  return w[..., 0] ^ (w[..., 1] * jnp.uint32(0x9E3779B1))


def _pair(x):
  """Two position-weighted uint32 sums of x's bits: any changed byte changes the first."""
  w = _words(x)
  i = jnp.zeros(w.shape, jnp.uint32)
  stride = 1
  for d in reversed(range(w.ndim)):
    i = i + jax.lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride % 2**32)
    stride *= w.shape[d]
  # Sums wrap modulo 2**32 in any order, so a sharded reduction gives the same bits everywhere.
  a = jnp.sum(w * (2 * i + 1), dtype=jnp.uint32)
  b = jnp.sum(((w << 7) | (w >> 25)) ^ (i * jnp.uint32(0x9E3779B1)), dtype=jnp.uint32)
  return jnp.stack([a, b])


_pairs = jax.jit(lambda leaves: [_pair(x) for x in leaves])


def name_of(path) -> str:
  """'params/blocks/0/attn/q/kernel' for a key path (saved trees key list items by strings)."""
  return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def checksums(tree) -> dict:
  """{array name: 16 hex digits}, computed on the devices where the arrays already are."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  values = jax.device_get(_pairs([jnp.asarray(x) for _, x in flat]))
  return {name_of(p): f"{int(v[0]):08x}{int(v[1]):08x}" for (p, _), v in zip(flat, values)}


def verify(tree, integrity, where: str, prefix: str = "") -> None:
  """Raise Damaged unless every array of `tree` matches the checksum saved with it."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  verify_named({prefix + name_of(p): x for p, x in flat}, integrity, where)


def verify_named(arrays: dict, integrity, where: str) -> None:
  """verify() of {saved name: array}. With checksums saved, an array they do not list is
  damaged too (a record edited or from another tree checked nothing and said intact)."""
  if integrity is None or not arrays:  # a step written before checksums existed: none to compare
    return
  saved = integrity.get("checksums") if isinstance(integrity, dict) else None  # '[1]': edited
  if not isinstance(saved, dict) or not saved:  # emptied, or edited: it checked nothing, "intact"
    raise Damaged(f"checkpoint '{where}' is damaged: its integrity record lists no checksums")
  unlisted = [k for k in arrays if k not in saved]
  if unlisted:
    more = f" and {len(unlisted) - 1} more" if len(unlisted) > 1 else ""
    raise Damaged(f"checkpoint '{where}' is damaged: array {unlisted[0]}{more} has no checksum "
                  "saved with it")
  values = jax.device_get(_pairs([jnp.asarray(x) for x in arrays.values()]))
  got = {k: f"{int(v[0]):08x}{int(v[1]):08x}" for k, v in zip(arrays, values)}
  bad = [k for k, v in got.items() if saved[k] != v]
  if bad:
    more, verb = (f" and {len(bad) - 1} more", "do") if len(bad) > 1 else ("", "does")
    raise Damaged(f"checkpoint '{where}' is damaged: array {bad[0]}{more} {verb} not match the "
                  "checksum saved with it")


def record_of_params_only(folder: str):
  """The integrity record of a params-only folder: its convert.json's checksums of params/
  (None: a folder written before they existed, or a convert.json that cannot say)."""
  try:
    with open(os.path.join(folder, "convert.json"), encoding="utf-8") as f:
      record = json.load(f)
    return {"checksums": record["checksums"]} if "checksums" in record else None
  except (OSError, ValueError, TypeError):
    return None


def require_listed(step_dir: str) -> None:
  """Raise Damaged when the step's orbax metadata names an `integrity` item whose folder is gone:
  a step saved with checksums that lost them, not one written before checksums existed."""
  if os.path.isdir(os.path.join(step_dir, "integrity")):
    return
  try:
    with open(os.path.join(step_dir, "_CHECKPOINT_METADATA"), encoding="utf-8") as f:
      handlers = json.load(f).get("item_handlers")
  except (OSError, ValueError, AttributeError):  # no metadata to say: treated as an older step
    return
  if isinstance(handlers, dict) and "integrity" in handlers:
    raise Damaged(f"checkpoint '{step_dir}' is damaged: its integrity/ folder (the checksums "
                  "it was saved with) is gone")


def record_beside(item: str):
  """The integrity record of the step whose `state` item is `item`: None for a step written
  before records existed (no integrity/ folder), {} (no checksums: damaged) for one unreadable."""
  require_listed(os.path.dirname(item))
  folder = os.path.join(os.path.dirname(item), "integrity")
  try:
    with open(os.path.join(folder, "metadata")) as f:
      record = json.load(f)
    return record if isinstance(record, dict) else {}
  except (OSError, ValueError):
    return {} if os.path.isdir(folder) else None
