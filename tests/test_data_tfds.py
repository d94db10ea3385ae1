"""The data pipeline on a TFDS source (data.source=tfds): needs tensorflow-datasets (the tfds extra)."""

import numpy as np
import pytest

from nanotext.data.pipeline import make_train_iter, make_val_batches
from nanotext.errors import UserError
from conftest import extra
from test_data import assert_same, data_cfg, take

tfds = extra("tfds")
pytestmark = [pytest.mark.fast, pytest.mark.tfds]


class NanotextTinyDocs(tfds.core.GeneratorBasedBuilder):
  """A tiny tokenized-documents data set, built locally in array_record format."""
  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
        {"tokens": tfds.features.Tensor(shape=(None,), dtype=np.int32)}))

  def _split_generators(self, dl_manager):
    return {"train": self._generate_examples(100, 30),
            "validation": self._generate_examples(5000, 6)}

  def _generate_examples(self, start, n):
    for i in range(n):
      yield i, {"tokens": np.arange(start + 100 * i, start + 100 * i + 5 + 3 * i, dtype=np.int32)}


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  """data_dir holding the prepared nanotext_tiny_docs data set."""
  path = str(tmp_path_factory.mktemp("tfds"))
  NanotextTinyDocs(data_dir=path, file_format="array_record").download_and_prepare()
  return path


def test_tfds_train_iter(tfds_dir):
  cfg = data_cfg(source="tfds", tfds_name="nanotext_tiny_docs", tfds_dir=tfds_dir, eot_id=1)
  # The stream the packer should see: every document, in record order, after an eot of 1.
  docs = tfds.data_source("nanotext_tiny_docs", split="train", data_dir=tfds_dir)
  stream = np.concatenate([np.concatenate([[1], d["tokens"]]) for d in docs])
  windows = {tuple(stream[i * 16:i * 16 + 17]) for i in range((len(stream) - 1) // 16)}
  it = make_train_iter(cfg, seq_len=16, batch_size=3, seed=0)
  seen = set()
  for batch in take(it, (len(windows)) // 3):
    assert batch["inputs"].shape == (3, 16) and batch["inputs"].dtype == np.int32
    for x, y in zip(batch["inputs"], batch["targets"]):
      row = tuple(np.concatenate([x, y[-1:]]))
      assert row in windows  # Windows span document boundaries with the separator between.
      seen.add(row)
  assert len(seen) == 3 * (len(windows) // 3)
  state = it.get_state()
  expected = take(it, 4)
  fresh = make_train_iter(cfg, seq_len=16, batch_size=3, seed=0)
  fresh.set_state(state)
  assert_same(take(fresh, 4), expected)


def test_tfds_val_and_errors(tfds_dir):
  cfg = data_cfg(source="tfds", tfds_name="nanotext_tiny_docs", tfds_dir=tfds_dir, eot_id=-1,
                 tokenizer="none")
  # No separator (eot_id -1, tokenizer none): documents simply concatenated in record order.
  docs = tfds.data_source("nanotext_tiny_docs", split="validation", data_dir=tfds_dir)
  stream = np.concatenate([d["tokens"] for d in docs])
  val = make_val_batches(cfg, seq_len=4, batch_size=2, num_batches=3)
  assert len(val) == 3
  got = np.concatenate([b["inputs"].reshape(-1) for b in val])
  np.testing.assert_array_equal(got, stream[:24])  # The first windows, in order.
  assert len(make_val_batches(cfg, seq_len=4, batch_size=2, num_batches=99)) == (
      (len(stream) - 1) // 4 // 2)
  with pytest.raises(UserError, match=r"no_such_data_set"):
    make_train_iter(data_cfg(source="tfds", tfds_name="no_such_data_set", tfds_dir=tfds_dir),
                    seq_len=4, batch_size=2, seed=0)
  with pytest.raises(UserError, match=r"data.tfds_field"):
    make_train_iter(data_cfg(source="tfds", tfds_name="nanotext_tiny_docs", tfds_dir=tfds_dir,
                             tfds_field="ids"), seq_len=4, batch_size=2, seed=0)


def test_tfds_ids_past_the_vocabulary_are_refused(tfds_dir):
  """The validation ids reach 5,000 and more: past 512 embedding rows, named with the data set."""
  cfg = data_cfg(source="tfds", tfds_name="nanotext_tiny_docs", tfds_dir=tfds_dir, eot_id=1)
  with pytest.raises(UserError, match=r"TFDS data set 'nanotext_tiny_docs' split 'validation' "
                     r"holds token id 5\d{3} \(in document \d\), not in \[0, 512\)"):
    make_val_batches(cfg, seq_len=4, batch_size=2, num_batches=1, vocab_size=512)
