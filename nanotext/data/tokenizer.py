"""Tokenizers by name: the shipped Shakespeare byte-level BPE, tiktoken gpt2, or none."""

import importlib.resources
import os
from typing import Protocol

from absl import flags
import numpy as np
from tokenizers import Tokenizer as HFTok, decoders, models, pre_tokenizers, trainers

from nanotext import fileio, probes
from nanotext.errors import UserError, write_error
from nanotext.data.corpus import load_corpus

EOT = "<|endoftext|>"
SHAKESPEARE_VOCAB = 8192
NAMES = ("shakespeare", "gpt2", "none")
GPT2_EOT = 50256


class Tokenizer(Protocol):
  """What the data layer and sampling need from a tokenizer."""
  vocab_size: int | None
  eot_id: int | None

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: list[int]) -> str: ...


def shipped_path():
  """Where the Shakespeare tokenizer.json lives inside the package."""
  return importlib.resources.files("nanotext.data") / "shakespeare" / "tokenizer.json"


class HFTokenizer:
  """A `tokenizers.Tokenizer` with the special token `<|endoftext|>`."""

  def __init__(self, tok):
    self._tok = tok
    # `<|endoftext|>` written in text is text, as tiktoken's encode_ordinary reads it: documents
    # are separated by the id, which data preparation inserts (a page quoting the token made
    # false document boundaries)
    tok.encode_special_tokens = True
    self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
    self.eot_id = tok.token_to_id(EOT)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids) -> str:
    # Keep <|endoftext|> visible: samples should show where a document ended.
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    """Encode many texts in parallel (the Rust side uses all cores)."""
    return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

  def token_bytes(self):
    """UTF-8 bytes each id stands for (0 for special tokens such as <|endoftext|>)."""
    out = np.zeros(self.vocab_size, np.int64)
    special = set(self._tok.get_added_tokens_decoder())
    byte_level = type(self._tok.decoder).__name__ == "ByteLevel"
    for piece, i in self._tok.get_vocab(with_added_tokens=False).items():
      if i in special:
        continue
      # Byte-level BPE spells each byte as one character; decoding one id alone could split a
      # multi-byte character into replacement characters.
      out[i] = len(piece) if byte_level else len(self._tok.decode([i]).encode("utf-8"))
    return out


class TiktokenTokenizer:
  """tiktoken's GPT-2 encoding (the FineWeb / speedrun tokenizer)."""

  def __init__(self, enc):
    self._enc = enc
    self.vocab_size = enc.n_vocab
    self.eot_id = enc.eot_token

  def encode(self, text: str) -> list[int]:
    return self._enc.encode_ordinary(text)

  def decode(self, ids) -> str:
    """Ids past the encoding's (a vocabulary padded to 50304: rows no token has, which a
    young model samples) stand for no text; tiktoken raised KeyError on them."""
    return self._enc.decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

  def token_bytes(self):
    """Bytes each id stands for (0 for <|endoftext|>)."""
    special = set(self._enc.special_tokens_set)
    return np.array([0 if self._enc.decode_single_token_bytes(i).decode("latin-1") in special
                     else len(self._enc.decode_single_token_bytes(i))
                     for i in range(self.vocab_size)], np.int64)


class NoTokenizer:
  """For data that is already tokens: no vocabulary, no text."""
  vocab_size = None
  eot_id = None

  def encode(self, text: str) -> list[int]:
    raise UserError("data.tokenizer is 'none': cannot encode text; set data.tokenizer")

  def decode(self, ids) -> str:
    raise UserError("data.tokenizer is 'none': cannot decode tokens; set data.tokenizer")


def bytes_per_token(tokenizer, batches) -> float | None:
  """Text bytes per target token over `batches` ({"targets": ids}); None without a vocabulary.

  val_loss / ln 2 / bytes_per_token is bits per byte: comparable across tokenizers.
  """
  table = getattr(tokenizer, "token_bytes", None)
  if table is None or not batches:
    return None
  lengths = table()
  targets = np.concatenate([np.asarray(b["targets"]).ravel() for b in batches])
  if targets.size and int(targets.max()) >= len(lengths):  # another tokenizer's ids: clipped,
    return None                                            # they gave a bpb of nothing
  total = int(lengths[np.clip(targets, 0, len(lengths) - 1)].sum())
  return total / targets.size if total else None


def train_tokenizer(texts, vocab_size: int = SHAKESPEARE_VOCAB):
  """Train a GPT-2-style byte-level BPE on `texts`; returns a `tokenizers.Tokenizer`."""
  tok = HFTok(models.BPE())
  # GPT-2 regex split + byte mapping: every string is encodable and decodes back exactly.
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[EOT],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
  tok.train_from_iterator(texts, trainer=trainer)
  return tok


def get_tokenizer(name: str) -> Tokenizer:
  """The tokenizer called `name` (one of NAMES)."""
  if name == "shakespeare":
    path = shipped_path()
    if not path.is_file():
      raise UserError(
          f"shipped tokenizer '{path}' is missing: run python -m nanotext.data.tokenizer --train")
    try:
      return HFTokenizer(HFTok.from_str(path.read_text(encoding="utf-8")))
    except Exception as e:  # tokenizers raises its own Exception type for a bad file
      why = (str(e).splitlines() or [type(e).__name__])[0][:120]
      raise UserError(f"shipped tokenizer '{path}' is damaged ({why}): reinstall nanotext, "
                      "or rebuild it with python -m nanotext.data.tokenizer --train") from None
  if name == "gpt2":
    try:
      import tiktoken
    except ImportError:
      raise UserError("the 'gpt2' tokenizer (data.tokenizer, or text_shards' --tokenizer) needs "
                      "tiktoken: pip install -e '.[gpt2]' (or tiktoken), or choose the shipped "
                      "'shakespeare'") \
          from None
    try:
      return TiktokenTokenizer(tiktoken.get_encoding("gpt2"))
    except Exception as e:  # tiktoken downloads its vocabulary on first use.
      raise UserError(
          f"cannot load the tiktoken gpt2 encoding ({type(e).__name__}: {e}); it needs the "
          "network once, or TIKTOKEN_CACHE_DIR pointing at a cached copy") from None
  if name == "none":
    return NoTokenizer()
  raise UserError(f"unknown tokenizer '{name}': data.tokenizer must be one of {', '.join(NAMES)}")


def known_eot_id(name: str) -> int | None:
  """The end-of-text id of tokenizer `name` without loading heavy vocabularies (None: none)."""
  if name == "gpt2":
    return GPT2_EOT  # Known constant: avoids tiktoken and its network fetch.
  return get_tokenizer(name).eot_id


def resolve_eot_id(data_cfg) -> int | None:
  """The end-of-text id of a data config: data.eot_id if set, else its tokenizer's (or None)."""
  if data_cfg.eot_id >= 0:
    return int(data_cfg.eot_id)
  return known_eot_id(data_cfg.tokenizer)


def known_vocab_size(name: str) -> int | None:
  """The vocabulary size of tokenizer `name` without loading heavy vocabularies (None: none)."""
  if name == "gpt2":
    return GPT2_EOT + 1  # tiktoken gpt2: 50257 ids, <|endoftext|> last
  return get_tokenizer(name).vocab_size


USAGE = "usage: python -m nanotext.data.tokenizer --train [--vocab_size=N] [--out=FILE]"


def save(tok, out: str) -> None:
  """tokenizer.json written next to `out` and renamed into place: a full disk or a size limit
  is one line and leaves `out` as it was."""
  tmp = os.path.join(os.path.dirname(os.path.abspath(out)),
                     f".{os.path.basename(out)}.tmp-{os.getpid()}")
  try:
    tok.save(tmp)
    fileio.replace_synced(tmp, out)
  except Exception as e:  # tokenizers (Rust) names the errno in its message
    err = write_error(e, f"cannot write '{out}'")
    if err is None:
      raise
    raise err from None
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


def main(args) -> None:
  """CLI: --train regenerates the shipped Shakespeare tokenizer.json."""
  if args:
    raise UserError(f"unexpected arguments: {' '.join(args)}; {USAGE}")
  if not flags.FLAGS.train:
    raise UserError(f"nothing to do: pass --train to regenerate the shipped tokenizer; {USAGE}")
  if flags.FLAGS.vocab_size < 257:  # it trained 257 ids for --vocab_size=10, silently
    raise UserError(f"--vocab_size={flags.FLAGS.vocab_size}: a byte-level BPE has at least 257 "
                    "ids (256 bytes and <|endoftext|>)")
  out = flags.FLAGS.out or str(shipped_path())
  probes.replaceable(out, "--out")  # before the minutes of training
  tok = train_tokenizer([text for _, text in load_corpus()], flags.FLAGS.vocab_size)
  save(tok, out)
  print(f"wrote {out} (vocab {tok.get_vocab_size()}, eot id {tok.token_to_id(EOT)})")


if __name__ == "__main__":
  from nanotext import cli
  flags.DEFINE_bool("train", False, "train the Shakespeare BPE on the embedded corpus")
  flags.DEFINE_integer("vocab_size", SHAKESPEARE_VOCAB, "vocabulary size including <|endoftext|>")
  flags.DEFINE_string("out", "", "where to write tokenizer.json; '' = the shipped file")
  cli.run(main, USAGE, __doc__)
