"""A run's start, before its first step: every write it will make is tried first, a path orbax
would read as a glob is refused, odd things in output_dir are one line, and a signal stops it at
once with output_dir as it was (there is nothing to save yet). Issue 21 and issue 18 item 4."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from conftest import BASE, PROCESS_TIMEOUT_S, REPO, compiling_env
from test_cli_errors import snapshot
from test_faults import (ARGS, array_files, assert_one_error_line, assert_same_as, copy_of,
                         make_reference, quiet_run, start)
from nanotext import checkpoint, params_from, probes, rundir
from nanotext.errors import ResourceError, UserError

reference = pytest.fixture(scope="module", name="reference")(make_reference)


def train_cli(out, *extra, shell=""):
  """`python -m nanotext.train` on the fault tests' tiny run; `shell` runs first (ulimit)."""
  cmd = [sys.executable, "-m", "nanotext.train", BASE, *ARGS, f"output_dir={out}", *extra]
  if shell:
    cmd = ["bash", "-c", f'{shell} && exec "$0" "$@"', *cmd]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


@contextlib.contextmanager
def immutable(path):
  """`chattr +i path` for the block (even root cannot write it); skips where unsupported."""
  if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
    pytest.skip("chattr +i is not available here (needs root and ext4-like file systems)")
  try:
    yield
  finally:
    subprocess.run(["chattr", "-i", str(path)], check=True)


# --- paths orbax reads as glob patterns ------------------------------------------------------

@pytest.mark.parametrize("name", [pytest.param("run[1]", marks=pytest.mark.fast), "st*q?"])
def test_a_glob_character_in_output_dir_is_refused_before_anything(tmp_path, name):
  """Orbax globs inside the checkpoint path: 'run[1]' trained and saved steps that no tool could
  read back. Refused in one line; nothing is created."""
  out = tmp_path / name
  assert_one_error_line(train_cli(out), 2, "output_dir", "glob")
  assert os.listdir(tmp_path) == []


def test_glob_characters_in_the_readers_paths_are_refused(reference, tmp_path):
  with pytest.raises(UserError, match="glob"):
    checkpoint.make_manager(str(tmp_path / "a[1]"), keep=1)
  with pytest.raises(UserError, match="checkpoint.load_params_from .*glob"):
    params_from.find_item(str(tmp_path / "a[1]"))
  link = tmp_path / "b?"  # the same run through a name with a glob character
  os.symlink(reference[0], link)
  for cmd in (["nanotext.generate", f"output_dir={link}"], ["nanotext.verify", str(link)],
              ["nanotext.convert", "params-only", f"--run={link}", f"--out={tmp_path / 'p'}"]):
    proc = subprocess.run([sys.executable, "-m", *cmd], cwd=REPO, capture_output=True,
                          text=True, timeout=PROCESS_TIMEOUT_S)
    assert_one_error_line(proc, 2, "glob")


@pytest.mark.fast
def test_a_backslash_in_output_dir_is_refused_before_anything(tmp_path):
  """Tensorstore reads '\\' as '/': 'c\\x' trained, said it finished, and wrote its arrays into
  a stray 'c/x' beside the run, so every step was unreadable. Refused in one line instead."""
  assert_one_error_line(train_cli(tmp_path / "c\\x"), 2, "output_dir", "backslash")
  assert os.listdir(tmp_path) == []


@pytest.mark.fast
def test_a_backslash_in_the_readers_and_converts_paths_is_refused(tmp_path):
  from nanotext.convert import hf, params, torch_import
  bad = str(tmp_path / "a\\b")
  with pytest.raises(UserError, match="backslash"):
    checkpoint.make_manager(bad, keep=1)
  with pytest.raises(UserError, match="checkpoint.load_params_from .*backslash"):
    params_from.find_item(bad)
  # each writes orbax checkpoints into --out
  for convert in (params.params_only, hf.read_hf, torch_import.read_config):
    with pytest.raises(UserError, match="--out .*backslash"):
      convert(str(tmp_path), bad)
  assert os.listdir(tmp_path) == []


@pytest.mark.fast
def test_a_data_dir_with_glob_characters_is_a_folder_not_a_pattern(tmp_path):
  from nanotext.data import binfile, prepare
  folder = tmp_path / "data[1]"
  folder.mkdir()
  binfile.write_shard(str(folder / "train_0.bin"), [1, 2, 3])
  files = prepare._result(str(folder), {})["train_files"]  # pylint: disable=protected-access
  assert binfile.find_shards(files, key="data.dir") == [str(folder / "train_0.bin")]


# --- odd things in output_dir ----------------------------------------------------------------

def test_stray_folders_named_with_non_ascii_digits_are_not_steps(reference, tmp_path):
  """'²'.isdigit() is True and int('²') raises; '٣' is a digit int() reads as 3."""
  out = copy_of(reference, tmp_path)
  for name in ("²", "٣", "٧"):
    os.mkdir(os.path.join(out, "checkpoints", name))
  _, lines = quiet_run(out, "train.steps=8")
  assert any("resumed from the checkpoint of step 6" in l for l in lines)
  assert rundir.is_step_name("12") and not rundir.is_step_name("²")


def test_a_lock_that_is_a_directory_is_one_line(reference, tmp_path):
  out = copy_of(reference, tmp_path)
  os.mkdir(os.path.join(out, ".lock"))
  before = snapshot(out)
  with pytest.raises(UserError, match=r"\.lock' is a directory"):
    quiet_run(out, "train.steps=8")
  assert snapshot(out) == before


def test_a_full_disk_at_the_lock_is_one_line_status_1_and_leaves_no_lock(tmp_path):
  """ulimit -f 0: the lock file is created but its first byte fails (EFBIG, as ENOSPC)."""
  out = tmp_path / "run"
  proc = train_cli(out, shell="ulimit -f 0")
  assert_one_error_line(proc, 1, "File too large", ".lock")
  assert not out.exists()


# --- write probes: refused before compiling, never a hang ------------------------------------

def test_an_immutable_checkpoint_folder_is_refused_before_training(reference, tmp_path):
  """Orbax waited 300 s for a step directory it could not create, then a traceback."""
  out = copy_of(reference, tmp_path)
  before = snapshot(out)
  with immutable(os.path.join(out, "checkpoints")):
    proc = train_cli(out, "train.steps=8")
  assert_one_error_line(proc, 2, "checkpoint folder", "Operation not permitted")
  assert "compiled" not in proc.stdout
  assert snapshot(out) == before


@pytest.mark.fast
def test_a_save_into_a_folder_that_became_unwritable_fails_at_once(tmp_path):
  """The probe in checkpoint.save: a run whose checkpoints/ turns read-only mid-run stops at
  its next save in one line (CheckpointError, status 1), before orbax is handed the step (it
  waited 300 s at a barrier for a directory it could not create)."""
  import jax.numpy as jnp
  manager = checkpoint.make_manager(str(tmp_path), keep=2, async_save=True)
  state = {"w": jnp.ones(4)}
  checkpoint.save(manager, 1, state, {}, {})
  checkpoint.wait(manager)
  orbax_save = manager.save
  manager.save = lambda *a, **k: pytest.fail("orbax was handed a step it cannot write")
  with immutable(tmp_path / "checkpoints"):
    with pytest.raises(checkpoint.CheckpointError, match="step 2: cannot write"):
      checkpoint.save(manager, 2, state, {}, {})
  manager.save = orbax_save
  manager.close()
  assert issubclass(checkpoint.CheckpointError, ResourceError)  # exit status 1


@pytest.mark.fast
def test_a_failed_save_names_the_step_kept_before_it(tmp_path):
  """`ulimit -n` too low for orbax's writers: the first save failed and the line said 'the
  earlier steps are intact' of none. It names the newest step saved before, or says there is
  none."""
  import errno
  import jax.numpy as jnp

  def emfile():
    raise OSError(errno.EMFILE, "Too many open files")

  state = {"w": jnp.ones(4)}
  for saved_before, kept in ((0, "no step was saved before it"),
                             (2, "step 2, saved before, is intact")):
    manager = checkpoint.make_manager(str(tmp_path / str(saved_before)), keep=3)
    for step in range(1, saved_before + 1):
      checkpoint.save(manager, step, state, {}, {})
    checkpoint.wait(manager)
    checkpoint.save(manager, saved_before + 1, state, {}, {})
    manager.check_for_errors = emfile  # the async write's error, as orbax raises it
    with pytest.raises(checkpoint.CheckpointError, match=f"Too many open files; {kept}$"):
      checkpoint.wait(manager)
    del manager.check_for_errors
    manager.close()


@pytest.mark.parametrize("victim", ["metrics.jsonl", "config.yml"])
def test_an_immutable_run_file_is_refused_before_training(reference, tmp_path, victim):
  out = copy_of(reference, tmp_path)
  before = snapshot(out)
  with immutable(os.path.join(out, victim)):
    proc = train_cli(out, "train.steps=8")
  assert_one_error_line(proc, 2, victim, "Operation not permitted")
  assert "compiled" not in proc.stdout and snapshot(out) == before


def test_a_profile_dir_that_cannot_be_written_is_refused_before_training(tmp_path):
  locked = tmp_path / "locked"
  locked.mkdir()
  out = tmp_path / "run"
  with immutable(locked):
    proc = train_cli(out, f"profile.dir={locked / 'p'}", "profile.steps=1",
                     "profile.start_step=0")
  assert_one_error_line(proc, 2, "profile.dir", str(locked / "p"))
  assert not out.exists() and not (locked / "p").exists()


def test_a_compile_cache_dir_that_cannot_be_written_is_refused(tmp_path):
  """JAX warned once per program and cached nothing: a restart compiled everything again."""
  locked = tmp_path / "locked"
  locked.mkdir()
  with immutable(locked):
    proc = train_cli(tmp_path / "run", f"train.compile_cache_dir={locked / 'cache'}")
  assert_one_error_line(proc, 2, "train.compile_cache_dir", "Operation not permitted")
  assert not (tmp_path / "run").exists()


def test_paths_with_percent_braces_and_spaces_work_in_every_tool(tmp_path,
                                                                restore_jax_cache_config):
  """Characters a format string or a shell would read (but a glob would not) are plain."""
  out = str(tmp_path / "a %s {0} b")
  quiet_run(out, "train.steps=2", "profile.steps=1", "profile.start_step=1",
            f"profile.dir={tmp_path / 'p %d'}", f"train.compile_cache_dir={tmp_path / 'c {}'}")
  assert os.listdir(tmp_path / "p %d") and os.listdir(tmp_path / "c {}")
  ok = subprocess.run([sys.executable, "-m", "nanotext.verify", out], cwd=REPO,
                      capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
  assert ok.returncode == 0 and "step       2  intact" in ok.stdout, ok.stderr
  folder = str(tmp_path / "p {1} %")
  conv = subprocess.run([sys.executable, "-m", "nanotext.convert", "params-only", f"--run={out}",
                         f"--out={folder}"], cwd=REPO, capture_output=True, text=True,
                        timeout=PROCESS_TIMEOUT_S)
  assert conv.returncode == 0, conv.stderr
  assert params_from.load(folder, checkpoint.latest_params(out)[1])[0] == folder


def test_a_run_gives_back_the_compilation_cache_settings_it_found(tmp_path):
  """train.compile_cache_dir stayed on for the rest of the process: a later run whose config
  says '' (off) and a notebook's own jits went on caching into the first run's folder."""
  import jax
  from nanotext import train
  before = {k: getattr(jax.config, k) for k in train.CACHE_KEYS}
  quiet_run(str(tmp_path / "run"), "train.steps=1", f"train.compile_cache_dir={tmp_path / 'c'}")
  assert os.listdir(tmp_path / "c")
  assert {k: getattr(jax.config, k) for k in train.CACHE_KEYS} == before
  (tmp_path / "file").write_text("")
  with pytest.raises(UserError):  # refused after the cache was taken: given back as well
    quiet_run(str(tmp_path / "file"), f"train.compile_cache_dir={tmp_path / 'c'}")
  assert {k: getattr(jax.config, k) for k in train.CACHE_KEYS} == before


@pytest.mark.fast
def test_probes_leave_nothing_behind_and_tell_resources_from_permissions(tmp_path):
  probes.writable_dir(str(tmp_path / "a" / "b"), "x")
  assert os.listdir(tmp_path) == []  # the folders it made for the probe are gone again
  with pytest.raises(ResourceError, match="a checkpoint needs about .* MiB free"):
    probes.free_space(str(tmp_path), 2**60, "a checkpoint")
  with pytest.raises(UserError, match="/f' is a file, not a folder"):
    (tmp_path / "f").write_text("")
    probes.writable_dir(str(tmp_path / "f" / "g"), "x")


@pytest.mark.fast
def test_a_pipe_or_a_device_is_never_an_output_file(tmp_path):
  """A rename would put a file where /dev/null was (the tools run as root in containers), and
  opening a pipe waits for a reader: every single-file output refuses them at once."""
  from nanotext import outputs
  pipe = str(tmp_path / "pipe")
  os.mkfifo(pipe)
  for probe in (probes.replaceable, probes.appendable):
    with pytest.raises(UserError, match="/pipe' is a pipe, not a file"):
      probe(pipe, "--out")
    with pytest.raises(UserError, match="'/dev/null' is a device, not a file"):
      probe(os.devnull, "--json")
  with pytest.raises(UserError, match="is a pipe"):
    with outputs.staged_file(pipe, force=True):
      raise AssertionError("not reached")
  link = tmp_path / "link"
  link.symlink_to(os.devnull)
  with pytest.raises(UserError, match="is a device"):
    probes.replaceable(str(link), "--out")
  assert sorted(os.listdir(tmp_path)) == ["link", "pipe"]  # nothing staged beside them
  # /dev/stdout with stdout sent to a file: a link (here two) to a process's open descriptor
  # of a plain file; a rename onto it would replace the link (the system's /dev/stdout).
  (tmp_path / "out.txt").write_text("kept")
  with open(tmp_path / "out.txt", "a") as f:
    (tmp_path / "fd").symlink_to(f"/proc/self/fd/{f.fileno()}")
    (tmp_path / "stdout").symlink_to(tmp_path / "fd")
    for name in ("fd", "stdout"):
      with pytest.raises(UserError, match="is a link to a process's open file"):
        probes.replaceable(str(tmp_path / name), "--json")
  assert os.path.islink(tmp_path / "stdout") and (tmp_path / "out.txt").read_text() == "kept"


def test_an_empty_prompt_is_refused_before_training(tmp_path):
  """sample.prompt= was refused only after training and saving."""
  out = tmp_path / "run"
  proc = train_cli(out, "sample.prompt=", "sample.max_new_tokens=4", "data.tokenizer=shakespeare",
                   "model.vocab_size=8192")
  assert_one_error_line(proc, 2, "sample.prompt=''", "no tokens")
  assert "compiled" not in proc.stdout and not out.exists()


# --- signals before the first step -----------------------------------------------------------

SLOW_COMPILE = ["model.num_layers=4"]  # several seconds of compiling on CPU


def start_and_signal(out, sig, *extra):
  """Start a run, send `sig` once it prints its model line (its compilation follows at once);
  returns (exit status, its output). It compiles, not loads from the cache: a resume of a run
  that compiled the same programs was done with them in under a second."""
  log = f"{out}.log"
  with open(log, "wb") as f:
    proc = subprocess.Popen([sys.executable, "-m", "nanotext.train", BASE, *ARGS, *SLOW_COMPILE,
                             f"output_dir={out}", *extra], cwd=REPO, stdout=f, stderr=f,
                            env=compiling_env())
  deadline = time.time() + PROCESS_TIMEOUT_S
  while "model:" not in open(log).read():
    assert proc.poll() is None and time.time() < deadline, open(log).read()[-3000:]
    time.sleep(0.05)
  time.sleep(0.5)  # into the restore or the compilation
  proc.send_signal(sig)
  status = proc.wait(timeout=PROCESS_TIMEOUT_S)
  return status, open(log).read()


@pytest.mark.slow
def test_sigterm_during_compilation_exits_at_once_and_creates_nothing(tmp_path):
  """SIGTERM while compiling was taken as a preemption request: the process compiled on (for
  minutes at full size) and only SIGKILL ended it."""
  out = tmp_path / "run"
  status, log = start_and_signal(out, signal.SIGTERM)
  assert status == 128 + signal.SIGTERM, log[-3000:]
  assert "compiled" not in log and "Traceback" not in log, log[-3000:]
  assert log.strip().splitlines()[-1] == (f"nanotext: error: stopped by SIGTERM before the first "
                                          f"step: nothing to save, output_dir '{out}' is as it was")
  assert not out.exists()  # "compiled" absent above: it stopped inside the compilation


@pytest.mark.slow
def test_a_signal_before_the_first_step_of_a_resume_or_overwrite_changes_nothing(tmp_path):
  """A resume rewrites config.yml and appends to metrics.jsonl before compiling, an overwrite
  sets the previous run aside: all of it is put back, bytes and times."""
  out = tmp_path / "run"
  first = train_cli(out, *SLOW_COMPILE, "train.steps=2", "checkpoint.every=2")
  assert first.returncode == 0, first.stderr[-3000:]
  before = snapshot(out)
  status, log = start_and_signal(out, signal.SIGINT, "train.steps=6")
  assert status == 128 + signal.SIGINT and "compiled" not in log, log[-3000:]
  assert snapshot(out) == before and sorted(os.listdir(out)) == sorted(
      ["checkpoints", "config.yml", "metrics.jsonl"])
  status, log = start_and_signal(out, signal.SIGTERM, "overwrite=true", "model.d_model=32")
  assert status == 128 + signal.SIGTERM, log[-3000:]
  assert snapshot(out) == before and not os.path.exists(out / ".overwritten")
  again = train_cli(out, *SLOW_COMPILE, "train.steps=4", "checkpoint.every=2")
  assert again.returncode == 0 and "resumed from the checkpoint of step 2" in again.stdout


def test_a_failure_before_the_first_step_puts_output_dir_back(reference, tmp_path):
  """Bad input found after the start-up writes (a damaged checkpoint.load_params_from, read
  after the lock and the probes) leaves no new output_dir behind."""
  src = copy_of(reference, tmp_path)
  # Every array file cut short: bytes written into the middle of them hit only the optimizer
  # state in some save layouts (load_params reads the parameters alone), and nothing failed.
  for victim in array_files(os.path.join(src, "checkpoints", "6")):
    with open(victim, "r+b") as f:
      f.truncate(1)
  out = tmp_path / "new"
  # The wording depends on which read meets the damage first (the metadata or an array): the
  # stable part is the kind of error and the step it names.
  with pytest.raises(checkpoint.Damaged, match=re.escape(os.path.join(src, "checkpoints", "6"))):
    quiet_run(str(out), f"checkpoint.load_params_from={src}")
  assert not out.exists()


@pytest.mark.slow
def test_a_second_ctrl_c_does_not_wait_for_the_save(reference, tmp_path):
  """The first Ctrl-C asks for a save and a stop; a second one (a save that hangs) stops at
  once. The step being written is discarded, the earlier ones stay, and a resume ends as the
  uninterrupted run."""
  out = str(tmp_path / "run")
  proc, marker = start(out, pause_at=6)  # holds inside the final save of step 6
  # A second SIGINT counts once Python has run the handler for the first; two that arrive
  # before it runs are one (a loaded machine left 0.5 s between them too short). So Ctrl-C
  # again until the run ends: the save stays held, so an exit at all is one without waiting.
  deadline = time.time() + PROCESS_TIMEOUT_S
  while proc.poll() is None:
    assert time.time() < deadline, "the run did not stop"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
  assert proc.returncode == 128 + signal.SIGINT
  log = open(f"{out}.log").read()
  assert "a second SIGINT: stopped without waiting" in log and "Traceback" not in log
  _, lines = quiet_run(out)
  assert any("resumed from the checkpoint of step 4" in l for l in lines), lines
  assert_same_as(reference, out)
