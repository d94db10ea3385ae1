"""Random-access sources of token windows: item i is an int32 array of seq_len + 1 tokens."""

import collections
import threading

import numpy as np

from nanotext.data import binfile
from nanotext.errors import UserError


# Shards a source keeps open at once (each an fd, in each grain worker): modded-nanogpt's
# fineweb100B has 1,028, and a reader per shard ran past the common `ulimit -n` of 1,024. The
# least recently read one closes first; shards read in order (data.shuffle=false) stay open.
MAX_OPEN_SHARDS = 128


def _windows(num_tokens: int, seq_len: int) -> int:
  """Windows of seq_len + 1 tokens at stride seq_len: each token is a target exactly once."""
  return max(0, (num_tokens - 1) // seq_len)


def _check_index(i: int, n: int) -> int:
  """A valid non-negative index below n, or IndexError."""
  i = int(i)
  if not 0 <= i < n:
    raise IndexError(f"index {i} out of range for {n} sequences")
  return i


def _record_windows(num_tokens: int, seq_len: int, group: int) -> int:
  """Windows of a shard read in groups of `group` consecutive rows, as modded-nanogpt's
  `distributed_data_generator`: it moves to the next shard once pos + group * seq_len + 1 reaches
  the shard's length, so a shard yields floor((n - 2) / (group * seq_len)) whole groups."""
  return group * max(0, (num_tokens - 2) // (group * seq_len))


class ShardSource:
  """Windows over `.bin` shards; a window never crosses a shard boundary.

  `max_tokens` caps the input tokens read (targets may reach one token beyond, as the record's
  val_tokens); `group` > 0 keeps whole groups of rows per shard, as the record's loader does.
  """

  def __init__(self, files: list[str], seq_len: int, max_tokens: int = 0, group: int = 0,
               vocab_size: int | None = None):
    counts = [binfile.read_header(f) for f in files]  # Validates every shard up front.
    self._tokens = sum(counts)
    windows = [_record_windows(c, seq_len, group) if group else _windows(c, seq_len)
               for c in counts]
    if max_tokens > 0:  # Keep only the first max_tokens // seq_len windows, in file order.
      left = max_tokens // seq_len
      for k, w in enumerate(windows):
        windows[k] = min(w, left)
        left -= windows[k]
    counts = [min(c, w * seq_len + 1) if w else 0 for c, w in zip(counts, windows)]
    self._files = list(files)
    self._seq_len = seq_len
    self._counts = counts
    self._starts = np.cumsum([0] + windows)
    self._vocab = vocab_size
    self.__setstate__(self.__dict__)

  def __len__(self) -> int:
    return int(self._starts[-1])

  def __getitem__(self, i) -> np.ndarray:
    i = _check_index(i, len(self))
    k = int(np.searchsorted(self._starts, i, side="right")) - 1
    offset = (i - int(self._starts[k])) * self._seq_len
    window = self._reader(k).tokens(offset, self._seq_len + 1).astype(np.int32)
    # An id past the embedding table would only show up later as a NaN loss; a max is cheap.
    if self._vocab is not None and window.size and window.max() >= self._vocab:
      first = int(np.argmax(window >= self._vocab))
      raise UserError(f"shard '{self._files[k]}' holds token id {int(window[first])} (at token "
                      f"{offset + first}), not below the {self._vocab} rows of the embedding "
                      "tables (model.embed_rows, at most model.vocab_size): the shard was made "
                      "with another tokenizer, or the tables are too small")
    return window

  def _reader(self, k: int) -> binfile.Reader:
    """Shard k's reader, opened on first use (in each worker process: its own files) and kept
    among the MAX_OPEN_SHARDS read last. One evicted is not closed here: a grain thread may be
    reading it; it closes when the last one drops it."""
    reader = self._open.get(k)  # the hot path, without the lock: each call is atomic
    if reader is not None:
      try:
        self._open.move_to_end(k)
      except KeyError:  # evicted by another thread meanwhile: still readable
        pass
      return reader
    # Reopened, it is checked against what it was first (a shard changed meanwhile is refused).
    reader = binfile.Reader(self._files[k], self._seen.get(k))
    with self._lock:
      self._seen.setdefault(k, reader.seen)
      self._open[k] = reader
      while len(self._open) > MAX_OPEN_SHARDS:
        self._open.popitem(last=False)
    return reader

  def __getstate__(self):
    # Open files and locks do not pickle; workers open their own.
    return {k: v for k, v in self.__dict__.items() if k not in ("_open", "_lock")}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._open, self._lock = collections.OrderedDict(), threading.Lock()
    self.__dict__.setdefault("_seen", {})

  def __repr__(self) -> str:
    return f"ShardSource({len(self._files)} files, {self._tokens} tokens, {len(self)} sequences)"


class PackedDocSource:
  """Windows over documents concatenated end to end (each preceded by eot_id when given)."""

  def __init__(self, docs, field: str, seq_len: int, eot_id: int | None = None,
               max_tokens: int = 0, chunk: int = 1024, vocab_size: int | None = None,
               name: str = "the documents"):
    self._docs, self._field, self._seq_len = docs, field, seq_len
    self._vocab, self._name = vocab_size, name
    self._eot = None if eot_id is None or eot_id < 0 else int(eot_id)
    # One pass over the documents builds the offset index that makes windows random access.
    lengths = np.zeros(len(docs), dtype=np.int64)
    for lo in range(0, len(docs), chunk):
      idx = list(range(lo, min(lo + chunk, len(docs))))
      for j, rec in zip(idx, self._read(idx)):
        lengths[j] = len(self._tokens(rec))
    self._doc_starts = np.concatenate([[0], np.cumsum(lengths)])
    total = int(self._doc_starts[-1])
    # As ShardSource: max_tokens caps the input tokens, the last target may lie one beyond.
    self._len = _windows(total, seq_len)
    if max_tokens > 0:
      self._len = min(self._len, max_tokens // seq_len)

  def _read(self, indices):
    """Records at `indices`, batched when the source supports it."""
    if hasattr(self._docs, "__getitems__"):
      return self._docs.__getitems__(indices)
    return [self._docs[j] for j in indices]

  def _tokens(self, rec) -> np.ndarray:
    """A record's token ids, with the separator in front."""
    toks = np.asarray(rec[self._field]).reshape(-1)
    if self._eot is not None:
      toks = np.concatenate([[self._eot], toks])
    return toks

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, i) -> np.ndarray:
    i = _check_index(i, len(self))
    start, end = i * self._seq_len, i * self._seq_len + self._seq_len + 1
    first = int(np.searchsorted(self._doc_starts, start, side="right")) - 1
    last = int(np.searchsorted(self._doc_starts, end, side="left"))  # One past the last doc.
    pieces = []
    for d, rec in zip(range(first, last), self._read(list(range(first, last)))):
      lo = max(start, int(self._doc_starts[d])) - int(self._doc_starts[d])
      hi = min(end, int(self._doc_starts[d + 1])) - int(self._doc_starts[d])
      pieces.append(self._tokens(rec)[lo:hi])
    window = np.concatenate(pieces).astype(np.int32)
    # As ShardSource: past the table a NaN loss later, a negative id wraps to its last row.
    if self._vocab is not None and window.size and (window.max() >= self._vocab
                                                    or window.min() < 0):
      first = int(np.argmax((window >= self._vocab) | (window < 0)))
      doc = int(np.searchsorted(self._doc_starts, start + first, side="right")) - 1
      raise UserError(f"{self._name} holds token id {int(window[first])} (in document {doc}), "
                      f"not in [0, {self._vocab}), the rows of the embedding tables "
                      "(model.embed_rows, at most model.vocab_size): the data was made with "
                      "another tokenizer, or the tables are too small")
    return window

  def __repr__(self) -> str:
    return f"PackedDocSource({len(self._doc_starts) - 1} documents, {len(self)} sequences)"


class SyntheticSource:
  """Uniform random tokens in [0, vocab_size), a pure function of (seed, stream, index)."""

  def __init__(self, vocab_size: int, seq_len: int, seed: int, stream: int = 0,
               length: int = 2**40):
    self._vocab, self._seq_len, self._key, self._len = vocab_size, seq_len, (seed, stream), length

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, i) -> np.ndarray:
    rng = np.random.default_rng([*self._key, _check_index(i, len(self))])
    return rng.integers(0, self._vocab, self._seq_len + 1, dtype=np.int32)

  def __repr__(self) -> str:
    return f"SyntheticSource(vocab {self._vocab})"
