"""Bits per byte: the tokenizer's bytes per id, bytes per token of batches, the eval row."""

import math

import numpy as np
import pytest

from nanotext import metrics
from nanotext.data.tokenizer import EOT, bytes_per_token, get_tokenizer

pytestmark = pytest.mark.fast

TEXT = "ROMEO: But soft, what light through yonder window breaks? ’Tis the east — ça va!\n"


def test_token_bytes_add_up_to_the_utf8_text():
  tok = get_tokenizer("shakespeare")
  ids = tok.encode(TEXT) + [tok.eot_id] + tok.encode(TEXT)
  table = tok.token_bytes()
  assert table[tok.eot_id] == 0  # a separator, not text
  assert int(table[ids].sum()) == 2 * len(TEXT.encode("utf-8"))  # multi-byte characters too


def test_end_of_text_written_in_text_is_text():
  """The Shakespeare tokenizer reads a literal `<|endoftext|>` as characters, as gpt2's does
  (tiktoken's encode_ordinary): only data preparation's inserted id separates documents. It made
  it the separator (a page quoting it split its document in two)."""
  tok = get_tokenizer("shakespeare")
  ids = tok.encode("a " + EOT + " b")
  assert tok.eot_id not in ids and tok.decode(ids) == "a " + EOT + " b"


def test_bytes_per_token_of_batches():
  tok = get_tokenizer("shakespeare")
  ids = np.array(tok.encode(TEXT * 4)[:64]).reshape(2, 32)
  batches = [{"inputs": ids, "targets": ids}, {"inputs": ids, "targets": ids}]
  want = tok.token_bytes()[ids].sum() / ids.size
  assert math.isclose(bytes_per_token(tok, batches), want)
  assert bytes_per_token(get_tokenizer("none"), batches) is None


def test_val_row_and_text():
  row = metrics.val_row(2.0, 4.0)
  assert math.isclose(row["val_bpb"], 2.0 / math.log(2) / 4.0)
  assert metrics.val_text(row) == "val_loss 2.0000 | val_bpb 0.7213"
  assert metrics.val_row(2.0, None) == {"val_loss": 2.0}
  assert metrics.val_text({"val_loss": 2.0}) == "val_loss 2.0000"


def test_duration():
  assert [metrics.duration(s) for s in (0, 44.6, 60, 185, 3600, 7322)] == [
      "0s", "45s", "1m00s", "3m05s", "1h00m", "2h02m"]
