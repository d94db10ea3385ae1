"""grain input pipelines: a checkpointable training iterator and fixed validation batches."""

import functools
import os
import signal
import sys
import threading
import time

import grain
import numpy as np
from absl import flags

from nanotext.data import registry
from nanotext.errors import UserError
from nanotext import config, config_file, signals
from nanotext.data.tokenizer import NAMES, bytes_per_token, get_tokenizer, known_vocab_size

DEFAULT_VOCAB = 8192
# Elements are whole batches, so a short prefetch queue keeps memory small and still hides I/O.
READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=8)


def check_config(d) -> None:
  """The data section: source and tokenizer choices, and the keys each source needs."""
  config.check_choices("data", d, {"source": registry.names(), "tokenizer": NAMES})
  if d.source == "shakespeare" and d.tokenizer == "gpt2":  # read as gpt2 ids, scored, sampled
    raise UserError("data.source=shakespeare holds ids of the shipped 'shakespeare' tokenizer, "
                    "not data.tokenizer=gpt2's: set data.tokenizer=shakespeare, or give gpt2 "
                    "data (data.source=bin with data.train_files and data.val_files, e.g. "
                    "FineWeb's shards, or text_shards' --tokenizer=gpt2 output)")
  registry.get(d.source).check(d)


# Data keys some sources read: given on the command line under another, they were ignored
# (evaluate on `val_files` of a shakespeare run printed the run's own figures; train with a
# train_files glob matching nothing, exit 0; synthetic data has no validation tokens to cap).
# A config's own (speedrun.yml's FineWeb globs under data.source=synthetic or shakespeare) are
# left to the source it names.
ONLY_READ_BY = {"train_files": ("bin",), "val_files": ("bin",), "tfds_name": ("tfds",),
                "tfds_dir": ("tfds",), "tfds_field": ("tfds",), "tfds_train_split": ("tfds",),
                "tfds_val_split": ("tfds",), "val_tokens": ("shakespeare", "bin", "tfds"),
                "dir": ("shakespeare",)}  # where its shards are prepared (registry, prepare)


def check_overrides(d, overrides) -> None:
  """Refuse a `key=value` override of a data key the run's source does not read; one that
  gives the key its default (`data.tfds_train_split=train`, `data.val_tokens=0`) is not set."""
  defaults = config_file.read(config.SCHEMA_PATH)["data"]
  for key, value in map(config.parse_override, overrides):
    leaf = key.removeprefix("data.")
    sources = ONLY_READ_BY.get(leaf, ()) if key.startswith("data.") else ()
    if not sources or d.source in sources:
      continue
    default = defaults[leaf]
    given = value.strip() if isinstance(default, str) else config_file.coerce(key, value, default)
    if given != default:
      names = ", ".join(sources[:-1]) + " or " * (len(sources) > 1) + sources[-1]
      raise UserError(f"{key} is read only by data.source={names} (this run's is "
                      f"data.source={d.source}): add data.source={names}, or leave {key} out")


def open_source(data_cfg, split: str, *, seq_len: int, seed: int = 0,
                vocab_size: int = DEFAULT_VOCAB, group: int = 0):
  """The random-access window source for split 'train' or 'val' (`group`: see ShardSource)."""
  max_tokens = data_cfg.val_tokens if split == "val" else 0
  return registry.get(data_cfg.source).open(data_cfg, split, seq_len=seq_len, seed=seed,
                                            vocab_size=vocab_size, group=group,
                                            max_tokens=max_tokens)


def _split_batch(batch: np.ndarray) -> dict:
  """[B, L+1] windows -> inputs [B, L] and next-token targets [B, L]."""
  return {"inputs": np.ascontiguousarray(batch[:, :-1]),
          "targets": np.ascontiguousarray(batch[:, 1:])}


def make_train_iter(data_cfg, *, seq_len: int, batch_size: int, seed: int,
                    process_index: int = 0, process_count: int = 1,
                    vocab_size: int = DEFAULT_VOCAB) -> "TrainIter":
  """Endless, checkpointable iterator of this process's batches of batch_size.

  Shuffled per epoch, or with data.shuffle=false in shard order, whole global batches per shard
  (the record's loader: global row r of step k is the shard's window k * rows + r).
  """
  seed = int(seed) % 2**32  # grain seeds must fit in 32 bits.
  group = 0 if data_cfg.shuffle else batch_size * process_count
  source = open_source(data_cfg, "train", seq_len=seq_len, seed=seed, vocab_size=vocab_size,
                       group=group)
  if len(source) == 0 and group:
    raise UserError(f"no training shard holds one whole global batch of {group} sequences of "
                    f"{seq_len + 1} tokens, which data.shuffle=false reads from each shard "
                    f"({source!r}): add data, lower train.batch_size or train.seq_len, or set "
                    "data.shuffle=true")
  if len(source) == 0:
    raise UserError(f"training data holds no sequence of {seq_len + 1} tokens "
                    f"({source!r}): add data or lower train.seq_len")
  rows = batch_size * process_count
  if len(source) < rows:  # every batch would hold some sequences twice, as validation refuses
    raise UserError(f"training data holds {len(source)} sequence{'s' * (len(source) != 1)} of "
                    f"{seq_len + 1} tokens, fewer than one global batch of {rows} "
                    f"(train.batch_size) ({source!r}): add data or lower train.batch_size or "
                    "train.seq_len")
  ds = grain.MapDataset.source(source)
  if data_cfg.shuffle and not registry.get(data_cfg.source).shuffled:
    ds = ds.shuffle(seed=seed)  # Followed by repeat: a fresh permutation every epoch.
  ds = ds.repeat(None)
  # Every process sees the same global order and keeps its own stride of it: disjoint data.
  ds = ds[process_index::process_count]
  ds = ds.batch(batch_size, drop_remainder=True).map(_split_batch)
  if data_cfg.workers > 0 and not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()  # grain workers read absl flags; library callers never parse.
  return TrainIter(ds, data_cfg.workers, windows=len(source), rows=rows)


class TrainIter:
  """This process's batches, read from a position on; the position (batches read) is its whole
  state, so a checkpoint resumes under any data.workers (grain's own state differs per count)."""

  def __init__(self, batches: grain.MapDataset, workers: int, windows: int = 0, rows: int = 0):
    self._batches, self._workers = batches, workers
    self.position, self._it = 0, None
    self.windows, self.rows = windows, rows  # the data's sequences, a global batch's rows

  def epochs(self, steps: int) -> float:
    """Passes over the training data in `steps` global batches."""
    return steps * self.rows / self.windows if self.windows else 0.0

  def __iter__(self):
    return self

  def __next__(self) -> dict:
    if self._it is None:
      ds = self._batches[self.position:].to_iter_dataset(READ_OPTIONS)
      if self._workers:
        _start_quiet_tracker()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=self._workers),
                            worker_init_fn=functools.partial(_end_with_parent, os.getpid()))
      self._it = iter(ds)
    batch = next(self._it)
    self.position += 1
    return batch

  def get_state(self) -> dict:
    return {"batches": self.position}

  def set_state(self, state: dict) -> None:
    self.close()
    self.position = position(state)
    if self.position >= len(self._batches):  # past the endless stream's 2**63 rows
      raise UserError(f"the saved data position {self.position} is past this data's "
                      f"{len(self._batches):,} batches: start a new output_dir with "
                      "checkpoint.load_params_from=<this run>")

  def close(self) -> None:
    """Stop the worker processes (a new read starts them again)."""
    it, self._it = self._it, None
    if it is not None and hasattr(it, "close"):
      it.close()


def position(state) -> int:
  """Batches read, from a saved data state (checkpoint.saved_position); UserError where it says
  none."""
  from nanotext.checkpoint import saved_position
  n = saved_position(state)
  if n is None:
    raise UserError(f"the saved data position {str(state)[:200]} is not one nanotext reads: "
                    "start a new output_dir with checkpoint.load_params_from=<this run>")
  return n


def _start_quiet_tracker() -> None:
  """Start multiprocessing's resource tracker with its stdout and stderr on /dev/null: after a
  run's os._exit it frees the workers' shared memory itself, and said so in warnings on
  the terminal below the run's one line."""
  from multiprocessing import resource_tracker
  signals.flush(sys.stdout, sys.stderr)  # None where closed (`>&-`)
  devnull = os.open(os.devnull, os.O_WRONLY)
  saved = [os.dup(1), os.dup(2)]
  try:
    for fd in (1, 2):
      os.dup2(devnull, fd)
    resource_tracker.ensure_running()
  finally:
    for fd, old in zip((1, 2), saved):
      os.dup2(old, fd)
      os.close(old)
    os.close(devnull)


def _end_with_parent(parent: int, worker_index: int, worker_count: int) -> None:
  """In each grain worker: exit once the training process (pid `parent`, given by it: it may be
  gone before a worker starts) is gone. Its exits (os._exit, a kill) skip the cleanup that stops
  workers, and an orphan keeps the caller's pipes open (`train ... | tail` never returned).
  Ctrl-C, which a terminal sends to every process of the job, is the training process's to act
  on: a worker printed a KeyboardInterrupt traceback beside its one line. So is SIGHUP (a
  closed terminal's, to the whole job): the training process saves and stops on it."""
  del worker_index, worker_count
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  signal.signal(signal.SIGHUP, signal.SIG_IGN)

  def watch():
    while os.getppid() == parent:
      time.sleep(0.2)
    os._exit(0)
  threading.Thread(target=watch, daemon=True, name="nanotext-parent-watch").start()


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
    raise UserError(_too_little_val(data_cfg, source, seq_len, global_batch, length_key,
                                    vocab_size))
  ds = grain.MapDataset.source(source)[:n * global_batch][process_index::process_count]
  return list(ds.batch(batch_size, drop_remainder=True).map(_split_batch))


# Where a source's validation data can grow (shakespeare's corpus is what it is; synthetic's
# never runs short): advice of a key the source refuses (data.val_files under shakespeare) sent
# the user round in a circle
MORE_VAL = {"bin": "add validation shards to data.val_files",
            "tfds": "choose a larger data.tfds_val_split"}


def _too_little_val(data_cfg, source, seq_len: int, global_batch: int, length_key: str,
                    vocab_size: int) -> str:
  """Why validation `source` holds no whole global batch: the sequences there are (under
  data.shuffle=false those of whole batches per shard only, so counted again ungrouped), and
  the keys of this source that give more."""
  total = len(source)
  if not data_cfg.shuffle:
    total = len(open_source(data_cfg, "val", seq_len=seq_len, vocab_size=vocab_size))
  held = f"validation data holds {total} sequence{'s' * (total != 1)} of {seq_len + 1} tokens"
  lower = f"lower train.batch_size or {length_key}"
  if total >= global_batch:  # enough, split over shards each short of a whole batch
    return (f"{held}, but no shard holds one whole global batch of {global_batch} "
            f"(train.batch_size), which data.shuffle=false reads from each shard: set "
            f"data.shuffle=true or {lower}")
  # Raising data.val_tokens adds data only where its cap holds some back (a cap above the data's
  # size advised raising it, to no effect)
  capped = data_cfg.val_tokens and total < len(registry.get(data_cfg.source).open(
      data_cfg, "val", seq_len=seq_len, seed=0, vocab_size=vocab_size, group=0, max_tokens=0))
  more = f"raise data.val_tokens={data_cfg.val_tokens}" if capped else \
      MORE_VAL.get(data_cfg.source, "")
  return (f"{held}, fewer than one global batch of {global_batch} (train.batch_size): "
          f"{more + ', or ' if more else ''}{lower}")


def tokenizer_problem(data_cfg) -> str:
  """Why data.tokenizer cannot load where the data are its text ('' where it can, or there is
  no text): what a missing val_bpb is owed to."""
  if data_cfg.tokenizer == "none" or not registry.get(data_cfg.source).text:
    return ""
  try:
    get_tokenizer(data_cfg.tokenizer)
  except UserError as e:
    return str(e)
  return ""


def check_tokenizer_ids(data_cfg, batches) -> None:
  """Refuse validation ids past data.tokenizer's vocabulary: shards of another tokenizer
  (FineWeb's have no meta.json to say so) trained with no val_bpb, no word why, and a sample
  decoded into another tokenizer's words."""
  if data_cfg.tokenizer == "none" or not registry.get(data_cfg.source).text or not batches:
    return
  vocab = known_vocab_size(data_cfg.tokenizer)  # without tiktoken too: gpt2's is known
  top = max(int(np.asarray(b["targets"]).max()) for b in batches)
  if top >= vocab:
    raise UserError(f"the validation data hold token id {top}, past the {vocab} ids of "
                    f"data.tokenizer={data_cfg.tokenizer}: they are another tokenizer's (FineWeb's "
                    "are gpt2's); set data.tokenizer to theirs, or none")


def val_bytes_per_token(data_cfg, batches) -> float | None:
  """bytes_per_token of data.tokenizer over validation batches; None when it cannot tell."""
  if data_cfg.tokenizer == "none" or not registry.get(data_cfg.source).text:
    return None
  try:
    return bytes_per_token(get_tokenizer(data_cfg.tokenizer), batches)
  except UserError:  # e.g. tiktoken offline: train on, with val_loss only
    return None
