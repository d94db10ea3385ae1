"""The data sources by name: each says in one place how to check its keys, which files to
fingerprint on resume, whether its tokens are text, and how to open a split.

`pipeline` (config checks, opening) and `fingerprint` (resume checks) read this table, so
a new source is one `register(Source(...))` beside its class.
"""

import dataclasses
import json
import os
from typing import Callable

from nanotext.data import binfile
from nanotext.data.sources import PackedDocSource, ShardSource, SyntheticSource
from nanotext.errors import UserError
from nanotext.data.prepare import prepare_shakespeare
from nanotext.data.tokenizer import resolve_eot_id


def _no_check(data_cfg) -> None:
  """A source without keys of its own."""


@dataclasses.dataclass(frozen=True)
class Source:
  """One data source. `open(data_cfg, split, *, seq_len, seed, vocab_size, group, max_tokens)`
  returns a random-access window source for split 'train' or 'val'; `files(data_cfg, split)` the
  paths to fingerprint (None: nothing to check on resume); `check` raises UserError for missing
  or contradictory data.* keys; `text` is False where the ids are not tokenized text (no bpb);
  `shuffled` is True where its windows come in random order already (the pipeline keeps it);
  `warn(data_cfg)` is a line to say ('': none) of keys that are valid but likely a mistake."""
  name: str
  open: Callable
  check: Callable = _no_check
  files: Callable | None = None
  text: bool = True
  shuffled: bool = False
  warn: Callable = lambda data_cfg: ""


SOURCES: dict[str, Source] = {}


def register(source: Source) -> Source:
  """Add a source under its name (a second one with the same name replaces the first)."""
  SOURCES[source.name] = source
  return source


def names() -> tuple[str, ...]:
  """The registered source names, in registration order (the order error messages list)."""
  return tuple(SOURCES)


def get(name: str) -> Source:
  """The source called `name`, or a UserError naming the choices."""
  if name not in SOURCES:
    raise UserError(f"unknown data.source '{name}': use one of {', '.join(SOURCES)}")
  return SOURCES[name]


# --- the built-in sources ---------------------------------------------------------------------

def _shakespeare_files(data_cfg, split: str) -> list[str]:
  """The embedded corpus's shards, tokenized into data.dir on first use."""
  return binfile.find_shards(prepare_shakespeare(data_cfg.dir or None)[f"{split}_files"],
                             key="data.dir")


def _check_written_with(tokenizer: str, folder: str) -> None:
  """Refuse shards whose meta.json (text_shards, prepare) names another tokenizer than
  data.tokenizer: its ids past this one's vocabulary were clipped into a bits-per-byte figure
  of nothing, and documents split at another token."""
  try:
    with open(os.path.join(folder, "meta.json"), encoding="utf-8") as f:
      written = json.load(f).get("tokenizer")
  except (OSError, ValueError, AttributeError):  # no record (FineWeb's shards): nothing to say
    return
  if isinstance(written, str) and tokenizer not in ("none", written):
    raise UserError(f"the shards in '{folder}' hold {written} token ids (their meta.json), not "
                    f"data.tokenizer={tokenizer}'s: set data.tokenizer={written}")


def _bin_files(data_cfg, split: str) -> list[str]:
  """The shards matched by data.train_files / data.val_files."""
  files = binfile.find_shards(data_cfg[f"{split}_files"], key=f"data.{split}_files")
  for folder in sorted({os.path.dirname(f) for f in files}):
    _check_written_with(data_cfg.tokenizer, folder)
  return files


def _shared_shards(data_cfg) -> str:
  """The warning where the validation glob matches a training shard too (`shards/*.bin` over a
  text_shards folder validated on text it trained on, without a word; an overfitting check may
  mean it); '' where it does not, or either glob matches nothing (said where it is read)."""
  try:
    train = {os.path.realpath(f) for f in binfile.find_shards(data_cfg.train_files)}
    both = [f for f in binfile.find_shards(data_cfg.val_files)
            if os.path.realpath(f) in train]
  except UserError:  # training shards moved away: evaluate reads only the validation ones
    return ""
  if not both:
    return ""
  return (f"data.train_files and data.val_files both match '{both[0]}'"
          f"{f' and {len(both) - 1} more' if len(both) > 1 else ''}: the validation loss is of "
          "text the run trains on (text_shards writes train_*.bin and val_*.bin)")


def _shards(files: Callable) -> Callable:
  """An `open` over the .bin shards that `files` lists."""
  def open_shards(data_cfg, split, *, seq_len, seed, vocab_size, group, max_tokens):
    del seed  # shards are read in order or shuffled by the pipeline
    return ShardSource(files(data_cfg, split), seq_len, max_tokens, group, vocab_size)
  return open_shards


def _check_bin(data_cfg) -> None:
  # val_files alone serve evaluate (a Hugging Face import's run on one's own validation shard);
  # training finds data.train_files empty where it opens them, before anything is written
  if not (data_cfg.train_files or data_cfg.val_files):
    raise UserError("data.source=bin needs data.train_files (a glob of .bin shards; "
                    "data.val_files alone serves evaluate)")


def _check_tfds(data_cfg) -> None:
  if not data_cfg.tfds_name:
    raise UserError("data.source=tfds needs data.tfds_name")


def _open_tfds(data_cfg, split, *, seq_len, seed, vocab_size, group, max_tokens):
  """Documents of a prepared array_record TFDS split, packed into windows."""
  del seed, group
  tfds_split = data_cfg.tfds_train_split if split == "train" else data_cfg.tfds_val_split
  if not data_cfg.tfds_name:
    raise UserError("data.source is 'tfds' but data.tfds_name is empty")
  try:
    import tensorflow_datasets as tfds
  except ImportError:  # an extra since the main install left it out (it pulls pyarrow)
    raise UserError("data.source=tfds needs tensorflow-datasets: pip install -e '.[tfds]'") \
        from None
  try:
    docs = tfds.data_source(data_cfg.tfds_name, split=tfds_split,
                            data_dir=data_cfg.tfds_dir or None, download=False)
  except Exception as e:  # TFDS raises many types; all mean "not there in usable form".
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise UserError(
        f"cannot open TFDS data set '{data_cfg.tfds_name}' split '{tfds_split}' in "
        f"'{data_cfg.tfds_dir or '~/tensorflow_datasets'}' ({first_line}); it must be prepared "
        "in array_record format: check data.tfds_name, data.tfds_dir and the split keys") from None
  if len(docs) and data_cfg.tfds_field not in docs[0]:
    raise UserError(f"TFDS data set '{data_cfg.tfds_name}' has no feature "
                    f"'{data_cfg.tfds_field}' (it has {sorted(docs[0])}): set data.tfds_field")
  return PackedDocSource(docs, data_cfg.tfds_field, seq_len, resolve_eot_id(data_cfg), max_tokens,
                         vocab_size=vocab_size,
                         name=f"TFDS data set '{data_cfg.tfds_name}' split '{tfds_split}'")


def _open_synthetic(data_cfg, split, *, seq_len, seed, vocab_size, group, max_tokens):
  """Uniform random ids, one stream per split."""
  del data_cfg, group, max_tokens
  return SyntheticSource(vocab_size, seq_len, seed, stream=0 if split == "train" else 1)


# Registration order is the order `data.source` errors list the choices in.
register(Source("shakespeare", _shards(_shakespeare_files), files=_shakespeare_files))
register(Source("bin", _shards(_bin_files), check=_check_bin, files=_bin_files,
                warn=_shared_shards))
register(Source("tfds", _open_tfds, check=_check_tfds))  # no files of ours to fingerprint
register(Source("synthetic", _open_synthetic, text=False, shuffled=True))
