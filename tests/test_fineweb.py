"""The FineWeb downloader against a local stand-in for the Hub (no network)."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import PROCESS_TIMEOUT_S, REPO, record_syncs, run_cli, synced_around_rename
from nanotext.data import binfile, fineweb
from nanotext.errors import UserError

pytestmark = pytest.mark.fast


@pytest.fixture
def remote(tmp_path):
  """A folder standing in for the Hub repo: the val shard and 5 tiny train shards."""
  d = tmp_path / "remote"
  for i, name in enumerate(fineweb.file_names(5)):
    binfile.write_shard(str(d / name), np.arange(10 + i, dtype=np.uint16))
  return d


class Fetch:
  """A fetch stand-in that copies from `remote` into tmp_dir and records what it fetched."""

  def __init__(self, remote, corrupt=()):
    self.remote, self.corrupt, self.calls = remote, set(corrupt), []

  def __call__(self, filename, tmp_dir):
    self.calls.append(filename)
    dst = os.path.join(tmp_dir, filename)
    if filename in self.corrupt:
      with open(dst, "wb") as f:
        f.write(b"<html>rate limited</html>")
    else:
      shutil.copyfile(self.remote / filename, dst)
    return dst


def quiet(*_):
  pass


def listing(d):
  """The visible files in `d` (the downloader's staging folder is hidden)."""
  return sorted(n for n in os.listdir(d) if not n.startswith("."))


def test_downloads_then_skips(remote, tmp_path):
  out = tmp_path / "out"
  fetch = Fetch(remote)
  info = fineweb.download(3, str(out), fetch=fetch, log=quiet)
  names = ["fineweb_train_000001.bin", "fineweb_train_000002.bin", "fineweb_train_000003.bin",
           "fineweb_val_000000.bin"]
  assert listing(out) == names
  assert sorted(fetch.calls) == names
  assert not os.path.exists(out / fineweb.TMP_DIR)
  assert [binfile.read_header(str(out / n)) for n in names] == [11, 12, 13, 10]
  assert (info["train_tokens"], info["val_tokens"]) == (36, 10)
  assert sorted(binfile.find_shards(info["train_files"])) == [str(out / n) for n in names[:3]]
  again = Fetch(remote)
  info = fineweb.download(3, str(out), fetch=again, log=quiet)
  assert again.calls == [] and info["downloaded"] == [] and len(info["skipped"]) == 4
  assert (info["train_tokens"], info["val_tokens"]) == (36, 10)


def test_each_shard_is_on_disk_before_its_rename(remote, tmp_path, monkeypatch):
  """A downloaded shard is fsynced before the rename to its final name, the folder after: a
  power cut after the rename could leave it empty, or its header whole and its tokens zeros
  (which the header check passes, so a next run keeps it)."""
  events = record_syncs(monkeypatch)
  out = tmp_path / "out"
  fineweb.download(1, str(out), fetch=Fetch(remote), log=quiet)
  for name in fineweb.file_names(1):
    synced_around_rename(events, [str(out / name)], str(out / name))


def test_the_count_is_what_the_glob_reads(remote, tmp_path):
  """--train-shards=2 after 5 reported 2 shards' tokens while the glob a config trains on read
  all 5: the count is every valid shard it matches, the ones beyond those asked for named, and
  one it matches that a run would refuse is a note."""
  out = tmp_path / "out"
  fineweb.download(5, str(out), fetch=Fetch(remote), log=quiet)
  (out / "fineweb_train_000009.bin").write_bytes(b"<html>rate limited</html>")
  info = fineweb.download(2, str(out), fetch=Fetch(remote), log=quiet)
  files = binfile.find_shards(info["train_files"])
  assert (info["train_shards"], info["train_tokens"]) == (5, 11 + 12 + 13 + 14 + 15)
  assert len(files) == 6 and info["invalid"] == ["fineweb_train_000009.bin"]
  assert info["extra"] == [f"fineweb_train_00000{i}.bin" for i in (3, 4, 5)]
  lines = fineweb.summary(info)
  assert lines[1] == ("train tokens: 65 (5 shards: the 2 asked for and 3 more already there, "
                      "which the glob fineweb_train_*.bin reads too)")
  assert lines[2] == (f"note: fineweb_train_000009.bin in {out} matches the glob "
                      "fineweb_train_*.bin but is not a valid shard, which a run refuses: "
                      "delete it, or download it again with a larger --train-shards")


def test_redownloads_corrupt_shard(remote, tmp_path):
  out = tmp_path / "out"
  fineweb.download(2, str(out), fetch=Fetch(remote), log=quiet)
  bad = out / "fineweb_train_000002.bin"
  bad.write_bytes(bad.read_bytes()[:-4])  # truncated: header claims more tokens than it holds
  fetch = Fetch(remote)
  lines = []
  info = fineweb.download(2, str(out), fetch=fetch, log=lines.append)
  assert fetch.calls == ["fineweb_train_000002.bin"]
  assert binfile.read_header(str(bad)) == 12
  assert info["train_tokens"] == 23
  assert any("not a valid shard" in l for l in lines)


def test_corrupt_download_leaves_nothing(remote, tmp_path):
  out = tmp_path / "out"
  fetch = Fetch(remote, corrupt=["fineweb_train_000002.bin"])
  with pytest.raises(UserError, match="fineweb_train_000002.bin.*not a valid shard"):
    fineweb.download(3, str(out), fetch=fetch, log=quiet)
  assert listing(out) == ["fineweb_train_000001.bin", "fineweb_val_000000.bin"]
  assert not os.path.exists(out / fineweb.TMP_DIR)  # nothing in it to resume


def test_a_failed_download_keeps_only_what_a_next_run_resumes(tmp_path):
  """A failure with nothing downloaded left the folder it made (the Hub's lock files in it);
  one with part of a file downloaded keeps the staging folder: the next run resumes there."""
  def unreachable(name, tmp_dir):
    os.makedirs(os.path.join(tmp_dir, ".cache"), exist_ok=True)
    open(os.path.join(tmp_dir, ".cache", f"{name}.lock"), "w").close()
    raise UserError("cannot download: the Hub is unreachable")
  out = tmp_path / "new" / "out"
  with pytest.raises(UserError, match="unreachable"):
    fineweb.download(1, str(out), fetch=unreachable, log=quiet)
  assert os.listdir(tmp_path) == []  # new/ too: made for it, empty

  def cut_off(name, tmp_dir):
    with open(os.path.join(tmp_dir, f"{name}.incomplete"), "wb") as f:
      f.write(b"part of it")
    raise UserError("cannot download: connection reset")
  with pytest.raises(UserError, match="reset"):
    fineweb.download(1, str(out), fetch=cut_off, log=quiet)
  assert sorted(os.listdir(out / fineweb.TMP_DIR)) == [fineweb.MARK,
                                                       "fineweb_val_000000.bin.incomplete"]


def test_a_folder_of_the_staging_name_that_it_did_not_make_is_left_alone(remote, tmp_path):
  """A '.download' folder already in --out (the staging folder's old name) was deleted, the
  user's files with it, once the download succeeded. The staging folder is named for the tool,
  and one of that name it did not make is refused before any download."""
  out = tmp_path / "out"
  for name in (".download", fineweb.TMP_DIR):
    (out / name).mkdir(parents=True, exist_ok=True)
    (out / name / "my_notes.txt").write_text("mine")
  with pytest.raises(UserError, match=r"holds '\.fineweb-download', which this tool did not "
                                      r"make .*: move it or choose another --out$"):
    fineweb.download(1, str(out), fetch=Fetch(remote), log=quiet)
  shutil.rmtree(out / fineweb.TMP_DIR)
  info = fineweb.download(1, str(out), fetch=Fetch(remote), log=quiet)
  assert len(info["downloaded"]) == 2 and not os.path.exists(out / fineweb.TMP_DIR)
  assert (out / ".download" / "my_notes.txt").read_text() == "mine"


def test_fetch_returning_file_elsewhere_is_copied(remote, tmp_path):
  out = tmp_path / "out"
  info = fineweb.download(1, str(out), fetch=lambda name, _: str(remote / name), log=quiet)
  assert info["train_tokens"] == 11
  assert os.path.exists(remote / "fineweb_train_000001.bin")  # the fetch's own file is kept


def test_fetch_error_is_user_error(tmp_path):
  def fetch(name, tmp_dir):
    raise FileNotFoundError(f"no such file: {name}")
  with pytest.raises(UserError, match="cannot download 'fineweb_val_000000.bin'"):
    fineweb.download(1, str(tmp_path / "out"), fetch=fetch, log=quiet)


@pytest.mark.parametrize("n", [0, -1, fineweb.MAX_TRAIN_SHARDS + 1, 2.5, "3", True])
def test_bad_train_shards(n, tmp_path):
  with pytest.raises(UserError, match="--train-shards"):
    fineweb.download(n, str(tmp_path / "out"), fetch=Fetch(tmp_path), log=quiet)
  assert not os.path.exists(tmp_path / "out")


def test_names():
  assert fineweb.file_names(2) == ["fineweb_val_000000.bin", "fineweb_train_000001.bin",
                                   "fineweb_train_000002.bin"]
  assert fineweb.train_file(103) == "fineweb_train_000103.bin"


@pytest.mark.parametrize("flag", [["--train-shards", "0"], ["--train-shards=0"],
                                  ["--train_shards=104"]])
def test_cli_bad_count(flag, tmp_path):
  result = run_cli("nanotext.data.fineweb", *flag, "--out", str(tmp_path / "x"))
  assert result.returncode == 2, result.stderr
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("nanotext: error: --train-shards must be in")
  assert not os.path.exists(tmp_path / "x")


def test_cli_help_mentions_flags():
  result = run_cli("nanotext.data.fineweb", "--helpshort")
  assert result.returncode == 0 and "--train_shards" in result.stdout and "--out" in result.stdout


def test_cli_offline_hub_error(tmp_path):
  pytest.importorskip("huggingface_hub")
  # HF_HUB_OFFLINE makes the real hf_hub_download fail at once, without touching the network.
  result = run_cli("nanotext.data.fineweb", "--train-shards=1", f"--out={tmp_path / 'x'}",
                   env={"HF_HUB_OFFLINE": "1"})
  assert result.returncode == 2, result.stderr
  last = result.stderr.strip().splitlines()[-1]
  assert last.startswith("nanotext: error: cannot download 'fineweb_val_000000.bin'")
  assert "unreachable" in last
  assert not os.path.exists(tmp_path / "x")  # made for the download, nothing in it


HUB_RETRYING = """
import logging, runpy, sys
import huggingface_hub
def download(*a, **k):  # the Hub's client retrying a refused connection, then giving up
  for i in range(3):
    logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry %d/5].", i)
  raise ConnectionError("Connection refused")
huggingface_hub.hf_hub_download = download
sys.argv = ["fineweb", "--train-shards=1", "--out=" + sys.argv[1]]
runpy.run_module("nanotext.data.fineweb", run_name="__main__", alter_sys=True)
"""


def test_the_hubs_retries_are_not_printed(tmp_path):
  """An unreachable Hub printed each retry twice (its handler, then absl's): 23 lines."""
  pytest.importorskip("huggingface_hub")
  result = subprocess.run([sys.executable, "-c", HUB_RETRYING, str(tmp_path / "x")], cwd=REPO,
                          capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      "nanotext: error: cannot download 'fineweb_val_000000.bin' from the Hugging Face dataset "
      "kjj0/fineweb10B-gpt2: ConnectionError: Connection refused"], result.stderr
