"""Faults and mistakes at seeded random points: kills during saves, damaged steps, concurrent
starts, failed overwrites. Every case ends bitwise equal to an uninterrupted run, or refused with
one line; no file of an earlier complete step is ever lost.

A kill lands inside a save deterministically: tests/pause_in_save.py runs the CLI with the save
of one step held (a marker file written) while that step is still under its temporary name.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from conftest import (BASE, PROCESS_TIMEOUT_S, REPO, TINY, compiling_env, one_line_error, run_cli,
                      train_command)
from nanotext import checkpoint
from nanotext.errors import UserError
from nanotext.train import run

SEED = 11  # each test's random choices: np.random.default_rng(SEED), its own, whatever ran before
ARGS = [o for o in TINY if not o.startswith(("train.steps", "train.eval_every",
                                             "checkpoint.every"))] + [
    "train.steps=6", "checkpoint.every=2", "checkpoint.keep=10", "train.eval_every=0",
    "sample.max_new_tokens=0"]


def quiet_run(out, *extra):
  lines = []
  result = run(BASE, ARGS + [f"output_dir={out}", *extra], log=lines.append)
  return result, lines


def losses(out) -> dict:
  with open(os.path.join(out, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def params(out):
  step, p = checkpoint.latest_params(out)
  return step, [np.asarray(x) for x in jax.tree.leaves(jax.device_get(p))]


def step_files(out) -> dict:
  """{relative path: sha1} of every file of every complete step."""
  root = os.path.join(out, "checkpoints")
  digests = {}
  for name in os.listdir(root) if os.path.isdir(root) else []:
    if not name.isdigit():
      continue
    for dirpath, _, files in os.walk(os.path.join(root, name)):
      for f in files:
        p = os.path.join(dirpath, f)
        with open(p, "rb") as fh:
          digests[os.path.relpath(p, root)] = hashlib.sha1(fh.read()).hexdigest()
  return digests


def assert_kept(before: dict, out: str, steps) -> None:
  """Every file of the given earlier steps is still there, byte for byte."""
  now = step_files(out)
  kept = {k: v for k, v in before.items() if k.split(os.sep)[0] in {str(s) for s in steps}}
  assert kept and {k: now.get(k) for k in kept} == kept


def row_kinds(out) -> list:
  """(step, which metrics) of each metrics.jsonl row, in file order."""
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [(r["step"], "val_loss" in r) for r in map(json.loads, f)]


def assert_same_as(reference, out) -> None:
  ref_out, ref_losses, ref_params = reference
  got = losses(out)
  assert {s: got[s] for s in ref_losses} == ref_losses  # bitwise: == on floats
  # Each step's rows once, in order: a resume drops the rows of steps past its checkpoint.
  assert row_kinds(out) == row_kinds(ref_out)
  step, p = params(out)
  assert step == 6 and all(np.array_equal(a, b) for a, b in zip(p, ref_params, strict=True))


_REFERENCE = []  # trained once per session: the three fault files' fixtures share it


def make_reference(tmp_path_factory):
  """An uninterrupted run of 6 steps with a checkpoint every 2 (all kept). Tests copy it
  (copy_of) before changing anything, or only read it."""
  if not _REFERENCE:
    out = str(tmp_path_factory.mktemp("reference") / "run")
    quiet_run(out)
    _REFERENCE.append((out, losses(out), params(out)[1]))
  return _REFERENCE[0]


reference = pytest.fixture(scope="module", name="reference")(make_reference)


def copy_of(reference, tmp_path) -> str:
  out = str(tmp_path / "run")
  shutil.copytree(reference[0], out)
  return out


def start(out, *extra, pause_at=None, env=None):
  """`python -m nanotext.train` in the background; with pause_at, it waits inside that save."""
  marker = f"{out}.marker"
  log = open(f"{out}.log", "ab")
  proc = subprocess.Popen(train_command(pause_at and f"{pause_at}:{marker}") + [
      BASE, *ARGS, f"output_dir={out}", *extra], cwd=REPO, stdout=log, stderr=log, env=env)
  if pause_at is not None:
    deadline = time.time() + PROCESS_TIMEOUT_S
    while not os.path.exists(marker):
      assert proc.poll() is None, open(f"{out}.log").read()[-3000:]
      assert time.time() < deadline, "the run never reached the save"
      time.sleep(0.05)
  return proc, marker


def saving(out) -> list:
  return [n for n in os.listdir(os.path.join(out, "checkpoints")) if "orbax-checkpoint-tmp" in n]


def value_spans(step_dir) -> dict:
  """{data file: [(offset, length), ...]}: the stored chunks a restore of the step's `state`
  reads, from its OCDBT b-tree. Bytes elsewhere in a data file (b-tree nodes the merged
  manifest no longer points to) are never read: damage there is no damage."""
  import tensorstore as ts
  state = os.path.join(step_dir, "state")
  kv = ts.KvStore.open(f"file://{state}/").result()
  spans, todo = {}, [ts.ocdbt.dump(kv).result()["versions"][-1]["root"]]

  def refs(x):  # every location string inside a dumped manifest or node
    if isinstance(x, dict):
      return [r for v in x.values() for r in refs(v)]
    if isinstance(x, list):
      return [r for v in x for r in refs(v)]
    return [x] if isinstance(x, str) and x.startswith(("btreenode:", "value:")) else []

  while todo:
    for ref in refs(todo.pop()):
      kind, rest = ref.split(":", 1)
      if kind == "btreenode":
        todo.append(ts.ocdbt.dump(kv, ref).result())
      else:  # "value:<prefix>:<file>:<offset>:<length>"
        name, offset, length = rest.replace(":", "", 1).rsplit(":", 2)
        spans.setdefault(os.path.join(state, name), []).append((int(offset), int(length)))
  return spans


def array_files(step_dir, spans=None) -> list:
  """The data files of a step's `state` item that hold array chunks, largest first (`spans`:
  its value_spans, if already read)."""
  return sorted(spans or value_spans(step_dir), key=os.path.getsize, reverse=True)


def read_bytes(rng, spans, count) -> list:
  """`count` distinct random offsets among a file's `spans` [(offset, length), ...]."""
  offsets = np.concatenate([np.arange(o, o + n) for o, n in spans])
  return sorted(int(at) for at in rng.choice(offsets, count, replace=False))


def damage_chunks(rng, victim: str, spans: dict, damage: str) -> None:
  """"truncate" `victim` inside one of its read chunks (a cut in the unread tail would lose
  nothing), or "flip" four bytes of its chunks in place (the file still parses, the checksums
  notice)."""
  with open(victim, "r+b") as f:
    if damage == "truncate":
      f.truncate(read_bytes(rng, spans[victim], 1)[0])
      return
    for at in read_bytes(rng, spans[victim], 4):
      f.seek(at)
      byte = f.read(1)[0]
      f.seek(at)
      f.write(bytes([byte ^ 0xFF]))


@pytest.mark.parametrize("damage", ["truncate", "flip", "data_file"])
def test_a_damaged_newest_step_falls_back_to_the_newest_intact_one(reference, tmp_path, damage):
  rng = np.random.default_rng(SEED)
  out = copy_of(reference, tmp_path)
  before = step_files(out)
  where = os.path.join(out, "checkpoints", "6")
  if damage == "data_file":  # the arrays whole, the data iterator's file gone
    os.remove(os.path.join(where, "data", "process_0-of-1.json"))
  else:
    spans = value_spans(where)
    files = array_files(where, spans)
    assert files, "no array files found"
    damage_chunks(rng, files[rng.integers(len(files))], spans, damage)
  _, lines = quiet_run(out)
  warnings = [l for l in lines if l.startswith("warning:")]
  assert len(warnings) == 1 and "step 6" in warnings[0] and "resuming from step 4" in warnings[0]
  assert any("resumed from the checkpoint of step 4" in l for l in lines)
  # The damaged step is kept (moved aside), the earlier ones are untouched.
  assert os.path.isdir(os.path.join(out, "damaged", "step_6", "state"))
  assert_kept(before, out, [2, 4])
  assert_same_as(reference, out)


def test_training_goes_on_when_stdout_is_closed(reference, tmp_path):
  """`train | tee log` with tee gone (its terminal closed, the run under nohup): the run trains
  to its end as it would have, says so once on stderr, and exits 0 (it ended in a BrokenPipeError
  traceback at its first line)."""
  out = str(tmp_path / "run")
  read, write = os.pipe()
  os.close(read)  # the reader has gone before the first line
  try:
    proc = subprocess.run(train_command() + [BASE, *ARGS, f"output_dir={out}"], cwd=REPO,
                          stdout=write, stderr=subprocess.PIPE, text=True,
                          timeout=PROCESS_TIMEOUT_S)
  finally:
    os.close(write)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stderr.count("stdout was closed; training goes on") == 1, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr
  assert_same_as(reference, out)


def test_nothing_intact_is_refused_with_one_line_and_nothing_moved(reference, tmp_path):
  out = copy_of(reference, tmp_path)
  for step in (2, 4, 6):
    for victim in array_files(os.path.join(out, "checkpoints", str(step))):
      with open(victim, "r+b") as f:
        f.truncate(1)
  before = step_files(out)
  with pytest.raises(UserError, match="checkpoint .*/6' .*; no older checkpoint restores"):
    quiet_run(out)
  assert step_files(out) == before and not os.path.exists(os.path.join(out, "damaged"))


def test_a_kill_during_a_save_resumes_bitwise(reference, tmp_path):
  out = str(tmp_path / "run")
  pause = int(np.random.default_rng(SEED).choice([2, 4]))
  proc, marker = start(out, pause_at=pause)
  before = step_files(out)
  assert saving(out) and all(int(k.split(os.sep)[0]) < pause for k in before)
  proc.kill()
  assert proc.wait(timeout=60) == -signal.SIGKILL
  assert os.path.exists(os.path.join(out, ".lock"))  # stale: its pid is gone
  _, lines = quiet_run(out)
  assert pause == 2 or any(f"resumed from the checkpoint of step {pause - 2}" in l for l in lines)
  if pause > 2:
    assert_kept(before, out, range(2, pause, 2))
  assert not saving(out)
  assert_same_as(reference, out)


def test_sigterm_in_the_final_save_and_a_concurrent_start(reference, tmp_path):
  out = str(tmp_path / "run")
  proc, marker = start(out, pause_at=6)
  # A second run into the same output_dir is refused with one line and changes nothing.
  before = step_files(out)
  with pytest.raises(UserError, match=r"is in use by another run \(pid \d+"):
    quiet_run(out)
  assert step_files(out) == before
  proc.send_signal(signal.SIGTERM)  # after the loop, while the final save is written
  time.sleep(0.5)
  open(marker + ".go", "w").close()
  assert proc.wait(timeout=PROCESS_TIMEOUT_S) == 0
  log = open(f"{out}.log").read()
  assert "Traceback" not in log and "received SIGTERM after the last step" in log, log[-2000:]
  assert not saving(out) and not os.path.exists(os.path.join(out, ".lock"))
  assert_same_as(reference, out)


def test_overwrite_keeps_the_old_run_until_the_new_one_has_a_checkpoint(reference, tmp_path):
  out = copy_of(reference, tmp_path)
  before = step_files(out)
  # 1. Bad input: refused before anything on disk is touched.
  with pytest.raises(UserError, match="matches no file"):
    quiet_run(out, "overwrite=true", "data.source=bin", "data.train_files=/nonexistent/*.bin",
              "data.val_files=/nonexistent/*.bin")
  # 2. Killed inside the new run's first save: the next start puts the old run back.
  # Another seed: another run, whose programs (the seed is an argument) the reference compiled.
  proc, _ = start(out, "overwrite=true", "seed=1", pause_at=2)
  assert os.path.isdir(os.path.join(out, ".overwritten"))
  proc.kill()
  proc.wait(timeout=60)
  _, lines = quiet_run(out)
  assert any("restored the previous run" in l for l in lines)
  assert any("resumed from the checkpoint of step 6" in l for l in lines)
  assert step_files(out) == before and not os.path.exists(os.path.join(out, ".overwritten"))
  with open(os.path.join(out, "config.yml")) as f:
    assert yaml.safe_load(f)["seed"] == 0  # the old run's, not the overwrite's
  assert_same_as(reference, out)


def test_a_mesh_change_is_a_resume_and_too_few_steps_are_refused(reference, tmp_path):
  out = copy_of(reference, tmp_path)
  with pytest.raises(UserError, match="step 6, past train.steps=4"):
    quiet_run(out, "train.steps=4")
  _, lines = quiet_run(out, "train.steps=7", "mesh.fsdp=4", "mesh.tensor=2")
  assert any("resumed from the checkpoint of step 6" in l for l in lines)
  assert max(losses(out)) == 7


def test_a_resume_on_changed_data_is_refused_unless_allowed(tmp_path):
  from nanotext.data import binfile
  shard = str(tmp_path / "train.bin")
  binfile.write_shard(shard, np.arange(6000) % 500)
  data = ["data.source=bin", f"data.train_files={shard}", f"data.val_files={shard}"]
  out = str(tmp_path / "run")
  quiet_run(out, *data, "train.steps=2")
  binfile.write_shard(shard, np.arange(6000)[::-1] % 500)  # same name and size, other tokens
  with pytest.raises(UserError, match="training data changed since the checkpoint of step 2 "
                     r"\(shard 'train.bin' changed"):
    quiet_run(out, *data, "train.steps=4")
  _, lines = quiet_run(out, *data, "train.steps=4", "data.allow_changed=true")
  assert any(l.endswith("; data.allow_changed=true: shard 'train.bin' changed (same size, other "
                        "contents)") and "resumed from the checkpoint of step 2" in l
             for l in lines), lines  # it said nothing of the change it went on with


def cli(args, timeout=PROCESS_TIMEOUT_S):
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True, text=True,
                        timeout=timeout)


def assert_one_error_line(proc, status: int, *needles) -> None:
  """Exit `status`; the error line is the last word on stderr: no traceback, no noise after it."""
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert proc.returncode == status, proc.stderr[-3000:]
  assert lines and lines[-1].startswith("nanotext: error:"), proc.stderr[-3000:]
  assert sum(l.startswith("nanotext: error:") for l in lines) == 1
  for bad in ("Traceback", "Event loop is closed", "Task exception"):
    assert bad not in proc.stderr, proc.stderr[-3000:]
  for needle in needles:
    assert needle in lines[-1], lines[-1]


def test_a_damaged_checkpoint_in_generate_is_one_line(reference, tmp_path):
  out = copy_of(reference, tmp_path)
  # generate refuses a run without a tokenizer before reading it; give it one to get that far
  with open(os.path.join(out, "config.yml")) as f:
    cfg = yaml.safe_load(f)
  cfg["data"]["tokenizer"] = "shakespeare"
  with open(os.path.join(out, "config.yml"), "w") as f:
    yaml.safe_dump(cfg, f)
  for victim in array_files(os.path.join(out, "checkpoints", "6")):
    with open(victim, "r+b") as f:
      f.truncate(os.path.getsize(victim) // 2)
  # a prompt whose ids fit the model's 512 rows (its default's do not: refused before the read)
  assert_one_error_line(cli(["nanotext.generate", f"output_dir={out}", "prompt=a",
                             "max_new_tokens=2"]), 2, "step 6")


def test_a_failing_disk_is_one_line_and_releases_the_lock(tmp_path):
  out = str(tmp_path / "run")
  # Files may not grow past 256 KiB: writes fail with EFBIG, as on a full disk (Python ignores
  # SIGXFSZ). Set by the shell, not a preexec_fn: forking a process that runs JAX can deadlock.
  proc = subprocess.run(["bash", "-c", 'ulimit -f 256 && exec "$0" "$@"', sys.executable, "-m",
                         "nanotext.train", BASE, *ARGS, f"output_dir={out}"], cwd=REPO,
                        capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
  assert_one_error_line(proc, 1, "checkpoint")
  assert not os.path.exists(os.path.join(out, ".lock"))


def test_metrics_that_cannot_grow_mid_run_are_one_line(tmp_path):
  """A full disk mid-run hit metrics.jsonl first (no periodic checkpoints): an OSError
  traceback. Now one line naming the file, status 1."""
  out = str(tmp_path / "run")
  proc = subprocess.run(["bash", "-c", 'ulimit -f 4 && exec "$0" "$@"', sys.executable, "-m",
                         "nanotext.train", BASE, *ARGS, f"output_dir={out}", "train.steps=80",
                         "checkpoint.every=0"], cwd=REPO, capture_output=True, text=True,
                        timeout=PROCESS_TIMEOUT_S)
  assert_one_error_line(proc, 1, "metrics.jsonl", "File too large")
  assert not os.path.exists(os.path.join(out, ".lock"))


def test_ctrl_c_during_compilation_stops_cleanly(tmp_path):
  """Before the first step there is nothing to save: Ctrl-C stops at once, in one line, and the
  output_dir the run created is gone again (tests/test_faults_startup.py: more signal cases)."""
  out = str(tmp_path / "run")
  # Not from the cache (the reference compiled these programs): loaded from it, they could be
  # done, and the first step with them, before the signal lands under load.
  proc, _ = start(out, "train.steps=50", env=compiling_env())
  deadline = time.time() + PROCESS_TIMEOUT_S
  while "model:" not in open(f"{out}.log").read():  # compilation starts right after this line
    assert proc.poll() is None and time.time() < deadline, open(f"{out}.log").read()[-3000:]
    time.sleep(0.05)
  proc.send_signal(signal.SIGINT)
  assert proc.wait(timeout=PROCESS_TIMEOUT_S) == 130, open(f"{out}.log").read()[-3000:]
  log = open(f"{out}.log").read()
  assert "stopped by SIGINT before the first step" in log and "Traceback" not in log
  assert not os.path.exists(out)


def test_verify_finds_damage_in_an_older_step_and_moves_nothing(reference, tmp_path):
  """`python -m nanotext.verify` reads every step, so damage to a step no resume would restore
  (here step 2 of 2, 4, 6) is found: exit 1, that step named with its array; nothing moved. A
  step whose arrays are whole but whose data-iterator file is gone (4) is damaged too: a resume
  could not restore it."""
  out = copy_of(reference, tmp_path)
  clean = run_cli("nanotext.verify", out)
  assert clean.returncode == 0 and clean.stderr == "", clean.stderr  # no orbax INFO logs
  assert [l.split()[:3] for l in clean.stdout.splitlines()[1:]] == \
      [["step", s, "intact"] for s in ("6", "4", "2")]
  where = os.path.join(out, "checkpoints", "2")
  spans = value_spans(where)
  victim = array_files(where, spans)[0]
  offset, length = spans[victim][0]
  with open(victim, "r+b") as f:  # into a chunk: bytes past the chunks are never read
    f.seek(offset + length // 2)
    f.write(b"\xde\xad\xbe\xef")
  os.remove(os.path.join(out, "checkpoints", "4", "data", "process_0-of-1.json"))
  before = step_files(out)
  proc = run_cli("nanotext.verify", out)
  # Nothing on stderr: the report is the output (orbax's dropped reads were a traceback there)
  assert proc.returncode == 1 and proc.stderr == "", proc.stderr
  rows = {l.split()[1]: l for l in proc.stdout.splitlines() if l.strip().startswith("step")}
  assert "intact" in rows["6"]
  assert "damaged" in rows["4"] and "data-iterator" in rows["4"]  # its arrays are whole
  assert "damaged" in rows["2"] and ("does not match" in rows["2"] or "cannot read" in rows["2"])
  assert step_files(out) == before and not os.path.exists(os.path.join(out, "damaged"))
  one_line_error(run_cli("nanotext.verify", str(tmp_path / "nothing")), "does not exist")
