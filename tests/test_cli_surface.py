"""Every tool's command line behaves the same (issue 27 item 7): `--help` is usage on stdout and
exit 0, an unknown flag one `nanotext: error:` line and exit 2, dashed flag names accepted."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, one_line_error, run_cli
from nanotext.errors import UserError

# Each tool as run, and the words its usage line starts with.
TOOLS = {
    "train": ["nanotext.train"],
    "generate": ["nanotext.generate"],
    "evaluate": ["nanotext.evaluate"],
    "convert": ["nanotext.convert"],
    "convert to-hf": ["nanotext.convert", "to-hf"],
    "convert from-torch": ["nanotext.convert", "from-torch"],
    "verify": ["nanotext.verify"],
    "plot": ["nanotext.plot"],
    "compile": ["nanotext.compile"],
    "data.prepare": ["nanotext.data.prepare"],
    "data.fineweb": ["nanotext.data.fineweb"],
    "data.tokenizer": ["nanotext.data.tokenizer"],
    "data.text_shards": ["nanotext.data.text_shards"],
}


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("flag", ["--help", "-h", "--helpfull"])
def test_help_is_usage_on_stdout_and_exit_0(tool, flag):
  proc = run_cli(*TOOLS[tool], flag, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith(f"usage: python -m {' '.join(TOOLS[tool])}"), proc.stdout
  assert not proc.stderr.strip()


@pytest.mark.parametrize("tool", TOOLS)
def test_unknown_flag_is_one_line_and_exit_2(tool):
  proc = run_cli(*TOOLS[tool], "--no_such_flag=1", timeout=120)
  assert proc.returncode == 2, (proc.stdout, proc.stderr)
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("nanotext: error:"), proc.stderr
  assert "no_such_flag" in lines[0] and "usage: python -m nanotext." in lines[0]
  assert not proc.stdout.strip()


def test_help_lists_the_tools_own_flags():
  out = run_cli("nanotext.compile", "--help").stdout
  assert "--topology" in out and "--min_headroom" in out and "--verbosity" not in out
  train = run_cli("nanotext.train", "--help").stdout
  # --config is refused twice: absl's help of a multi flag said to repeat it
  config_help = train[train.index("--config:"):train.index("--set:")]
  assert "given once" in config_help and "repeat" not in config_help, config_help


@pytest.mark.fast
def test_a_tokenizer_smaller_than_its_bytes_is_refused(tmp_path):
  proc = run_cli("nanotext.data.tokenizer", "--train", "--vocab_size=10",
                 f"--out={tmp_path / 'tok.json'}", timeout=120)
  one_line_error(proc, "--vocab_size=10", "at least 257")
  assert os.listdir(tmp_path) == []


def test_dashed_flag_names():
  """`--vocab-size` is `--vocab_size` for every tool (absl itself knows one spelling)."""
  proc = run_cli("nanotext.data.tokenizer", "--vocab-size=100", "extra", timeout=120)
  assert proc.returncode == 2 and "unexpected arguments: extra" in proc.stderr, proc.stderr


def non_utf8_args(tmp: bytes) -> dict:
  """Each tool given a path (or a prompt) holding a byte that is not UTF-8."""
  bad = tmp + b"/r\xffn"
  return {"train": [b"configs/base.yml", b"output_dir=" + bad],
          "generate": [b"output_dir=" + tmp, b"prompt=KING\xff:"],
          "evaluate": [b"output_dir=" + bad],
          "convert": [b"to-hf", b"--run=" + bad, b"--out=" + tmp + b"/o"],
          "verify": [bad],
          "plot": [bad, b"--out=" + tmp + b"/x.png"],
          "compile": [b"configs/base.yml", b"output_dir=" + bad, b"--topology=v6e-8"],
          "data.prepare": [b"--out=" + bad],
          "data.fineweb": [b"--out=" + bad],
          "data.tokenizer": [b"--train", b"--out=" + bad + b".json"],
          "data.text_shards": [bad + b".txt", b"--out=" + tmp + b"/o"]}


@pytest.mark.parametrize("tool", [t for t in TOOLS if not t.startswith("convert ")])
def test_bytes_that_are_not_utf8_are_one_line_in_every_tool(tool, tmp_path):
  """A Linux path is bytes, but config.yml, metrics.jsonl, the lock and orbax's paths are UTF-8:
  every tool refuses such an argument the same way, before it writes anything (issue 27 item 2;
  an output_dir was a UnicodeEncodeError traceback, a prompt a TypeError)."""
  args = non_utf8_args(os.fsencode(tmp_path))[tool]
  proc = subprocess.run([sys.executable, "-m", *TOOLS[tool], *args], cwd=REPO,
                        capture_output=True, timeout=120)
  stderr = proc.stderr.decode("utf-8", "backslashreplace")
  assert proc.returncode == 2, stderr
  lines = [l for l in stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("nanotext: error:"), stderr
  assert "not UTF-8" in lines[0] and "\\xff" in lines[0]
  assert os.listdir(tmp_path) == []


def bad_configs(tmp) -> dict:
  """Each tool that reads a config, given a mistake in it that only the file and its keys show."""
  run = os.path.join(tmp, "run")
  os.makedirs(run)
  shutil.copy(os.path.join(REPO, "configs", "base.yml"), os.path.join(run, "config.yml"))
  return {"train": ["nanotext.train", "configs/base.yml", "model.num_layerz=2"],
          "compile": ["nanotext.compile", "configs/base.yml", "train.steps=many",
                      "--topology=h100"],
          "generate": ["nanotext.generate", f"output_dir={run}", "max_new_tokens=many"],
          "evaluate": ["nanotext.evaluate", f"output_dir={run}", "train.eval_batches=many"]}


@pytest.mark.fast
@pytest.mark.parametrize("tool", ["train", "compile", "generate", "evaluate"])
def test_a_bad_config_is_refused_before_jax_loads(tool, tmp_path):
  """A typo in a key or a value is one line before the tool imports jax (a second or more of
  start-up): a `jax` package that fails on import, first on the path, is never reached."""
  fake = tmp_path / "fake"
  (fake / "jax").mkdir(parents=True)
  (fake / "jax" / "__init__.py").write_text("raise SystemExit('jax was imported')\n")
  args = bad_configs(str(tmp_path))[tool]
  proc = run_cli(*args, env={"PYTHONPATH": str(fake)}, timeout=120)
  assert proc.returncode == 2, (proc.stdout, proc.stderr)
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("nanotext: error:"), proc.stderr
  assert ("num_layerz" if tool == "train" else "expects an integer") in lines[0]


@pytest.mark.fast
@pytest.mark.parametrize("override,status", [("model.d_model=-1", 2), ("nokey=1", 2),
                                             ("model.d_model=64", 0)])
def test_only_check_args_checks_the_config_and_writes_nothing(override, status, tmp_path):
  """absl's --only_check_args exited 0 before nanotext saw the config: a bad key passed."""
  out = tmp_path / "out"
  proc = run_cli("nanotext.train", os.path.join(REPO, "configs", "base.yml"), override,
                 f"output_dir={out}", "--only_check_args", timeout=120)
  if status:
    one_line_error(proc, override.split("=")[0])
  assert proc.returncode == status and not proc.stdout, (proc.stdout, proc.stderr)
  assert not os.listdir(tmp_path)


@pytest.mark.parametrize("override", ["model.norm=bogus", "model.zero_init_head=true"])
def test_only_check_args_runs_every_sections_rules(override, tmp_path):
  """It checked keys and types only: a value a section's rules refuse passed (a fresh start's
  rules too: base.yml ties the head, which zero_init_head may not be)."""
  proc = run_cli("nanotext.train", os.path.join(REPO, "configs", "base.yml"), override,
                 f"output_dir={tmp_path / 'out'}", "--only_check_args", timeout=120)
  one_line_error(proc, override.split("=")[0])
  assert not proc.stdout and not os.listdir(tmp_path)


@pytest.mark.parametrize("overrides,want", [
    (["seed=7", "overwrite=true", "model.zero_init_head=true"], "model.zero_init_head"),
    (["checkpoint.load_params_from=/nonexistent"], "does not exist"),
    (["output_dir=/proc/nanotext-run"], "kernel file system"),
])
def test_only_check_args_checks_output_dir_as_a_start_does(overrides, want, tmp_path):
  """It passed what a start refuses before its first step (a probe of the new checks): a fresh
  start's rules where overwrite=true replaces a run, a missing parameter source, an output_dir
  no run can use."""
  from nanotext import config
  out = tmp_path / "run"
  base = os.path.join(REPO, "configs", "base.yml")
  if "checkpoint.load_params_from=/nonexistent" not in overrides:  # a run there already
    os.makedirs(out / "checkpoints" / "2")
    config.save(config.load(base, [f"output_dir={out}"]), str(out / "config.yml"))
  before = sorted(os.walk(tmp_path))
  proc = run_cli("nanotext.train", base, f"output_dir={out}", *overrides, "--only_check_args",
                 timeout=120)
  one_line_error(proc, want)
  assert sorted(os.walk(tmp_path)) == before


@pytest.mark.fast
def test_only_check_args_resumes_the_same_run_under_overwrite(tmp_path):
  """overwrite=true on the same run resumes it: the fresh rules and parameter source were
  checked anyway, so a run started from a folder since deleted was refused ("does not exist")
  by the check of a command the start accepts; a changed config still replaces it."""
  from nanotext import config, train
  out, base = tmp_path / "run", os.path.join(REPO, "configs", "base.yml")
  args = [base, f"output_dir={out}", f"checkpoint.load_params_from={tmp_path / 'gone'}",
          "overwrite=true", "model.embed_rows=-1"]
  os.makedirs(out / "checkpoints" / "2")
  saved = config.finalize(config.load(base, args[1:]), mesh_sizes={"fsdp": 8}, data_dir="/d",
                          tokenizer_vocab=200)  # the start's, on its devices and tokenizer
  config.save(saved, str(out / "config.yml"))
  train.check_only(args)
  with pytest.raises(UserError, match="does not exist"):
    train.check_only(args + ["seed=7"])


@pytest.mark.fast
def test_only_check_args_refuses_another_run_or_one_past_steps_without_overwrite(tmp_path):
  """Without overwrite=true a checkpoint there was not judged at all: the check passed a changed
  model and a train.steps below the saved step, both of which the start refuses."""
  from nanotext import config, train
  out, base = tmp_path / "run", os.path.join(REPO, "configs", "base.yml")
  os.makedirs(out / "checkpoints" / "4")
  config.save(config.finalize(config.load(base, [f"output_dir={out}"]), mesh_sizes={"fsdp": 8},
                              data_dir="/d", tokenizer_vocab=None), str(out / "config.yml"))
  before = sorted(os.walk(tmp_path))
  train.check_only([base, f"output_dir={out}"])  # the same run: it resumes
  with pytest.raises(UserError, match="holds a different run"):
    train.check_only([base, f"output_dir={out}", "model.d_model=128"])
  with pytest.raises(UserError, match="past train.steps"):
    train.check_only([base, f"output_dir={out}", "train.steps=2"])
  assert sorted(os.walk(tmp_path)) == before


@pytest.mark.fast
@pytest.mark.parametrize("flag,want", [("--passes=-1", "--passes=-1 must be 0"),
                                       ("--min_headroom=1", "--min_headroom=1.0 must be in"),
                                       ("--json=FOLDER", "cannot write --json"),
                                       ("--hlo_dir=FOLDER/file", "--hlo_dir"),
                                       ("--json=FOLDER/o --hlo_dir=FOLDER/o", "are both"),
                                       # the YAML was replaced by the JSON
                                       ("--json=configs/base.yml", "is the config file it"),
                                       ("XLA_PYTHON_CLIENT_MEM_FRACTION=abc", "must be a number")])
def test_compile_flags_out_of_range_are_one_line_before_jax_loads(flag, want, tmp_path):
  """Flags and the outputs they name (--json a folder, --hlo_dir under a file: found after
  minutes of compiling before), and the GPU pool's variable (the CUDA plugin failed on it with
  'topology not implemented'), are one line before jax loads."""
  (tmp_path / "file").write_text("")
  words = flag.replace("FOLDER", str(tmp_path)).split(" ")
  flags, env = [w for w in words if w.startswith("--")], [w for w in words if "--" not in w]
  fake = tmp_path / "fake"
  (fake / "jax").mkdir(parents=True)
  (fake / "jax" / "__init__.py").write_text("raise SystemExit('jax was imported')\n")
  proc = run_cli("nanotext.compile", "configs/base.yml", "--topology=h100", *flags,
                 env={"PYTHONPATH": str(fake), **dict(e.split("=", 1) for e in env)},
                 timeout=120)
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert proc.returncode == 2 and len(lines) == 1, (proc.stdout, proc.stderr)
  assert lines[0].startswith("nanotext: error:") and want in lines[0], lines[0]


@pytest.mark.fast
@pytest.mark.parametrize("argv,want", [
    (["nanotext.train", "--config=configs/base.yml", "configs/shakespeare.yml"],
     "two config files: --config=configs/base.yml and 'configs/shakespeare.yml'; give one"),
    (["nanotext.train", "--config=configs/base.yml", "--config=configs/shakespeare.yml"],
     "--config is given 2 times"),
    (["nanotext.train", "train.steps=3"], "no config file given"),
    (["nanotext.train", "--config="], "--config is empty"),  # named the working directory
    (["nanotext.compile", "train.steps=3", "--topology=h100"], "no config file given")])
def test_the_config_file_argument_is_one_and_named(argv, want, tmp_path):
  """A second config file was 'not of the form key=value' (given positionally after --config)
  or silently the one used (--config twice); compile without one said the file 'train.steps=3'
  does not exist. Refused before jax loads."""
  fake = tmp_path / "fake"
  (fake / "jax").mkdir(parents=True)
  (fake / "jax" / "__init__.py").write_text("raise SystemExit('jax was imported')\n")
  one_line_error(run_cli(*argv, env={"PYTHONPATH": str(fake)}, timeout=120), want)


@pytest.mark.fast
def test_a_config_path_holding_an_equals_sign_is_the_config(tmp_path):
  """A sweep's folder lr=3e-3: train said 'no config file given' though the file exists."""
  from nanotext import train
  path = tmp_path / "lr=3e-3" / "c.yml"
  path.parent.mkdir()
  shutil.copy(os.path.join(REPO, "configs", "base.yml"), path)
  assert train.parse_args([str(path), "train.steps=3"]) == (str(path), ["train.steps=3"])
  train.precheck([str(path), "train.steps=3"])
  with pytest.raises(UserError, match="config file '.*lr=3e-3/missing.yml' does not exist"):
    train.precheck([str(tmp_path / "lr=3e-3" / "missing.yml")])
  with pytest.raises(UserError, match="no config file given"):
    train.parse_args(["train.steps=3"])


@pytest.mark.fast
def test_importing_train_defines_no_flags():
  """A script that defines its own --config (a flax example's config_flags) and imports
  nanotext.train to call run: DuplicateFlagError at the import."""
  code = ("from absl import flags\nflags.DEFINE_string('config', '', 'mine')\n"
          "import nanotext.train\nprint('imported')")
  proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                        timeout=120)
  assert (proc.returncode, proc.stdout) == (0, "imported\n"), proc.stderr
