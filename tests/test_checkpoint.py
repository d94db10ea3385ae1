"""Checkpoints: exact resume after SIGTERM/SIGKILL, atomic saves, the NaN guard, restoring onto
other meshes, and load_params_from."""

import json
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import nan_poison
from conftest import BASE, PROCESS_TIMEOUT_S, REPO, TINY, train_command
from nanotext import checkpoint, params_from, signals, trainer, watch, window_schedule, wiring
from nanotext.errors import UserError
from nanotext.train import run

# 24 steps with a checkpoint every 4: long enough for a signal to land mid-run.
RESUME = [o for o in TINY if not o.startswith(("train.steps", "train.eval_every",
                                               "checkpoint.every"))] + [
    "train.steps=24", "checkpoint.every=4", "train.eval_every=0", "checkpoint.keep=2",
    "sample.max_new_tokens=0"]


FSDP8 = TINY + ["train.eval_every=0", "sample.max_new_tokens=0"]


@pytest.fixture
def fsdp8_run(tiny_run):
  """Two steps of FSDP8 under FSDP=8 (all 8 devices), checkpointed at step 2: conftest's run."""
  return tiny_run[0]


def quiet_run(overrides, log=None):
  lines = []
  def record(line):
    lines.append(line)
    if log:
      log(line)
  return run(BASE, overrides, log=record), lines


def train_losses(out) -> dict:
  """{step: loss} from metrics.jsonl; a restarted run appends, so the last row of a step wins."""
  with open(os.path.join(out, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def steps_on_disk(out) -> list:
  root = os.path.join(out, "checkpoints")
  return sorted(int(n) for n in os.listdir(root) if n.isdigit()) if os.path.isdir(root) else []


def start(out, devices: int, pause: str | None = None):
  """`python -m nanotext.train` in the background, stdout and stderr to out.log; `pause`
  "STEP:MARKER" makes the save of STEP write MARKER and wait (tests/pause_in_save.py)."""
  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
             JAX_PLATFORMS="cpu")
  log = open(f"{out}.log", "ab")
  return subprocess.Popen(train_command(pause) + [BASE, *RESUME, f"output_dir={out}"], cwd=REPO,
                          env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for(proc, condition, what: str, timeout: float = PROCESS_TIMEOUT_S):
  """Poll every 10 ms until `condition()`; fails if the process ends first."""
  deadline = time.time() + timeout
  while not condition():
    assert proc.poll() is None, f"the run ended (status {proc.returncode}) before {what}"
    assert time.time() < deadline, f"timed out waiting for {what}"
    time.sleep(0.01)


def saving_now(out) -> bool:
  root = os.path.join(out, "checkpoints")
  return os.path.isdir(root) and any(".orbax-checkpoint-tmp" in n for n in os.listdir(root))


def final_params(out):
  step, params = checkpoint.latest_params(out)
  assert step == 24
  return jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]


@pytest.mark.parametrize("devices", [1, 8])
def test_sigterm_then_sigkill_resumes_bitwise_exactly(tmp_path, devices):
  straight, broken = str(tmp_path / "straight"), str(tmp_path / "broken")
  reached = lambda step: os.path.exists(os.path.join(broken, "metrics.jsonl")) and \
      max(train_losses(broken), default=0) >= step
  # 1. SIGTERM mid-run: the process finishes its step, saves it, and exits 0 by itself.
  proc = start(broken, devices)
  # The uninterrupted run alongside, started once this one has compiled: the worker's cache then
  # serves its programs (started together, the two compiled the same programs at once).
  wait_for(proc, lambda: reached(1), "step 1")
  reference = start(straight, devices)
  wait_for(proc, lambda: reached(6), "step 6")
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=PROCESS_TIMEOUT_S) == 0
  with open(f"{broken}.log") as f:
    log = f.read()
  assert "received SIGTERM: saved the checkpoint of step" in log, log[-2000:]
  stopped = steps_on_disk(broken)[-1]
  assert 6 <= stopped < 24 and f"checkpoint of step {stopped} and stopped" in log
  # 2. The same command resumes; SIGKILL it while its first save is being written, so nothing
  # gets a chance to clean up. The trainer writes the marker inside that save and waits there.
  marker, pause = f"{broken}.marker", (stopped // 4 + 1) * 4  # the next checkpoint.every=4
  proc = start(broken, devices, pause=f"{pause}:{marker}")
  wait_for(proc, lambda: os.path.exists(marker), f"the save of step {pause}",
           timeout=PROCESS_TIMEOUT_S)
  assert saving_now(broken)
  proc.kill()
  assert proc.wait(timeout=60) == -signal.SIGKILL
  assert steps_on_disk(broken)[-1] == stopped, "the save of the killed run completed"
  # 3. The same command again finishes the run from the newest complete checkpoint.
  proc = start(broken, devices)
  assert proc.wait(timeout=PROCESS_TIMEOUT_S) == 0, open(f"{broken}.log").read()[-3000:]
  assert reference.wait(timeout=PROCESS_TIMEOUT_S) == 0, open(f"{straight}.log").read()[-3000:]
  with open(f"{broken}.log") as f:
    assert f.read().count("resumed from the checkpoint of step") == 2
  assert not saving_now(broken)

  want, got = train_losses(straight), train_losses(broken)
  assert list(want) == list(range(1, 25)) and sorted(got) == list(want)
  assert [got[s] for s in want] == list(want.values())  # bitwise: == on floats
  for (path_a, a), (path_b, b) in zip(final_params(straight), final_params(broken)):
    assert path_a == path_b and np.array_equal(a, b), jax.tree_util.keystr(path_a)


def test_the_metrics_rows_of_a_step_are_on_disk_before_its_checkpoint(tmp_path, monkeypatch):
  """A power cut after a save must not keep the checkpoint and lose metrics rows before it: the
  resume writes none of them again (a gap in the curve for ever)."""
  out = str(tmp_path / "run")
  path, fsync, synced = os.path.join(out, "metrics.jsonl"), os.fsync, []

  def recording(fd):
    if os.readlink(f"/proc/self/fd/{fd}") == path:
      synced.append(max(row["step"] for row in train_losses_rows(out)))
    return fsync(fd)

  monkeypatch.setattr(os, "fsync", recording)
  quiet_run(FSDP8 + ["train.steps=4", "checkpoint.every=2", f"output_dir={out}"])
  assert steps_on_disk(out) == [2, 4] and synced == [2, 4], synced


def train_losses_rows(out) -> list:
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_an_unfinished_save_is_ignored_and_cleaned(fsdp8_run, tmp_path):
  out = str(tmp_path / "run")
  shutil.copytree(fsdp8_run, out)
  # What a process killed while writing step 3 leaves behind.
  junk = os.path.join(out, "checkpoints", "3.orbax-checkpoint-tmp-1700000000000000")
  os.makedirs(os.path.join(junk, "state"))
  with open(os.path.join(junk, "state", "half_written"), "w") as f:
    f.write("x")
  result, lines = quiet_run(FSDP8 + [f"output_dir={out}", "train.steps=3"])
  assert any("resumed from the checkpoint of step 2" in l for l in lines)
  assert "train.steps 2 -> 3: the learning rate's cooldown follows 3 steps from step 2 on" in \
      lines, lines
  assert not os.path.exists(junk) and steps_on_disk(out) == [2, 3]
  assert int(result.state["step"]) == 3


@pytest.mark.fast
@pytest.mark.parametrize("extra, changes", [
    ([], "the learning rate's cooldown follows"),
    (["optim.cooldown_frac=0"], "no schedule here counts in train.steps; only the end moves"),
    (["optim.name=muon", "optim.muon_momentum_warmup=10", "train.seq_len=32",
      "train.seq_len_start=16", "attention.window_schedule=true", "attention.window_block=8",
      "attention.window_start=8", "attention.window=32"],
     "the learning rate's cooldown, the row length (train.seq_len_start), the attention windows "
     "follow"),
])
def test_a_resume_under_other_train_steps_names_the_schedules_that_change(extra, changes):
  """The line named momentum (Muon's warmup counts optimizer steps, not train.steps) and left
  out the row-length warmup, whose rows went back to their short length."""
  from nanotext import config
  cfg = config.load(BASE, TINY + extra + ["train.steps=48"])
  line = window_schedule.steps_change_line(cfg, 24, 16)
  assert line.startswith(f"train.steps 24 -> 48: {changes}") and "momentum" not in line, line


def test_nonfinite_loss_aborts_before_the_bad_state_is_saved(tmp_path):
  out = str(tmp_path)
  # Log rarely so the bad step is first read back by the save of that very step.
  args = [BASE, *TINY, f"output_dir={out}", "train.steps=8", "checkpoint.every=2",
          "train.log_every=100", "sample.max_new_tokens=0"]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  proc = subprocess.run([sys.executable, "tests/nan_poison.py", "6", *args], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
  assert proc.returncode == 1, proc.stderr[-3000:]
  err = [l for l in proc.stderr.splitlines() if l.startswith("nanotext: error:")]
  assert len(err) == 1 and "step 6 has a non-finite loss" in err[0], proc.stderr[-3000:]
  assert "the newest checkpoint (step 4) is the last finite state: resume with " \
      "train.on_nonfinite=skip" in err[0]
  assert "Traceback" not in proc.stderr
  assert steps_on_disk(out) == [2, 4]  # keep=2; step 6 was never written
  # The eval at step 6 came after the bad step was read: no val_loss nan row.
  with open(os.path.join(out, "metrics.jsonl")) as f:
    assert all(np.isfinite(r.get("val_loss", 0)) for r in map(json.loads, f))
  # The advice can be followed: on_nonfinite may change on resume (it was refused).
  restore = nan_poison.install(args[0], args[1:] + ["train.on_nonfinite=skip"], 6)
  try:
    result, lines = quiet_run(args[1:] + ["train.on_nonfinite=skip"])
  finally:
    restore()
  assert any("resumed from the checkpoint of step 4" in l for l in lines)
  assert result.skipped_steps == 1 and int(result.state["step"]) == 8


def test_skip_leaves_the_state_and_counts_the_step(tmp_path):
  args = FSDP8 + [f"output_dir={tmp_path}", "train.steps=6", "train.on_nonfinite=skip"]
  restore = nan_poison.install(BASE, args, 3)
  try:
    result, lines = quiet_run(args)
  finally:
    restore()
  assert "warning: 1 of 6 steps skipped for a non-finite loss or gradient norm " \
      "(train.on_nonfinite=skip)" in lines
  def strict(text):  # NaN, Infinity: not JSON (jq and JavaScript reject the line)
    raise ValueError(f"{text} in metrics.jsonl")
  with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
    rows = [json.loads(line, parse_constant=strict) for line in f]
  rows = [r for r in rows if "loss" in r]
  assert [r["skipped_steps"] for r in rows] == [0, 0, 1, 1, 1, 1]
  assert rows[2]["loss"] is None and all(np.isfinite(r["loss"]) for r in rows[3:])
  assert result.skipped_steps == 1 and int(result.state["step"]) == 6
  counts = [int(x) for p, x in jax.tree_util.tree_flatten_with_path(result.state["opt_state"])[0]
            if "count" in jax.tree_util.keystr(p)]
  # The counts advance with the loop's step (kept, they lagged one step per skip: the logged
  # lr was not the one applied, and the cooldown never reached its end).
  assert counts and set(counts) == {6}


def test_a_run_whose_every_step_was_skipped_says_so(tmp_path, monkeypatch):
  """Every loss non-finite under on_nonfinite=skip: the run ends, saying it learned nothing (it
  ended 0 with no word beyond each step's count)."""
  real = trainer.loss_fn
  monkeypatch.setattr(trainer, "loss_fn", lambda *a, **k: real(*a, **k) * np.nan)
  result, lines = quiet_run(FSDP8 + [f"output_dir={tmp_path}", "train.steps=2",
                                     "train.on_nonfinite=skip"])
  assert result.skipped_steps == 2
  assert "warning: 2 of 2 steps skipped for a non-finite loss or gradient norm (train.on_nonfinite" \
      "=skip) (every one: the parameters are those the run started with)" in lines


@pytest.mark.parametrize("signum,raised", [(signal.SIGINT, KeyboardInterrupt),
                                           (signal.SIGTERM, signals.Terminated)])
def test_a_signal_before_the_first_step_in_process_raises_and_puts_output_dir_back(
    tmp_path, monkeypatch, signum, raised):
  """train.run in a notebook, interrupted while it compiles: os._exit(130) killed the kernel
  (the caller's `except KeyboardInterrupt` never ran). A library caller gets the exception,
  output_dir as it was."""
  monkeypatch.setattr(signals, "_watching", False)  # no tool's command line took the signals
  out = tmp_path / "run"
  def send(line):
    if line.startswith("model:"):  # output_dir is open, the first step not yet compiled
      os.kill(os.getpid(), signum)
  before = signal.getsignal(signum)
  with pytest.raises(raised):
    quiet_run(FSDP8 + [f"output_dir={out}"], log=send)
  assert not out.exists() and signal.getsignal(signum) is before


def test_sigterm_in_process_saves_stops_and_restores_handlers(tmp_path):
  before = signal.getsignal(signal.SIGTERM)
  def send_at_step_3(line):
    if line.startswith("step      3/"):
      os.kill(os.getpid(), signal.SIGTERM)
  result, lines = quiet_run(FSDP8 + [f"output_dir={tmp_path}", "train.steps=50"],
                            log=send_at_step_3)
  assert result.preempted and signal.getsignal(signal.SIGTERM) is before
  stopped = int(result.state["step"])
  assert 3 <= stopped < 50 and steps_on_disk(str(tmp_path)) == [stopped]
  assert f"received SIGTERM: saved the checkpoint of step {stopped} and stopped; " \
         "the same command resumes from it" in lines


def test_a_stopped_run_records_the_step_it_stopped_at(tmp_path, monkeypatch):
  """A preempted run's rows ended before the step it saved and stopped at (the save read that
  step back first, with no row); resumed and stopped before its first row, the killed run's
  rows past its checkpoint stayed (plot drew them). Killed after step 4, checkpoint at 2,
  resumed with a signal in its first step (step 3): the rows are those of steps 1-3."""
  out = str(tmp_path)
  common = FSDP8 + [f"output_dir={out}", "checkpoint.every=2"]
  quiet_run(common + ["train.steps=4"])  # a row of every step
  shutil.rmtree(os.path.join(out, "checkpoints", "4"))  # as if killed before step 4's save
  def begin_with_a_signal(self):
    self.training, self.received = True, "SIGTERM"
  monkeypatch.setattr(watch.Preemption, "begin_training", begin_with_a_signal)
  result, lines = quiet_run(common + ["train.steps=50", "train.log_every=100"])
  assert result.preempted and steps_on_disk(out) == [2, 3], lines
  with open(os.path.join(out, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [(r["step"], "loss" in r) for r in rows] == [(1, True), (2, True), (3, True)], rows




def setup_for(overrides, devices: int):
  return wiring.prepare(BASE, TINY + overrides, devices=jax.devices()[:devices])


def test_restore_onto_other_meshes_gives_the_same_next_loss(fsdp8_run):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 512, size=(8, 33), dtype=np.int32)
  local = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
  losses = {}
  for name, overrides, devices in [("fsdp8", ["mesh.fsdp=8"], 8),
                                   ("tp2xfsdp4", ["mesh.fsdp=4", "mesh.tensor=2"], 8),
                                   ("one", ["mesh.fsdp=1"], 1)]:
    setup = setup_for(overrides, devices)
    manager = checkpoint.make_manager(fsdp8_run, keep=2, create=False)
    state, _, _ = checkpoint.restore(manager, 2, setup.abstract_state())
    manager.close()
    wte = jax.tree.leaves(state["params"])[0]
    assert wte.sharding.mesh.devices.size == devices
    _, m = trainer.make_train_step(setup)(state, trainer.global_batch(setup, local))
    losses[name] = float(m["loss"])
  np.testing.assert_allclose(losses["tp2xfsdp4"], losses["fsdp8"], rtol=1e-5)
  np.testing.assert_allclose(losses["one"], losses["fsdp8"], rtol=1e-5)


def test_load_params_from_starts_fresh_from_those_parameters(fsdp8_run, tmp_path):
  # lr=0: the one step changes nothing, so the new run's checkpoint must hold the old params.
  result, lines = quiet_run(FSDP8 + [f"output_dir={tmp_path}", "train.steps=1", "optim.lr=0",
                                     f"checkpoint.load_params_from={fsdp8_run}"])
  assert any(f"initialised parameters from {fsdp8_run}/checkpoints/2" in l for l in lines)
  assert int(result.state["step"]) == 1
  counts = [int(x) for p, x in jax.tree_util.tree_flatten_with_path(result.state["opt_state"])[0]
            if "count" in jax.tree_util.keystr(p)]
  assert counts and set(counts) == {1}  # a fresh optimizer state
  _, old = checkpoint.latest_params(fsdp8_run)
  _, new = checkpoint.latest_params(str(tmp_path))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), old, new)


def test_load_params_from_a_params_only_folder(fsdp8_run, tmp_path):
  import orbax.checkpoint as ocp
  _, params = checkpoint.latest_params(fsdp8_run)
  ckptr = ocp.StandardCheckpointer()  # the layout of `nanotext.convert`'s params-only output
  ckptr.save(str(tmp_path / "only" / "params"), params)
  ckptr.wait_until_finished()
  setup = setup_for(["mesh.fsdp=4", "mesh.tensor=2"], 8)
  where, got = params_from.load(str(tmp_path / "only"),
                                      setup.abstract_state()["params"])
  assert where == str(tmp_path / "only")
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(jax.device_get(got)), strict=True):
    np.testing.assert_array_equal(a, b)  # (saved trees key layers '0', live ones 0)


def test_load_params_from_checks_a_cast_folder_before_the_cast(fsdp8_run, tmp_path):
  """A bfloat16 params-only folder into the float32 model: read as saved, checked, then cast.
  A damaged one loaded unchecked (the sums skipped every cast array)."""
  from nanotext.convert import params_only
  out = params_only(fsdp8_run, str(tmp_path / "bf16"), dtype="bfloat16", log=lambda *_: None)
  abstract = setup_for([], 8).abstract_state()["params"]
  _, got = params_from.load(out, abstract)
  _, want = checkpoint.latest_params(fsdp8_run)
  for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(jax.device_get(got)), strict=True):
    assert b.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(a).astype(jnp.bfloat16).astype(np.float32), b)
  data = os.path.join(out, "params", "ocdbt.process_0", "d")
  biggest = max((os.path.join(data, n) for n in os.listdir(data)), key=os.path.getsize)
  raw = bytearray(open(biggest, "rb").read())
  raw[len(raw) // 2:len(raw) // 2 + 64] = bytes(b ^ 0x55 for b in raw[len(raw) // 2:][:64])
  open(biggest, "wb").write(raw)
  with pytest.raises(UserError, match="damaged|does not match"):
    params_from.load(out, abstract)


@pytest.mark.parametrize("overrides, needle", [
    (["model.d_model=128"], "in the checkpoint but shape ("),
    (["model.num_layers=3"], "is missing in the checkpoint"),
    (["model.merged_qkv=true"], "holds q, k and v as three parameters, this model as one "
                                "attn/qkv: set model.merged_qkv=false"),
])
def test_load_params_from_refuses_another_architecture(fsdp8_run, tmp_path, overrides, needle):
  step_dir = os.path.join(fsdp8_run, "checkpoints", "2")
  with pytest.raises(UserError, match="does not fit this model") as e:
    quiet_run(TINY + overrides + [f"output_dir={tmp_path}",
                                  f"checkpoint.load_params_from={step_dir}"])
  assert needle in str(e.value), str(e.value)
  with pytest.raises(UserError, match="load_params_from='.*/nope' does not exist"):
    quiet_run(TINY + [f"output_dir={tmp_path}", f"checkpoint.load_params_from={tmp_path}/nope"])
  (tmp_path / "file").write_text("x")
  with pytest.raises(UserError, match="load_params_from='.*/file' is not a directory"):
    quiet_run(TINY + [f"output_dir={tmp_path}", f"checkpoint.load_params_from={tmp_path}/file"])


def test_sighup_from_a_closed_terminal_saves_and_stops(tmp_path):
  """The terminal (an ssh session) closes under a run: SIGHUP killed it unsaved, and every line
  after would have failed with EIO. Now it is SIGTERM: the step is saved, exit 0."""
  out = str(tmp_path / "run")
  master, slave = pty.openpty()
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
             JAX_PLATFORMS="cpu")
  # SIGHUP as a terminal's job has it (the tests themselves may run under nohup)
  as_from_a_terminal = ("import runpy, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
                        "sys.argv[0] = 'nanotext.train'; "
                        "runpy.run_module('nanotext.train', run_name='__main__')")
  proc = subprocess.Popen([sys.executable, "-c", as_from_a_terminal, BASE, *RESUME,
                           "train.steps=200", f"output_dir={out}"],
                          cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                          start_new_session=True)
  os.close(slave)
  seen, closing = [], threading.Event()
  def drain():  # the terminal's reader, until it closes
    while not closing.is_set():
      if select.select([master], [], [], 0.05)[0]:
        seen.append(os.read(master, 4096))
  reader = threading.Thread(target=drain, daemon=True)
  reader.start()
  reached = lambda: os.path.exists(os.path.join(out, "metrics.jsonl")) and \
      max(train_losses(out), default=0) >= 2
  wait_for(proc, reached, "step 2")
  closing.set()
  reader.join()
  os.close(master)  # the terminal hangs up: writes to it fail from here
  proc.send_signal(signal.SIGHUP)
  assert proc.wait(timeout=PROCESS_TIMEOUT_S) == 0, b"".join(seen).decode()[-2000:]
  stopped = steps_on_disk(out)[-1]
  assert 2 <= stopped < 200 and max(train_losses(out)) == stopped


def test_a_value_beyond_the_target_dtype_is_refused_not_read_as_infinite(tmp_path):
  """A float32 run's 3.4e38 loaded into a bfloat16 model (load_params_from) or written by
  params-only --dtype=bfloat16 became inf: the first step's loss NaN, blamed on training."""
  from nanotext import config
  from nanotext.convert import params_only
  from nanotext.trees import path_name
  src = str(tmp_path / "src")
  run32 = wiring.prepare(BASE, TINY + [f"output_dir={src}"])
  state = run32.init_state()
  def big(path, x):
    a = np.asarray(x).copy()
    a.flat[5] = 3.4e38 if path_name(path) == "embed.embedding" else a.flat[5]
    return jax.device_put(a, x.sharding)
  state = {**state, "params": jax.tree_util.tree_map_with_path(big, state["params"])}
  config.save(run32.cfg, os.path.join(src, "config.yml"))
  manager = checkpoint.make_manager(src, keep=1)
  checkpoint.save(manager, 3, state, {}, {})
  checkpoint.wait(manager)
  manager.close()
  with pytest.raises(UserError, match=r"'embed\.embedding' holds values beyond bfloat16's range"):
    run(BASE, TINY + ["model.param_dtype=bfloat16", f"checkpoint.load_params_from={src}",
                      f"output_dir={tmp_path / 'bf16'}"], log=lambda *_: None)
  with pytest.raises(UserError, match=r"^--dtype=bfloat16: 'embed\.embedding' holds values beyond"):
    params_only(src, str(tmp_path / "p16"), dtype="bfloat16", log=lambda *_: None)
  assert not os.path.exists(tmp_path / "p16")
