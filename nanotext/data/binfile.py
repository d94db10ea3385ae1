"""The modded-nanogpt `.bin` token shard: 256 int32 header words, then uint16 tokens."""

import glob
import os

import numpy as np

from nanotext.data.fileio import atomic_write
from nanotext.errors import UserError

MAGIC = 20240520
VERSION = 1
HEADER_WORDS = 256
HEADER_BYTES = HEADER_WORDS * 4
TOKEN_DTYPE = np.dtype("<u2")


def write_shard(path: str, tokens) -> None:
  """Write `tokens` (ints in [0, 65536)) as a shard, atomically."""
  tokens = np.asarray(tokens)
  if tokens.ndim != 1:
    tokens = tokens.reshape(-1)
  if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
    raise UserError(
        f"cannot write shard '{path}': token ids must lie in [0, 65536), "
        f"got range [{tokens.min()}, {tokens.max()}]")
  header = np.zeros(HEADER_WORDS, dtype="<i4")
  header[0], header[1], header[2] = MAGIC, VERSION, tokens.size
  atomic_write(path, [header.tobytes(), tokens.astype(TOKEN_DTYPE).tobytes()])


def read_header(path: str) -> int:
  """Validate a shard's header and size; return its token count."""
  if not os.path.isfile(path):
    raise UserError(f"shard '{path}' does not exist")
  size = os.path.getsize(path)
  if size < HEADER_BYTES:
    raise UserError(
        f"shard '{path}' is {size} bytes, shorter than the {HEADER_BYTES}-byte header")
  header = np.fromfile(path, dtype="<i4", count=HEADER_WORDS)
  if header[0] != MAGIC:
    raise UserError(
        f"shard '{path}' has magic number {header[0]}, expected {MAGIC} "
        "(not a modded-nanogpt .bin shard)")
  if header[1] != VERSION:
    raise UserError(f"shard '{path}' has version {header[1]}, expected {VERSION}")
  count = int(header[2])
  have = (size - HEADER_BYTES) // TOKEN_DTYPE.itemsize
  if count < 0 or have < count:
    raise UserError(
        f"shard '{path}' header claims {count} tokens but the file holds {have} "
        "(truncated?)")
  return count


def read_shard(path: str) -> np.ndarray:
  """Memory-map a shard's tokens as a read-only uint16 array."""
  count = read_header(path)
  if count == 0:
    return np.zeros(0, dtype=TOKEN_DTYPE)  # np.memmap refuses empty maps.
  return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))


def find_shards(pattern: str, key: str = "data.train_files") -> list[str]:
  """Sorted files matching `pattern`; UserError naming `key` when there are none."""
  if not pattern:
    raise UserError(f"{key} is empty: set it to a glob of .bin shards")
  files = sorted(glob.glob(os.path.expanduser(pattern)))
  if not files:
    raise UserError(f"data path '{pattern}' matches no file: check {key}")
  return files
