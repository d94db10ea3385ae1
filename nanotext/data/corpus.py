"""The embedded Shakespeare corpus (42 works, CC-BY 2.5, see shakespeare/README.md)."""

import gzip
import importlib.resources

SUFFIX = ".txt.gz"


def texts_dir():
  """The package folder holding the gzip-compressed works."""
  return importlib.resources.files("nanotext.data") / "shakespeare" / "texts"


def load_corpus() -> list[tuple[str, str]]:
  """All works as (name, text), sorted by name; name is the file stem, e.g. 'hamlet_gut'."""
  out = []
  for entry in sorted(texts_dir().iterdir(), key=lambda e: e.name):
    if entry.name.endswith(SUFFIX):
      out.append((entry.name[:-len(SUFFIX)], gzip.decompress(entry.read_bytes()).decode("utf-8")))
  return out
