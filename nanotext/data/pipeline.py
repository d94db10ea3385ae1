"""grain input pipelines: a checkpointable training iterator and fixed validation batches."""

import grain
import numpy as np

from nanotext.data import binfile
from nanotext.data.sources import PackedDocSource, ShardSource, SyntheticSource
from nanotext.data.tokenizer import resolve_eot_id
from nanotext.errors import UserError

SOURCES = ("shakespeare", "bin", "tfds", "synthetic")
DEFAULT_VOCAB = 8192
# Elements are whole batches, so a short prefetch queue keeps memory small and still hides I/O.
READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=8)


def check_config(d) -> None:
  """The data section: source and tokenizer choices, and the keys each source needs."""
  from nanotext import config
  from nanotext.data.tokenizer import NAMES
  config.check_choices("data", d, {"source": SOURCES, "tokenizer": NAMES})
  if d.source == "bin" and not d.train_files:
    raise UserError("data.source=bin needs data.train_files (a glob of .bin shards)")
  if d.source == "tfds" and not d.tfds_name:
    raise UserError("data.source=tfds needs data.tfds_name")


def _tfds_source(data_cfg, split: str, seq_len: int, max_tokens: int) -> PackedDocSource:
  """Documents of a prepared array_record TFDS split, packed into windows."""
  if not data_cfg.tfds_name:
    raise UserError("data.source is 'tfds' but data.tfds_name is empty")
  try:
    import tensorflow_datasets as tfds
  except ImportError:  # an extra since the main install left it out (it pulls pyarrow)
    raise UserError("data.source=tfds needs tensorflow-datasets: pip install -e '.[tfds]'") \
        from None
  try:
    docs = tfds.data_source(data_cfg.tfds_name, split=split, data_dir=data_cfg.tfds_dir or None,
                            download=False)
  except Exception as e:  # TFDS raises many types; all mean "not there in usable form".
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise UserError(
        f"cannot open TFDS data set '{data_cfg.tfds_name}' split '{split}' in "
        f"'{data_cfg.tfds_dir or '~/tensorflow_datasets'}' ({first_line}); it must be prepared "
        "in array_record format: check data.tfds_name, data.tfds_dir and the split keys") from None
  if len(docs) and data_cfg.tfds_field not in docs[0]:
    raise UserError(f"TFDS data set '{data_cfg.tfds_name}' has no feature "
                    f"'{data_cfg.tfds_field}' (it has {sorted(docs[0])}): set data.tfds_field")
  return PackedDocSource(docs, data_cfg.tfds_field, seq_len, resolve_eot_id(data_cfg), max_tokens)


def _shard_files(data_cfg, split: str) -> list[str]:
  """The shard paths of a split for the `bin` and `shakespeare` sources."""
  if data_cfg.source == "shakespeare":
    from nanotext.data.prepare import prepare_shakespeare
    return binfile.find_shards(prepare_shakespeare(data_cfg.dir or None)[f"{split}_files"],
                               key="data.dir")
  return binfile.find_shards(data_cfg[f"{split}_files"], key=f"data.{split}_files")


def open_source(data_cfg, split: str, *, seq_len: int, seed: int = 0,
                vocab_size: int = DEFAULT_VOCAB, group: int = 0):
  """The random-access window source for split 'train' or 'val' (`group`: see ShardSource)."""
  max_tokens = data_cfg.val_tokens if split == "val" else 0
  if data_cfg.source in ("bin", "shakespeare"):
    return ShardSource(_shard_files(data_cfg, split), seq_len, max_tokens, group,
                       vocab_size)
  if data_cfg.source == "tfds":
    tfds_split = data_cfg.tfds_train_split if split == "train" else data_cfg.tfds_val_split
    return _tfds_source(data_cfg, tfds_split, seq_len, max_tokens)
  if data_cfg.source == "synthetic":
    return SyntheticSource(vocab_size, seq_len, seed, stream=0 if split == "train" else 1)
  raise UserError(f"unknown data.source '{data_cfg.source}': use one of {', '.join(SOURCES)}")


def _split_batch(batch: np.ndarray) -> dict:
  """[B, L+1] windows -> inputs [B, L] and next-token targets [B, L]."""
  return {"inputs": np.ascontiguousarray(batch[:, :-1]),
          "targets": np.ascontiguousarray(batch[:, 1:])}


def make_train_iter(data_cfg, *, seq_len: int, batch_size: int, seed: int,
                    process_index: int = 0, process_count: int = 1,
                    vocab_size: int = DEFAULT_VOCAB) -> grain.DatasetIterator:
  """Endless, checkpointable iterator of this process's batches of batch_size.

  Shuffled per epoch, or with data.shuffle=false in shard order, whole global batches per shard
  (the record's loader: global row r of step k is the shard's window k * rows + r).
  """
  seed = int(seed) % 2**32  # grain seeds must fit in 32 bits.
  group = 0 if data_cfg.shuffle else batch_size * process_count
  source = open_source(data_cfg, "train", seq_len=seq_len, seed=seed, vocab_size=vocab_size,
                       group=group)
  if len(source) == 0:
    raise UserError(f"training data holds no sequence of {seq_len + 1} tokens "
                    f"({source!r}): add data or lower train.seq_len")
  ds = grain.MapDataset.source(source)
  if data_cfg.shuffle and not isinstance(source, SyntheticSource):  # Synthetic: already random.
    ds = ds.shuffle(seed=seed)  # Followed by repeat: a fresh permutation every epoch.
  ds = ds.repeat(None)
  # Every process sees the same global order and keeps its own stride of it: disjoint data.
  ds = ds[process_index::process_count]
  ds = ds.batch(batch_size, drop_remainder=True).map(_split_batch)
  it_ds = ds.to_iter_dataset(READ_OPTIONS)
  if data_cfg.workers > 0:
    from absl import flags
    if not flags.FLAGS.is_parsed():  # grain workers read absl flags; library callers never parse.
      flags.FLAGS.mark_as_parsed()
    it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=data_cfg.workers))
  return iter(it_ds)


def make_val_batches(data_cfg, *, seq_len: int, batch_size: int, num_batches: int,
                     process_index: int = 0, process_count: int = 1,
                     vocab_size: int = DEFAULT_VOCAB, seed: int = 0,
                     length_key: str = "train.seq_len") -> list[dict]:
  """This process's share of the first validation sequences, in order, as full batches;
  `length_key` is the config key that set `seq_len` (named when the data is too short)."""
  source = open_source(data_cfg, "val", seq_len=seq_len, seed=int(seed) % 2**32,
                       vocab_size=vocab_size,
                       group=0 if data_cfg.shuffle else batch_size * process_count)
  global_batch = batch_size * process_count
  # Every process gets the same number of batches, so eval collectives line up.
  n = min(num_batches, len(source) // global_batch)
  if n == 0:
    raise UserError(
        f"validation data holds {len(source)} sequences of {seq_len + 1} tokens, fewer than "
        f"one global batch of {global_batch} (train.batch_size): add validation data "
        "(data.val_files / data.val_tokens, or data.tfds_val_split) or lower train.batch_size "
        f"or {length_key}")
  ds = grain.MapDataset.source(source)[:n * global_batch][process_index::process_count]
  return list(ds.batch(batch_size, drop_remainder=True).map(_split_batch))
