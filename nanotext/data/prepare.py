"""Tokenize the embedded Shakespeare corpus into train/val `.bin` shards (cached on disk)."""

import glob
import hashlib
import json
import os

import numpy as np
from absl import flags

from nanotext.data import binfile
from nanotext.data.corpus import load_corpus
from nanotext.fileio import atomic_write
from nanotext.data.tokenizer import get_tokenizer, shipped_path
from nanotext.errors import UserError, os_error
from nanotext import probes

# Two whole plays (a tragedy and a comedy, ~4.6% of the text) held out by name, so the split
# never depends on tokenizer, ordering or a random seed.
VAL_WORKS = ("julius_caesar_gut", "twelfth_night_gut")
TRAIN_FILE = "train_000000.bin"
VAL_FILE = "val_000000.bin"
META_FILE = "meta.json"
FORMAT = 1  # Bump when the shard layout changes, so stale caches are rebuilt.


def default_dir(what: str = "data.dir", needed: bool = True) -> str:
  """$NANOTEXT_CACHE/shakespeare, or ~/.cache/nanotext/shakespeare. HOME set but empty is no
  home (~ would be the root: /.cache/...): a UserError naming `what`, or "" where not `needed`."""
  parent = os.environ.get("NANOTEXT_CACHE")
  if not parent and os.environ.get("HOME") == "":
    if not needed:
      return ""
    raise UserError("HOME is empty, so the prepared data has no default folder "
                    f"(~/.cache/nanotext would be /.cache/nanotext): set HOME, NANOTEXT_CACHE "
                    f"or {what}")
  parent = parent or os.path.join("~", ".cache", "nanotext")
  return os.path.join(os.path.expanduser(parent), "shakespeare")


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
  """Entropy in nats of the empirical token distribution (the loss of a unigram model)."""
  counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


def _tokenizer_digest() -> str:
  """Hash of the shipped tokenizer.json: a retrained tokenizer invalidates cached shards."""
  return hashlib.sha256(shipped_path().read_bytes()).hexdigest()[:16]


def _result(out_dir: str, meta: dict) -> dict:
  """The returned description: globs for the pipeline plus the metadata."""
  # Escaped: a data.dir holding [ ] * ? is a folder name, not a pattern.
  return {"train_files": os.path.join(glob.escape(out_dir), "train_*.bin"),
          "val_files": os.path.join(glob.escape(out_dir), "val_*.bin"), "dir": out_dir, **meta}


def _cached(out_dir: str, digest: str) -> dict | None:
  """The metadata of a complete, valid, up-to-date preparation in out_dir, else None."""
  try:
    with open(os.path.join(out_dir, META_FILE)) as f:
      meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("tokenizer_digest") != digest:
      return None
    if binfile.read_header(os.path.join(out_dir, TRAIN_FILE)) != meta["train_tokens"]:
      return None
    if binfile.read_header(os.path.join(out_dir, VAL_FILE)) != meta["val_tokens"]:
      return None
    return meta
  except (OSError, ValueError, KeyError, UserError):
    return None


def _foreign(out_dir: str) -> str:
  """The first entry of out_dir that a preparation would not have written ("" if none): a
  stale or damaged cache of its own is rebuilt, other shards (text_shards', FineWeb's) are kept.
  """
  try:
    names = sorted(os.listdir(out_dir))
  except OSError:
    return ""  # absent, or not a folder: makedirs says so
  ours = (TRAIN_FILE, VAL_FILE, META_FILE)
  for name in names:
    if name not in ours and not name.startswith(tuple("." + o for o in ours)):  # staging
      return name
  try:
    with open(os.path.join(out_dir, META_FILE), encoding="utf-8") as f:
      meta = json.load(f)
  except (OSError, ValueError):
    return ""  # no record, or a damaged one: a preparation cut short
  return "" if isinstance(meta, dict) and "train_works" in meta else META_FILE


def prepare_shakespeare(out_dir: str | None = None, what: str = "data.dir") -> dict:
  """Write train/val shards and meta.json under out_dir unless valid ones already exist.

  Each work becomes `<|endoftext|>` + its tokens (the FineWeb shard convention: the separator
  comes before every document). The works named in VAL_WORKS form the validation shard; the
  other 40 the training shard, in sorted name order. Returns the shard globs and the metadata
  (token counts, tokenizer, vocab size, unigram entropy of the training tokens in nats). `what`
  names the setting that chose out_dir in errors.
  """
  if not out_dir and os.environ.get("NANOTEXT_CACHE"):  # the folder the errors name chose it
    what = f"{what} (or NANOTEXT_CACHE={os.environ['NANOTEXT_CACHE']}, which chose it)"
  out_dir = os.path.abspath(os.path.expanduser(out_dir or default_dir(what)))
  digest = _tokenizer_digest()
  meta = _cached(out_dir, digest)
  if meta is not None:
    return _result(out_dir, meta)
  foreign = _foreign(out_dir)
  if foreign:
    raise UserError(f"'{out_dir}' holds files this preparation did not write ('{foreign}'); "
                    f"nothing was changed: set {what} to a new or empty folder")
  try:  # Fail before the slow tokenization when out_dir cannot be written.
    os.makedirs(out_dir, exist_ok=True)
  except OSError as e:
    raise UserError(f"cannot create the folder '{out_dir}' ({e.strerror}): set {what} to a "
                    "folder that can be written") from None
  probes.writable_dir(out_dir, "the prepared-data folder (data.dir)")
  tok = get_tokenizer("shakespeare")
  corpus = load_corpus()
  missing = set(VAL_WORKS) - {name for name, _ in corpus}
  if missing:
    raise UserError(f"validation works {sorted(missing)} are not in the embedded corpus")
  ids = tok.encode_batch([text for _, text in corpus])
  train, val = [], []
  for (name, _), doc in zip(corpus, ids):
    (val if name in VAL_WORKS else train).append([tok.eot_id] + doc)
  train = np.concatenate(train).astype(np.uint16)
  val = np.concatenate(val).astype(np.uint16)
  try:
    binfile.write_shard(os.path.join(out_dir, TRAIN_FILE), train)
    binfile.write_shard(os.path.join(out_dir, VAL_FILE), val)
    meta = {
        "format": FORMAT, "tokenizer": "shakespeare", "tokenizer_digest": digest,
        "vocab_size": tok.vocab_size, "eot_id": tok.eot_id,
        "train_tokens": int(train.size), "val_tokens": int(val.size),
        "train_works": len(corpus) - len(VAL_WORKS), "val_works": list(VAL_WORKS),
        "unigram_entropy_nats": unigram_entropy(train, tok.vocab_size),
    }
    # meta.json goes last: its presence marks a complete preparation.
    atomic_write(os.path.join(out_dir, META_FILE),
                 [(json.dumps(meta, indent=2) + "\n").encode()])
  except OSError as e:  # a full disk is exit 1, a folder that cannot be written exit 2
    raise os_error(e, f"cannot write prepared data under '{out_dir}' (or set {what})") \
        from None
  return _result(out_dir, meta)


USAGE = "usage: python -m nanotext.data.prepare [--out=DIR]"


def main(args) -> None:
  """CLI: prepare the shards and print their token counts and unigram entropy."""
  if args:
    raise UserError(f"unexpected arguments: {' '.join(args)}; {USAGE}")
  info = prepare_shakespeare(flags.FLAGS.out or None, "--out")
  print(f"shards in {info['dir']}")
  print(f"train tokens: {info['train_tokens']:,} ({info['train_works']} works)")
  print(f"val tokens:   {info['val_tokens']:,} ({', '.join(info['val_works'])})")
  print(f"vocab size:   {info['vocab_size']} (eot id {info['eot_id']})")
  print(f"unigram entropy of train tokens: {info['unigram_entropy_nats']:.4f} nats/token")


if __name__ == "__main__":
  from nanotext import cli
  flags.DEFINE_string("out", "", "output folder; '' = $NANOTEXT_CACHE/shakespeare or "
                      "~/.cache/nanotext/shakespeare")
  cli.run(main, USAGE, __doc__)
