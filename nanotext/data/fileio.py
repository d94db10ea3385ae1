"""Atomic file writes: readers see the old file or the whole new one, never half of one; an
append is whole or not there."""

import os
import uuid


def atomic_write(path: str, chunks) -> None:
  """Write the byte strings in `chunks` to `path` via a sibling temp file and os.replace."""
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  # Same folder, so os.replace is a rename on one file system; a unique name, so concurrent
  # writers (several hosts preparing the same cache) never share a temp file.
  tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
  try:
    with open(tmp, "xb") as f:
      for chunk in chunks:
        f.write(chunk)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def append_whole(fd: int, data: bytes) -> None:
  """Append `data` to the file open as `fd`, whole or not at all: a write cut short by a full
  disk or a file-size limit is truncated away before the OSError goes on."""
  end = os.lseek(fd, 0, os.SEEK_END)
  view = memoryview(data)
  try:
    while view:
      view = view[os.write(fd, view):]
  except OSError:
    try:
      os.ftruncate(fd, end)
    except OSError:
      pass
    raise
