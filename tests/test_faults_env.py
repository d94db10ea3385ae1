"""The environment a tool runs in (issue 27 item 1): JAX_PLATFORMS naming a backend the machine
lacks, a flag in XLA_FLAGS that XLA does not know, an address-space limit too small for jax.
Each is one `nanotext: error:` line naming the variable or the limit, exit 2 for bad input and
1 for a resource, and nothing created in output_dir (no lock left behind)."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import BASE, PROCESS_TIMEOUT_S, REPO, TINY
from test_faults import assert_one_error_line
from nanotext import cli, errors, xla_flags

pytestmark = pytest.mark.fast  # one-line errors of tiny programs: seconds


def tool(name, out):
  """The command line of a tool that starts jax, aimed at `out` (which need not exist)."""
  return {"train": ["nanotext.train", BASE, *TINY, f"output_dir={out}"],
          "generate": ["nanotext.generate", f"output_dir={out}"],
          "verify": ["nanotext.verify", str(out)],
          "convert": ["nanotext.convert", "params-only", f"--run={out}", f"--out={out}.p"],
          "compile": ["nanotext.compile", BASE, *TINY, "--topology=v6e-8"]}[name]


def aimed(name, tmp_path) -> tuple:
  """(command line, files under tmp_path before it runs). generate checks the run's config.yml
  before the environment (its arguments are read before jax loads): it gets a run folder with
  one, so the environment is what it refuses."""
  out = tmp_path / "run"
  if name == "generate":
    out.mkdir()
    shutil.copy(BASE, out / "config.yml")
  return tool(name, out), files(tmp_path)


def files(folder) -> list:
  """Every folder and file under `folder`, as relative paths."""
  return sorted(os.path.relpath(os.path.join(d, name), folder)
                for d, dirs, names in os.walk(folder) for name in dirs + names)


def cli_run(args, env=None, shell=""):
  cmd = [sys.executable, "-m", *args]
  if shell:
    cmd = ["bash", "-c", f'{shell} && exec "$0" "$@"', *cmd]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S,
                        env=dict(os.environ, **(env or {})))


TOOLS = ["train", "generate", "verify", "convert", "compile"]


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", TOOLS[:4])
def test_jax_platforms_naming_a_missing_backend(tmp_path, name, platform):
  if cli.present(platform):
    pytest.skip(f"this machine has a {platform} device")
  args, before = aimed(name, tmp_path)
  proc = cli_run(args, env={"JAX_PLATFORMS": platform})
  assert_one_error_line(proc, 2, f"JAX_PLATFORMS={platform}")
  assert files(tmp_path) == before


def test_jax_platforms_naming_no_backend_at_all(tmp_path):
  """A name jax does not know: jax's own RuntimeError, said in one line."""
  proc = cli_run(tool("train", tmp_path / "run"), env={"JAX_PLATFORMS": "nosuchdevice"})
  assert_one_error_line(proc, 2, "JAX_PLATFORMS=nosuchdevice")
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", TOOLS)
def test_an_unknown_flag_in_xla_flags(tmp_path, name):
  """XLA aborts the process on it (its own fatal line, exit 1): checked before jax starts."""
  flags = os.environ["XLA_FLAGS"] + " --xla_no_such_flag=1"
  args, before = aimed(name, tmp_path)
  proc = cli_run(args, env={"XLA_FLAGS": flags})
  assert_one_error_line(proc, 2, "XLA_FLAGS", "--xla_no_such_flag")
  assert files(tmp_path) == before


@pytest.mark.parametrize("flags,why", [
    ("--xla_force_host_platform_device_count=abc", "must be a positive whole number"),
    ("--xla_force_host_platform_device_count=0", "must be a positive whole number"),
    ("xla_force_host_platform_device_count=8", "does not start with --")])
def test_a_malformed_xla_flag(tmp_path, flags, why):
  """XLA aborted on these (its 94-line flag list, exit 1; a count of 0: 'set JAX_PLATFORMS=cpu',
  on the CPU already): one line naming what to change."""
  proc = cli_run(tool("train", tmp_path / "run"), env={"XLA_FLAGS": flags})
  assert_one_error_line(proc, 2, "XLA_FLAGS", why)
  assert os.listdir(tmp_path) == []
  assert xla_flags.malformed({"XLA_FLAGS": os.environ["XLA_FLAGS"]}) == ""


def test_known_xla_flags_pass():
  assert xla_flags.unknown_flags({"XLA_FLAGS": os.environ["XLA_FLAGS"]}) == []
  assert xla_flags.unknown_flags({"XLA_FLAGS": " ".join(xla_flags.CPU_FLAGS)}) == []
  assert xla_flags.unknown_flags({}) == []


@pytest.mark.parametrize("name", ["train", "generate"])
def test_a_small_address_space_limit(tmp_path, name):
  """`ulimit -v` of 1.5 GiB: XLA aborted in pthread_create with a thread dump and left the
  lock. Refused up front: a resource, exit 1."""
  args, before = aimed(name, tmp_path)
  proc = cli_run(args, shell="ulimit -v 1500000")
  assert_one_error_line(proc, 1, "ulimit -v 1500000")
  assert files(tmp_path) == before


def test_a_thread_refused_under_the_limit_is_one_line(monkeypatch):
  """Above the floor, what Python sees refused (a thread, an allocation) is one line too."""
  monkeypatch.setattr(errors.resource, "getrlimit", lambda _: (3 * 2**30, 3 * 2**30))
  assert "ulimit -v 3145728" in errors.limit_error(RuntimeError("can't start new thread"))
  assert "ulimit -v" in errors.limit_error(MemoryError())
  assert errors.limit_error(RuntimeError("something else")) == ""
  monkeypatch.setattr(errors.resource, "getrlimit", lambda _: (-1, -1))
  assert errors.limit_error(MemoryError()) == ""


@pytest.mark.parametrize("name", ["train", "evaluate"])
def test_jax_disable_jit_is_refused_by_the_tools_that_compile_ahead_of_time(tmp_path, name):
  """JAX_DISABLE_JIT=1 (a debugging switch left set): train compiled, then died at its first
  step with 'Disable jit is not supported in the AOT path' (a bug, exit 1), leaving a fresh
  output_dir that a later start with another config took for another run."""
  out = tmp_path / "run"
  args = tool(name, out) if name == "train" else ["nanotext.evaluate", f"output_dir={out}"]
  if name == "evaluate":  # a run with a step, so evaluate's own checks pass before jax's
    (out / "checkpoints" / "2").mkdir(parents=True)
    shutil.copy(BASE, out / "config.yml")
  before = files(tmp_path)
  proc = cli_run(args, env={"JAX_DISABLE_JIT": "1"})
  assert_one_error_line(proc, 2, "JAX_DISABLE_JIT=1", "unset JAX_DISABLE_JIT")
  assert files(tmp_path) == before


def test_jax_disable_jit_is_read_as_jax_reads_it():
  """The tools that only read and run jitted code eagerly (verify, convert, generate) go on;
  a value jax cannot read made its import raise in every tool."""
  for value in ("1", "True", "on"):
    cli.check_environment({"JAX_DISABLE_JIT": value})
    with pytest.raises(errors.UserError, match=f"JAX_DISABLE_JIT={value}: this tool compiles"):
      cli.check_environment({"JAX_DISABLE_JIT": value}, aot=True)
  cli.check_environment({"JAX_DISABLE_JIT": "0"}, aot=True)
  for value in ("", "maybe"):
    with pytest.raises(errors.UserError, match=f"JAX_DISABLE_JIT='{value}' is not a value jax"):
      cli.check_environment({"JAX_DISABLE_JIT": value})


@pytest.mark.parametrize("args", [
    ["nanotext.train", BASE, *TINY, "output_dir=run"],
    ["nanotext.train", os.path.relpath(BASE, REPO), *TINY, "output_dir=/nonexistent/run"],
    ["nanotext.verify", "run"],
    ["nanotext.convert", "params-only", "--run=run", "--out=p"]],
    ids=["train-output_dir", "train-config", "verify", "convert"])
def test_a_relative_path_from_a_deleted_working_directory_is_one_line(tmp_path, args):
  """A shell left in a folder since deleted: a relative path raised 'unexpected
  FileNotFoundError (a bug)' from os.path.abspath, or a config file 'did not exist'."""
  gone = tmp_path / "gone"
  # absolute: Python itself cannot start (a fatal error in getpath) with a relative entry there
  paths = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  env = {"PYTHONPATH": os.pathsep.join([REPO] + paths)}
  proc = cli_run(args, env=env, shell=f"mkdir '{gone}' && cd '{gone}' && rmdir '{gone}'")
  assert_one_error_line(proc, 2, "the working directory was deleted")
  assert os.listdir(tmp_path) == []


@pytest.mark.skipif(any(cli.present(p) or cli.device_nodes(p) for p in cli.ACCELERATORS),
                    reason="this machine has an accelerator: jax chooses among its plugins")
def test_no_accelerator_starts_the_cpu_without_plugin_noise():
  """JAX_PLATFORMS unset on a machine with no accelerator: the CPU backend, and none of the
  installed plugins' failures (the CUDA plugin's traceback without cuDNN, libtpu's warnings)."""
  script = ("import os; from nanotext import cli; cli.check_environment(os.environ); "
            "import jax; print(jax.devices()[0].platform)")
  env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
  proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                        timeout=PROCESS_TIMEOUT_S, env=env)
  assert proc.returncode == 0 and proc.stdout.strip() == "cpu", proc.stderr
  assert "Traceback" not in proc.stderr and "TPU_" not in proc.stderr, proc.stderr
