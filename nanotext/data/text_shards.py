"""Your own text as `.bin` shards: `python -m nanotext.data.text_shards FILE [FILE ...] --out=DIR`.

Each file is one document, `<|endoftext|>` before its tokens (the FineWeb shards' convention);
the documents go in the order given. The last `--val_fraction` of the tokens form the validation
shard, the rest training shards of at most `--shard_tokens` tokens. The folder is written whole
or not at all; its meta.json records the tokenizer, the counts and the files.
"""

import codecs
import glob
import json
import os
import shlex
import time

import numpy as np
from absl import flags

from nanotext import signals
from nanotext.data import binfile
from nanotext.data.tokenizer import get_tokenizer
from nanotext.errors import UserError
from nanotext.outputs import check_out, staged_dir

USAGE = ("usage: python -m nanotext.data.text_shards FILE [FILE ...] --out=DIR "
         "[--tokenizer=gpt2|shakespeare] [--val_fraction=F] [--shard_tokens=N] [--force]")
TOKENIZERS = ("gpt2", "shakespeare")


def check_file(path: str) -> None:
  """UserError for an input path that is not a file."""
  if not os.path.isfile(path):
    raise UserError(f"'{path}' is not a file; give text files (a shell glob such as "
                    "'corpus/*.txt' names many)")


def read_text(path: str) -> str:
  """A document's text, line ends as \n and a leading byte-order mark dropped (an editor's mark,
  not text); UserError for a path that is not a readable UTF-8 file."""
  check_file(path)
  try:
    with open(path, encoding="utf-8-sig") as f:
      return f.read()
  except UnicodeDecodeError as e:
    # utf-8-sig counts from after a byte-order mark: the offset said is the file's own
    at = e.start + (len(codecs.BOM_UTF8) if _starts_with_bom(path) else 0)
    raise UserError(f"'{path}' is not UTF-8 text (byte {at}): convert it first") from None
  except OSError as e:
    raise UserError(f"cannot read '{path}' ({e.strerror})") from None


def _starts_with_bom(path: str) -> bool:
  with open(path, "rb") as f:
    return f.read(len(codecs.BOM_UTF8)) == codecs.BOM_UTF8


def tokenize(paths, tokenizer, log=lambda s: None, every_s: float = 5.0) -> np.ndarray:
  """The token stream of the documents: `<|endoftext|>` + each file's tokens, as uint16."""
  if tokenizer.vocab_size > 2**16:
    raise UserError(f"a vocabulary of {tokenizer.vocab_size} ids does not fit .bin shards' "
                    "uint16 tokens")
  docs, total, last = [], 0, time.monotonic()
  for i, path in enumerate(paths):
    ids = tokenizer.encode(read_text(path))
    docs.append(np.asarray([tokenizer.eot_id, *ids], dtype=np.uint16))
    total += docs[-1].size
    if time.monotonic() - last > every_s:
      log(f"tokenized {i + 1:,}/{len(paths):,} files, {total:,} tokens")
      last = time.monotonic()
  return np.concatenate(docs) if docs else np.zeros(0, np.uint16)


def split(tokens: np.ndarray, val_fraction: float) -> tuple:
  """(train, val): val is the stream's last `val_fraction` (at least one token each)."""
  n_val = int(round(tokens.size * val_fraction))
  if tokens.size < 2 or not 0 < n_val < tokens.size:
    raise UserError(f"{tokens.size:,} token{'s' * (tokens.size != 1)} cannot be split into "
                    "training and validation "
                    f"tokens at --val_fraction={val_fraction}: give more text or another fraction")
  return tokens[:-n_val], tokens[-n_val:]


def check_shard_tokens(shard_tokens: int) -> None:
  """UserError for a --shard_tokens no shard can hold, before minutes of tokenizing."""
  if shard_tokens < 1:
    raise UserError(f"--shard_tokens={shard_tokens} must be positive")
  if shard_tokens > binfile.MAX_TOKENS:
    raise UserError(f"--shard_tokens={shard_tokens} is more than the {binfile.MAX_TOKENS:,} "
                    "tokens a .bin shard's header counts (an int32): give a smaller one")


# What --force may replace: an earlier output of this tool (not, say, a pytorch_model.bin).
OWN = ("meta.json", "train_" + "[0-9]" * 6 + ".bin", "val_" + "[0-9]" * 6 + ".bin")


def write_shards(out: str, tokens: np.ndarray, *, val_fraction: float, shard_tokens: int,
                 meta: dict, force: bool = False) -> dict:
  """train_NNNNNN.bin, val_NNNNNN.bin and meta.json in `out`, replacing it only when whole."""
  check_shard_tokens(shard_tokens)
  train, val = split(tokens, val_fraction)
  starts = range(0, train.size, shard_tokens)
  with staged_dir(out, force=force, own=OWN) as tmp:
    for k, start in enumerate(starts):
      shard = train[start:start + shard_tokens]
      binfile.write_shard(os.path.join(tmp, f"train_{k:06d}.bin"), shard)
    # One shard, unless the split is longer than a shard's header counts (--val_fraction
    # is not bounded by --shard_tokens): then as many as it takes.
    for k, start in enumerate(range(0, val.size, binfile.MAX_TOKENS)):
      binfile.write_shard(os.path.join(tmp, f"val_{k:06d}.bin"),
                          val[start:start + binfile.MAX_TOKENS])
    meta = {**meta, "train_tokens": int(train.size), "val_tokens": int(val.size),
            "train_shards": len(starts)}
    with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
      f.write(json.dumps(meta, indent=2) + "\n")
  return meta


def main(args) -> None:
  """CLI: tokenize the files, write the shards, and print the command that trains on them."""
  F = flags.FLAGS
  if not args:
    raise UserError(f"give the text files to tokenize; {USAGE}")
  if not F.out:
    raise UserError(f"--out is required; {USAGE}")
  if not 0 < F.val_fraction < 1:
    raise UserError(f"--val_fraction={F.val_fraction} must lie between 0 and 1")
  check_shard_tokens(F.shard_tokens)
  seen = {}
  for i, path in enumerate(args):  # every name, before minutes of tokenizing (nothing written)
    check_file(path)
    st = os.stat(path)  # a link, another spelling or a hard link: its text trained on twice
    j = seen.setdefault((st.st_dev, st.st_ino), i)
    if j != i:
      raise UserError(f"'{path}' is given twice: give each file once" if args[j] == path else
                      f"'{path}' and '{args[j]}' are the same file: give it once")
  out = os.path.abspath(os.path.expanduser(F.out))
  check_out(out, force=F.force, protect=[os.path.abspath(a) for a in args], own=OWN)
  tok = get_tokenizer(F.tokenizer)
  tokens = tokenize(args, tok, log=print)
  meta = write_shards(out, tokens, val_fraction=F.val_fraction, shard_tokens=F.shard_tokens,
                      force=F.force, meta={"tokenizer": F.tokenizer, "vocab_size": tok.vocab_size,
                                           "eot_id": tok.eot_id, "files": list(args)})
  # The shards are in place: a Ctrl-C while the summary is made (a config read) said only
  # 'interrupted', exit 130; it now waits for the lines and says the output is complete.
  with signals.held("after --out was written: it is complete"):
    print(summary(out, meta, F.tokenizer, tok.vocab_size, F.shard_tokens), flush=True)


def summary(out: str, meta: dict, tokenizer: str, vocab_size: int, shard_tokens: int) -> str:
  """What was written, and the command that trains on it."""
  vocab = -(-vocab_size // 128) * 128  # the head rounded up to 128 rows
  n_val = -(-meta["val_tokens"] // binfile.MAX_TOKENS)
  lines = [f"wrote {meta['train_shards']} training shard(s) of {meta['train_tokens']:,} tokens "
           f"and {'a validation shard' if n_val == 1 else f'{n_val} validation shards'} of "
           f"{meta['val_tokens']:,} to {out}"]
  files = [shlex.quote(f"data.{kind}_files={glob.escape(out)}/{kind}_*.bin")
           for kind in ("train", "val")]
  n = meta["train_tokens"]
  sizes = [min(shard_tokens, n - start) for start in range(0, n, shard_tokens)]
  suffix, note = fitting_batch(sizes, meta["val_tokens"])
  lines.append(f"train on them: python -m nanotext.train configs/base.yml data.source=bin "
               f"{files[0]} {files[1]} data.tokenizer={tokenizer} model.vocab_size={vocab}{suffix}")
  return "\n".join(lines + [note] * bool(note))


def fitting_batch(train_sizes, val_tokens: int) -> tuple:
  """(' train.batch_size=K', '') where the training shards (tokens each) or the validation shard
  hold under one batch of configs/base.yml's rows (K a power of two: the printed command failed
  on its validation data); ('', a note) where they hold no row; ('', '') where a batch fits. A
  row never spans two shards."""
  from nanotext import config
  t = config.load(str(config.SCHEMA_PATH)).train
  rows = lambda sizes: sum(max(n - 1, 0) // t.seq_len for n in sizes)  # noqa: E731
  fewest = min(rows(train_sizes), rows([val_tokens]))
  if fewest >= t.batch_size:
    return "", ""
  if fewest >= 1:
    return f" train.batch_size={2 ** (fewest.bit_length() - 1)}", ""
  notes = []
  if rows([sum(train_sizes)]) >= 1 and not rows(train_sizes):
    notes.append(f"note: training shards of {max(train_sizes):,} tokens hold no row of "
                 f"configs/base.yml's train.seq_len={t.seq_len} (a row does not span shards): "
                 "give a larger --shard_tokens")
  for tokens in (sum(train_sizes), val_tokens):
    if not rows([tokens]):
      notes.append(f"note: a split of {tokens:,} tokens holds no row of configs/base.yml's "
                   f"train.seq_len={t.seq_len}: train with a shorter train.seq_len, or give "
                   "more text or another --val_fraction")
      break
  return "", "\n".join(notes)


if __name__ == "__main__":
  from nanotext import cli
  flags.DEFINE_string("out", "", "the folder to write the shards to")
  flags.DEFINE_enum("tokenizer", "gpt2", TOKENIZERS, "gpt2 (tiktoken, 50,257 ids: the gpt2 "
                    "extra) or shakespeare (the shipped BPE, 8,192 ids)")
  flags.DEFINE_float("val_fraction", 0.01, "the stream's last fraction held out for validation")
  flags.DEFINE_integer("shard_tokens", 100_000_000, "tokens per training shard at most")
  flags.DEFINE_bool("force", False, "replace an existing --out")
  cli.run(main, USAGE, __doc__)
