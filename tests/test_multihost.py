"""Two processes x 4 CPU devices train exactly like one process x 8; distributed-key validation."""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import BASE, PROCESS_TIMEOUT_S, REPO, TINY, run_cli
from nanotext import checkpoint, config, config_file, distributed, wiring
from nanotext.errors import UserError
from nanotext.train import run

TIMEOUT_S = PROCESS_TIMEOUT_S  # both processes, start to finish; about 35 s when idle
# Losses agree to float32 rounding, not bit for bit: process i holds every i-th sequence of the
# global batch, so the rows sit in another order and the mean-loss and gradient reductions add
# in another order (observed: at most ~2e-7 relative after 4 steps).
RTOL = 1e-5


# Process 0's line when another program took its port after free_port(); jax's, where it came
# between process 0's check and jax's own bind (a refusal, or XLA's line and a segmentation fault).
PORT_TAKEN = ("is in use on this host", "Failed to start RPC server",
              "Failed to add port to server")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def metrics_of(out):
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def launch_two(overrides, timeout=TIMEOUT_S, tries=3, per_process=([], []), expect=0,
               cwds=(REPO, REPO), poke=None, devices=(4, 4)) -> list:
  """Run processes 0 and 1 of one distributed run (each with its `per_process` overrides too,
  in its folder of `cwds`, with its number of `devices`; `poke(processes)` once they started);
  returns their combined outputs, each process's exit status `expect`. A port that another
  program took between free_port() and the coordinator's bind is tried again."""
  address = f"127.0.0.1:{free_port()}"
  # distributed.local_device_count beats the 8 devices conftest puts in XLA_FLAGS.
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen(
      [sys.executable, "-m", "nanotext.train", BASE, *overrides, *per_process[i],
       f"distributed.coordinator_address={address}", "distributed.num_processes=2",
       f"distributed.process_id={i}", f"distributed.local_device_count={devices[i]}",
       "distributed.init_timeout=60"],
      cwd=cwds[i], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for i in range(2)]
  deadline = time.monotonic() + timeout
  if poke is not None:
    poke(procs)
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
      if tries > 1 and p is procs[0] and any(t in outputs[0] for t in PORT_TAKEN):
        procs[1].kill()
        procs[1].communicate()
        return launch_two(overrides, timeout, tries - 1, per_process, expect, cwds, poke,
                          devices)
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    tails = [(p.communicate()[0] or "")[-2000:] for p in procs]
    pytest.fail(f"2-process run did not finish in {timeout} s; outputs:\n" +
                "\n--- process 1 ---\n".join(tails))
  for i, (p, out) in enumerate(zip(procs, outputs)):
    assert p.returncode == expect, f"process {i} exited with {p.returncode}:\n{out[-3000:]}"
  return outputs


# fsdp=8: each process holds half of the batch. The second mesh holds the batch split in two along
# `tensor` (pairs of devices within a process), each half replicated along fsdp across both
# processes: each process needs every row. Without the global shape jax took each process's
# rows for its half and trained on both halves mixed (losses 1% off after 4 steps, exit 0).
@pytest.mark.parametrize("mesh", [[], ["mesh.fsdp=4", "mesh.tensor=2",
                                       "mesh.rules=[[batch,tensor],[heads,tensor],[embed,fsdp]]"]],
                         ids=["split", "replicated"])
def test_two_processes_match_one(tmp_path, mesh):
  common = TINY + ["train.steps=4"] + mesh
  if not mesh:  # text, so that val_bpb is compared too (of process 0's rows alone, it was off)
    from nanotext.data import binfile
    for i, name in enumerate(("train.bin", "val.bin")):
      binfile.write_shard(str(tmp_path / name),
                          np.random.default_rng(i).integers(0, 8192, 20000, dtype=np.uint16))
    common += ["data.source=bin", f"data.train_files={tmp_path / 'train.bin'}",
               f"data.val_files={tmp_path / 'val.bin'}", "data.tokenizer=shakespeare",
               "model.vocab_size=8192"]
  multi = str(tmp_path / "multi")
  def final():  # process 0 wrote the last step's val_loss (a line may be half-written yet)
    try:
      return any(r["step"] == 4 and "val_loss" in r for r in metrics_of(multi))
    except (OSError, ValueError):
      return False
  def poke(procs):  # SIGTERM to process 1 alone after the last step: the sample still runs
    while not final() and procs[0].poll() is None:
      time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
  outputs = launch_two(common + [f"output_dir={multi}"], poke=None if mesh else poke)
  # Process 1 skipped the end-of-run sample alone: process 0 waited in its collectives for ever.
  assert mesh or "sample: ROMEO:" in outputs[0], outputs[0][-2000:]
  for i, out in enumerate(outputs):
    assert f"process {i}/2 on host" in out and "with 4 local devices (8 in all)" in out, out
  assert "on 8 cpu device(s)" in outputs[0]
  assert "model:" not in outputs[1]  # only process 0 prints the run's log lines

  single = str(tmp_path / "single")
  result = run(BASE, common + [f"output_dir={single}"], log=lambda s: None)

  got, want = metrics_of(multi), metrics_of(single)
  # Process 1 writes nothing: each step is logged once, by process 0.
  assert [(r["step"], sorted(r)) for r in got] == [(r["step"], sorted(r)) for r in want]
  assert any("val_bpb" in r for r in want) == (not mesh)
  diffs = []
  for g, w in zip(got, want):
    for key in ("loss", "val_loss", "grad_norm", "val_bpb"):
      if key in w:
        np.testing.assert_allclose(g[key], w[key], rtol=RTOL, err_msg=f"step {g['step']} {key}")
        diffs.append(abs(g[key] - w[key]) / abs(w[key]))
  print(f"max relative difference 1x8 vs 2x4: {max(diffs):.2e}")
  if mesh:
    return
  assert config.load(os.path.join(multi, "config.yml")).mesh.fsdp == 8
  # No launch value of one process, no peak of these devices: `train RUN/config.yml` resumes.
  saved = config_file.read(os.path.join(multi, "config.yml"))
  assert (saved["distributed"]["coordinator_address"], saved["distributed"]["process_id"],
          saved["metrics"]["peak_flops"]) == ("", -1, 0)
  # Both processes wrote one checkpoint together (each its own shards, process 0 the metadata):
  # it must restore into one process's 8-device shardings (the resume path) whole, holding the
  # single-process run's parameters.
  setup = wiring.prepare(BASE, common)
  manager = checkpoint.make_manager(multi, keep=1, create=False)
  assert list(manager.all_steps()) == [4]
  state, _, _ = checkpoint.restore(manager, 4, setup.abstract_state())
  manager.close()
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-6),
               jax.device_get(state["params"]), jax.device_get(result.state["params"]))


def test_processes_given_different_configs_refuse_in_one_line(tmp_path):
  """Another train.steps on one process hung both in a collective (past SIGTERM); another
  model crashed them in gloo; another seed trained silently. Nothing is written."""
  out = tmp_path / "run"
  outputs = launch_two(TINY + [f"output_dir={out}"], per_process=(["seed=0"], ["seed=1"]),
                       expect=2)
  for i, text in enumerate(outputs):
    assert text.strip().splitlines()[-1] == (
        f"nanotext: error: process 1 was given another seed than process 0 ({i} here): give "
        "every process the same config and overrides (only distributed.process_id differs)"), text
  assert not out.exists()


def test_processes_with_different_device_counts_refuse_in_one_line(tmp_path):
  """2 devices on process 0, 3 on process 1: check_same_config's all-gather crashed both
  ('cannot reshape array of size 5 into shape (2,2)', exit 1). Refused once they joined."""
  out = tmp_path / "run"
  outputs = launch_two(TINY + [f"output_dir={out}", "mesh.fsdp=-1"], devices=(2, 3), expect=2)
  for text in outputs:
    assert text.strip().splitlines()[-1] == (
        "nanotext: error: the processes hold different numbers of devices "
        "(jax.local_device_count(): 2 on process 0; 3 on process 1): give every process the same "
        "number (distributed.local_device_count on CPUs; as many visible accelerators on each "
        "host)"), text
  assert not out.exists()


@pytest.mark.fast
def test_trains_refusal_meets_the_other_processes_first(monkeypatch):
  """train's CLI said its refusals itself, so the hook that holds process 0 (the coordinator)
  until the others reach theirs never ran: a process still starting its backend aborted."""
  from nanotext import errors, train
  met = []
  monkeypatch.setattr(errors, "BEFORE_REFUSAL", [lambda: met.append(True)])

  def fail(message, status=2):  # the real one ends the process (os._exit)
    raise SystemExit((status, message))
  for module in (errors, train):
    monkeypatch.setattr(module, "fail", fail)
  with pytest.raises(SystemExit) as e:
    errors.run_cli(train.main, ["no_such_config.yml"])
  assert e.value.code[0] == 2 and "no_such_config.yml" in e.value.code[1]
  assert met == [True]


@pytest.mark.fast
def test_device_counts_are_compared_per_process():
  """From the global device list each process holds (no collective, which unequal counts
  break)."""
  class Device:
    def __init__(self, process_index):
      self.process_index = process_index
  distributed.check_device_counts([Device(p) for p in (0, 0, 1, 1)])
  with pytest.raises(UserError, match=r"\(jax.local_device_count\(\): 1 on processes 1, 2, 3, "
                                      r"\.\.\.; 2 on process 0\)"):
    distributed.check_device_counts([Device(p) for p in (0, 0, 1, 2, 3, 4)])


@pytest.mark.fast
def test_one_output_dir_spelt_otherwise_on_each_process_is_one_run(tmp_path, monkeypatch):
  """Process 0 given runs/a from its cwd, process 1 the same folder absolute or through a link:
  both refused, 'another output_dir'. The real paths are compared too; another folder is not.
  So for every key naming a path (shards, a checkpoint to start from, caches)."""
  def gathered(here, peer, key="output_dir"):  # check_same_config, process 1 given `peer`
    codes = []
    monkeypatch.setattr(distributed, "_every_process", lambda c: codes.append(c) or c[None])
    distributed.check_same_config(config.load(BASE, TINY + [f"{key}={peer}"]).to_dict())
    monkeypatch.setattr(distributed, "_every_process", lambda c: np.stack([c, codes[0]]))
    distributed.check_same_config(config.load(BASE, TINY + [f"{key}={here}"]).to_dict())
  (tmp_path / "runs" / "a").mkdir(parents=True)
  os.symlink(tmp_path / "runs", tmp_path / "link")
  monkeypatch.chdir(tmp_path)
  for peer in (tmp_path / "runs" / "a", tmp_path / "link" / "a", "./runs/a/", "runs/a"):
    gathered("runs/a", peer)
  for key in ("data.train_files", "checkpoint.load_params_from", "train.compile_cache_dir"):
    gathered("runs/a/*.bin", tmp_path / "link" / "a" / "*.bin", key)
  with pytest.raises(UserError) as e:
    gathered("runs/a", tmp_path / "runs" / "b")
  assert str(e.value) == (
      f"process 1 was given another output_dir than process 0 ('runs/a', resolved "
      f"'{os.path.realpath(tmp_path)}/runs/a' here): give every process the same config and "
      "overrides (only distributed.process_id differs)")
  with pytest.raises(UserError, match="another data.val_files than process 0"):
    gathered("runs/a/*.bin", "runs/b/*.bin", "data.val_files")
  gathered("", "", "data.dir")  # unset on both: one value, whatever each cwd


def test_an_output_dir_not_shared_by_the_processes_is_refused(tmp_path):
  """One spelling, two folders (here: a relative path from two working directories; on two
  hosts: a local path): the first save failed with a traceback on one process and hung or
  aborted the other. Both refuse before compiling, and process 0's folder is as it was."""
  hosts = [tmp_path / "host0", tmp_path / "host1"]
  for h in hosts:
    h.mkdir()
  outputs = launch_two(TINY + ["output_dir=run"], cwds=hosts, expect=2)
  for text in outputs:
    assert text.strip().splitlines()[-1] == (
        "nanotext: error: output_dir 'run' is not one folder that every process sees: process 1 "
        "does not find process 0's .lock in it; give every process a path on a file system they "
        "share"), text
  assert [os.listdir(h) for h in hosts] == [[], []]


def write_data(folder, seeds=(0, 1)) -> list:
  """train.bin and val.bin of random tokens (each from its seed) in `folder`; the overrides
  that read them as spelt from inside it."""
  from nanotext.data import binfile
  folder.mkdir(parents=True, exist_ok=True)
  for seed, split in zip(seeds, ("train", "val")):
    binfile.write_shard(str(folder / f"{split}.bin"),
                        np.random.default_rng(seed).integers(0, 512, 20000, dtype=np.uint16))
  return ["data.source=bin", "data.train_files=data/train.bin", "data.val_files=data/val.bin",
          "data.tokenizer=none"]


@pytest.mark.fast
def test_processes_reading_other_data_files_are_refused(tmp_path, monkeypatch):
  """data.train_files spelt the same on two hosts named other tokens on each: the run trained
  on their mix, exit 0, its config.yml naming process 0's files alone. The fingerprints of both
  splits are gathered as the configs are; files elsewhere with the same contents pass."""
  from nanotext.data import fingerprint
  def data(name, seeds):
    keys = write_data(tmp_path / name / "data", seeds)
    return config.load(BASE, TINY + [k.replace("=data/", f"={tmp_path / name}/data/")
                                     for k in keys]).data
  def gathered(here, peer):  # same_data on `here` with process 1 reading `peer`'s files
    codes = []
    monkeypatch.setattr(distributed, "_every_process", lambda c: codes.append(c) or c[None])
    distributed.same_data(peer)
    monkeypatch.setattr(distributed, "_every_process", lambda c: np.stack([c, codes[0]]))
    return distributed.same_data(here)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  h0 = data("h0", (0, 1))
  assert gathered(h0, data("h1", (0, 1))) == fingerprint.fingerprint(h0)
  for split, peer in (("val", data("h2", (0, 2))), ("train", data("h3", (2, 1)))):
    with pytest.raises(UserError) as e:
      gathered(h0, peer)
    assert str(e.value) == (
        f"process 1 reads other data.{split}_files than process 0 "
        f"('{tmp_path}/h0/data/{split}.bin' here): every host must see the same files; give "
        "every process a path to the same shards (on a file system they share, or the same "
        "copy on each host)")


def test_processes_reading_other_data_refuse_in_one_line(tmp_path):
  """The same relative data paths in two working directories (two hosts' local copies) that
  differ: both processes refuse once they read them, nothing written."""
  hosts = [tmp_path / "host0", tmp_path / "host1"]
  keys = [write_data(h / "data", seeds) for h, seeds in zip(hosts, ((0, 1), (2, 1)))][0]
  out = tmp_path / "run"
  outputs = launch_two(TINY + keys + [f"output_dir={out}"], cwds=hosts, expect=2)
  for host, text in zip(hosts, outputs):
    assert text.strip().splitlines()[-1] == (
        f"nanotext: error: process 1 reads other data.train_files than process 0 "
        f"('{host}/data/train.bin' here): every host must see the same files; give every "
        "process a path to the same shards (on a file system they share, or the same copy on "
        "each host)"), text
  assert not out.exists()


def test_sigterm_to_one_process_stops_both_at_the_next_step(tmp_path):
  """Processes agreed on a stop only on logging steps: at train.log_every=500 a SIGTERM after
  step 1 trained on to step 500 (81 s at log_every=300 in the report), past a cloud's grace
  period. Now both save the step after the one that saw it and exit 0, whichever process got
  it (here process 0 alone, as a single preempted host)."""
  out = tmp_path / "run"
  rows = out / "metrics.jsonl"
  def poke(procs):
    while not (rows.exists() and rows.stat().st_size) and procs[0].poll() is None:
      time.sleep(0.05)
    procs[0].send_signal(signal.SIGTERM)
  outputs = launch_two(TINY + [f"output_dir={out}", "train.steps=1000", "train.log_every=500",
                               "train.eval_every=0"], poke=poke)
  steps = os.listdir(out / "checkpoints")
  assert len(steps) == 1 and int(steps[0]) < 500, steps
  assert (f"received SIGTERM: saved the checkpoint of step {steps[0]} and stopped"
          in outputs[0]), outputs[0][-2000:]


@pytest.mark.fast
@pytest.mark.parametrize("overrides, needle", [
    (["distributed.num_processes=2", "distributed.process_id=0"],
     "need distributed.coordinator_address"),
    (["distributed.coordinator_address=127.0.0.1:1234", "distributed.process_id=0"],
     "distributed.num_processes >= 1"),
    (["distributed.coordinator_address=127.0.0.1:1234", "distributed.num_processes=2"],
     "needs distributed.process_id"),
    (["distributed.coordinator_address=127.0.0.1:1234", "distributed.num_processes=2",
      "distributed.process_id=2"], "distributed.process_id=2 must be in [0, "),
    (["distributed.coordinator_address=localhost", "distributed.num_processes=2",
      "distributed.process_id=0"], "must be HOST:PORT"),
    (["distributed.num_processes=-1"], "distributed.num_processes=-1 must not be negative"),
    (["distributed.process_id=-2"], "distributed.process_id=-2 must be -1"),
    (["distributed.local_device_count=-1"], "distributed.local_device_count=-1"),
    (["distributed.init_timeout=0"], "distributed.init_timeout=0 must be positive"),
])
def test_bad_distributed_keys_are_user_errors(overrides, needle, tmp_path):
  # Checked before any connection attempt, so these fail at once and touch nothing.
  with pytest.raises(UserError) as e:
    run(BASE, TINY + overrides + [f"output_dir={tmp_path / 'run'}"], log=lambda s: None)
  assert needle in str(e.value), str(e.value)
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.fast
def test_env_fallbacks_and_auto(monkeypatch):
  cfg = config.load(BASE)
  assert distributed.plan(cfg.distributed) is None  # the default: one process
  monkeypatch.setenv("NANOTEXT_COORDINATOR_ADDRESS", "10.0.0.1:5000")
  monkeypatch.setenv("NANOTEXT_NUM_PROCESSES", "4")
  monkeypatch.setenv("NANOTEXT_PROCESS_ID", "3")
  p = distributed.plan(cfg.distributed)
  assert (p.coordinator_address, p.num_processes, p.process_id, p.auto) == \
      ("10.0.0.1:5000", 4, 3, False)
  # Config keys win over the environment.
  p = distributed.plan(config.load(BASE, ["distributed.process_id=1"]).distributed)
  assert p.process_id == 1
  monkeypatch.setenv("NANOTEXT_PROCESS_ID", "x")
  with pytest.raises(UserError, match="NANOTEXT_PROCESS_ID"):
    distributed.plan(cfg.distributed)
  for name in ("COORDINATOR_ADDRESS", "NUM_PROCESSES", "PROCESS_ID"):
    monkeypatch.delenv("NANOTEXT_" + name)
  monkeypatch.setenv("NANOTEXT_NUM_PROCESSES", "2")  # alone: the line named only config keys
  with pytest.raises(UserError, match="need distributed.coordinator_address .*; set here by the "
                                      "environment: NANOTEXT_NUM_PROCESSES=2"):
    distributed.plan(cfg.distributed)
  monkeypatch.delenv("NANOTEXT_NUM_PROCESSES")
  # auto: unset values stay None for JAX to detect (SLURM, Open MPI, TPU pods).
  p = distributed.plan(config.load(BASE, ["distributed.auto=true"]).distributed)
  assert (p.coordinator_address, p.num_processes, p.process_id, p.auto) == \
      (None, None, None, True)


def test_cli_reports_a_bad_distributed_key():
  r = run_cli("nanotext.train", BASE, *TINY, "distributed.num_processes=2", timeout=120)
  assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
  assert r.stderr.strip().splitlines()[-1].startswith(
      "nanotext: error: distributed.num_processes and distributed.process_id need")


@pytest.mark.fast
def test_process_0_refuses_a_coordinator_port_in_use(monkeypatch):
  """Another program listening on the coordinator's port: process 0's coordination service
  failed to bind ('Failed to add port to server') and XLA crashed it with a segmentation fault
  (exit 139). Refused before joining, checked where jax binds (every interface); process 1,
  which hosts nothing, goes on to join."""
  def initialize(**kwargs):
    raise AssertionError(f"joined as process {kwargs['process_id']}")
  monkeypatch.setattr(jax.distributed, "initialize", initialize)
  def keys(pid):
    return config.load(BASE, [f"distributed.coordinator_address=127.0.0.1:{port}",
                              "distributed.num_processes=2",
                              f"distributed.process_id={pid}"]).distributed
  with socket.socket() as held:  # on 127.0.0.1 alone: jax's [::] still collides with it
    held.bind(("127.0.0.1", 0))
    held.listen(1)
    port = held.getsockname()[1]
    with pytest.raises(UserError) as e:
      distributed.maybe_initialize(keys(0))
    assert str(e.value) == (
        f"port {port} is in use on this host: process 0 hosts the run's coordinator there "
        f"(distributed.coordinator_address='127.0.0.1:{port}'); give every process another "
        "port, or stop the program that holds it")
    with pytest.raises(AssertionError, match="joined as process 1"):
      distributed.maybe_initialize(keys(1))
    monkeypatch.setenv("JAX_COORDINATOR_BIND_ADDRESS", f"127.0.0.1:{port}")  # jax's override
    with pytest.raises(UserError, match=f"JAX_COORDINATOR_BIND_ADDRESS='127.0.0.1:{port}'"):
      distributed.maybe_initialize(keys(0))
  with pytest.raises(AssertionError, match="joined as process 0"):  # let go: free again
    distributed.maybe_initialize(keys(0))


@pytest.mark.parametrize("process_id", [0, 1])
def test_a_run_whose_other_processes_never_join_ends_in_one_line(process_id, tmp_path):
  """Process 0 alone (its peers never started), or process 1 with nothing at the coordinator's
  address: after distributed.init_timeout one line and exit 2, where XLA aborted the process
  with a C++ check failure (exit 134, ~45 lines); nothing written."""
  out = tmp_path / "run"
  r = run_cli("nanotext.train", BASE, *TINY, f"output_dir={out}",
              f"distributed.coordinator_address=127.0.0.1:{free_port()}",
              "distributed.num_processes=2", f"distributed.process_id={process_id}",
              "distributed.local_device_count=4", "distributed.init_timeout=2", timeout=120)
  assert r.returncode == 2, r.stderr
  assert "Traceback" not in r.stderr and "Check failure" not in r.stderr, r.stderr
  line = r.stderr.strip().splitlines()[-1]
  assert line.startswith("nanotext: error: cannot join the distributed run at 127.0.0.1:"), line
  assert f"process {process_id} of 2 waited distributed.init_timeout=2 s" in line
  assert not out.exists()
