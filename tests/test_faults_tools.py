"""The tools around a run (generate, verify, convert, plot) under bad input, damage, races and
Ctrl-C: one line and the promised status, nothing written where it must not be. Issue 21, and
generate's layer order from issue 18 item 4."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from conftest import BASE, PROCESS_TIMEOUT_S, REPO, TINY, forward, saved_run
from test_cli_errors import snapshot
from test_faults import (ARGS, array_files, assert_one_error_line, copy_of, make_reference,
                         quiet_run)
from test_faults_startup import immutable, train_cli
from nanotext import checkpoint, config, config_file, generate, rundir, verify
from nanotext.errors import UserError

reference = pytest.fixture(scope="module", name="reference")(make_reference)


def cli(*args, env=None, shell=""):
  cmd = [sys.executable, "-m", *args]
  if shell:
    cmd = ["bash", "-c", f'{shell} && exec "$0" "$@"', *cmd]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S,
                        env=dict(os.environ, **(env or {})))


def with_tokenizer(out):
  """The run at `out` relabelled as Shakespeare-tokenized (TINY has none), so generate gets past
  its prompt check; the model's 512 rows are enough for the ids of a short prompt."""
  cfg = config_file.read(os.path.join(out, "config.yml"))
  cfg["data"]["tokenizer"] = "shakespeare"
  with open(os.path.join(out, "config.yml"), "w") as f:
    yaml.safe_dump(cfg, f)
  return out


# --- generate ---------------------------------------------------------------------------------

def logits(graphdef, params):
  tokens = np.arange(32, dtype=np.int32)[None] * 7 % 512
  return forward(graphdef, params, tokens, train=False)


def test_generate_restores_12_layers_in_their_order(tmp_path):
  """Saved trees key layers by strings: restored without the model's tree they came back as
  '0', '1', '10', '11', '2', ... and merged by position, so 12 layers ran permuted."""
  out = str(tmp_path / "run")
  run, params = saved_run(BASE, TINY + ["model.num_layers=12", "model.d_model=32",
                                       "model.head_dim=16"], out)
  want = logits(run.graphdef, params)
  step, graphdef, got = generate.restore(out, config.load(os.path.join(out, "config.yml")))
  assert step == 3
  np.testing.assert_array_equal(logits(graphdef, got), want)
  # The bug this guards against: the saved tree merged as restored is another model.
  _, as_saved = checkpoint.latest_params(out)
  assert list(as_saved["blocks"])[:4] == ["0", "1", "10", "11"]
  assert not np.allclose(logits(run.graphdef, as_saved), want)
  # A params-only folder (convert) restores in order too, in its saved dtype.
  from nanotext.convert import params_only
  folder = str(tmp_path / "p")
  params_only(out, folder, dtype="bfloat16", log=lambda s: None)
  _, graphdef, got = generate.restore(folder, config.load(os.path.join(folder, "config.yml")))
  assert {x.dtype for x in jax.tree.leaves(got)} == {np.dtype("bfloat16")}
  bf16 = jax.tree.map(lambda x: np.asarray(x).astype("bfloat16"), params)
  np.testing.assert_array_equal(logits(graphdef, got), logits(run.graphdef, bf16))


@pytest.mark.parametrize("what", ["step", "file"])
def test_the_newest_step_rotated_away_while_read_is_read_again(reference, tmp_path, monkeypatch,
                                                               what):
  """generate and convert read the newest step of a run that may still be training: a step
  removed under them (the directory at once, or file by file as orbax rotates a step out once a
  newer one is saved) is no 'damaged' error; the newest one by then is read. A step asked for
  by number that vanishes is not there."""
  out = copy_of(reference, tmp_path)
  read = checkpoint.read_on_one_device
  removed = []

  def rotated_away(m, step, part=""):
    if not removed:
      removed.append(step)
      where = checkpoint.step_dir(m, step)
      if what == "step":
        shutil.rmtree(where)
      else:  # the run saved a newer step and is deleting this one, one file so far
        shutil.copytree(where, checkpoint.step_dir(m, 8), dirs_exist_ok=True)
        os.remove(array_files(where)[0])
    return read(m, step, part)
  monkeypatch.setattr(checkpoint, "read_on_one_device", rotated_away)
  step, _ = checkpoint.latest_params(out)
  assert removed == [6] and step == (4 if what == "step" else 8)
  removed.clear()
  with pytest.raises(UserError, match="step 2 was removed while it was read"):
    checkpoint.latest_params(out, 2)


def test_steps_rotated_away_faster_than_read_are_said_to_be(reference, tmp_path, monkeypatch):
  """checkpoint.every=1 with keep=1 rotates each newest step away while it is read: the third
  such read ended with the step's read error, as if it were damaged."""
  out = copy_of(reference, tmp_path)
  read = checkpoint.read_on_one_device
  newer = iter(range(10, 100))

  def rotated_away(m, step, part=""):  # a newer step saved, this one half deleted
    where = checkpoint.step_dir(m, step)
    shutil.copytree(where, checkpoint.step_dir(m, next(newer)))
    os.remove(array_files(where)[0])
    return read(m, step, part)
  monkeypatch.setattr(checkpoint, "read_on_one_device", rotated_away)
  with pytest.raises(UserError, match=r"removed each newest step before it could be read "
                                      r"\(steps 6, 10, 11\); read it with a larger "
                                      r"checkpoint.keep"):
    checkpoint.latest_params(out)


def test_beside_a_live_run_the_newest_step_is_read_again_longer(reference, tmp_path,
                                                                 monkeypatch):
  """checkpoint.keep=1 with a save every step: generate, evaluate and convert gave up (exit 2)
  after three newest steps rotated away, though a vanishing step is never their error. While
  the run holding the lock is alive they read again, up to LIVE_READS times."""
  out = copy_of(reference, tmp_path)
  with open(os.path.join(out, ".lock"), "w") as f:  # a run training into it: this process
    json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
  read = checkpoint.read_on_one_device
  newer, rotations = iter(range(10, 100)), []

  def rotated_away(m, step, part=""):  # the first 6 reads: a newer step saved, this one going
    if len(rotations) < 6:
      where = checkpoint.step_dir(m, step)
      rotations.append(step)
      shutil.copytree(where, checkpoint.step_dir(m, next(newer)))
      os.remove(array_files(where)[0])
    return read(m, step, part)
  monkeypatch.setattr(checkpoint, "read_on_one_device", rotated_away)
  assert checkpoint.latest_params(out)[0] == 15 and rotations == [6, 10, 11, 12, 13, 14]
  rotations.clear()
  monkeypatch.setattr(rundir, "LIVE_READS", 4)  # rotated away each time: bounded, one line
  with pytest.raises(UserError, match=r"removed each newest step before it could be read "
                                      r"\(steps 15, 16, 17, 18\)"):
    checkpoint.latest_params(out)


def test_generate_refuses_a_negative_step_and_an_empty_prompt_first(reference, tmp_path):
  """step=-5 sampled the newest step; the prompt is checked before the checkpoint is read."""
  out = with_tokenizer(copy_of(reference, tmp_path))
  assert_one_error_line(cli("nanotext.generate", f"output_dir={out}", "step=-5"), 2, "step=-5")
  for victim in array_files(os.path.join(out, "checkpoints", "6")):
    os.truncate(victim, 10)
  proc = cli("nanotext.generate", f"output_dir={out}", "prompt=")
  assert_one_error_line(proc, 2, "prompt='' encodes to no tokens")
  assert "sample." not in proc.stderr  # generate's argument is prompt=, not sample.prompt


def test_a_damaged_tokenizer_is_one_line(reference, tmp_path):
  """The shipped tokenizer.json damaged (in a copy of the package): train and generate say so
  in one line instead of the tokenizers parser's exception."""
  pkg = tmp_path / "pkg"
  shutil.copytree(os.path.join(REPO, "nanotext"), pkg / "nanotext",
                  ignore=shutil.ignore_patterns("__pycache__"))
  shutil.copytree(os.path.join(REPO, "configs"), pkg / "configs")
  tok = pkg / "nanotext" / "data" / "shakespeare" / "tokenizer.json"
  tok.write_bytes(tok.read_bytes()[:5000])  # cut inside a UTF-8 character
  out = with_tokenizer(copy_of(reference, tmp_path))
  for cmd in ([sys.executable, "-m", "nanotext.generate", f"output_dir={out}"],
              [sys.executable, "-m", "nanotext.train", "configs/base.yml", *ARGS,
               "data.tokenizer=shakespeare", "model.vocab_size=8192",
               f"output_dir={tmp_path / 'new'}"]):
    proc = subprocess.run(cmd, cwd=pkg, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
    assert_one_error_line(proc, 2, "tokenizer.json' is damaged", "--train")
  assert not (tmp_path / "new").exists()


def test_load_params_from_a_damaged_checkpoint_is_one_line(reference, tmp_path):
  """Truncated array files: tensorstore tracebacks and a flood of 'sys.meta_path is None'."""
  src = copy_of(reference, tmp_path)
  for victim in array_files(os.path.join(src, "checkpoints", "6")):
    os.truncate(victim, 1000)
  proc = train_cli(tmp_path / "new", f"checkpoint.load_params_from={src}")
  # Which read meets the damage first (metadata or an array) sets the wording: not asserted.
  assert_one_error_line(proc, 2, "checkpoint", os.path.join(src, "checkpoints", "6"))
  assert "meta_path" not in proc.stderr and not (tmp_path / "new").exists()


# --- verify -----------------------------------------------------------------------------------

def test_verify_calls_a_step_removed_while_read_gone_not_damaged(reference, tmp_path,
                                                                 monkeypatch):
  """A run training into the folder rotates steps out while verify reads them (3 of 5 tries
  reported them damaged, exit 1). Here the removal lands inside the read, every time: the
  step directory, or one file of it (orbax deletes file by file, the directory last)."""
  out = copy_of(reference, tmp_path)
  manager = checkpoint.reader(out)
  read = checkpoint.read_on_one_device

  def rotated_away(m, step, part=""):
    where = checkpoint.step_dir(m, step)
    shutil.rmtree(where) if step == 4 else os.remove(array_files(where)[0])
    return read(m, step, part)
  monkeypatch.setattr(checkpoint, "read_on_one_device", rotated_away)
  assert verify.check_step(manager, 4)[0] == "gone"
  assert verify.check_step(manager, 2)[0] == "gone"
  monkeypatch.setattr(checkpoint, "read_on_one_device", read)
  # A file missing before the read began: damaged, unless a run training into the folder
  # (checkpoint.keep=1 here) is removing that step, being older than its newest.
  victim = array_files(os.path.join(out, "checkpoints", "6"))[0]
  os.truncate(victim, 10)
  status, detail = verify.check_step(manager, 6, keep=1)
  assert status == "damaged" and "step 6" in detail
  shutil.copytree(os.path.join(out, "checkpoints", "6"), os.path.join(out, "checkpoints", "8"))
  assert verify.check_step(manager, 6, keep=1)[0] == "gone"
  assert verify.check_step(manager, 6)[0] == "damaged"


@pytest.mark.parametrize("rotations", [3, 99])
def test_verify_beside_a_run_that_rotates_every_step_listed_reads_the_newer_ones(
    reference, tmp_path, monkeypatch, rotations):
  """A run saving faster than verify reads (checkpoint.keep=3, a save every 0.4 s) rotated away
  each step listed: every line said gone, exit 0, nothing checked. The steps saved meanwhile
  are listed and read; where those go too, 3 listings in all, one line and exit 2."""
  out = copy_of(reference, tmp_path)  # steps 2, 4, 6
  read, newer, removed = checkpoint.read_on_one_device, iter(range(10, 100)), []

  def rotated_away(m, step, part=""):  # a newer step saved, this one removed
    if len(removed) < rotations:
      where = checkpoint.step_dir(m, step)
      shutil.copytree(where, checkpoint.step_dir(m, next(newer)))
      shutil.rmtree(where)
      removed.append(step)
    return read(m, step, part)
  monkeypatch.setattr(checkpoint, "read_on_one_device", rotated_away)
  lines = []
  if rotations == 3:
    assert verify.report(out, lines.append) == 0, lines
    assert [line.split()[1:3] for line in lines if line.startswith("  step")] == [
        ["6", "gone"], ["4", "gone"], ["2", "gone"],
        ["12", "intact"], ["11", "intact"], ["10", "intact"]], lines
    return
  with pytest.raises(UserError, match=r"removed every step listed before it could be read "
                                      r"\(steps 6, 4, 2, 12, 11, 10, 15, 14, 13\)"):
    verify.report(out, lines.append)
  assert [line.split()[2] for line in lines if line.startswith("  step")] == ["gone"] * 9


def test_verify_calls_a_step_a_killed_run_was_deleting_a_leftover(reference, tmp_path):
  """SIGKILL while orbax deleted a step older than the newest checkpoint.keep, file by file:
  verify called the rest damaged, exit 1; the next start removes it. A step the
  keep does not rotate out that misses files is damaged."""
  out = with_keep(copy_of(reference, tmp_path), 2)  # steps 2, 4, 6
  shutil.rmtree(os.path.join(out, "checkpoints", "2", "data"))
  lines = []
  assert verify.report(out, lines.append) == 0, lines
  assert lines[3].split()[1:3] == ["2", "leftover"] and "being deleted when the run stopped" in \
      lines[3] and "the next start removes it" in lines[3]
  with_keep(out, 3)
  assert verify.report(out, lines.append) == 1
  assert lines[-2].split()[1:3] == ["2", "damaged"]


def test_a_resume_that_never_saves_removes_a_step_a_killed_run_was_deleting(reference,
                                                                              tmp_path):
  """The leftover of a kill inside a rotation went only at the next start's first save: a resume
  already at train.steps (it ends at once, saving nothing) left it for good. The start removes
  it, holding the lock; the complete steps, and a step missing files the keep does not rotate
  out (damaged, for verify to name), stay as they were."""
  out = with_keep(copy_of(reference, tmp_path), 3)  # steps 2, 4, 6
  shutil.rmtree(os.path.join(out, "checkpoints", "2", "data"))
  before = snapshot(os.path.join(out, "checkpoints"))
  quiet_run(out, "checkpoint.keep=3")
  assert snapshot(os.path.join(out, "checkpoints")) == before
  with_keep(out, 2)
  _, lines = quiet_run(out, "checkpoint.keep=2")
  assert rundir.steps_on_disk(out) == [4, 6]
  assert snapshot(os.path.join(out, "checkpoints")) == \
      {k: v for k, v in before.items() if not k.startswith("2" + os.sep)}
  assert any(line.startswith("removed the checkpoint of step 2: a run killed while deleting it")
             for line in lines), lines


def with_keep(out, keep: int):
  """The run at `out` as saved with checkpoint.keep=`keep` (the reference keeps every step)."""
  cfg = config_file.read(os.path.join(out, "config.yml"))
  cfg["checkpoint"]["keep"] = keep
  with open(os.path.join(out, "config.yml"), "w") as f:
    yaml.safe_dump(cfg, f)
  return out


def test_verify_of_a_run_an_overwrite_sets_aside_while_read_exits_0(reference, tmp_path,
                                                                      monkeypatch):
  """`train overwrite=true` moved the run into .overwritten/ while verify read it: its steps were
  said gone as if the run kept checkpoint.keep, and config.yml, gone with them, was 'edited'
  ('config file ... does not exist', exit 1)."""
  out = copy_of(reference, tmp_path)
  read = checkpoint.read_on_one_device

  def set_aside_meanwhile(m, step, part=""):
    if not os.path.isdir(os.path.join(out, rundir.ASIDE)):
      rundir.set_aside(out)
      os.makedirs(os.path.join(out, "checkpoints"))  # the new run's
    return read(m, step, part)
  monkeypatch.setattr(checkpoint, "read_on_one_device", set_aside_meanwhile)
  lines = []
  assert verify.report(out, lines.append) == 0, lines
  assert [line.split()[2] for line in lines[1:4]] == ["gone"] * 3
  assert all("overwrite=true" in line and "keep" not in line for line in lines[1:4]), lines
  assert lines[-1].startswith("config.yml: set aside with the run") and len(lines) == 5


def test_a_step_asked_for_of_a_run_set_aside_while_read_says_so(reference, tmp_path,
                                                                 monkeypatch):
  """generate (and convert) step=N of a run an overwrite=true start set aside while it was read
  said the step was removed as the run in progress keeps checkpoint.keep; and, set aside before
  the listing, only that the step is missing. Exit 2 as for the newest step."""
  out = copy_of(reference, tmp_path)
  read = checkpoint.read_on_one_device
  with open(os.path.join(out, ".lock"), "w") as f:  # the overwrite=true run: this process
    json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)

  def set_aside_meanwhile(m, step, part=""):
    if not os.path.isdir(os.path.join(out, rundir.ASIDE)):
      rundir.set_aside(out)
      os.makedirs(os.path.join(out, "checkpoints"))  # the new run's
    return read(m, step, part)
  monkeypatch.setattr(checkpoint, "read_on_one_device", set_aside_meanwhile)
  with pytest.raises(UserError) as e:
    checkpoint.latest_params(out, 4)
  assert "step 4 was set aside with the run while it was read, by an overwrite=true" in \
      str(e.value) and "keep" not in str(e.value)
  assert f"set aside in '{os.path.join(out, rundir.ASIDE)}'" in str(e.value)
  with pytest.raises(UserError, match=r"no checkpoint for step 4; it has \[\]; an overwrite=true"):
    checkpoint.latest_params(out, 4)


@pytest.mark.slow
def test_verify_beside_a_run_that_is_training_raises_no_false_alarm(tmp_path):
  out = tmp_path / "run"
  log = open(tmp_path / "train.log", "wb")
  proc = subprocess.Popen([sys.executable, "-m", "nanotext.train", BASE, *ARGS, f"output_dir={out}",
                           # steps it never reaches (it is killed below): a run that ended
                           # during a verify's start-up would not be "training into it"
                           "train.steps=100000", "checkpoint.every=1", "checkpoint.keep=2"],
                          cwd=REPO, stdout=log, stderr=log)
  try:
    while not (out / "checkpoints").is_dir() or not any(
        n.isdigit() for n in os.listdir(out / "checkpoints")):
      assert proc.poll() is None, (tmp_path / "train.log").read_text()[-3000:]
      time.sleep(0.2)
    checked, tries = 0, 0
    while proc.poll() is None and checked < 5 and tries < 20:
      tries += 1
      result = cli("nanotext.verify", str(out))
      assert "damaged" not in result.stdout, result.stdout
      if result.returncode == 2:  # each step of three listings rotated away (a loaded machine)
        assert "a run training into it removed every step listed" in result.stderr, result.stderr
        continue
      assert result.returncode == 0 and "a run is training into it" in result.stdout, result
      checked += 1
    assert checked >= 3
  finally:
    proc.kill()
    proc.wait()


def test_ctrl_c_during_verify_is_one_line(reference, tmp_path):
  out = copy_of(reference, tmp_path)
  root = os.path.join(out, "checkpoints")
  for n in range(8, 60, 2):  # more steps to read: a window for the signal
    shutil.copytree(os.path.join(root, "6"), os.path.join(root, str(n)))
  proc = subprocess.Popen([sys.executable, "-m", "nanotext.verify", out], cwd=REPO,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
  assert "checkpoint(s) in" in proc.stdout.readline()
  proc.send_signal(signal.SIGINT)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
  assert err.strip().splitlines()[-1] == ("nanotext: error: stopped by SIGINT; this tool only "
                                          "reads, nothing was changed")


# --- convert ----------------------------------------------------------------------------------

def test_convert_refuses_an_out_inside_a_run(reference, tmp_path):
  """params-only --out=RUN/checkpoints/99 wrote into the run it read, which then refused to
  resume ('step 99 past train.steps')."""
  run = copy_of(reference, tmp_path)
  other = str(tmp_path / "other")
  shutil.copytree(run, other)
  before = snapshot(run), snapshot(other)
  for out, needle in ((f"{run}/checkpoints/99", "inside the input"),
                      (f"{run}/params", "inside the input"),
                      (f"{other}/checkpoints/99", "inside the checkpoints/ of the run")):
    assert_one_error_line(cli("nanotext.convert", "params-only", f"--run={run}",
                              f"--out={out}"), 2, needle)
  assert_one_error_line(cli("nanotext.convert", "to-hf", f"--run={run}", "--out=/proc/x"), 2,
                        "kernel file system")
  assert (snapshot(run), snapshot(other)) == before


def test_a_file_size_limit_while_converting_is_one_line_status_1(reference, tmp_path):
  out = tmp_path / "a" / "b" / "p"
  proc = cli("nanotext.convert", "params-only", f"--run={reference[0]}", f"--out={out}",
             shell="ulimit -f 64")
  assert_one_error_line(proc, 1, "File too large")
  assert "meta_path" not in proc.stderr and "ERROR" not in proc.stderr
  assert os.listdir(tmp_path) == []  # no --out, no staging folder, no folder made for it


# --- plot -------------------------------------------------------------------------------------

@pytest.mark.plots
def test_plot_skips_lines_that_are_not_metrics_and_needs_no_config(reference, tmp_path):
  run = copy_of(reference, tmp_path)
  with open(os.path.join(run, "metrics.jsonl"), "ab") as f:
    f.write(b'{"step": 7, "loss": "abc"}\n{"step": 8, "loss": 1.0}\xff\xfe\n'
            b'{"step": 1e400, "loss": 1.0}\n[1, 2]\n{"step": 9, "lo')  # the last: being written
  with open(os.path.join(run, "config.yml"), "w") as f:
    f.write("train: [\n")
  out = tmp_path / "curves.png"
  proc = cli("nanotext.plot", run, f"--out={out}")
  assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
  assert "skipped 5 line(s) that are not metrics rows (line 8, ...)" in proc.stdout
  assert out.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.plots
def test_plot_refuses_an_out_it_cannot_write_before_reading(reference, tmp_path):
  run = reference[0]
  assert_one_error_line(cli("nanotext.plot", run, f"--out={tmp_path / 'x.xyz'}"), 2,
                        "'.xyz' is not an image format")
  folder = tmp_path / "locked"
  folder.mkdir()
  with immutable(folder):
    assert_one_error_line(cli("nanotext.plot", run, f"--out={folder / 'x.png'}"), 2,
                          "Operation not permitted")
  old = tmp_path / "old.png"
  old.write_bytes(b"keep")
  with immutable(old):
    assert_one_error_line(cli("nanotext.plot", run, f"--out={old}"), 2,
                          "Operation not permitted")
  assert old.read_bytes() == b"keep" and sorted(os.listdir(tmp_path)) == ["locked", "old.png"]
