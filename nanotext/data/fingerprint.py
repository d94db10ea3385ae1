"""The training data's fingerprint: names, sizes and a cheap hash of the files its source reads,
saved with every checkpoint, so a resume on data that changed is noticed."""

import os
import zlib

from nanotext.data import registry
from nanotext.errors import UserError


def _cheap_hash(path: str, size: int, chunk: int = 1 << 16) -> str:
  """crc32 of a file's first and last 64 KiB: catches replaced shards without reading them all."""
  with open(path, "rb") as f:
    crc = zlib.crc32(f.read(chunk))
    if size > chunk:
      f.seek(max(chunk, size - chunk))
      crc = zlib.crc32(f.read(chunk), crc)
  return f"{crc:08x}"


def fingerprint(data_cfg) -> list:
  """[[name, size, hash]] of the training files its source names ([] for one without files)."""
  files = registry.get(data_cfg.source).files
  paths = files(data_cfg, "train") if files else []
  out = []
  for path, name in zip(paths, _names(paths)):
    try:
      size = os.path.getsize(path)
      out.append([name, size, _cheap_hash(path, size)])
    except OSError as e:
      raise UserError(f"cannot read training shard '{path}': {e.strerror}") from None
  return out


def _names(paths: list) -> list:
  """Each file's name, or where two share one (cA/train_000000.bin, cB/train_000000.bin: one hid
  the other's change), its path below their common folder."""
  base = [os.path.basename(p) for p in paths]
  if len(set(base)) == len(base):
    return base
  root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
  return [os.path.relpath(os.path.abspath(p), root) for p in paths]


def fingerprint_change(old: list, new: list) -> str:
  """'' when equal, else what changed between two fingerprints, in a few words."""
  a, b = {n: (s, h) for n, s, h in old}, {n: (s, h) for n, s, h in new}
  for name in sorted(set(a) | set(b)):
    if name not in b:
      return f"shard '{name}' is gone"
    if name not in a:
      return f"shard '{name}' is new"
    if a[name] != b[name]:
      return f"shard '{name}' changed (size {a[name][0]} -> {b[name][0]} bytes)" \
          if a[name][0] != b[name][0] else f"shard '{name}' changed (same size, other contents)"
  return ""
