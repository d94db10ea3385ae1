"""The training data's fingerprint: names, sizes and a cheap hash of the files its source reads,
in the order it reads them, saved with every checkpoint, so a resume on data that changed is
noticed."""

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


def fingerprint(data_cfg, split: str = "train") -> list:
  """[[name, size, hash]] of the files of `split` ('train' or 'val') its source names ([] for one
  without files)."""
  files = registry.get(data_cfg.source).files
  paths = files(data_cfg, split) if files else []
  out = []
  for path, name in zip(paths, _names(paths)):
    try:
      size = os.path.getsize(path)
      out.append([name, size, _cheap_hash(path, size)])
    except OSError as e:
      raise UserError(f"cannot read {'training' if split == 'train' else 'validation'} shard "
                      f"'{path}': {e.strerror}") from None
  return out


def _names(paths: list) -> list:
  """Each file's name, or where two share one (cA/train_000000.bin, cB/train_000000.bin: one hid
  the other's change), its path below their common folder."""
  base = [os.path.basename(p) for p in paths]
  if len(set(base)) == len(base):
    return base
  root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
  return [os.path.relpath(os.path.abspath(p), root) for p in paths]


def _same_shard(a: str, b: str) -> bool:
  """Whether two names may be one shard's: equal, or one its path below a folder that a second
  shard of its name added (train_000000.bin became cA/train_000000.bin; see _names)."""
  return a == b or a.endswith(os.sep + b) or b.endswith(os.sep + a)


def _pairs(old: list, new: list) -> dict:
  """{index in new: index in old} of each shard that was there before: equal names first, then
  names that changed form, those with the same size and hash first within each."""
  pairs, left = {}, list(range(len(old)))
  for loose, same_contents in ((False, True), (False, False), (True, True), (True, False)):
    for j, now in enumerate(new):
      i = None if j in pairs else next((i for i in left if _fits(old[i], now, loose,
                                                                 same_contents)), None)
      if i is not None:
        pairs[j] = i
        left.remove(i)
  return pairs


def _fits(was: list, now: list, loose: bool, same_contents: bool) -> bool:
  """Whether `now` may be the shard `was`, under one of _pairs' rules."""
  name = _same_shard(was[0], now[0]) if loose else was[0] == now[0]
  return name and (not same_contents or list(was[1:]) == list(now[1:]))


def fingerprint_change(old: list, new: list) -> str:
  """'' when equal, else what changed between two fingerprints, in a few words. The order
  counts: the run reads its shards in the order of their sorted paths."""
  pairs = _pairs(old, new)
  gone = [name for i, (name, _, _) in enumerate(old) if i not in pairs.values()]
  if gone:
    return f"shard '{gone[0]}' is gone"
  for j, (name, _, _) in enumerate(new):
    if j not in pairs:
      return f"shard '{name}' is new"
  for j, (name, size, crc) in enumerate(new):
    was = old[pairs[j]]
    if [was[1], was[2]] != [size, crc]:
      return f"shard '{name}' changed (size {was[1]} -> {size} bytes)" \
          if was[1] != size else f"shard '{name}' changed (same size, other contents)"
  moved = next((j for j in range(len(new)) if pairs[j] != j), None)
  if moved is not None:  # the same shards, read in another order: other batches
    before = next(k for k in range(len(new)) if pairs[k] == moved)
    return (f"the shards' paths sort in another order: '{new[moved][0]}' now comes before "
            f"'{new[before][0]}'")
  return ""
