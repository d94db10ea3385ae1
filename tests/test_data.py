"""Tests of the data layer: shards, tokenizer, corpus, preparation, pipelines, sources."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import importlib.util
import json
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
import yaml

from conftest import BASE, TINY, one_line_error, record_syncs, run_cli, synced_around_rename
from nanotext.data import binfile, pipeline, prepare
from nanotext.data.corpus import load_corpus
from nanotext.data.pipeline import check_config, make_train_iter, make_val_batches
from nanotext.data.prepare import VAL_WORKS, prepare_shakespeare
from nanotext.data.tokenizer import get_tokenizer, train_tokenizer
from nanotext.errors import UserError

pytestmark = pytest.mark.fast

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def data_cfg(**overrides) -> ml_collections.ConfigDict:
  """The `data:` section of configs/base.yml with some keys changed."""
  with open(os.path.join(REPO, "configs", "base.yml")) as f:
    cfg = ml_collections.ConfigDict(yaml.safe_load(f)["data"])
  cfg.update(overrides)
  return cfg


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
  """The Shakespeare shards, prepared once per session (a few seconds)."""
  return prepare_shakespeare(str(tmp_path_factory.mktemp("shakespeare")))


@pytest.fixture
def arange_bins(tmp_path):
  """Two train shards and one val shard whose tokens are their positions: windows are traceable."""
  binfile.write_shard(tmp_path / "train_0.bin", np.arange(0, 1000))
  binfile.write_shard(tmp_path / "train_1.bin", np.arange(1000, 2000))
  binfile.write_shard(tmp_path / "val_0.bin", np.arange(5000, 5500))
  return data_cfg(source="bin", train_files=str(tmp_path / "train_*.bin"),
                  val_files=str(tmp_path / "val_*.bin"))


def take(it, n):
  """The next n batches of an iterator."""
  return [next(it) for _ in range(n)]


def assert_same(a, b):
  """Two lists of batches are equal."""
  assert len(a) == len(b)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["inputs"], y["inputs"])
    np.testing.assert_array_equal(x["targets"], y["targets"])


# --- .bin shards -------------------------------------------------------------------------------


def test_shard_round_trip(tmp_path):
  tokens = np.array([0, 1, 65535, 50256, 7], dtype=np.int64)
  path = tmp_path / "deep" / "dir" / "a.bin"
  binfile.write_shard(str(path), tokens)
  out = binfile.read_shard(str(path))
  assert out.dtype == np.uint16 and isinstance(out, np.memmap)
  np.testing.assert_array_equal(out, tokens)
  assert os.path.getsize(path) == 1024 + 2 * len(tokens)
  assert os.listdir(path.parent) == ["a.bin"]  # No temp file left behind.


def test_write_rejects_out_of_range(tmp_path):
  for bad in ([1, 65536], [-1, 3]):
    with pytest.raises(UserError, match=r"\[0, 65536\)"):
      binfile.write_shard(str(tmp_path / "x.bin"), bad)
  assert not os.listdir(tmp_path)


def _raw_shard(path, header_words, n_tokens):
  """A shard with a hand-made header."""
  header = np.zeros(256, dtype="<i4")
  header[:len(header_words)] = header_words
  with open(path, "wb") as f:
    f.write(header.tobytes() + np.zeros(n_tokens, dtype="<u2").tobytes())
  return str(path)


@pytest.mark.parametrize("make,pattern", [
    (lambda p: _raw_shard(p, [123, 1, 4], 4), r"magic number 123, expected 20240520"),
    (lambda p: _raw_shard(p, [20240520, 7, 4], 4), r"version 7, expected 1"),
    (lambda p: _raw_shard(p, [20240520, 1, 10], 4), r"claims 10 tokens but the file holds 4"),
    (lambda p: _raw_shard(p, [20240520, 1, -5], 4), r"claims -5 tokens, a negative count"),
    # More than the header says (read as its 10 tokens, the rest ignored), a stray byte after.
    (lambda p: _raw_shard(p, [20240520, 1, 10], 5000), r"claims 10 tokens .*\(5000 tokens\)"),
    (lambda p: _raw_shard(p, [20240520, 1, 4], 4) and open(p, "ab").write(b"x") and str(p),
     r"claims 4 tokens .*4 tokens and a stray byte"),
    (lambda p: p.write_bytes(b"\x00" * 100) and str(p), r"100 bytes, shorter than the 1024"),
    (lambda p: str(p), r"does not exist"),
])
def test_bad_shards(tmp_path, make, pattern):
  path = make(tmp_path / "bad.bin")
  with pytest.raises(UserError, match=pattern) as e:
    binfile.read_shard(path)
  assert "bad.bin" in str(e.value)


def test_find_shards(tmp_path):
  for name in ("b.bin", "a.bin", "c.txt"):
    (tmp_path / name).write_bytes(b"")
  assert binfile.find_shards(str(tmp_path / "*.bin")) == [
      str(tmp_path / "a.bin"), str(tmp_path / "b.bin")]
  with pytest.raises(UserError, match=r"matches no file: check data.val_files"):
    binfile.find_shards(str(tmp_path / "nope_*.bin"), key="data.val_files")
  with pytest.raises(UserError, match=r"data.train_files is empty"):
    binfile.find_shards("")


# --- tokenizer and corpus ----------------------------------------------------------------------


def test_shakespeare_tokenizer():
  tok = get_tokenizer("shakespeare")
  assert tok.vocab_size == 8192
  assert 0 <= tok.eot_id < tok.vocab_size
  text = "ROMEO:\nBut, soft! what light through yonder window breaks?\n\n\tIt is the east.  ~{}|"
  ids = tok.encode(text)
  assert all(0 <= i < 8192 for i in ids) and len(ids) < len(text) / 2
  assert tok.decode(ids) == text
  assert tok.decode([tok.eot_id]) == "<|endoftext|>"


def test_train_tokenizer_small():
  tok = train_tokenizer(["hello world, hello there"] * 10, vocab_size=300)
  assert 257 < tok.get_vocab_size() <= 300  # 256 bytes + eot + merges (few in a tiny corpus).
  assert tok.token_to_id("<|endoftext|>") == 0
  assert tok.decode(tok.encode("xyz hello!").ids) == "xyz hello!"  # Unseen bytes still round trip.


def test_a_saved_tokenizer_is_on_disk_before_its_rename(tmp_path, monkeypatch):
  """tokenizer.json is fsynced before the rename onto --out, its folder after, as atomic_write
  does: a power cut after the rename could leave the shipped tokenizer empty."""
  from nanotext.data import tokenizer
  tok = train_tokenizer(["hello world, hello there"] * 10, vocab_size=300)
  events = record_syncs(monkeypatch)
  out = str(tmp_path / "tokenizer.json")
  tokenizer.save(tok, out)
  synced_around_rename(events, [out], out)


def test_the_shipped_shards_are_not_read_as_gpt2_ids():
  """data.source=shakespeare with data.tokenizer=gpt2 (from-hf of a real GPT-2 set the tokenizer
  and kept base.yml's source): its ids were read, scored and sampled as gpt2's, val_loss 10.8,
  exit 0."""
  from conftest import BASE
  from nanotext import wiring
  with pytest.raises(UserError, match="data.source=shakespeare holds ids of the shipped "
                                      "'shakespeare' tokenizer, not data.tokenizer=gpt2's"):
    wiring.load(BASE, ["data.tokenizer=gpt2"])
  wiring.load(BASE, ["data.tokenizer=none"])  # ids without text: read as they are


def test_tokenizer_errors():
  with pytest.raises(UserError, match=r"shakespeare, gpt2, none"):
    get_tokenizer("bpe9000")
  none = get_tokenizer("none")
  with pytest.raises(UserError, match=r"data.tokenizer"):
    none.encode("x")
  with pytest.raises(UserError, match=r"data.tokenizer"):
    none.decode([1])


def test_gpt2_without_tiktoken_is_a_user_error():
  if importlib.util.find_spec("tiktoken") is not None:
    pytest.skip("tiktoken installed; loading gpt2 may need the network")
  with pytest.raises(UserError, match=r"tiktoken"):
    get_tokenizer("gpt2")


def test_corpus():
  corpus = load_corpus()
  names = [name for name, _ in corpus]
  assert len(corpus) == 42 and names == sorted(names)
  assert set(VAL_WORKS) <= set(names)
  assert 5_000_000 < sum(len(text) for _, text in corpus) < 5_200_000
  assert dict(corpus)["hamlet_gut"].startswith("HAMLET, PRINCE OF DENMARK")


# --- preparation -------------------------------------------------------------------------------


def test_prepare_writes_valid_shards(prepared):
  train = binfile.read_shard(os.path.join(prepared["dir"], "train_000000.bin"))
  val = binfile.read_shard(os.path.join(prepared["dir"], "val_000000.bin"))
  assert len(train) == prepared["train_tokens"] > 1_000_000
  assert len(val) == prepared["val_tokens"] > 50_000
  with open(os.path.join(prepared["dir"], "meta.json")) as f:
    meta = json.load(f)
  assert meta["vocab_size"] == 8192 and meta["tokenizer"] == "shakespeare"
  assert 5.0 < meta["unigram_entropy_nats"] < np.log(8192)
  eot = meta["eot_id"]
  # One separator BEFORE each document: 40 train works, 2 val works.
  assert train[0] == eot and val[0] == eot
  assert (train == eot).sum() == 40 and (val == eot).sum() == 2


def test_prepare_split_is_disjoint_and_whole_works(prepared):
  tok = get_tokenizer("shakespeare")
  docs = dict(load_corpus())

  def split_docs(name):
    tokens = np.asarray(binfile.read_shard(os.path.join(prepared["dir"], name)))
    starts = np.flatnonzero(tokens == tok.eot_id)
    return [tok.decode(d[1:]) for d in np.split(tokens, starts[1:])]

  val_docs, train_docs = split_docs("val_000000.bin"), split_docs("train_000000.bin")
  assert val_docs == [docs[name] for name in sorted(VAL_WORKS)]
  assert train_docs == [text for name, text in sorted(docs.items()) if name not in VAL_WORKS]


def test_prepare_is_idempotent(prepared):
  paths = [os.path.join(prepared["dir"], f) for f in ("train_000000.bin", "val_000000.bin",
                                                      "meta.json")]
  before = [os.stat(p).st_mtime_ns for p in paths]
  again = prepare_shakespeare(prepared["dir"])
  assert [os.stat(p).st_mtime_ns for p in paths] == before
  assert again == prepared


def test_prepare_detects_a_corrupt_cache(prepared, tmp_path):
  # Checks the cache test only: a rebuild re-tokenizes the corpus, which the fixture covers.
  digest = prepare._tokenizer_digest()
  out = tmp_path / "copy"
  out.mkdir()
  for name in ("train_000000.bin", "val_000000.bin", "meta.json"):
    (out / name).write_bytes(open(os.path.join(prepared["dir"], name), "rb").read())
  assert prepare._cached(str(out), digest)["val_tokens"] == prepared["val_tokens"]
  assert prepare._cached(str(out), "other tokenizer") is None
  with open(out / "val_000000.bin", "r+b") as f:
    f.truncate(2000)
  assert prepare._cached(str(out), digest) is None


def test_prepare_cli(prepared):
  env = {**os.environ, "PYTHONPATH": REPO}
  ok = subprocess.run([sys.executable, "-m", "nanotext.data.prepare", "--out", prepared["dir"]],
                      capture_output=True, text=True, env=env, cwd=REPO, check=False)
  assert ok.returncode == 0, ok.stderr
  assert f"{prepared['train_tokens']:,}" in ok.stdout and "nats/token" in ok.stdout
  bad = subprocess.run([sys.executable, "-m", "nanotext.data.prepare", "--out",
                        "/proc/nanotext-cannot-write"],
                       capture_output=True, text=True, env=env, cwd=REPO, check=False)
  assert bad.returncode == 2
  assert bad.stderr.startswith("nanotext: error: ") and "Traceback" not in bad.stderr


# --- training iterator -------------------------------------------------------------------------


def test_train_iter_shapes_and_shift(arange_bins):
  it = make_train_iter(arange_bins, seq_len=8, batch_size=4, seed=0)
  for batch in take(it, 20):
    assert set(batch) == {"inputs", "targets"}
    for v in batch.values():
      assert v.shape == (4, 8) and v.dtype == np.int32
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    # Windows are contiguous token runs that never cross a shard boundary (999 -> 1000).
    rows = np.concatenate([batch["inputs"], batch["targets"][:, -1:]], axis=1)
    assert (np.diff(rows, axis=1) == 1).all()
    assert ((rows[:, 0] < 1000) == (rows[:, -1] < 1000)).all()


def test_train_iter_is_deterministic_and_shuffled(arange_bins):
  a = take(make_train_iter(arange_bins, seq_len=8, batch_size=4, seed=1), 10)
  assert_same(a, take(make_train_iter(arange_bins, seq_len=8, batch_size=4, seed=1), 10))
  b = take(make_train_iter(arange_bins, seq_len=8, batch_size=4, seed=2), 10)
  assert not np.array_equal(a[0]["inputs"], b[0]["inputs"])
  firsts = np.concatenate([x["inputs"][:, 0] for x in a])
  assert not (np.diff(firsts) > 0).all()  # Not in file order.


def test_processes_get_disjoint_data_covering_an_epoch(arange_bins):
  # 2 shards x (999 // 8) = 248 windows; 2 processes x 31 batches x 4 = one epoch.
  starts = []
  for p in range(2):
    it = make_train_iter(arange_bins, seq_len=8, batch_size=4, seed=5, process_index=p,
                         process_count=2)
    starts.append({int(s) for b in take(it, 31) for s in b["inputs"][:, 0]})
  assert not starts[0] & starts[1]
  assert starts[0] | starts[1] == {8 * i for i in range(124)} | {1000 + 8 * i for i in range(124)}


def test_train_iter_state_resumes_exactly(arange_bins):
  it = make_train_iter(arange_bins, seq_len=8, batch_size=4, seed=3)
  take(it, 70)  # Past the first epoch (62 batches): resume must also hold across epochs.
  state = it.get_state()
  expected = take(it, 10)
  fresh = make_train_iter(arange_bins, seq_len=8, batch_size=4, seed=3)
  fresh.set_state(state)
  assert_same(take(fresh, 10), expected)
  json.dumps(state)  # The state is plain JSON: it can sit next to a checkpoint.


def test_shakespeare_source(prepared):
  cfg = data_cfg(source="shakespeare", dir=prepared["dir"])
  batch = next(make_train_iter(cfg, seq_len=64, batch_size=2, seed=0))
  assert batch["inputs"].shape == (2, 64) and batch["inputs"].max() < 8192
  val = make_val_batches(cfg, seq_len=64, batch_size=2, num_batches=3)
  val_tokens = binfile.read_shard(os.path.join(prepared["dir"], "val_000000.bin"))
  np.testing.assert_array_equal(val[0]["inputs"][0], val_tokens[:64])


# --- validation batches ------------------------------------------------------------------------


def test_val_batches(arange_bins):
  # 499 // 8 = 62 windows: 7 full batches of 8, so 7 even when 10 are asked for.
  a = make_val_batches(arange_bins, seq_len=8, batch_size=8, num_batches=10)
  assert len(a) == 7
  assert_same(a, make_val_batches(arange_bins, seq_len=8, batch_size=8, num_batches=10))
  assert a[0]["inputs"][:, 0].tolist() == [5000 + 8 * i for i in range(8)]  # Unshuffled, first.
  assert a[0]["inputs"].shape == (8, 8) and a[0]["targets"].dtype == np.int32
  assert len(make_val_batches(arange_bins, seq_len=8, batch_size=8, num_batches=2)) == 2


def test_val_batches_split_over_processes(arange_bins):
  parts = [make_val_batches(arange_bins, seq_len=8, batch_size=4, num_batches=10,
                            process_index=p, process_count=2) for p in range(2)]
  assert len(parts[0]) == len(parts[1]) == 7
  seen = [int(s) for part in parts for b in part for s in b["inputs"][:, 0]]
  assert sorted(seen) == [5000 + 8 * i for i in range(56)]


def test_val_tokens_cap_and_too_little_data(arange_bins):
  arange_bins.val_tokens = 100  # 99 // 8 = 12 windows: one batch of 8.
  assert len(make_val_batches(arange_bins, seq_len=8, batch_size=8, num_batches=10)) == 1
  # The cap holds the data back: raising it is the way (data.val_tokens cannot add data at 0).
  with pytest.raises(UserError, match=r": raise data.val_tokens=100, or lower train.batch_size"):
    make_val_batches(arange_bins, seq_len=8, batch_size=16, num_batches=10)
  # At 0, or above the data's size, the cap holds nothing back: raising it adds nothing.
  for cap in (0, 1_000_000):
    arange_bins.val_tokens = cap
    with pytest.raises(UserError, match=r": add validation shards to data.val_files, or lower "
                                        r"train.batch_size or train.seq_len$"):
      make_val_batches(arange_bins, seq_len=8, batch_size=4096, num_batches=10)


def test_too_little_unshuffled_validation_data_says_what_there_is(prepared, tmp_path):
  """data.shuffle=false counted whole batches per shard ('holds 0 sequences', Shakespeare's
  holds 274), and advised data.val_files, which data.source=shakespeare refuses."""
  cfg = data_cfg(source="shakespeare", dir=prepared["dir"], shuffle=False)
  for shuffle in (False, True):
    cfg.update(shuffle=shuffle)
    with pytest.raises(UserError, match=r"^validation data holds 274 sequences of 257 tokens, "
                       r"fewer than one global batch of 300 \(train.batch_size\): lower "
                       r"train.batch_size or train.seq_len$"):
      make_val_batches(cfg, seq_len=256, batch_size=300, num_batches=1)
  # Enough sequences, but no shard with a whole batch of them: data.shuffle=true reads them
  for k in range(2):
    binfile.write_shard(tmp_path / f"val_{k}.bin", np.arange(100))
  cfg = data_cfg(source="bin", val_files=str(tmp_path / "val_*.bin"), shuffle=False)
  with pytest.raises(UserError, match=r"holds 6 sequences of 33 tokens, but no shard holds one "
                     r"whole global batch of 4 .*: set data.shuffle=true or lower"):
    make_val_batches(cfg, seq_len=32, batch_size=4, num_batches=1)
  cfg.update(shuffle=True)
  assert len(make_val_batches(cfg, seq_len=32, batch_size=4, num_batches=1)) == 1


def test_bad_data_config(tmp_path):
  with pytest.raises(UserError, match=r"shakespeare, bin, tfds, synthetic"):
    make_train_iter(data_cfg(source="parquet"), seq_len=8, batch_size=2, seed=0)
  with pytest.raises(UserError, match=r"matches no file: check data.train_files"):
    make_train_iter(data_cfg(source="bin", train_files=str(tmp_path / "*.bin")), seq_len=8,
                    batch_size=2, seed=0)
  binfile.write_shard(str(tmp_path / "bad.bin"), [1, 2, 3])
  with open(tmp_path / "bad.bin", "r+b") as f:
    f.write(np.int32(99).tobytes())
  with pytest.raises(UserError, match=r"bad.bin.*magic"):
    make_train_iter(data_cfg(source="bin", train_files=str(tmp_path / "*.bin")), seq_len=8,
                    batch_size=2, seed=0)


# --- the source registry -----------------------------------------------------------------------


class _NpySource:
  """Windows of seq_len + 1 tokens over one .npy file of ids."""

  def __init__(self, path, seq_len):
    self._ids, self._seq_len = np.load(path), seq_len

  def __len__(self):
    return (len(self._ids) - 1) // self._seq_len

  def __getitem__(self, i):
    return self._ids[i * self._seq_len:(i + 1) * self._seq_len + 1].astype(np.int32)


def test_a_registered_source_is_checked_opened_and_fingerprinted(tmp_path, monkeypatch):
  """A source added from outside pipeline.py and fingerprint.py: its keys are checked, its files
  fingerprinted for resume, its splits opened and its text flag honoured, all via the registry."""
  from nanotext.data import fingerprint, pipeline, registry
  from nanotext.data.pipeline import val_bytes_per_token
  np.save(tmp_path / "train.npy", np.arange(200))
  np.save(tmp_path / "val.npy", np.arange(500, 600))

  def check(d):
    if not d.dir:
      raise UserError("data.source=npy needs data.dir")

  monkeypatch.setitem(registry.SOURCES, "npy", registry.Source(
      "npy", lambda d, split, *, seq_len, **_: _NpySource(f"{d.dir}/{split}.npy", seq_len),
      check=check, files=lambda d, split: [f"{d.dir}/{split}.npy"], text=False))

  with pytest.raises(UserError, match="needs data.dir"):
    pipeline.check_config(data_cfg(source="npy", dir=""))
  cfg = data_cfg(source="npy", dir=str(tmp_path), tokenizer="shakespeare")
  pipeline.check_config(cfg)
  first = fingerprint.fingerprint(cfg)
  assert [name for name, _, _ in first] == ["train.npy"]
  np.save(tmp_path / "train.npy", np.arange(1, 201))
  assert "train.npy' changed" in fingerprint.fingerprint_change(first, fingerprint.fingerprint(cfg))

  cfg.shuffle = False
  batch = next(make_train_iter(cfg, seq_len=10, batch_size=2, seed=0))
  np.testing.assert_array_equal(batch["inputs"][0], np.arange(1, 11))
  val = make_val_batches(cfg, seq_len=10, batch_size=2, num_batches=1)
  np.testing.assert_array_equal(val[0]["targets"][1], np.arange(511, 521))
  assert val_bytes_per_token(cfg, val) is None  # text=False: no bits per byte
  with pytest.raises(UserError, match="npy"):  # the choices named in errors include it
    pipeline.check_config(data_cfg(source="parquet"))


# --- synthetic ---------------------------------------------------------------------------------


def test_synthetic():
  cfg = data_cfg(source="synthetic")
  a = take(make_train_iter(cfg, seq_len=32, batch_size=4, seed=7, vocab_size=100), 3)
  assert a[0]["inputs"].shape == (4, 32) and a[0]["inputs"].dtype == np.int32
  assert 0 <= min(b["inputs"].min() for b in a) and max(b["inputs"].max() for b in a) < 100
  np.testing.assert_array_equal(a[0]["inputs"][:, 1:], a[0]["targets"][:, :-1])
  assert_same(a, take(make_train_iter(cfg, seq_len=32, batch_size=4, seed=7, vocab_size=100), 3))
  other = next(make_train_iter(cfg, seq_len=32, batch_size=4, seed=8, vocab_size=100))
  assert not np.array_equal(a[0]["inputs"], other["inputs"])
  p1 = next(make_train_iter(cfg, seq_len=32, batch_size=4, seed=7, vocab_size=100,
                            process_index=1, process_count=2))
  assert not np.array_equal(a[0]["inputs"], p1["inputs"])
  val = make_val_batches(cfg, seq_len=32, batch_size=4, num_batches=2, vocab_size=100)
  assert len(val) == 2 and not np.array_equal(val[0]["inputs"], a[0]["inputs"])


def test_the_data_position_resumes_under_another_worker_count(arange_bins):
  """data.workers is resume-ok: grain's own state differs per worker count (0 -> 2 was a
  KeyError, 2 -> 0 too), so the saved state is the position, read back by any count."""
  expected = take(make_train_iter(arange_bins, seq_len=8, batch_size=4, seed=9), 9)
  arange_bins.workers = 2
  two = make_train_iter(arange_bins, seq_len=8, batch_size=4, seed=9)
  assert_same(take(two, 3), expected[:3])
  assert two.get_state() == {"batches": 3}
  # grain's own state of a worker pipeline (checkpoints written before) reads as its position.
  assert pipeline.position(two._it.get_state()) == 3
  two.close()
  arange_bins.workers = 0
  none = make_train_iter(arange_bins, seq_len=8, batch_size=4, seed=9)
  none.set_state(json.loads(json.dumps(two.get_state())))
  assert_same(take(none, 3), expected[3:6])
  arange_bins.workers = 1
  one = make_train_iter(arange_bins, seq_len=8, batch_size=4, seed=9)
  one.set_state(none.get_state())
  assert_same(take(one, 3), expected[6:9])
  one.close()
  assert pipeline.position({"next_index": 4}) == 4  # grain's in-process state
  for bad in ({}, {"batches": -1}, {"batches": "3"}, [3], {"iterators_in_use_states": [{}]}):
    with pytest.raises(UserError, match="not one nanotext reads"):
      pipeline.position(bad)
  with pytest.raises(UserError, match=r"position 100000000000000000000 is past this data's "):
    one.set_state({"batches": 10**20})  # grain's endless stream ended: a StopIteration


def test_workers_start_with_a_standard_stream_closed(monkeypatch):
  """`train ... data.workers=1 >&-` (or `2>&-`): Python's sys.stdout (sys.stderr) is None, and
  the run died at its first batch, flushing it before it starts the resource tracker."""
  before = [os.fstat(fd) for fd in (1, 2)]
  monkeypatch.setattr(sys, "stdout", None)
  monkeypatch.setattr(sys, "stderr", None)
  pipeline._start_quiet_tracker()
  assert all(map(os.path.samestat, before, [os.fstat(fd) for fd in (1, 2)]))  # put back


def test_worker_processes_end_with_the_training_process(arange_bins, tmp_path):
  """A run's exits (os._exit after an error or a signal, a kill) skip grain's cleanup: its
  workers lived on with the caller's pipes open, so `train ... | tail` never returned."""
  script = tmp_path / "orphan.py"
  script.write_text(
      "import os, sys, threading, time, ml_collections\n"
      "from nanotext.data.pipeline import make_train_iter\n"
      "if __name__ == '__main__':\n"
      f"  cfg = ml_collections.ConfigDict({arange_bins.to_dict()!r})\n"
      "  cfg.workers = 2\n"
      "  it = make_train_iter(cfg, seq_len=8, batch_size=4, seed=1)\n"
      "  threading.Thread(target=next, args=(it,), daemon=True).start()\n"
      "  time.sleep(0.5)  # the workers are starting (or have started: either way)\n"
      "  print('exit', flush=True)\n"
      "  os._exit(3)\n")
  # communicate() returns once every holder of the pipes has closed them: the workers included.
  done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                        timeout=300, cwd=REPO)
  assert done.returncode == 3 and done.stdout == "exit\n", done.stderr[-2000:]
  assert done.stderr == ""  # multiprocessing's tracker frees the shared memory without a word


def test_ctrl_c_is_the_training_process_s_not_its_workers(arange_bins, tmp_path):
  """A terminal's Ctrl-C reaches every process of the job: each grain worker printed a
  KeyboardInterrupt traceback beside the run's one line. The workers leave it to the run."""
  script = tmp_path / "ctrl_c.py"
  script.write_text(
      "import os, signal, time, ml_collections\n"
      "from nanotext.data.pipeline import make_train_iter\n"
      "if __name__ == '__main__':\n"
      f"  cfg = ml_collections.ConfigDict({arange_bins.to_dict()!r})\n"
      "  cfg.workers = 1\n"
      "  it = make_train_iter(cfg, seq_len=8, batch_size=4, seed=1)\n"
      "  next(it)  # from the worker: it has started\n"
      "  signal.signal(signal.SIGINT, lambda *a: print('run got SIGINT', flush=True))\n"
      "  os.killpg(0, signal.SIGINT)  # the whole job, as a terminal sends it\n"
      "  time.sleep(1)\n"
      "  next(it)  # the worker still serves batches\n"
      "  it.close()\n"
      "  print('closed', flush=True)\n")
  done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                        timeout=300, cwd=REPO, start_new_session=True)
  assert done.returncode == 0 and done.stdout == "run got SIGINT\nclosed\n", done.stderr[-2000:]
  assert "KeyboardInterrupt" not in done.stderr, done.stderr[-2000:]


def test_too_little_training_data_says_what_there_is(tmp_path):
  """A shard with 3 windows under data.shuffle=false (whole global batches per shard) said it
  held no sequence of 33 tokens; a folder as the shard glob said it did not exist."""
  binfile.write_shard(tmp_path / "train_0.bin", np.arange(100))
  cfg = data_cfg(source="bin", train_files=str(tmp_path / "train_*.bin"), shuffle=False)
  with pytest.raises(UserError, match=r"no training shard holds one whole global batch of 8 "
                     r"sequences of 33 tokens.*100 tokens.*set data.shuffle=true"):
    make_train_iter(cfg, seq_len=32, batch_size=8, seed=0)
  cfg.update(shuffle=True)
  # Fewer sequences than one batch were read anyway, each batch repeating some (53 epochs in 20
  # steps, not a word): refused, as validation data is.
  with pytest.raises(UserError, match=r"training data holds 3 sequences of 33 tokens, fewer than "
                     r"one global batch of 8 \(train.batch_size\)"):
    make_train_iter(cfg, seq_len=32, batch_size=8, seed=0)
  it = make_train_iter(cfg, seq_len=32, batch_size=3, seed=0)
  assert next(it)["inputs"].shape == (3, 32) and it.epochs(20) == 20
  with pytest.raises(UserError, match=r"no sequence of 129 tokens .*100 tokens"):
    make_train_iter(cfg, seq_len=128, batch_size=8, seed=0)
  cfg.update(train_files=str(tmp_path))
  with pytest.raises(UserError, match=r"is a folder: name its .bin files"):
    make_train_iter(cfg, seq_len=32, batch_size=8, seed=0)


def test_shard_windows_never_cross_a_shard(tmp_path):
  from nanotext.data.sources import ShardSource, SyntheticSource
  a, b = str(tmp_path / "a.bin"), str(tmp_path / "b.bin")
  binfile.write_shard(a, np.arange(100) % 50)
  binfile.write_shard(b, np.arange(100, 150) % 50)
  src = ShardSource([a, b], seq_len=16)
  assert len(src) == 99 // 16 + 49 // 16  # windows of 17 tokens (inputs and targets) per shard
  np.testing.assert_array_equal(src[0], np.arange(17) % 50)
  np.testing.assert_array_equal(src[6], np.arange(100, 117) % 50)  # the second shard's first
  with pytest.raises(IndexError):
    src[len(src)]
  syn = SyntheticSource(vocab_size=10, seq_len=8, seed=1)
  np.testing.assert_array_equal(syn[3], SyntheticSource(10, 8, seed=1)[3])
  assert syn[3].shape == (9,) and syn[3].max() < 10


def test_prepare_names_its_own_flag_for_a_folder_it_cannot_make(tmp_path):
  """--out naming a file: the error said to set data.dir, a key the command does not take."""
  (tmp_path / "afile").write_text("mine")
  one_line_error(run_cli("nanotext.data.prepare", f"--out={tmp_path / 'afile'}"),
                 "cannot create the folder", "set --out")
  assert (tmp_path / "afile").read_text() == "mine"


def test_a_cache_folder_it_cannot_make_names_nanotext_cache(tmp_path, monkeypatch):
  """NANOTEXT_CACHE under a file: the line said to set data.dir alone, not the variable that
  chose the folder."""
  (tmp_path / "afile").write_text("mine")
  monkeypatch.setenv("NANOTEXT_CACHE", str(tmp_path / "afile"))
  with pytest.raises(UserError, match=r"cannot create the folder .*: set data.dir \(or "
                                      r"NANOTEXT_CACHE=.*afile, which chose it\)"):
    prepare.prepare_shakespeare()


def test_an_empty_home_is_no_default_folder(monkeypatch):
  """HOME="" (set, empty): ~ expanded to '', and the shards went to /.cache/nanotext in the
  filesystem root. Now one line naming what to set; NANOTEXT_CACHE still chooses."""
  monkeypatch.setenv("HOME", "")
  monkeypatch.delenv("NANOTEXT_CACHE", raising=False)
  with pytest.raises(UserError, match="HOME is empty.*set HOME, NANOTEXT_CACHE or data.dir"):
    prepare.default_dir()
  with pytest.raises(UserError, match="HOME is empty.*or --out$"):
    prepare_shakespeare(None, "--out")
  assert prepare.default_dir(needed=False) == ""
  monkeypatch.setenv("NANOTEXT_CACHE", "/cache")
  assert prepare.default_dir() == "/cache/shakespeare"


def test_bin_needs_train_or_val_files():
  """data.source=bin with neither glob names data.train_files; val_files alone passes the check
  (evaluate reads it; training refuses an empty train_files where it opens them)."""
  with pytest.raises(UserError, match="data.source=bin needs data.train_files"):
    check_config(data_cfg(source="bin", train_files="", val_files=""))
  check_config(data_cfg(source="bin", train_files="", val_files="/some/val_*.bin"))


@pytest.mark.fast
def test_prepare_keeps_a_folder_of_other_shards(tmp_path):
  """--out (or data.dir) naming text_shards' output: prepare wrote its two shards and meta.json
  over that corpus's first ones and kept the rest, a folder of two corpora."""
  binfile.write_shard(tmp_path / "train_000000.bin", np.arange(100))
  binfile.write_shard(tmp_path / "train_000001.bin", np.arange(100))
  (tmp_path / "meta.json").write_text('{"tokenizer": "gpt2", "train_tokens": 200}\n')
  before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
  one_line_error(run_cli("nanotext.data.prepare", f"--out={tmp_path}"),
                 "holds files this preparation did not write", "set --out")
  (tmp_path / "train_000001.bin").unlink()  # one shard and a meta.json of another's: kept too
  with pytest.raises(UserError, match="'meta.json'.*set data.dir"):
    prepare_shakespeare(str(tmp_path))
  assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == \
      {k: v for k, v in before.items() if k != "train_000001.bin"}


@pytest.mark.fast
@pytest.mark.parametrize("key,value,source,other", [
    ("train_files", "/some/*.bin", "bin", "shakespeare"),
    ("val_files", "/some/*.bin", "bin", "shakespeare"),
    ("tfds_name", "mine", "tfds", "shakespeare"), ("tfds_dir", "/some", "tfds", "shakespeare"),
    ("tfds_field", "text", "tfds", "bin"), ("tfds_train_split", "mine", "tfds", "bin"),
    ("tfds_val_split", "mine", "tfds", "shakespeare"),
    ("val_tokens", "10", "shakespeare, bin or tfds", "synthetic"),
    ("dir", "/some", "shakespeare", "bin"), ("dir", "/some", "shakespeare", "tfds")])
def test_a_data_key_the_source_does_not_read_is_refused(key, value, source, other):
  """evaluate data.val_files=mine/*.bin on a shakespeare run printed the run's own figures;
  train with globs matching nothing trained on Shakespeare, exit 0; data.dir under bin or tfds,
  the tfds field and splits under another source and val_tokens under synthetic data were
  ignored. A config's own keys are its source's business (speedrun.yml's FineWeb globs under
  data.source=synthetic); a key given its default is not set."""
  with pytest.raises(UserError, match=f"data.{key} is read only by data.source={source} .*"
                                      f"add data.source={source}"):
    pipeline.check_overrides(data_cfg(source=other), [f"data.{key}={value}"])
  default = data_cfg()[key]
  pipeline.check_overrides(data_cfg(source=other), [f"data.{key}={default}"])  # not set
  if default == "":
    pipeline.check_overrides(data_cfg(source=other), [f"data.{key}= "])  # cleared
  pipeline.check_overrides(data_cfg(source=source.split(",")[0]), [f"data.{key}={value}"])


@pytest.mark.fast
def test_wiring_prepare_refuses_what_train_refuses():
  """wiring.prepare (the Python API's, and compile's) took data.train_files under a synthetic
  source that train.run refuses, and built a run that read none of them."""
  from nanotext import wiring
  with pytest.raises(UserError, match="data.train_files is read only by data.source=bin"):
    wiring.prepare(BASE, TINY + ["data.train_files=/some/*.bin"])


@pytest.mark.fast
def test_a_validation_glob_matching_a_training_shard_is_said(tmp_path):
  """data.train_files=shards/*.bin over a text_shards folder took val_000000.bin too: a val_loss
  of 2.2 against 4.7, the run validating on text it trained on, without a word (the line goes
  to the run's log: tests/test_train.py)."""
  from nanotext.data import registry
  for name in ("train_000000.bin", "val_000000.bin"):
    binfile.write_shard(str(tmp_path / name), np.arange(300) % 50)
  cfg = data_cfg(source="bin", train_files=str(tmp_path / "*.bin"),
                 val_files=str(tmp_path / "val_*.bin"))
  assert len(registry.get("bin").files(cfg, "val")) == 1
  line = registry.get("bin").warn(cfg)
  assert "both match" in line and "val_000000.bin" in line
  cfg.update(train_files=str(tmp_path / "train_*.bin"))
  assert registry.get("bin").warn(cfg) == ""
  cfg.update(train_files=str(tmp_path / "gone_*.bin"))  # training shards moved away: evaluate
  assert registry.get("bin").warn(cfg) == ""


@pytest.mark.fast
def test_shards_of_another_tokenizer_are_refused_and_score_no_bits_per_byte(tmp_path):
  """GPT-2-id shards (text_shards --tokenizer=gpt2) read with data.tokenizer=shakespeare: 85% of
  the ids past its 8,192 were clipped onto one into val_bpb 2.65, documents split at id 0."""
  from nanotext.data import registry
  from nanotext.data.tokenizer import bytes_per_token
  binfile.write_shard(str(tmp_path / "train_000000.bin"), np.arange(300) % 50)
  (tmp_path / "meta.json").write_text(json.dumps({"tokenizer": "gpt2"}))
  cfg = data_cfg(source="bin", train_files=str(tmp_path / "train_*.bin"), tokenizer="shakespeare")
  with pytest.raises(UserError, match="hold gpt2 token ids .* set data.tokenizer=gpt2"):
    registry.get("bin").files(cfg, "train")
  cfg.update(tokenizer="none")
  assert len(registry.get("bin").files(cfg, "train")) == 1
  tok = get_tokenizer("shakespeare")
  assert bytes_per_token(tok, [{"targets": np.array([[5, 9000]])}]) is None
  assert bytes_per_token(tok, [{"targets": np.array([[5, 90]])}]) > 0


@pytest.mark.fast
def test_validation_ids_past_the_tokenizer_without_a_meta_json_are_refused(tmp_path):
  """FineWeb-like shards (no meta.json) of GPT-2 ids read as data.tokenizer=shakespeare trained
  with no val_bpb, no word why, and a sample decoded into Shakespeare's words."""
  from nanotext import wiring
  ids = np.arange(4096) * 4099 % 50257  # GPT-2's ids, most past Shakespeare's 8,192
  for name, shard in (("train", ids), ("val", ids), ("small", ids % 8192)):
    binfile.write_shard(str(tmp_path / f"{name}_000000.bin"), shard)

  def val(split, *more):
    return wiring.prepare(BASE, TINY + [f"data.train_files={tmp_path}/train_*.bin",
                                        f"data.val_files={tmp_path}/{split}_*.bin",
                                        "data.source=bin", "data.tokenizer=shakespeare",
                                        "model.vocab_size=50304", "train.eval_batches=1",
                                        *more]).val_batches()
  with pytest.raises(UserError, match=r"token id \d+, past the 8192 ids of data.tokenizer="
                     "shakespeare: .* set data.tokenizer to theirs, or none"):
    val("val")
  assert val("val", "data.tokenizer=none") and val("small")


@pytest.mark.fast
def test_a_tokenizer_that_cannot_load_is_named_where_the_data_are_its_text(monkeypatch):
  """evaluate dropped val_bpb without a word where tiktoken was missing (train says why)."""
  def offline(name):
    raise UserError("data.tokenizer=gpt2 needs tiktoken")
  monkeypatch.setattr(pipeline, "get_tokenizer", offline)
  assert pipeline.tokenizer_problem(data_cfg(source="bin", tokenizer="gpt2")) == \
      "data.tokenizer=gpt2 needs tiktoken"
  assert pipeline.tokenizer_problem(data_cfg(source="bin", tokenizer="none")) == ""
  assert pipeline.tokenizer_problem(data_cfg(source="synthetic", tokenizer="gpt2")) == ""


def test_packed_documents_read_as_many_windows_as_shards_under_a_token_cap(tmp_path):
  """data.val_tokens=320 at seq_len 32: 10 windows from a shard, 9 from the same documents packed
  (tfds): the cap took the targets' extra token from the inputs."""
  from nanotext.data.sources import PackedDocSource, ShardSource
  docs = [{"tokens": np.arange(1, 101, dtype=np.int32)} for _ in range(10)]
  path = str(tmp_path / "v.bin")
  binfile.write_shard(path, np.concatenate([[0, *d["tokens"]] for d in docs]))
  for cap in (0, 64, 320, 1000, 1009, 1010):
    packed = PackedDocSource(docs, "tokens", 32, eot_id=0, max_tokens=cap)
    shards = ShardSource([path], 32, max_tokens=cap)
    assert len(packed) == len(shards), cap
    for i in range(len(packed)):
      np.testing.assert_array_equal(packed[i], shards[i])


@pytest.mark.parametrize("bad", [9000, -1])
def test_packed_documents_refuse_ids_outside_the_vocabulary(bad):
  """Past the table an id became a NaN loss naming nothing; -1 read the table's last row."""
  from nanotext.data.sources import PackedDocSource
  docs = [{"tokens": np.arange(1, 40, dtype=np.int32)},
          {"tokens": np.array([5, bad, 7] * 20, dtype=np.int32)}]
  src = PackedDocSource(docs, "tokens", 32, eot_id=0, vocab_size=8192, name="TFDS data set 'x'")
  src[0]  # the first document's window is whole ids
  with pytest.raises(UserError, match=rf"TFDS data set 'x' holds token id {bad} \(in document 1\)"
                     r", not in \[0, 8192\)"):
    src[1]
