"""The run directory's guards, one by one and without training: the lock, the overwrite
transaction, output_dir checks, checksums, the data fingerprint, process-count changes, and
the config mistakes that must be one line (duplicate keys, non-UTF-8, NaN rates, huge ints)."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE, REPO, TINY
from nanotext import (checkpoint, config, identity, lock, rundir, sharding, window_schedule,
                      wiring)
from nanotext.data import binfile, fingerprint, pipeline
from nanotext.errors import UserError

pytestmark = pytest.mark.fast


def dead_pid() -> int:
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


def test_a_second_lock_is_refused_and_released_locks_are_gone(tmp_path):
  with lock.Lock(str(tmp_path)):
    with pytest.raises(UserError, match=r"in use by another run \(pid \d+ on "):
      lock.Lock(str(tmp_path)).acquire()
  assert not os.path.exists(tmp_path / lock.LOCK)


@pytest.mark.parametrize("holder, stale", [
    (lambda: {"pid": dead_pid(), "host": socket.gethostname()}, True),
    (lambda: {"pid": os.getpid(), "host": socket.gethostname(), "start_time": -5}, True),
    (lambda: {"pid": os.getppid(), "host": socket.gethostname()}, False),
    (lambda: {"pid": 1, "host": "another-host"}, False),
])
def test_stale_locks_are_taken_over_by_pid_and_host(tmp_path, holder, stale):
  (tmp_path / lock.LOCK).write_text(json.dumps(holder()))
  held = lock.Lock(str(tmp_path))
  if stale:  # a killed run's lock (pid gone, or the pid reused by a younger process)
    with held:
      assert json.loads((tmp_path / lock.LOCK).read_text())["pid"] == os.getpid()
  else:
    with pytest.raises(UserError, match="in use by another run"):
      held.acquire()


def test_of_two_starts_taking_over_a_stale_lock_one_wins(tmp_path, monkeypatch):
  """Without flock (lock.GUARD), as on Windows: the takeover's rename-and-check alone."""
  monkeypatch.setattr(lock, "fcntl", None)
  (tmp_path / lock.LOCK).write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname()}))
  first, second = lock.Lock(str(tmp_path)), lock.Lock(str(tmp_path))
  judged, real_alive = [], lock.alive

  def first_takes_over_meanwhile(holder):  # `second` judged the old lock stale; then `first` ran
    stale = real_alive(holder)
    if not judged:
      judged.append(holder)
      first.acquire()
    return stale

  monkeypatch.setattr(lock, "alive", first_takes_over_meanwhile)
  with pytest.raises(UserError, match=r"in use by another run \(pid \d+ on "):
    second.acquire()  # it moved `first`'s fresh lock away and wrote its own
  assert first.held and not second.held
  assert sorted(os.listdir(tmp_path)) == [lock.LOCK]
  first.release()
  assert not os.listdir(tmp_path)


def test_of_three_starts_at_a_stale_lock_one_holds_it(tmp_path, monkeypatch):
  """`second` judged a dead run's lock stale, `first` took it over meanwhile, `second` moved
  `first`'s fresh lock away and, while it put it back, `third` wrote its own: `first` and
  `third` both held it. Each start now judges and takes under an flock: the others are refused."""
  (tmp_path / lock.LOCK).write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname()}))
  first, second, third = (lock.Lock(str(tmp_path)) for _ in range(3))
  tried, done, refused, real_alive, real_read = set(), set(), [], lock.alive, lock._read
  monkeypatch.setattr(lock, "GUARD_S", 0, raising=False)  # a busy guard: refused at once

  def attempt(start) -> None:
    tried.add(start)
    try:
      start.acquire()
    except UserError as e:
      refused.append(str(e))
    done.add(start)

  def first_takes_over_meanwhile(holder):  # `second` judged the old lock stale
    if first not in tried:
      attempt(first)
    return real_alive(holder)

  def third_starts_meanwhile(path):  # `second` reads back what it moved: the path is free
    if ".stale-" in path and first in done and third not in tried:
      attempt(third)
    return real_read(path)

  monkeypatch.setattr(lock, "alive", first_takes_over_meanwhile)
  monkeypatch.setattr(lock, "_read", third_starts_meanwhile)
  attempt(second)
  assert [s.held for s in (first, second, third)] == [False, True, False], refused
  assert len(refused) == 2 and all("is being locked by another run right now" in r
                                    for r in refused)
  assert sorted(os.listdir(tmp_path)) == [lock.LOCK]  # the guard removed by its holder
  second.release()
  assert not os.listdir(tmp_path)


def test_a_start_killed_holding_the_guard_never_blocks_the_next(tmp_path, monkeypatch):
  """SIGKILL inside the judge-and-take: the kernel drops its flock, the next start takes the
  lock at once (and removes the guard file left behind)."""
  code = ("import os, signal, sys; from nanotext import lock; "
          "held = lock.Lock(sys.argv[1])._guarded(); held.__enter__(); "
          "os.kill(os.getpid(), signal.SIGKILL)")
  proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, timeout=60)
  assert proc.returncode == -9 and (tmp_path / lock.GUARD).exists()
  monkeypatch.setattr(lock, "GUARD_S", 0)
  with lock.Lock(str(tmp_path)) as held:
    assert held.held and sorted(os.listdir(tmp_path)) == [lock.LOCK]
  assert not os.listdir(tmp_path)


def a_step_of_a_run(d) -> str:
  """A step folder of a run in `d` (its rotation deletes what lies inside)."""
  (d / "checkpoints" / "14").mkdir(parents=True)
  (d / "config.yml").write_text("")
  return str(d / "checkpoints" / "14")


@pytest.mark.parametrize("make, needle", [
    (lambda d: "", "output_dir is empty"),
    (lambda d: "/proc/nanotext", "kernel file system"),
    (lambda d: "/", "is the file system's root"),  # config.yml and checkpoints/ written into /
    (lambda d: "//..", "is the file system's root"),
    (lambda d: str(d / ("x" * 300)), "too long"),
    (lambda d: (d / "f").write_text("") or str(d / "f"), "not a directory"),
    (lambda d: (d / "checkpoints").write_text("") or str(d), "checkpoints' exists and is not"),
    (lambda d: a_step_of_a_run(d) + "/nested", "inside the checkpoints/ of the run"),
    (lambda d: os.symlink(d / "gone", d / "link") or str(d / "link"),  # was 'File exists'
     "is a symbolic link to '.*gone', which does not exist"),
])
def test_output_dirs_that_cannot_hold_a_run(tmp_path, make, needle):
  with pytest.raises(UserError, match=needle):
    rundir.check_output_dir_path(make(tmp_path))


def test_an_output_dir_that_cannot_be_created(tmp_path):
  (tmp_path / "file").write_text("")
  with pytest.raises(UserError, match="cannot create output_dir"):
    lock.Lock(str(tmp_path / "file" / "run")).acquire()


def fake_run(out, tag: str, steps=(2,)) -> None:
  os.makedirs(out / "checkpoints", exist_ok=True)
  for s in steps:
    (out / "checkpoints" / str(s)).mkdir()
    (out / "checkpoints" / str(s) / "x").write_text(tag)
  (out / "config.yml").write_text(tag)
  (out / "metrics.jsonl").write_text(tag)


def test_overwrite_rolls_back_until_the_new_run_has_a_checkpoint(tmp_path):
  fake_run(tmp_path, "old")
  rundir.set_aside(str(tmp_path))
  (tmp_path / "config.yml").write_text("new")  # the new run started, then was killed
  (tmp_path / "checkpoints").mkdir()
  lines = []
  rundir.recover(str(tmp_path), lines.append)
  assert "restored the previous run" in lines[0]
  assert (tmp_path / "config.yml").read_text() == "old"
  assert (tmp_path / "checkpoints" / "2" / "x").read_text() == "old"
  assert not (tmp_path / rundir.ASIDE).exists()


def test_overwrite_commits_once_the_new_run_has_a_checkpoint(tmp_path):
  fake_run(tmp_path, "old")
  rundir.set_aside(str(tmp_path))
  fake_run(tmp_path, "new", steps=(4,))
  rundir.recover(str(tmp_path), print)  # killed between its first checkpoint and the commit
  assert not (tmp_path / rundir.ASIDE).exists()
  assert (tmp_path / "config.yml").read_text() == "new"


def test_checksums_see_every_byte_and_not_the_layout():
  x = jnp.arange(4 * 6, dtype=jnp.float32).reshape(4, 6)
  base = checkpoint.checksums({"a": x, "b": x.astype(jnp.bfloat16), "s": jnp.int32(3)})
  sharded = jax.device_put(x, jax.sharding.NamedSharding(
      jax.sharding.Mesh(np.array(jax.devices()[:2]), ("d",)), jax.sharding.PartitionSpec("d")))
  assert checkpoint.checksums({"a": sharded})["a"] == base["a"]
  raw = np.asarray(x).reshape(-1).view(np.uint8).copy()
  for byte in (0, 1, 2, 3, 50, 95):
    flipped = raw.copy()
    flipped[byte] ^= 0x10
    assert checkpoint.checksums({"a": flipped.view(np.float32).reshape(4, 6)})["a"] != base["a"]
  swapped = np.asarray(x).copy()
  swapped[[0, 1]] = swapped[[1, 0]]
  assert checkpoint.checksums({"a": swapped})["a"] != base["a"]


def test_verify_names_the_damaged_array():
  tree = {"params": {"w": jnp.ones((3,))}}
  integrity = {"checksums": checkpoint.checksums(tree)}
  checkpoint.verify(tree, integrity, "here")
  with pytest.raises(checkpoint.Damaged, match="array params/w does not match"):
    checkpoint.verify({"params": {"w": jnp.zeros((3,))}}, integrity, "here")


def test_fingerprint_notices_deleted_and_rewritten_shards(tmp_path):
  for i in range(2):
    binfile.write_shard(str(tmp_path / f"train_{i}.bin"), np.arange(3000) % 500)
  cfg = config.load(BASE, TINY + ["data.source=bin", f"data.train_files={tmp_path}/train_*.bin"])
  first = fingerprint.fingerprint(cfg.data)
  assert len(first) == 2 and fingerprint.fingerprint_change(first, fingerprint.fingerprint(cfg.data)) == ""
  binfile.write_shard(str(tmp_path / "train_1.bin"), np.arange(3000)[::-1] % 500)
  assert "train_1.bin' changed (same size" in fingerprint.fingerprint_change(
      first, fingerprint.fingerprint(cfg.data))
  os.remove(tmp_path / "train_1.bin")
  assert "train_1.bin' is gone" in fingerprint.fingerprint_change(first, fingerprint.fingerprint(cfg.data))


def test_shards_of_one_name_in_two_folders_are_told_apart(tmp_path):
  """Keyed by file name, cA/train_000000.bin hid cB's: replacing one, or dropping a folder from
  the glob, resumed as the same data."""
  for d in ("cA", "cB"):
    (tmp_path / d).mkdir()
    binfile.write_shard(str(tmp_path / d / "train_000000.bin"), np.arange(3000) % 500)
  both = config.load(BASE, TINY + ["data.source=bin",
                                   f"data.train_files={tmp_path}/c*/train_*.bin"])
  first = fingerprint.fingerprint(both.data)
  assert sorted(n for n, _, _ in first) == ["cA/train_000000.bin", "cB/train_000000.bin"]
  binfile.write_shard(str(tmp_path / "cA" / "train_000000.bin"), np.arange(3000)[::-1] % 500)
  assert "cA/train_000000.bin' changed" in fingerprint.fingerprint_change(
      first, fingerprint.fingerprint(both.data))
  one = config.load(BASE, TINY + ["data.source=bin",
                                  f"data.train_files={tmp_path}/cB/train_*.bin"])
  assert "is gone" in fingerprint.fingerprint_change(first, fingerprint.fingerprint(one.data))


def test_a_second_folder_of_the_same_names_is_named_as_the_new_shard(tmp_path):
  """Adding cB/train_000000.bin beside cA's turns both names into paths: the refusal named the
  old shard, cA's, as new; removing a folder named the kept one's new form as gone."""
  (tmp_path / "cA").mkdir()
  binfile.write_shard(str(tmp_path / "cA" / "train_000000.bin"), np.arange(3000) % 500)
  glob = ["data.source=bin", f"data.train_files={tmp_path}/c*/train_*.bin"]
  one = fingerprint.fingerprint(config.load(BASE, TINY + glob).data)
  (tmp_path / "cB").mkdir()
  binfile.write_shard(str(tmp_path / "cB" / "train_000000.bin"), np.arange(3000)[::-1] % 500)
  both = fingerprint.fingerprint(config.load(BASE, TINY + glob).data)
  assert fingerprint.fingerprint_change(one, both) == "shard 'cB/train_000000.bin' is new"
  assert fingerprint.fingerprint_change(both, one) == "shard 'cB/train_000000.bin' is gone"


def test_the_same_shards_read_in_another_order_are_other_data(tmp_path):
  """x/train_b.bin and y/train_a.bin gathered into one folder keep their names but sort the
  other way: the resume read other batches than the run it continued, without a word."""
  for d, name, tokens in (("x", "train_b.bin", np.arange(3000)), ("y", "train_a.bin",
                                                                   np.arange(3000)[::-1])):
    (tmp_path / d).mkdir()
    binfile.write_shard(str(tmp_path / d / name), tokens % 500)
  load = lambda glob: fingerprint.fingerprint(config.load(
      BASE, TINY + ["data.source=bin", f"data.train_files={tmp_path}/{glob}"]).data)
  first = load("*/train_*.bin")
  for d, name in (("x", "train_b.bin"), ("y", "train_a.bin")):  # a move keeping the order
    os.renames(tmp_path / d / name, tmp_path / "moved" / d / name)
  assert fingerprint.fingerprint_change(first, load("moved/*/train_*.bin")) == ""
  for d, name in (("x", "train_b.bin"), ("y", "train_a.bin")):  # one folder: another order
    os.renames(tmp_path / "moved" / d / name, tmp_path / "all" / name)
  assert fingerprint.fingerprint_change(first, load("all/train_*.bin")) == \
      "the shards' paths sort in another order: 'train_a.bin' now comes before 'train_b.bin'"


def test_a_step_missing_a_process_data_file_is_damaged():
  """Each process saves its own data-iterator file; a step without all of them is damaged (a
  resume falls back past it), which is not the same as one saved by another process count."""
  whole = {p: {"count": 2, "iterator": {"batches": 3}} for p in range(2)}
  assert checkpoint.data_problem(whole) == ""
  assert "no data-iterator file" in checkpoint.data_problem({})
  assert "1 of the 2 processes" in checkpoint.data_problem({1: whole[1]})
  assert "[1, 2]" in checkpoint.data_problem({0: whole[0], 1: {"count": 1}})
  # a position no reader takes is damage too (a resume falls back past it; it said "start a new
  # output_dir", or a huge one died in grain with a StopIteration traceback)
  for bad in ({"batches": "3"}, {"batches": -1}, {}):
    assert "data position no reader understands (process 1's file)" in \
        checkpoint.data_problem({0: whole[0], 1: {"count": 2, "iterator": bad}})


def test_the_data_position_carries_over_to_another_process_count():
  cfg = config.load(BASE, TINY)
  kw = dict(seq_len=32, seed=0)
  two = [pipeline.make_train_iter(cfg.data, batch_size=4, process_index=p, process_count=2, **kw)
         for p in range(2)]
  for it in two:
    for _ in range(3):
      next(it)
  saved = {p: {"count": 2, "iterator": it.get_state(), "skipped_steps": 1}
           for p, it in enumerate(two)}
  own = checkpoint.own_data(saved, "here")  # this test is one process
  assert own["count"] == 1 and own["skipped_steps"] == 1
  one = pipeline.make_train_iter(cfg.data, batch_size=8, **kw)
  one.set_state(own["iterator"])
  rows = lambda b: sorted(map(tuple, b["inputs"]))
  assert rows(next(one)) == rows({"inputs": np.concatenate([next(it)["inputs"] for it in two])})
  saved[1]["iterator"] = {"next_index": 5}
  with pytest.raises(UserError, match="do not agree on a position"):
    checkpoint.own_data(saved, "here")


def write(tmp_path, text, mode="w"):
  path = tmp_path / "c.yml"
  with open(path, mode) as f:
    f.write(text)
  return str(path)


@pytest.mark.parametrize("text, needle", [
    (f"base: {BASE}\ntrain:\n  steps: 3\ntrain:\n  steps: 200\n",
     r"duplicate key 'train' \(line 4\)"),
    (f"base: {BASE}\ntrain:\n  steps: 3\n  steps: 5\n", "duplicate key 'steps'"),
    (f"base: {BASE}\nseed: 1\n# caf\xe9\n".encode("latin-1"), "is not UTF-8"),
])
def test_config_files_that_are_refused(tmp_path, text, needle):
  path = write(tmp_path, text, "wb" if isinstance(text, bytes) else "w")
  with pytest.raises(UserError, match=needle):
    config.load(path)


@pytest.mark.parametrize("override, needle", [
    ("optim.lr=nan", "a finite number"), ("optim.lr=inf", "a finite number"),
    ("optim.lr=-0.1", "must not be negative"), ("optim.muon_lr=-1", "must not be negative"),
    ("sample.temperature=nan", "a finite number"), ("optim.lr=1e999", "a finite number"),
    ("optim.lr=1e300", "float32"),  # finite in Python, inf in the step: "lr inf", then NaN
    (f"train.steps={10**20}", "fits in 64 bits"),
    (f"train.steps={2**40}", "does not fit in 32 bits"),
    (f"seed={2**70}", "fits in 64 bits"),
    ("mesh.rules=[[batch, [fsdp, fsdp]]]", "mesh axis 'fsdp' twice"),
    ("mesh.rules=[[embed, fsdp], [embed, tensor]]", "two rules for 'embed'"),
])
def test_numbers_and_rules_that_cannot_be_right(override, needle):
  with pytest.raises(UserError, match=needle):
    cfg = config.load(BASE, TINY + [override])
    sharding.parse_rules(cfg.mesh.rules)


def test_window_stages_are_found_without_visiting_every_step():
  cfg = config.load(BASE, TINY + ["attention.window_schedule=true", "attention.window=1024",
                                  "attention.window_start=128", "attention.window_block=128",
                                  "train.seq_len=2048", f"train.steps={2**31 - 1}"])
  # A loop over 2**31 steps would hang.
  stages = window_schedule.stages(cfg, 0, cfg.train.steps, key=window_schedule.step_windows)
  assert len(stages) == 8 and stages == list(dict.fromkeys(stages))
  small = cfg.copy_and_resolve_references()
  with small.unlocked():
    small.train.steps = 500
  want = list(dict.fromkeys(window_schedule.step_windows(small, s) for s in range(500)))
  assert window_schedule.stages(small, 0, 500, key=window_schedule.step_windows) == want
  assert window_schedule.stages(small, 300, 500, key=window_schedule.step_windows) == \
      list(dict.fromkeys(window_schedule.step_windows(small, s) for s in range(300, 500)))


def test_token_ids_past_the_vocab_name_the_shard(tmp_path):
  path = str(tmp_path / "bad.bin")
  # The first bad id and its place (the line named the window's largest id beside them).
  binfile.write_shard(path, np.r_[np.arange(2000) % 500, [700, 900], np.arange(100)])
  cfg = config.load(BASE, TINY + ["data.source=bin", f"data.train_files={path}",
                                  "data.shuffle=false"])
  it = pipeline.make_train_iter(cfg.data, seq_len=32, batch_size=8, seed=0, vocab_size=512)
  with pytest.raises(UserError, match=f"shard '{path}' holds token id 700 \\(at token 2000\\), "
                                      "not below the 512 rows of the embedding tables"):
    for _ in range(20):
      next(it)


def test_a_config_yml_edited_after_the_newest_step_is_another_run(tmp_path):
  """config.yml edited (seed) and given as the config: the run resumed the checkpoint saved with
  the old seed as if the same run. The newest step's own config item judges it too."""
  old = config.load(BASE, TINY + [f"output_dir={tmp_path}"])
  item = tmp_path / "checkpoints" / "4" / "config"
  item.mkdir(parents=True)
  item.joinpath("metadata").write_text(json.dumps(old.to_dict()))
  edited = config.load(BASE, TINY + [f"output_dir={tmp_path}", "seed=7"])
  config.save(edited, tmp_path / "config.yml")
  with pytest.raises(UserError, match=r"holds a different run \(seed: 0 -> 7, against its "
                                      r"checkpoint of step 4: config.yml was edited after it\)"):
    identity.check_run(edited, str(tmp_path))
  overwrite = config.load(BASE, TINY + [f"output_dir={tmp_path}", "seed=7", "overwrite=true"])
  assert identity.check_run(overwrite, str(tmp_path)) is True  # replaced, as asked
  item.joinpath("metadata").write_text("{")  # unreadable: the restore judges the step
  assert identity.check_run(edited, str(tmp_path)) is False


def test_a_config_yml_edited_after_a_step_this_run_matches_says_so(tmp_path):
  """config.yml edited (seed 0 -> 7) while the command and the newest step agree (seed 0): it was
  'a different run', the advice overwrite=true (deleting the matching checkpoint)."""
  run = config.load(BASE, TINY + [f"output_dir={tmp_path}"])
  item = tmp_path / "checkpoints" / "4" / "config"
  item.mkdir(parents=True)
  item.joinpath("metadata").write_text(json.dumps(run.to_dict()))
  config.save(config.load(BASE, TINY + [f"output_dir={tmp_path}", "seed=7"]),
              tmp_path / "config.yml")
  with pytest.raises(UserError, match=r"config.yml' differs from the config its checkpoint of step "
                                      r"4 was saved with \(seed: 0 -> 7\): it was edited after; "
                                      r"put the saved values back \(checkpoints/4/config/metadata"):
    identity.check_run(run, str(tmp_path))
  with pytest.raises(UserError, match=r"holds a different run \(seed: 7 -> 3"):  # neither's run
    identity.check_run(config.load(BASE, TINY + [f"output_dir={tmp_path}", "seed=3"]), str(tmp_path))


def test_a_config_in_output_dir_is_trained_from_only_as_that_runs_own(tmp_path):
  """train runs/u/config.yml, a hand-written file in the folder it names as output_dir, no run
  there: 'holds a different run (base: ... -> '')', and overwrite=true replaced the file."""
  from nanotext import train
  out = tmp_path / "u"
  out.mkdir()
  mine = f"# notes\nbase: {BASE}\noutput_dir: {out}\ntrain: {{steps: 2}}\n"
  (out / "config.yml").write_text(mine)
  for extra in ([], ["overwrite=true"], [f"output_dir={out}"]):
    with pytest.raises(UserError, match=r"config file '.*u/config.yml' is output_dir's own "
                                        r"config.yml, .*name another output_dir"):
      train.run(str(out / "config.yml"), TINY + extra, log=None)
  assert (out / "config.yml").read_text() == mine
  config.save(config.load(BASE, TINY + [f"output_dir={out}"]), out / "config.yml")
  (out / "metrics.jsonl").write_text("")  # a run's own: resumed as before
  identity.check_source(str(out / "config.yml"), [], config.load(out / "config.yml"))


def test_a_moved_runs_config_is_not_trained_at_its_old_path(tmp_path):
  """mv runs/m runs/m2; train runs/m2/config.yml trained from scratch at runs/m (the output_dir
  it saved), saying nothing."""
  from nanotext import train
  old, moved = tmp_path / "m", tmp_path / "m2"
  moved.mkdir()
  config.save(config.load(BASE, TINY + [f"output_dir={old}"]), moved / "config.yml")
  (moved / "checkpoints" / "2").mkdir(parents=True)
  with pytest.raises(UserError, match=f"config file '{moved}/config.yml' is the saved config of "
                                      f"the run whose output_dir is '{old}', not of the folder it "
                                      f"lies in: pass output_dir={moved} to resume"):
    train.run(str(moved / "config.yml"), [], log=None)
  assert not old.exists()
  for out in (moved, tmp_path / "new"):  # the run resumed there, or a start elsewhere
    identity.check_source(str(moved / "config.yml"), [f"output_dir={out}"], config.load(
        moved / "config.yml", [f"output_dir={out}"]))


def test_one_shot_keys_act_only_when_given_for_this_start(tmp_path):
  """A run started with overwrite=true saved `overwrite: true`: a later start from its config.yml
  (a model key changed; docs/convert.md's start from its weights into another folder) replaced
  the run there unasked. Saved now at false; a run folder's older config.yml is read without it."""
  run = tmp_path / "run"
  run.mkdir()
  cfg = config.load(BASE, TINY + [f"output_dir={run}", "overwrite=true", "data.allow_changed=true"])
  config.save(cfg, run / "config.yml")
  assert "overwrite: false" in (run / "config.yml").read_text()
  (run / "metrics.jsonl").write_text("")
  text = (run / "config.yml").read_text()  # as an older nanotext saved it
  (run / "config.yml").write_text(text.replace("overwrite: false", "overwrite: true")
                                  .replace("allow_changed: false", "allow_changed: true"))
  again = config.load(run / "config.yml", ["model.num_layers=3"])
  assert (again.overwrite, again.data.allow_changed) == (False, False)
  with pytest.raises(UserError, match=r"holds a different run \(model.num_layers: 2 -> 3\)"):
    identity.check_run(again, str(run))
  assert config.load(run / "config.yml", ["overwrite=true"]).overwrite  # given now: it acts
  (tmp_path / "mine.yml").write_text(f"base: {BASE}\noverwrite: true\n")  # not a run's file
  assert config.load(tmp_path / "mine.yml").overwrite


def test_someone_elses_config_yml_is_no_run_to_resume(tmp_path):
  """A config.yml sharing no key with nanotext's (a docker-compose file) was 'the same run':
  replaced by the run's, a foreign metrics.jsonl appended to, exit 0."""
  (tmp_path / "config.yml").write_text("services:\n  web:\n    image: nginx\n")
  cfg = lambda *o: config.load(BASE, TINY + [f"output_dir={tmp_path}", *o])
  with pytest.raises(UserError, match=r"holds a config.yml that is no nanotext run's \(no model:, "
                                      r"train:, data: sections\): choose another output_dir"):
    identity.check_run(cfg(), str(tmp_path))
  assert identity.check_run(cfg("overwrite=true"), str(tmp_path)) is True


def test_a_run_checks_its_output_dir_from_a_deleted_working_directory(tmp_path, monkeypatch):
  """Every path absolute, the shell's folder deleted: check_run resolved the empty
  checkpoint.load_params_from (none given) against the cwd, 'unexpected FileNotFoundError'."""
  run, gone = tmp_path / "run", tmp_path / "gone"
  cfg = lambda *o: config.load(BASE, TINY + [f"output_dir={run}", *o])
  (run / "checkpoints" / "4").mkdir(parents=True)
  config.save(cfg("seed=7"), run / "config.yml")
  fresh, overwrite = cfg(), cfg("overwrite=true")
  gone.mkdir()
  monkeypatch.chdir(gone)
  gone.rmdir()
  with pytest.raises(UserError, match="holds a different run"):
    identity.check_run(fresh, str(run))
  assert identity.check_run(overwrite, str(run)) is True


def test_a_step_linked_in_from_elsewhere_is_refused(tmp_path):
  """A step folder that is a symbolic link (another run's, to resume from): the run resumed,
  then died at the first rotation ("Cannot call rmtree on a symbolic link"), every time."""
  cfg = config.load(BASE, TINY + [f"output_dir={tmp_path / 'run'}"])
  (tmp_path / "other" / "4").mkdir(parents=True)
  (tmp_path / "run" / "checkpoints").mkdir(parents=True)
  config.save(cfg, tmp_path / "run" / "config.yml")
  (tmp_path / "run" / "checkpoints" / "4").symlink_to(tmp_path / "other" / "4")
  with pytest.raises(UserError, match=r"checkpoints/4' is a symbolic link, which the run cannot "
                                      r"rotate away .*cp -rL"):
    identity.check_run(cfg, str(tmp_path / "run"))


def test_check_run_tells_a_resume_from_another_run(tmp_path):
  old = config.load(BASE, TINY + [f"output_dir={tmp_path}"])
  config.save(old, tmp_path / "config.yml")
  same = lambda *o: identity.check_run(config.load(BASE, TINY + [f"output_dir={tmp_path}", *o]),
                                     str(tmp_path))
  assert same() is False and same("mesh.fsdp=4", "mesh.tensor=2", "train.steps=9") is False
  # What the memory plan advises where a resumed step no longer fits: the same step, in parts.
  assert same("train.grad_accum=2") is False
  # What a default stands for, spelled out (TINY: seq_len 32, vocab_size 512, float32 params).
  assert same("train.eval_seq_len=32", "model.embed_rows=512", "model.embed_dtype=float32") \
      is False
  with pytest.raises(UserError, match=r"holds a different run \(train.eval_seq_len: 32 -> 16\)"):
    same("train.eval_seq_len=16")
  # A recipe's default changed since the run began: its own config.yml resumes it, not overwrite
  with pytest.raises(UserError, match=re.escape(f"resume it as it began with `nanotext.train "
                                                f"{tmp_path / 'config.yml'}`, or pass overwrite")):
    same("train.eval_seq_len=16")
  # the key changed first, what follows it (max_seq_len: 0 = seq_len) after; values as YAML's
  with pytest.raises(UserError, match=r"run \(train.seq_len: 32 -> 16 and 2 more\)"):
    same("train.seq_len=16")
  with pytest.raises(UserError, match=r"run \(attention.doc_mask: false -> true\)"):
    same("attention.doc_mask=true")
  # Where the shards lie (NANOTEXT_CACHE set in another shell, a folder moved) is no other run:
  # the checkpoint's fingerprint of the training shards judges the data itself.
  assert same("data.dir=/elsewhere", "data.train_files=/a/*.bin", "data.val_files=/b/*") is False
  with pytest.raises(UserError, match="holds a different run .*model.d_model"):
    same("model.d_model=128")
  assert same("model.d_model=128", "overwrite=true") is True
  (tmp_path / "checkpoints" / "6").mkdir(parents=True)
  with pytest.raises(UserError, match="step 6, past train.steps=4.*pass overwrite=true"):
    same()
  assert same("overwrite=true") is True  # it cannot be continued: replaced, as asked
  (tmp_path / "config.yml").write_bytes(b"model: [\xff")
  with pytest.raises(UserError, match="config.yml' is damaged"):
    same()
  assert same("overwrite=true") is True


def test_a_runs_files_without_its_config_yml_are_not_continued_blind(tmp_path):
  """A metrics.jsonl (or checkpoint steps) in a folder without config.yml was appended to (or
  resumed) as this run's; an empty metrics.jsonl is what a start killed early leaves."""
  check = lambda *o: identity.check_run(config.load(BASE, TINY + [f"output_dir={tmp_path}", *o]),
                                      str(tmp_path))
  (tmp_path / "metrics.jsonl").write_text("")
  assert check() is False
  (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
  with pytest.raises(UserError, match="holds metrics.jsonl but no config.yml.*overwrite=true"):
    check()
  (tmp_path / "metrics.jsonl").unlink()
  (tmp_path / "checkpoints" / "2").mkdir(parents=True)
  with pytest.raises(UserError, match=r"holds checkpoint steps \[2\] but no config.yml"):
    check()
  assert check("overwrite=true") is True


def test_read_tools_say_how_to_put_a_lost_config_yml_back(tmp_path):
  """evaluate and generate on a run without config.yml asked 'is it a run's output_dir?' of a
  folder whose checkpoints hold the config; the cp they now advise gives it back whole."""
  from nanotext import evaluate, generate
  (tmp_path / "checkpoints" / "4" / "config").mkdir(parents=True)
  with pytest.raises(UserError, match=r"holds no config.yml: is it a run's output_dir\?$"):
    rundir.check_run_dir(str(tmp_path), "output_dir")  # no step holds a config
  prompt = "sample.prompt=\u00e9t\u00e9 \U0001F600"
  cfg = config.load(BASE, TINY + [f"output_dir={tmp_path}", prompt, "optim.lr=3e-05"]).to_dict()
  saved = tmp_path / "checkpoints" / "2" / "config" / "metadata"
  saved.parent.mkdir(parents=True)
  saved.write_text(json.dumps(cfg))  # as orbax writes it: JSON, ASCII (\ud83d\ude00, 3e-05)
  line = (f"output_dir '{tmp_path}' holds no config.yml, which its checkpoint of step 2 was saved "
          f"with: put it back (cp '{saved}' '{tmp_path / 'config.yml'}': JSON is YAML)")
  for parse in (evaluate.parse, generate.parse):  # step 4's config unreadable: step 2's named
    with pytest.raises(UserError, match=f"^{re.escape(line)}$"):
      parse([f"output_dir={tmp_path}"])
  shutil.copy(saved, tmp_path / "config.yml")
  assert config.load(str(tmp_path / "config.yml")).to_dict() == cfg
  evaluate.parse([f"output_dir={tmp_path}"])


def test_an_eot_id_past_the_vocabulary_is_refused():
  """It was accepted: the tables' lookup clamps an id past them (inserted before each document
  of a packed text source), and attention.doc_mask never saw a document end."""
  assert wiring.load(BASE, TINY + ["data.eot_id=511"]).data.eot_id == 511
  with pytest.raises(UserError, match=r"data.eot_id=512 is no token of the model "
                                      r"\(model.vocab_size=512\)"):
    wiring.load(BASE, TINY + ["data.eot_id=512"])


def test_a_damaged_step_that_cannot_be_moved_aside_is_one_line(tmp_path):
  """output_dir/damaged a file (or the step immutable): a traceback, exit 1; now one line
  naming the step, and the step left where it was."""
  (tmp_path / "checkpoints" / "6").mkdir(parents=True)
  (tmp_path / "damaged").write_text("not a folder")
  with pytest.raises(UserError, match=r"checkpoint step 6 is damaged and cannot be moved aside "
                                      r"to '.*damaged/step_6' \(.*\): move or delete '.*/6'"):
    rundir.quarantine(str(tmp_path), 6)
  assert (tmp_path / "checkpoints" / "6").is_dir()
  (tmp_path / "damaged").unlink()
  assert rundir.quarantine(str(tmp_path), 6) == str(tmp_path / "damaged" / "step_6")


def test_read_tools_say_where_a_run_set_aside_by_a_killed_overwrite_is(tmp_path):
  """overwrite=true killed before its first checkpoint: the run is whole in .overwritten/ until
  the next start puts it back, but verify said 'nothing to verify' and the others 'holds no
  checkpoints' (a user could take it for gone and delete the folder)."""
  from nanotext import verify
  (tmp_path / rundir.ASIDE / "checkpoints" / "4").mkdir(parents=True)
  (tmp_path / "checkpoints").mkdir()
  note = f"the run it held is set aside whole in '{tmp_path / rundir.ASIDE}'"
  with pytest.raises(UserError, match="holds no checkpoints .*" + re.escape(note)):
    checkpoint.latest_params(str(tmp_path))
  lines = []
  verify.report(str(tmp_path), lines.append)
  assert "nothing to verify" in lines[0] and note in lines[0]
  # evaluate (and checkpoint.load_params_from) said 'holds no complete checkpoint (give a run
  # directory, ...)' of it
  from nanotext import params_from
  with pytest.raises(UserError, match="output_dir=.* holds no checkpoints; " + re.escape(note)):
    params_from.find_item(str(tmp_path), "output_dir")
  (tmp_path / rundir.ASIDE / rundir.COMMITTED).write_text("")  # deleted next: no longer whole
  assert rundir.aside_note(str(tmp_path)) == ""


def test_read_tools_say_an_overwrite_in_progress_replaces_the_run(tmp_path, monkeypatch):
  """While an overwrite=true run is alive (before its first checkpoint) the read tools said the
  run set aside would be put back by the next start: the live run deletes it instead. evaluate,
  whose config.yml went aside between its checks, said 'config file ... does not exist'."""
  from nanotext import evaluate
  fake_run(tmp_path, "old", steps=(4,))
  rundir.set_aside(str(tmp_path))
  (tmp_path / "checkpoints").mkdir()  # the new run's, no step yet
  with lock.Lock(str(tmp_path)):  # held by a live run
    note = (f"; an overwrite=true run (pid {os.getpid()} on {socket.gethostname()}) is replacing "
            f"the run it held, set aside in '{tmp_path / rundir.ASIDE}' until the new run's "
            "first checkpoint, which deletes it")
    assert rundir.aside_note(str(tmp_path)) == note
    with pytest.raises(UserError, match="holds no checkpoints .*" + re.escape(note)):
      checkpoint.latest_params(str(tmp_path))
    with pytest.raises(UserError, match="holds no config.yml" + re.escape(note)):
      evaluate.parse([f"output_dir={tmp_path}"])
    rundir.roll_back(str(tmp_path))  # the run is back; the overwrite sets it aside mid-read
    load = config.load

    def set_aside_first(*args, **kwargs):
      rundir.set_aside(str(tmp_path))
      return load(*args, **kwargs)
    monkeypatch.setattr(config, "load", set_aside_first)
    with pytest.raises(UserError, match="holds no config.yml" + re.escape(note)):
      evaluate.load_config(str(tmp_path), [], checked=False)
  assert "the next train start there puts it back" in rundir.aside_note(str(tmp_path))


def test_read_tools_say_a_run_is_saving_its_first_checkpoint(tmp_path):
  """generate and convert said a run saving its first checkpoint 'holds no checkpoints (its
  checkpoints/ folder is empty)', and evaluate and convert said so of an unfinished save."""
  from nanotext import evaluate
  (tmp_path / "checkpoints").mkdir()
  with pytest.raises(UserError, match=r"no checkpoints \(its checkpoints/ folder is empty\)$"):
    checkpoint.latest_params(str(tmp_path))
  # A save that never finished is no empty folder (evaluate and convert said it was)
  unfinished = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1765000000"
  unfinished.mkdir()
  said = r"no checkpoints \(its checkpoints/ folder holds a save that never finished\)$"
  with pytest.raises(UserError, match=said):
    checkpoint.latest_params(str(tmp_path))
  with pytest.raises(UserError, match=said):
    evaluate.sources(str(tmp_path), -1)
  unfinished.rmdir()
  (tmp_path / "checkpoints" / "notes.txt").write_text("")  # neither: nothing said of it
  with pytest.raises(UserError, match=r"no checkpoints$"):
    evaluate.sources(str(tmp_path), "all")
  (tmp_path / "checkpoints" / "notes.txt").unlink()
  live = f"the run training into it (pid {os.getpid()} on {socket.gethostname()})"
  with lock.Lock(str(tmp_path)):
    with pytest.raises(UserError, match=re.escape(f"holds no checkpoints yet: {live} has saved "
                                                  "none")):
      checkpoint.latest_params(str(tmp_path))
    (tmp_path / "checkpoints" / "5.orbax-checkpoint-tmp-1733").mkdir()
    saving = f"holds no checkpoints yet: {live} is saving its first one"
    with pytest.raises(UserError, match=re.escape(saving) + "$"):
      checkpoint.latest_params(str(tmp_path))
    with pytest.raises(UserError, match=re.escape(saving) + "$"):
      evaluate.sources(str(tmp_path), -1)


def params_only_folder(d, *, trained_into: bool = False) -> str:
  """The files of a `convert params-only` output (contents not read by these checks)."""
  (d / "params").mkdir(parents=True)
  (d / "convert.json").write_text('{"step": 6}')
  (d / "config.yml").write_text("model: {}\n")
  if trained_into:  # what a run trained into it before it was refused
    (d / "checkpoints" / "2" / "state").mkdir(parents=True)
  return str(d)


def test_a_params_only_folder_is_no_output_dir(tmp_path):
  """Trained into, a params-only folder's params/ was ignored (a random start, said nowhere) and
  the tools then read it differently (evaluate checkpoints/, convert params/): refused, naming
  checkpoint.load_params_from, before anything is written."""
  out = params_only_folder(tmp_path / "po")
  before = sorted(os.listdir(out))
  with pytest.raises(UserError, match="is a params-only folder .*checkpoint.load_params_from="
                     + re.escape(out) + " and another output_dir"):
    rundir.check_output_dir_path(out)
  assert sorted(os.listdir(out)) == before


def test_load_params_from_a_folder_with_params_and_checkpoints_names_both(tmp_path):
  """Such a folder (trained into before that was refused) read as 'holds no complete
  checkpoint (give ... a params-only folder)' where its checkpoints/ was empty, and as the
  random-start run's weights otherwise: refused, naming what each path reads."""
  from nanotext import params_from
  for folder in (params_only_folder(tmp_path / "a", trained_into=True),
                 params_only_folder(tmp_path / "b")):
    if folder.endswith("b"):
      (tmp_path / "b" / "checkpoints").mkdir()
    with pytest.raises(UserError, match="holds both params/ .* and checkpoints/ .*give "
                       + re.escape(os.path.join(folder, "checkpoints"))):
      params_from.find_item(folder)
  assert params_from.find_item(os.path.join(tmp_path / "a", "checkpoints"))[1]


def test_a_changed_load_params_from_is_another_run(tmp_path):
  """overwrite=true with a new checkpoint.load_params_from (one not even of the model's shapes)
  resumed the old fine-tune (checkpoint.* is resume-ok), printed its final eval again, exit 0;
  without overwrite=true the new source was ignored in passing. Another source on a run with
  checkpoints is another run; the same one, or none, resumes."""
  out = tmp_path / "ft"
  cfg = lambda *o: config.load(BASE, TINY + [f"output_dir={out}", *o])
  out.mkdir()
  config.save(cfg(f"checkpoint.load_params_from={tmp_path / 'a'}"), out / "config.yml")
  assert identity.check_run(cfg(f"checkpoint.load_params_from={tmp_path / 'b'}"), str(out)) is False
  (out / "checkpoints" / "2").mkdir(parents=True)
  with pytest.raises(UserError, match=r"holds a different run \(checkpoint.load_params_from: "
                                      r".*/a -> .*/b\); .*pass overwrite=true to replace it; or "
                                      r"give the checkpoint.load_params_from it started from"):
    identity.check_run(cfg(f"checkpoint.load_params_from={tmp_path / 'b'}"), str(out))
  (tmp_path / "b").mkdir()  # read before the overwrite sets the old run aside
  assert identity.check_run(cfg(f"checkpoint.load_params_from={tmp_path / 'b'}",
                              "overwrite=true"), str(out)) is True  # a fresh start from b
  for same in (f"checkpoint.load_params_from={tmp_path / 'a'}",
               f"checkpoint.load_params_from={tmp_path / 'x' / '..' / 'a'}", "seed=0"):
    assert identity.check_run(cfg(same), str(out)) is False
  config.save(cfg("checkpoint.load_params_from=rel/a"), out / "config.yml")
  for same in ("checkpoint.load_params_from=rel/a", "seed=0"):  # as given, from any folder
    assert identity.check_run(cfg(same), str(out)) is False


def test_overwrite_refuses_a_source_it_would_set_aside(tmp_path):
  """overwrite=true with checkpoint.load_params_from=output_dir (the next try after a refused
  model.scan_layers flip): the old run was set aside, then the source 'held no checkpoints'.
  Refused before anything moves; a folder inside output_dir that the overwrite keeps is read."""
  config.save(config.load(BASE, TINY + [f"output_dir={tmp_path}"]), tmp_path / "config.yml")
  (tmp_path / "checkpoints" / "2").mkdir(parents=True)
  (tmp_path / "params_only").mkdir()
  cfg = lambda src: config.load(BASE, TINY + [f"output_dir={tmp_path}", "overwrite=true",
                                              "model.scan_layers=true",
                                              f"checkpoint.load_params_from={src}"])
  for src in (tmp_path, tmp_path / "checkpoints", tmp_path / "checkpoints" / "2"):
    with pytest.raises(UserError, match=r"load_params_from='.*' lies in the run in output_dir, "
                                        r"which overwrite=true sets aside before the parameters "
                                        r"are read: to start from its weights, train into "):
      identity.check_run(cfg(src), str(tmp_path))
  assert identity.check_run(cfg(tmp_path / "params_only"), str(tmp_path)) is True
  assert sorted(os.listdir(tmp_path)) == ["checkpoints", "config.yml", "params_only"]


@pytest.mark.fast
def test_dev_shm_is_no_kernel_file_system():
  """output_dir=/dev/shm/x (a tmpfs a run can write to) was refused as lying in 'dev'."""
  assert rundir.kernel_fs("/dev/shm/run") == "" and rundir.kernel_fs("/dev/shm") == ""
  assert rundir.kernel_fs("/dev/null") == "dev" and rundir.kernel_fs("/proc/1") == "proc"
