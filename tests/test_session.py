"""The run-directory session in-process, without a CLI or a model: what a run that fails or is
stopped before its first step leaves, when a replaced run comes back, when it is deleted, and
that a run it refuses changes nothing (tests/test_faults*.py: the same through the CLI)."""

import os

import pytest

from conftest import BASE, TINY
from test_cli_errors import snapshot
from nanotext import config, lock, rundir
from nanotext.errors import UserError
from nanotext.session import Session
from nanotext.watch import Preemption

pytestmark = pytest.mark.fast


class Boom(Exception):
  """What a failing run raises inside the session."""


def session(out, *overrides) -> tuple:
  """(Session, its log lines) for the tiny config into `out`."""
  lines = []
  cfg = config.load(BASE, TINY + [f"output_dir={out}", *overrides])
  return Session(cfg, lines.append), lines


def old_run(out, *overrides) -> dict:
  """A finished run in `out` (config.yml of `overrides`, one step, metrics); its snapshot."""
  os.makedirs(out / "checkpoints" / "2")
  (out / "checkpoints" / "2" / "x").write_text("old")
  config.save(config.load(BASE, TINY + [f"output_dir={out}", *overrides]), out / "config.yml")
  (out / "metrics.jsonl").write_text('{"step": 2, "loss": 5.0}\n')
  return snapshot(out)


def new_run_writes(out) -> None:
  """What a starting run writes before its first step: its config.yml, a metrics line."""
  (out / "config.yml").write_text("new: run\n")
  with open(out / "metrics.jsonl", "a") as f:
    f.write('{"step": 0, "val_loss": 6.0}\n')


def test_a_failure_before_the_first_step_leaves_no_new_output_dir(tmp_path):
  out = tmp_path / "run"
  s, _ = session(out)
  with pytest.raises(Boom):
    with s.open(Preemption(on_early_stop=s.stop_early), 0):
      assert (out / lock.LOCK).exists()  # locked, probed
      new_run_writes(out)
      os.makedirs(out / "checkpoints", exist_ok=True)
      raise Boom
  assert not out.exists()


def test_a_failure_before_the_first_step_of_a_resume_puts_its_files_back(tmp_path):
  before = old_run(tmp_path)
  s, _ = session(tmp_path, "train.steps=8")
  with pytest.raises(Boom):
    with s.open(Preemption(on_early_stop=s.stop_early), 0):
      assert not s.replacing
      new_run_writes(tmp_path)
      raise Boom
  assert snapshot(tmp_path) == before and not (tmp_path / lock.LOCK).exists()


def test_a_replaced_run_comes_back_when_the_new_one_never_checkpoints(tmp_path):
  before = old_run(tmp_path, "seed=1")
  s, lines = session(tmp_path, "overwrite=true")
  preemption = Preemption(on_early_stop=s.stop_early)
  with pytest.raises(Boom):
    with s.open(preemption, 0):
      assert s.replacing and (tmp_path / rundir.ASIDE / "checkpoints" / "2").is_dir()
      assert not (tmp_path / "config.yml").exists()
      new_run_writes(tmp_path)
      os.makedirs(tmp_path / "checkpoints", exist_ok=True)
      preemption.begin_training()
      raise Boom  # a failed step, before any checkpoint
  assert snapshot(tmp_path) == before and not (tmp_path / rundir.ASIDE).exists()
  assert lines == [f"restored the previous run in {tmp_path}"]


def test_a_missing_params_source_is_refused_before_the_replaced_run_moves(tmp_path):
  """overwrite=true with checkpoint.load_params_from=/nonexistent set the previous run aside,
  put it back ('restored the previous run') and only then refused the path."""
  before = old_run(tmp_path, "seed=1")
  for src in (tmp_path.parent / "nonexistent", tmp_path / "metrics.jsonl"):
    s, lines = session(tmp_path, "overwrite=true", f"checkpoint.load_params_from={src}")
    with pytest.raises(UserError, match=r"^checkpoint.load_params_from='.*' (does not exist|is "
                                        r"not a directory)$"):
      with s.open(Preemption(on_early_stop=s.stop_early), 0):
        pytest.fail("the session opened")
    assert lines == [] and snapshot(tmp_path) == before


def test_a_replaced_run_is_deleted_once_a_step_of_the_new_one_is_confirmed(tmp_path):
  old_run(tmp_path, "seed=1")
  s, lines = session(tmp_path, "overwrite=true")
  preemption = Preemption(on_early_stop=s.stop_early)
  with pytest.raises(Boom):
    with s.open(preemption, 0):
      new_run_writes(tmp_path)
      preemption.begin_training()
      os.makedirs(tmp_path / "checkpoints" / "4")
      s.confirmed(4)  # the checkpoint manager's on_confirmed
      assert not s.replacing and not (tmp_path / rundir.ASIDE).exists()
      raise Boom  # a later failure keeps the new run
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4"] and not lines
  assert (tmp_path / "config.yml").read_text() == "new: run\n"


def test_a_failure_after_a_checkpoint_keeps_a_replacing_run_for_the_next_start(tmp_path):
  """A step on disk but not yet confirmed: kept, and the next start commits it (`recover`)."""
  old_run(tmp_path, "seed=1")
  s, _ = session(tmp_path, "overwrite=true")
  preemption = Preemption(on_early_stop=s.stop_early)
  with pytest.raises(Boom):
    with s.open(preemption, 0):
      preemption.begin_training()
      os.makedirs(tmp_path / "checkpoints" / "4")
      raise Boom
  assert (tmp_path / rundir.ASIDE).is_dir()
  rundir.recover(str(tmp_path), print)
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4"]
  assert not (tmp_path / rundir.ASIDE).exists()


def test_overwrite_on_the_same_run_says_it_changed_nothing(tmp_path):
  """overwrite=true replaces only a different run (it is resume-ok: a restarted command that
  keeps it must not wipe its run); on the same run's folder it resumed without a word."""
  before = old_run(tmp_path)
  s, lines = session(tmp_path, "overwrite=true", "train.steps=8")
  with s.open(Preemption(on_early_stop=s.stop_early), 0):
    assert not s.replacing
  assert snapshot(tmp_path) == before and len(lines) == 1, lines
  assert lines[0].startswith(f"overwrite=true changed nothing: output_dir '{tmp_path}' holds "
                             "this same run"), lines


def test_probe_files_a_killed_run_left_are_removed_at_the_next_start(tmp_path):
  """A SIGKILL between a write probe's create and remove left `.nanotext-probe-*` in the run's
  folders for good (a chaos probe: one more per such kill), profile.dir's and
  train.compile_cache_dir's as well."""
  before = old_run(tmp_path)
  os.makedirs(tmp_path / "tb")
  os.makedirs(tmp_path / "profile")
  cache = tmp_path.parent / f"{tmp_path.name}-cache"  # a folder of its own, outside the run
  cache.mkdir()
  left = [tmp_path / d / ".nanotext-probe-abc123" for d in ("", "checkpoints", "tb", "profile")]
  left.append(cache / ".nanotext-probe-abc123")
  for path in left:
    path.write_text("probe\n")
  s, _ = session(tmp_path, "train.steps=8", f"train.compile_cache_dir={cache}")
  with s.open(Preemption(on_early_stop=s.stop_early), 0):
    assert not any(path.exists() for path in left)
  assert snapshot(tmp_path) == before  # the run's own files untouched


@pytest.mark.parametrize("overrides", [["train.steps=8"], ["overwrite=true", "seed=1"]])
def test_an_early_signal_puts_output_dir_back_and_releases_it(tmp_path, overrides):
  """Preemption calls stop_early in its signal handler before the first step (then exits)."""
  before = old_run(tmp_path)
  s, _ = session(tmp_path, *overrides)
  with s.open(Preemption(on_early_stop=s.stop_early), 0):
    new_run_writes(tmp_path)
    line = s.stop_early("SIGTERM")
    assert line == (f"stopped by SIGTERM before the first step: nothing to save, output_dir "
                    f"'{tmp_path}' is as it was")
    assert snapshot(tmp_path) == before and not (tmp_path / lock.LOCK).exists()


def test_an_early_signal_keeps_a_recovered_overwrite(tmp_path):
  """A killed overwrite left the old run aside and the new run's config.yml; the next start
  restores the old run, and a signal before its first step keeps that repair."""
  before = old_run(tmp_path)
  rundir.set_aside(str(tmp_path))
  (tmp_path / "config.yml").write_text("killed: run\n")
  s, lines = session(tmp_path, "train.steps=8")
  with s.open(Preemption(on_early_stop=s.stop_early), 0):
    assert "restored the previous run" in lines[0]
    new_run_writes(tmp_path)
    s.stop_early("SIGINT")
  assert snapshot(tmp_path) == before


def test_a_refused_run_changes_nothing_and_releases_the_lock(tmp_path):
  before = old_run(tmp_path, "seed=1")
  s, _ = session(tmp_path)
  with pytest.raises(UserError, match="holds a different run"):
    with s.open(Preemption(on_early_stop=s.stop_early), 0):
      pass
  assert snapshot(tmp_path) == before and not (tmp_path / lock.LOCK).exists()


@pytest.mark.parametrize("overrides", [["train.steps=8"], ["train.steps=8", "overwrite=true"]])
def test_a_key_this_nanotext_does_not_know_stops_a_resume(tmp_path, overrides):
  """config.yml from a newer version: evaluate refused its unknown key, a resume (overwrite=true
  on the same run included) went on and rewrote config.yml without it."""
  old_run(tmp_path)
  path = tmp_path / "config.yml"
  path.write_text(path.read_text().replace("seed: 0\n", "seed: 0\nnew_feature: 3\n"))
  before = snapshot(tmp_path)
  s, _ = session(tmp_path, *overrides)
  with pytest.raises(UserError, match=rf"^unknown config key 'new_feature'.* \(in '{path}'\)$"):
    with s.open(Preemption(on_early_stop=s.stop_early), 0):
      pass
  assert snapshot(tmp_path) == before and not (tmp_path / lock.LOCK).exists()
  s, _ = session(tmp_path, "seed=1", "overwrite=true")  # another run: replaces it, unread
  with s.open(Preemption(on_early_stop=s.stop_early), 0):
    assert s.replacing


def test_the_rules_of_a_fresh_start_are_checked_where_the_run_starts_afresh(tmp_path):
  """train checks a fresh start's own rules (wiring.check's) here, once it is known whether the
  run resumes (a run saved before a rule resumes past it) or replaces output_dir (refused before
  anything is set aside)."""
  def opened(out, *overrides):
    def refuse():
      raise UserError("fresh")
    cfg = config.load(BASE, TINY + [f"output_dir={out}", *overrides])
    s = Session(cfg, lambda line: None, fresh_rules=refuse)
    with s.open(Preemption(on_early_stop=s.stop_early), 0):
      pass
  before = old_run(tmp_path)
  opened(tmp_path, "train.steps=8")  # resumes
  opened(tmp_path, "train.steps=8", "overwrite=true")  # the same run: resumes
  with pytest.raises(UserError, match="^fresh$"):  # replaces it
    opened(tmp_path, "seed=1", "overwrite=true")
  assert snapshot(tmp_path) == before and not (tmp_path / lock.LOCK).exists()
  with pytest.raises(UserError, match="^fresh$"):
    opened(tmp_path / "new")
  assert not (tmp_path / "new").exists()


def test_a_run_holding_the_lock_is_left_alone(tmp_path):
  """Another run's output_dir: refused, and nothing of it put back or removed."""
  before = old_run(tmp_path)
  s, _ = session(tmp_path, "train.steps=8")
  with lock.Lock(str(tmp_path)):
    with pytest.raises(UserError, match="in use by another run"):
      with s.open(Preemption(on_early_stop=s.stop_early), 0):
        pass
    assert (tmp_path / lock.LOCK).exists()
  assert snapshot(tmp_path) == before


def test_the_path_is_checked_before_anything_is_written(tmp_path):
  with pytest.raises(UserError, match="glob"):
    session(tmp_path / "run[1]")
  assert os.listdir(tmp_path) == []
