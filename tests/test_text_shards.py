"""nanotext.data.text_shards: text files to .bin shards that a run reads (data.source=bin)."""

import json
import os
import shlex
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import BASE, PROCESS_TIMEOUT_S, REPO, TINY, one_line_error, run_cli
from nanotext import wiring
from nanotext.data import binfile, text_shards
from nanotext.data.tokenizer import get_tokenizer
from nanotext.errors import UserError

pytestmark = pytest.mark.fast

DOCS = {"a.txt": "ROMEO: What light through yonder window breaks?\n",
        "b.txt": "JULIET: Ay me! — a word in two bytes: Dé, and 日本, and 😀.\n" * 40}


def texts(tmp_path) -> list:
  paths = []
  for name, text in DOCS.items():
    (tmp_path / name).write_text(text, encoding="utf-8")
    paths.append(str(tmp_path / name))
  return paths


def test_shards_are_the_documents_in_order_and_validation_is_the_tail(tmp_path):
  """Training shards then the validation shard, read back in order, are the token stream:
  <|endoftext|> + each file's tokens; validation is its last val_fraction."""
  tok = get_tokenizer("shakespeare")
  paths = texts(tmp_path)
  stream = text_shards.tokenize(paths, tok)
  want = np.concatenate([[tok.eot_id, *tok.encode(t)] for t in DOCS.values()])
  np.testing.assert_array_equal(stream, want)
  out = str(tmp_path / "shards")
  meta = text_shards.write_shards(out, stream, val_fraction=0.1, shard_tokens=100,
                                  meta={"tokenizer": "shakespeare"})
  train = sorted(f for f in os.listdir(out) if f.startswith("train_"))
  assert len(train) == meta["train_shards"] == -(-meta["train_tokens"] // 100) > 1
  parts = [binfile.read_shard(os.path.join(out, f)) for f in train]
  assert all(p.size == 100 for p in parts[:-1]) and 0 < parts[-1].size <= 100
  val = binfile.read_shard(os.path.join(out, "val_000000.bin"))
  assert val.size == meta["val_tokens"] == round(0.1 * want.size)
  np.testing.assert_array_equal(np.concatenate(parts + [val]), want)
  with open(os.path.join(out, "meta.json"), encoding="utf-8") as f:
    assert json.load(f) == meta


def test_no_shard_holds_more_than_its_header_counts(tmp_path, monkeypatch):
  """--shard_tokens of 2**31 died in an OverflowError traceback at the first shard's header,
  after all the tokenizing; so could a validation split that long. --shard_tokens is refused
  first, and a validation split past the cap is written as several shards."""
  with pytest.raises(UserError, match=r"cannot write shard '.*': 2,147,483,648 tokens, more "
                                      r"than the 2,147,483,647 a shard's header counts"):
    binfile.write_shard(str(tmp_path / "huge.bin"), np.broadcast_to(np.uint16(5), (2**31,)))
  with pytest.raises(UserError, match=r"^--shard_tokens=2147483648 is more than"):
    text_shards.write_shards(str(tmp_path / "s"), np.arange(9, dtype=np.uint16),
                             val_fraction=0.5, shard_tokens=2**31, meta={})
  monkeypatch.setattr(binfile, "MAX_TOKENS", 10)  # a cap a test can reach
  tokens = np.arange(100, dtype=np.uint16)
  out = tmp_path / "shards"
  meta = text_shards.write_shards(str(out), tokens, val_fraction=0.25, shard_tokens=10, meta={})
  val = sorted(out.glob("val_*.bin"))
  assert [binfile.read_header(str(p)) for p in val] == [10, 10, 5] and meta["val_tokens"] == 25
  np.testing.assert_array_equal(np.concatenate([binfile.read_shard(str(p)) for p in val]),
                                tokens[-25:])
  assert not list(tmp_path.glob(".*"))


def test_the_cli_writes_shards_a_run_reads(tmp_path):
  """The command the tool prints reads its shards: a run's batches are their tokens."""
  out = tmp_path / "shards"
  proc = run_cli("nanotext.data.text_shards", *texts(tmp_path), f"--out={out}",
                 "--tokenizer=shakespeare", "--val_fraction=0.2")
  assert proc.returncode == 0, proc.stderr
  command = proc.stdout.strip().splitlines()[-1]
  assert command.startswith("train on them: python -m nanotext.train configs/base.yml")
  overrides = [a for a in shlex.split(command) if "=" in a]
  assert "model.vocab_size=8192" in overrides and "data.tokenizer=shakespeare" in overrides
  # as printed (its rows of 256 tokens: a batch of one here, where base.yml's 16 did not fit the
  # validation data), the model made small
  small = [o for o in TINY if o.startswith("model.") and "vocab" not in o]
  assert "train.batch_size=1" in overrides
  run = wiring.prepare(BASE, small + overrides, devices=jax.devices()[:1])  # a user's CPU
  assert len(run.val_batches()) == 1
  batch = next(run.train_iter())
  tokens = np.concatenate([binfile.read_shard(str(p)) for p in sorted(out.glob("train_*.bin"))])
  row = np.asarray(batch["inputs"])[0]
  windows = np.lib.stride_tricks.sliding_window_view(tokens, row.size)
  assert (windows == row).all(axis=1).any()  # a window of the training shards


# text_shards as its command line runs it, a Ctrl-C arriving once its shards are in place
INTERRUPTED = """
import os, runpy, signal, sys
from nanotext import config
real = config.load
def load(*args, **kwargs):  # the summary's read of base.yml: after the rename
  os.kill(os.getpid(), signal.SIGINT)
  return real(*args, **kwargs)
config.load = load
sys.argv = ["text_shards", *sys.argv[1:]]
runpy.run_module("nanotext.data.text_shards", run_name="__main__")
"""


def test_a_signal_once_the_shards_are_written_says_they_are_complete(tmp_path):
  """Ctrl-C after the rename, while the summary was made, printed 'nanotext: error:
  interrupted' (exit 130) about a complete output. The summary is printed, then one line says
  the output is complete."""
  out = tmp_path / "shards"
  proc = subprocess.run([sys.executable, "-c", INTERRUPTED, *texts(tmp_path), f"--out={out}",
                         "--tokenizer=shakespeare"], cwd=REPO, capture_output=True, text=True,
                        timeout=PROCESS_TIMEOUT_S)
  assert proc.returncode == 130 and proc.stdout.startswith("wrote 1 training shard(s)")
  assert "train on them: " in proc.stdout
  assert proc.stderr == ("nanotext: error: stopped by SIGINT after --out was written: it is "
                         "complete\n")
  assert sorted(os.listdir(out)) == ["meta.json", "train_000000.bin", "val_000000.bin"]


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
  paths = texts(tmp_path)
  out = tmp_path / "shards"
  (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
  os.link(paths[0], tmp_path / "hard.txt")  # a hard link was tokenized twice
  cases = [([*paths, str(tmp_path / "hard.txt")], "are the same file: give it once"),
           ([*paths, os.path.join(str(tmp_path), ".", "a.txt")], "are the same file"),([str(tmp_path / "missing.txt")], "is not a file"),
           ([str(tmp_path)], "is not a file"),
           ([*paths, str(tmp_path / "latin1.txt")], "is not UTF-8"),
           ([*paths, "--val_fraction=0"], "--val_fraction=0.0 must lie between 0 and 1"),
           ([*paths, "--shard_tokens=0"], "--shard_tokens=0 must be positive"),
           ([*paths, "--shard_tokens=2147483648"], "is more than the 2,147,483,647 tokens a "
            ".bin shard's header counts"),
           (paths[:1] + ["--val_fraction=0.99"], "cannot be split"),
           ([*paths, paths[0]], "is given twice")]
  for args, needle in cases:
    one_line_error(run_cli("nanotext.data.text_shards", *args, f"--out={out}",
                           "--tokenizer=shakespeare"), needle)
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if p.startswith(".")]
  os.unlink(tmp_path / "hard.txt")
  out.write_text("x")  # it said 'this conversion writes a directory'
  one_line_error(run_cli("nanotext.data.text_shards", *paths, f"--out={out}",
                         "--tokenizer=shakespeare"), "is a file, and a folder is written there")
  out.unlink()
  out.mkdir()
  (out / "keep").write_text("x")
  one_line_error(run_cli("nanotext.data.text_shards", *paths, f"--out={out}",
                         "--tokenizer=shakespeare"), "holds 'keep', which this tool does not")
  assert os.listdir(out) == ["keep"]


def test_an_input_named_through_a_link_into_out_survives_force(tmp_path):
  """The input named as links/a.txt lies in --out: --force replaced the folder, input and all
  (exit 0) before the inputs' real places were compared."""
  corpus, links = tmp_path / "corpus", tmp_path / "links"
  corpus.mkdir()
  links.mkdir()
  (corpus / "a.txt").write_text("To be, or not to be, that is the question. " * 40)
  (corpus / "notes.md").write_text("mine")
  (links / "a.txt").symlink_to(corpus / "a.txt")
  one_line_error(run_cli("nanotext.data.text_shards", str(links / "a.txt"), f"--out={corpus}",
                         "--tokenizer=shakespeare", "--force"), "would replace the input")
  assert sorted(os.listdir(corpus)) == ["a.txt", "notes.md"]


def test_the_gpt2_tokenizer_without_tiktoken_names_both_ways_to_choose(monkeypatch):
  """text_shards' default tokenizer needs tiktoken; the line named data.tokenizer only, a key
  text_shards does not take."""
  import builtins
  real = builtins.__import__

  def no_tiktoken(name, *a, **k):
    if name == "tiktoken":
      raise ImportError("No module named 'tiktoken'")
    return real(name, *a, **k)
  monkeypatch.setattr(builtins, "__import__", no_tiktoken)
  with pytest.raises(UserError, match=r"data.tokenizer, or text_shards' --tokenizer\) needs "
                                      r"tiktoken"):
    get_tokenizer("gpt2")


@pytest.mark.parametrize("mark", ["checkpoints", "metrics.jsonl", ".lock"])
def test_force_never_replaces_a_training_run(tmp_path, mark):
  """--force onto a run's output_dir exit 0 and left only shards (config, metrics and
  checkpoints gone), a live, locked run's too; convert shares the check."""
  from nanotext import outputs
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.yml").write_text("x: 1\n")
  (run / mark).mkdir() if mark == "checkpoints" else (run / mark).write_text("")
  for out in (run, tmp_path / "link"):
    if out != run:
      out.symlink_to(run)
    with pytest.raises(UserError, match=f"training run's folder \\(it holds {mark}\\)"):
      outputs.check_out(str(out), force=True)
  assert sorted(os.listdir(run)) == sorted(["config.yml", mark])
  params_only = tmp_path / "p"  # config.yml alone: a params-only folder, replaced with --force
  params_only.mkdir()
  (params_only / "config.yml").write_text("x: 1\n")
  outputs.check_out(str(params_only), force=True)
  # a folder holding runs, at any depth (--out one level too high): they went with it
  (tmp_path / "experiments" / "a").mkdir(parents=True)
  os.rename(run, tmp_path / "experiments" / "a" / "run")
  with pytest.raises(UserError, match=f"holds the training run '.*/experiments/a/run' "
                                      rf"\(it holds {mark}\)"):
    outputs.check_out(str(tmp_path / "experiments"), force=True)


def test_out_at_the_root_is_refused():
  """'/' passed the check against the inputs ('/' + os.sep is '//', under which nothing lies)."""
  from nanotext import outputs
  with pytest.raises(UserError, match="file system's root"):
    outputs.check_out("/", force=True, protect=["/etc/hostname"])


def test_a_byte_order_mark_is_no_text_and_line_ends_read_as_newlines(tmp_path):
  """A BOM from an editor was tokenized as the document's first character."""
  plain, marked = tmp_path / "plain.txt", tmp_path / "marked.txt"
  plain.write_bytes("ROMEO: hi\nJULIET: ho\n".encode())
  marked.write_bytes(b"\xef\xbb\xbf" + "ROMEO: hi\r\nJULIET: ho\r\n".encode())
  assert text_shards.read_text(str(marked)) == text_shards.read_text(str(plain))
  for head in (b"", b"\xef\xbb\xbf"):  # a bad byte after a BOM was said 3 bytes early
    (tmp_path / "bad.txt").write_bytes(head + b"abc\xffdef")
    with pytest.raises(UserError, match=rf"is not UTF-8 text \(byte {len(head) + 3}\)"):
      text_shards.read_text(str(tmp_path / "bad.txt"))


def test_the_printed_command_fits_its_batch_to_the_splits():
  """base.yml's 16 rows of 256 tokens where both splits hold them; fewer, a power of two, where
  one does not; a note where a split holds no row, or its shards do (rows do not span shards:
  shards of 100 tokens printed a command that found no training row)."""
  big = 16 * 256 + 1
  assert text_shards.fitting_batch([big], big) == ("", "")
  assert text_shards.fitting_batch([big], 16 * 256) == (" train.batch_size=8", "")
  assert text_shards.fitting_batch([257] * 3, big) == (" train.batch_size=2", "")
  assert text_shards.fitting_batch([257], 257) == (" train.batch_size=1", "")
  suffix, note = text_shards.fitting_batch([big], 200)
  assert not suffix and "holds no row of configs/base.yml's train.seq_len=256" in note
  suffix, note = text_shards.fitting_batch([100] * 46 + [29], 47)
  assert not suffix and "shards of 100 tokens hold no row" in note and "--shard_tokens" in note
  assert "a split of 47 tokens holds no row" in note.splitlines()[1]


def test_force_replaces_only_an_earlier_output_of_text_shards(tmp_path):
  """--out=<a git checkout> --force replaced the checkout, .git and all, with three shards."""
  tokens = np.arange(400, dtype=np.uint16)
  out = tmp_path / "repo"
  (out / ".git").mkdir(parents=True)
  (out / "setup.py").write_text("x")
  with pytest.raises(UserError, match=r"holds '\.git' and 1 more, which this tool does not "
                                      r"write: --force replaces only an earlier output"):
    text_shards.write_shards(str(out), tokens, val_fraction=0.5, shard_tokens=100, meta={},
                             force=True)
  assert sorted(os.listdir(out)) == [".git", "setup.py"]
  shards = tmp_path / "shards"
  text_shards.write_shards(str(shards), tokens, val_fraction=0.5, shard_tokens=100, meta={})
  text_shards.write_shards(str(shards), tokens, val_fraction=0.5, shard_tokens=50, meta={},
                           force=True)  # an earlier output: replaced
  assert len([n for n in os.listdir(shards) if n.startswith("train_")]) == 4


def test_force_replaces_only_the_shards_and_meta_it_writes(tmp_path):
  """Its own= took every *.bin: --force deleted a pytorch_model.bin beside earlier shards."""
  from nanotext import outputs
  out = tmp_path / "shards"
  out.mkdir()
  for name in ("meta.json", "train_000000.bin", "train_000001.bin", "val_000000.bin"):
    (out / name).write_text("x")
  outputs.check_out(str(out), force=True, own=text_shards.OWN)  # an earlier output
  (out / "pytorch_model.bin").write_text("mine")
  with pytest.raises(UserError, match="holds 'pytorch_model.bin', which this tool does not"):
    outputs.check_out(str(out), force=True, own=text_shards.OWN)
  (tmp_path / "link").symlink_to(out)  # it said --out 'link' holds 'link'
  with pytest.raises(UserError, match=r"^--out '.*/link' is a link \(to '.*/shards'\), which the "
                                      r"output would replace, not write through: give the path "
                                      r"it links to"):
    outputs.check_out(str(tmp_path / "link"), force=True, own=text_shards.OWN)


@pytest.mark.parametrize("contents", [(), ("old.safetensors",), ("notes.txt",)])
def test_a_folder_given_to_a_file_tool_is_said_to_be_a_folder_first(tmp_path, contents):
  """export-torch's --out as a folder was told "pass --force" (which then said "is a folder"),
  or that --force replaces only its own files: the folder is the thing to change."""
  from nanotext import outputs
  out = tmp_path / "exp"
  out.mkdir()
  for name in contents:
    (out / name).write_text("x")
  for force in (False, True):
    with pytest.raises(UserError, match=r"^output '.*/exp' is a folder; give a file path"):
      outputs.check_out(str(out), force=force, folder=False, own=("*.safetensors",))
    with pytest.raises(UserError, match=r"^output '.*/exp' is a folder; give a file path"):
      with outputs.staged_file(str(out), force=force, own=("*.safetensors",)):
        pass
  assert sorted(os.listdir(out)) == sorted(contents)
