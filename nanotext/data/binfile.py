"""The modded-nanogpt `.bin` token shard: 256 int32 header words, then uint16 tokens."""

import errno
import glob
import os

import numpy as np

from nanotext.fileio import atomic_write
from nanotext.errors import UserError

MAGIC = 20240520
VERSION = 1
HEADER_WORDS = 256
HEADER_BYTES = HEADER_WORDS * 4
TOKEN_DTYPE = np.dtype("<u2")
MAX_TOKENS = 2**31 - 1  # the header counts a shard's tokens in an int32


def write_shard(path: str, tokens) -> None:
  """Write `tokens` (ints in [0, 65536)) as a shard, atomically."""
  tokens = np.asarray(tokens)
  if tokens.ndim != 1:
    tokens = tokens.reshape(-1)
  if tokens.size > MAX_TOKENS:  # before a scan of min/max: the header cannot hold the count
    raise UserError(f"cannot write shard '{path}': {tokens.size:,} tokens, more than the "
                    f"{MAX_TOKENS:,} a shard's header counts; write them as several shards")
  if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
    raise UserError(
        f"cannot write shard '{path}': token ids must lie in [0, 65536), "
        f"got range [{tokens.min()}, {tokens.max()}]")
  header = np.zeros(HEADER_WORDS, dtype="<i4")
  header[0], header[1], header[2] = MAGIC, VERSION, tokens.size
  atomic_write(path, [header.tobytes(), tokens.astype(TOKEN_DTYPE).tobytes()])


def read_header(path: str) -> int:
  """Validate a shard's header and size; return its token count."""
  if os.path.isdir(path):
    raise UserError(f"shard '{path}' is a folder: name its .bin files (a glob such as "
                    f"'{os.path.join(path, '*.bin')}')")
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
  if count < 0:
    raise UserError(f"shard '{path}' header claims {count} tokens, a negative count: the header "
                    "is damaged; rewrite the shard")
  if have < count:
    raise UserError(
        f"shard '{path}' header claims {count} tokens but the file holds {have} "
        "(truncated?)")
  if size != HEADER_BYTES + count * TOKEN_DTYPE.itemsize:  # modded-nanogpt's loader asserts it
    raise UserError(
        f"shard '{path}' header claims {count} tokens but the file holds "
        f"{size - HEADER_BYTES} bytes after it ({have} tokens"
        f"{' and a stray byte' if (size - HEADER_BYTES) % 2 else ''}): a header written for "
        "another file, or data appended after it; rewrite the shard")
  return count


def read_shard(path: str) -> np.ndarray:
  """Memory-map a shard's tokens as a read-only uint16 array."""
  count = read_header(path)
  if count == 0:
    return np.zeros(0, dtype=TOKEN_DTYPE)  # np.memmap refuses empty maps.
  return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))


class ShardChanged(UserError):
  """A shard changed on disk while a run was reading it."""


class Reader:
  """A shard's tokens read with os.pread, each read checked against the file as it was opened.

  Not a memory map: a shard truncated under a memory map kills the process with SIGBUS and a
  crash dump. Here a file cut short, grown or rewritten in place (its size or modification time
  changed) is one line naming it. A shard replaced by a rename keeps being read as it was
  opened (this open file is the old one), so a run stays on one version of its data; the
  checkpoint's data fingerprint tells a resume about the new one. (ShardSource closes shards
  read least recently; one reopened is checked against its first state, so a rename is refused.)
  """

  def __init__(self, path: str, seen: tuple | None = None):
    """`seen`: the (size, mtime) an earlier Reader of the shard saw (ShardSource reopens shards
    it closed): a shard that changed since is refused as it would have been while open."""
    self.path = path
    if seen is None:
      read_header(path)
    try:
      self._fd = os.open(path, os.O_RDONLY)
    except OSError as e:
      if e.errno == errno.EMFILE:
        raise UserError(f"cannot open shard '{path}': too many open files (the limit is "
                        f"{_open_files_limit()}): raise it with `ulimit -n`") from None
      raise
    self.seen = seen or self._state()  # a reopened shard is checked by its first read

  def _state(self) -> tuple:
    st = os.fstat(self._fd)
    return st.st_size, st.st_mtime_ns

  def tokens(self, start: int, n: int) -> np.ndarray:
    """Tokens [start, start + n) as uint16."""
    now = self._state()
    if now != self.seen:
      self._changed(f"its size or modification time changed ({self.seen[0]:,} -> "
                    f"{now[0]:,} bytes)")
    want = n * TOKEN_DTYPE.itemsize
    data = os.pread(self._fd, want, HEADER_BYTES + start * TOKEN_DTYPE.itemsize)
    if len(data) != want:  # cut short between the check and the read
      self._changed(f"{len(data)} of {want} bytes could be read")
    return np.frombuffer(data, dtype=TOKEN_DTYPE)

  def _changed(self, how: str) -> None:
    raise ShardChanged(f"shard '{self.path}' changed while the run was reading it ({how}); "
                       "checkpoints already written are intact: put the shard back as it was "
                       "and run the same command again to resume")

  def __del__(self):  # threads that opened the same shard at once: the spare ones close
    try:
      os.close(self._fd)
    except (OSError, AttributeError, TypeError):
      pass


def _open_files_limit() -> str:
  """The soft limit on open files, as `ulimit -n` says it."""
  try:
    import resource
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
  except (ImportError, OSError, ValueError):
    return "unknown"
  return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


def find_shards(pattern: str, key: str = "data.train_files") -> list[str]:
  """Sorted files matching `pattern`; UserError naming `key` when there are none."""
  if not pattern:
    raise UserError(f"{key} is empty: set it to a glob of .bin shards")
  files = sorted(glob.glob(os.path.expanduser(pattern)))
  if not files:
    raise UserError(f"data path '{pattern}' matches no file: check {key}")
  return files
