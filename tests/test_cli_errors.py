"""Bad input: exit status 2, one `nanotext: error:` line, no traceback, and nothing in an
existing output_dir touched. A few cases run the real CLIs for that contract (`train_cli`, the
generate and flag cases); the rest are the same errors raised in-process (`train`), where the
CLI's part (turning a UserError into that line and status) is the same for every one."""

import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

from conftest import BASE, REPO, TINY, run_cli
from nanotext.data import binfile
from nanotext.errors import UserError
from nanotext.train import run


def snapshot(root) -> dict:
  """Relative path -> (mtime, contents) of every file under `root`."""
  out = {}
  for dirpath, _, files in os.walk(root):
    for name in files:
      p = os.path.join(dirpath, name)
      with open(p, "rb") as f:
        out[os.path.relpath(p, root)] = (os.stat(p).st_mtime_ns, f.read())
  return out


def expect_error(result, *needles) -> str:
  """Assert a clean user error (a CLI's CompletedProcess, or a UserError raised in-process);
  returns its line."""
  if isinstance(result, UserError):
    line = str(result)
    assert "\n" not in line, line
    for needle in needles:
      assert needle in line, line
    return line
  assert result.returncode == 2, result.stderr
  assert "Traceback" not in result.stderr
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  last = lines[-1]
  assert last.startswith("nanotext: error:"), result.stderr
  for needle in needles:
    assert needle in last
  return last


@pytest.fixture
def out(tmp_path):
  """An existing output_dir holding one file."""
  d = tmp_path / "run"
  d.mkdir()
  (d / "notes.txt").write_text("keep me")
  return d


def train_cli(out, *args):
  """Run the trainer's CLI on `args` into `out`; asserts it left `out` untouched."""
  before = snapshot(out)
  result = run_cli("nanotext.train", *args, f"output_dir={out}")
  assert snapshot(out) == before
  return result


def train(out, config, *overrides) -> UserError:
  """The UserError `train.run` raises in-process for `overrides` into `out`; asserts it left
  `out` untouched."""
  before = snapshot(out)
  with pytest.raises(UserError) as e:
    run(config, [*overrides, f"output_dir={out}"], log=lambda line: None)
  assert snapshot(out) == before
  return e.value


@pytest.mark.fast
def test_unknown_key(out):
  expect_error(train_cli(out, BASE, *TINY, "train.step=5"), "'train.step'", "'train.steps'")


@pytest.mark.fast
def test_wrong_type(out):
  expect_error(train(out, BASE, *TINY, "train.steps=ten"), "'train.steps'", "'ten'", "integer")


@pytest.mark.fast
def test_missing_config_file(out, tmp_path):
  missing = str(tmp_path / "nope.yml")
  expect_error(train(out, missing, *TINY), missing)


@pytest.mark.fast
@pytest.mark.parametrize("key", ["train.steps", "train.batch_size", "train.seq_len"])
def test_non_positive(out, key):
  expect_error(train(out, BASE, *TINY, f"{key}={-1 if key == 'train.steps' else 0}"),
               key, "positive")


@pytest.mark.fast
def test_batch_not_divisible_by_devices(out):
  assert "--xla_force_host_platform_device_count=8" in os.environ["XLA_FLAGS"]
  expect_error(train(out, BASE, *TINY, "train.batch_size=6"),
               "train.batch_size=6", "mesh.fsdp", "=8")


@pytest.mark.fast
def test_vocab_smaller_than_tokenizer(out):
  expect_error(train(out, BASE, *TINY, "data.source=shakespeare", "data.tokenizer=shakespeare",
                     "model.vocab_size=512"), "model.vocab_size=512", "8192")


def corrupt(path, word, value):
  header = np.memmap(path, dtype="<i4", mode="r+", shape=(binfile.HEADER_WORDS,))
  header[word] = value
  header.flush()
  del header


@pytest.mark.fast
@pytest.mark.parametrize("word,value,needle", [(0, 1234, "magic"), (1, 7, "version"),
                                               (2, 5000, "claims 5000 tokens")])
def test_bad_bin_shard(out, tmp_path, word, value, needle):
  path = str(tmp_path / "shard.bin")
  binfile.write_shard(path, np.arange(1000) % 512)
  corrupt(path, word, value)
  expect_error(train(out, BASE, *TINY, "data.source=bin", f"data.train_files={path}",
                     f"data.val_files={path}", "data.tokenizer=none"), path, needle)


@pytest.mark.fast
def test_data_path_matches_nothing(out):
  expect_error(train(out, BASE, *TINY, "data.source=bin", "data.train_files=/nonexistent/*.bin",
                     "data.val_files=/nonexistent/*.bin"),
               "/nonexistent/*.bin", "data.train_files")


def test_output_dir_of_another_run(tmp_path):
  out = tmp_path / "run"
  # conftest's tiny_run: its programs, compiled once in this worker, are in the compile cache
  args = [*TINY, "train.steps=2", "train.eval_every=0", "sample.max_new_tokens=0",
          f"output_dir={out}"]
  run(BASE, args, log=lambda line: None)
  before = snapshot(out)
  assert "config.yml" in before and "metrics.jsonl" in before
  expect_error(train(out, BASE, *args, "seed=1"), str(out), "overwrite", "seed")
  assert snapshot(out) == before
  lines = []
  run(BASE, args, log=lines.append)  # the same run: resumes from its checkpoint
  assert "resumed from the checkpoint of step 2" in "\n".join(lines)
  run(BASE, [*args, "seed=1", "overwrite=true"], log=lambda line: None)
  with open(out / "config.yml") as f:
    assert yaml.safe_load(f)["seed"] == 1


@pytest.mark.fast
def test_bad_flag():
  result = run_cli("nanotext.train", BASE, "--no_such_flag")
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("nanotext: error: Unknown command line flag "
                                                 "'no_such_flag'; usage:")


@pytest.mark.fast
def test_no_config_argument():
  expect_error(run_cli("nanotext.train"), "no config file")
  expect_error(run_cli("nanotext.train", "train.steps=2"), "no config file")


@pytest.mark.fast
def test_generate_without_output_dir():
  expect_error(run_cli("nanotext.generate", "prompt=hi"), "output_dir is required")


@pytest.mark.fast
def test_generate_output_dir_without_config(out):
  before = snapshot(out)
  expect_error(run_cli("nanotext.generate", f"output_dir={out}"), str(out), "config.yml")
  assert snapshot(out) == before


@pytest.mark.fast
def test_generate_num_samples_out_of_range_is_refused_before_jax(out):
  """num_samples outside 1..1000, or seeds (sample.seed + i for sample i) past 64 bits."""
  from nanotext import config, generate
  from nanotext.errors import UserError
  config.save(config.load(BASE, TINY), str(out / "config.yml"))
  for args, needle in ((["num_samples=0"], "between 1 and 1000"),
                       (["num_samples=1001"], "between 1 and 1000"),
                       (["num_samples=2", f"seed={2**63 - 1}"], "give a smaller seed")):
    with pytest.raises(UserError, match=needle):
      generate.precheck([f"output_dir={out}", *args])
  generate.precheck([f"output_dir={out}", "num_samples=2", f"seed={2**63 - 2}"])


@pytest.mark.fast
def test_checkpoints_is_a_file(out):
  (out / "checkpoints").write_text("not a folder")
  expect_error(train(out, BASE, *TINY), "checkpoints' exists and is not a directory")


@pytest.mark.fast
def test_damaged_config_yml_in_output_dir(out):
  (out / "config.yml").write_bytes(b"model: [\xff\x00")
  expect_error(train(out, BASE, *TINY), "config.yml' is damaged", "overwrite=true")


@pytest.mark.fast
def test_duplicate_keys_and_nan_rates(out, tmp_path):
  cfg = tmp_path / "dup.yml"
  cfg.write_text(f"base: {BASE}\ntrain:\n  steps: 3\ntrain:\n  steps: 200\n")
  expect_error(train(out, str(cfg), *TINY), "duplicate key 'train'")
  expect_error(train(out, BASE, *TINY, "optim.lr=nan"), "optim.lr", "finite")


def test_device_out_of_memory_is_one_line_and_status_1():
  """XLA's RESOURCE_EXHAUSTED (a run too big for its devices) is a failed run, said in one line
  that names the keys that lower memory; other failures of XLA's runtime are one line too."""
  raise_in_run = ("import sys, jax, nanotext.train as t\n"
                  "def run(*a, **k):\n"
                  "  raise jax.errors.JaxRuntimeError(sys.argv[1])\n"
                  "t.run = run\n"
                  "t.cli.run(t.main, t.USAGE, argv=['train', 'configs/base.yml'], jax=True)\n")
  go = lambda msg: subprocess.run([sys.executable, "-c", raise_in_run, msg], cwd=REPO,
                                  capture_output=True, text=True, timeout=120)
  proc = go("RESOURCE_EXHAUSTED: Out of memory allocating 38730384176 bytes.")
  assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
  lines = [l for l in proc.stderr.splitlines() if l.startswith("nanotext: error:")]
  assert len(lines) == 1 and "ran out of memory (Out of memory allocating 38730384176" in lines[0]
  assert "model.remat=dots" in lines[0] and "nanotext.compile" in lines[0]
  other = go("INTERNAL: YNNPACK operation failed")  # another failure of XLA's runtime: one line
  assert other.returncode == 1 and "Traceback" not in other.stderr, other.stderr
  assert other.stderr.strip().splitlines()[-1] == ("nanotext: error: XLA failed while running "
                                                   "a program: INTERNAL: YNNPACK operation failed")


@pytest.mark.fast
def test_shared_memory_past_the_gpus_is_not_the_device_out_of_memory():
  """Triton's RESOURCE_EXHAUSTED for a kernel's tiles past a block's shared memory was told as
  the device out of memory, advising remat, loss chunks and accumulation, which change nothing
  there: it names the attention kernel to change."""
  import jax
  from nanotext.train import out_of_memory
  line = out_of_memory(jax.errors.JaxRuntimeError(
      "RESOURCE_EXHAUSTED: Shared memory size limit exceeded: requested 278528, available: "
      "232448, context: []"))
  assert "shared memory (Shared memory size limit exceeded: requested 278528" in line
  assert "attention.impl=blocked" in line and "ran out of memory" not in line
  assert "model.remat" not in line
  assert "ran out of memory" in out_of_memory(jax.errors.JaxRuntimeError(
      "RESOURCE_EXHAUSTED: Out of memory allocating 38730384176 bytes."))


def test_a_leading_tilde_is_home_in_every_path_argument(tmp_path, monkeypatch):
  """Only output_dir expanded '~' (and the shell, where it did): --run=~/run, verify '~/run' and
  checkpoint.load_params_from=~/run said 'does not exist', and --out=~/po wrote a folder named
  '~' in the working directory."""
  from nanotext import config, evaluate, verify
  home, cwd = tmp_path / "home", tmp_path / "cwd"
  home.mkdir(), cwd.mkdir()
  (home / "afile").write_text("x")
  monkeypatch.setenv("HOME", str(home))
  monkeypatch.chdir(cwd)
  cli = lambda *a: subprocess.run([sys.executable, "-m", "nanotext.convert", *a], cwd=cwd,
                                  capture_output=True, text=True, timeout=120,
                                  env=dict(os.environ, PYTHONPATH=REPO))
  for proc, needle in [(cli("to-hf", "--run=~/gone", "--out=~/afile"),
                        f"--out '{home}/afile' is a file"),
                       (cli("params-only", "--run=~/gone", "--out=~/po"),
                        f"--run '{home}/gone' does not exist")]:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr
  with pytest.raises(UserError, match=f"'{home}/gone' "):
    verify.main(["~/gone"])
  with pytest.raises(UserError, match=f"output_dir '{home}/gone' does not"):
    evaluate.parse(["output_dir=~/gone"])
  assert os.listdir(cwd) == [] and sorted(os.listdir(home)) == ["afile"]
  cfg = config.load(BASE, ["output_dir=~/run", "checkpoint.load_params_from=~/src",
                           "profile.dir=~/trace"])  # the trace went into a folder named '~'
  assert (cfg.output_dir, cfg.checkpoint.load_params_from, cfg.profile.dir) == \
      (f"{home}/run", f"{home}/src", f"{home}/trace")
