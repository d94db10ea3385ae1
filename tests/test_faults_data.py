"""A training shard that changes while a run reads it (issue 27 item 3): truncated, rewritten in
place or replaced by a rename. Shards were memory-mapped, and a truncated one killed the run with
SIGBUS and a 142-line crash dump; now reads go through os.pread, checked against the file as it
was opened."""

import os
import shutil
import subprocess
import time

import numpy as np
import pytest

from conftest import BASE, PROCESS_TIMEOUT_S, REPO, TINY, train_command
from test_faults import assert_one_error_line
from nanotext.data import binfile
from nanotext.data.sources import ShardSource
from nanotext.errors import UserError


def shard(path, n=20_000, seed=0):
  binfile.write_shard(str(path), np.random.default_rng(seed).integers(0, 512, n))
  return str(path)


def test_a_truncated_shard_is_one_line_naming_it(tmp_path):
  path = shard(tmp_path / "a.bin")
  src = ShardSource([path], seq_len=32)
  src[0]
  os.truncate(path, binfile.HEADER_BYTES + 1000)
  with pytest.raises(binfile.ShardChanged, match=f"shard '{path}' changed while the run"):
    src[len(src) - 1]


def test_a_shard_rewritten_in_place_is_noticed(tmp_path):
  """The same size, other tokens: the modification time tells."""
  path = shard(tmp_path / "a.bin")
  src = ShardSource([path], seq_len=32)
  before = src[3]
  stat = os.stat(path)
  with open(path, "r+b") as f:
    f.seek(binfile.HEADER_BYTES)
    f.write(b"\0" * 4000)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # coarse clocks too
  assert os.path.getsize(path) == stat.st_size
  with pytest.raises(binfile.ShardChanged, match="modification time"):
    src[3]
  assert before.size == 33


def test_a_shard_replaced_by_a_rename_is_read_as_it_was_opened(tmp_path):
  """The run keeps its open file, the old version: one version of the data per run (the data
  fingerprint then tells a resume that the shard changed)."""
  path = shard(tmp_path / "a.bin")
  src = ShardSource([path], seq_len=32)
  first = src[5].copy()
  os.replace(shard(tmp_path / "b.bin", seed=1), path)
  np.testing.assert_array_equal(src[5], first)


ARGS = [a for a in TINY if not a.startswith(("train.steps", "train.eval_every", "data.",
                                            "checkpoint.every"))] + [
    "train.steps=40", "train.eval_every=0", "checkpoint.every=2", "checkpoint.keep=10",
    "sample.max_new_tokens=0", "data.source=bin", "data.tokenizer=none", "data.eot_id=0"]


def test_a_shard_truncated_during_a_run(tmp_path):
  """One line naming the shard, exit 2; the checkpoints stay intact and, the shard put back,
  the same command resumes and finishes."""
  train, val = shard(tmp_path / "train.bin", 200_000), shard(tmp_path / "val.bin", seed=1)
  kept = tmp_path / "train.bin.orig"
  shutil.copyfile(train, kept)
  out, marker = tmp_path / "run", tmp_path / "marker"
  cmd = train_command(f"2:{marker}") + [BASE, *ARGS, f"data.train_files={train}",
                                         f"data.val_files={val}", f"output_dir={out}"]
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.time() + PROCESS_TIMEOUT_S
  while not marker.exists():  # the run waits inside its save of step 2
    assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
    time.sleep(0.05)
  os.truncate(train, binfile.HEADER_BYTES + 5000)
  (tmp_path / "marker.go").touch()
  stdout, stderr = proc.communicate(timeout=PROCESS_TIMEOUT_S)
  assert_one_error_line(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr), 2,
                        f"shard '{train}' changed")
  assert "Fatal Python error" not in stderr
  steps = [n for n in os.listdir(out / "checkpoints") if n.isdigit()]
  assert steps and not os.path.exists(out / ".lock")
  shutil.copyfile(kept, train)  # in place, as it was: the data fingerprint matches again
  again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "resumed from the checkpoint of step" in again.stdout


def test_many_shards_keep_a_bounded_number_open_and_reopen_checked(tmp_path, monkeypatch):
  """A reader (an fd) per shard read ran past `ulimit -n` (1,024) with 1,100 shards: EMFILE."""
  from nanotext.data import sources
  monkeypatch.setattr(sources, "MAX_OPEN_SHARDS", 4, raising=False)
  paths = [shard(tmp_path / f"s{k:02d}.bin", n=200, seed=k) for k in range(30)]
  src = ShardSource(paths, seq_len=32)
  before = len(os.listdir("/proc/self/fd"))
  first = src[0].copy()
  windows = [src[i] for i in range(len(src))]
  assert len(os.listdir("/proc/self/fd")) - before <= 4
  np.testing.assert_array_equal(windows[0], first)  # reopened, the same tokens
  stat = os.stat(paths[0])  # closed since: rewritten meanwhile, it is refused when reopened
  os.utime(paths[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
  with pytest.raises(binfile.ShardChanged, match=f"shard '{paths[0]}' changed"):
    src[0]


def test_too_many_open_files_is_one_line_naming_ulimit(tmp_path, monkeypatch):
  import errno
  path = shard(tmp_path / "a.bin", n=200)
  def emfile(*args, **kwargs):
    raise OSError(errno.EMFILE, "Too many open files")
  monkeypatch.setattr(os, "open", emfile)
  with pytest.raises(UserError, match=r"too many open files .*ulimit -n"):
    ShardSource([path], seq_len=32)[0]
