"""Writers under limits (issue 27 item 4): a file-size limit (`ulimit -f`) or a full disk in any
writer (orbax checkpoints, safetensors, JSON, TensorBoard, plots, the tokenizer file) is one
`nanotext: error:` line and exit 1, with nothing half-written left where the output goes."""

import io
import json
import os
import resource
import subprocess
import sys

import pytest

from conftest import BASE, PROCESS_TIMEOUT_S, REPO, TINY
from test_faults import assert_one_error_line
from test_plot import fake_run
from nanotext import errors, metrics
from nanotext import fileio

RUN = [BASE, *TINY, "train.steps=2", "train.eval_every=0", "sample.max_new_tokens=0"]


def limited(kib: int, *args):
  """`python -m ARGS` under `ulimit -f KIB` (1 KiB blocks)."""
  cmd = ["bash", "-c", f'ulimit -f {kib} && exec "$0" "$@"', sys.executable, "-m", *args]
  return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A tiny classic GPT-2 run with a checkpoint of step 2 (1.7 MB)."""
  out = str(tmp_path_factory.mktemp("limits") / "run")
  proc = subprocess.run([sys.executable, "-m", "nanotext.train", *RUN, "checkpoint.every=2",
                         f"output_dir={out}"], cwd=REPO, capture_output=True, text=True,
                        timeout=PROCESS_TIMEOUT_S)
  assert proc.returncode == 0, proc.stderr
  return out


@pytest.mark.parametrize("command", ["to-hf", "params-only"])
def test_convert_under_a_file_size_limit(run_dir, tmp_path, command):
  """to-hf was a SafetensorError traceback; both are one line and leave no --out."""
  out = tmp_path / "out"
  assert_one_error_line(limited(64, "nanotext.convert", command, f"--run={run_dir}",
                                f"--out={out}"), 1, str(out), "File too large")
  assert os.listdir(tmp_path) == []


def test_a_checkpoint_under_a_file_size_limit(tmp_path):
  """The save fails: one line, exit 1; its step never loses orbax's temporary name."""
  out = tmp_path / "run"
  proc = limited(64, "nanotext.train", *RUN, "checkpoint.every=2", "metrics.tensorboard=true",
                 f"output_dir={out}")
  assert_one_error_line(proc, 1, "checkpoint", "File too large")
  assert [n for n in os.listdir(out / "checkpoints") if "tmp" not in n] == []


UNREAD_TASK = """
import asyncio, logging
from absl import logging as absl_logging
from nanotext import errors
absl_logging.use_absl_handler()
errors.quiet_background_errors()
log = logging.getLogger("asyncio")
log.error("Task exception was never retrieved\\nfuture: <Task finished coro=<write_fragment() "
          "done, defined at /x/orbax/checkpoint/serialization.py:188>>", exc_info=ValueError("w"))
log.error("Task exception was never retrieved\\nfuture: <Task finished coro=<mine()>>")
def raised_in(path):  # an exception raised in code of that file
  ns = {}
  exec(compile("def read():\\n  raise ValueError('no such array index')\\n", path, "exec"), ns)
  try:
    ns["read"]()
  except ValueError as e:
    return e
for path, name in (("/x/orbax/checkpoint/serialization.py", "theirs"), ("/x/ours.py", "ours")):
  log.error("Future exception was never retrieved\\nfuture: <Future finished exception="
            "ValueError('NOT_FOUND')> %s", name, exc_info=raised_in(path))
# tensorstore's statuses, set on a future from C++: no frame of orbax's or tensorstore's
status = ValueError('FAILED_PRECONDITION: Error reading "a/0.0" in OCDBT database: Truncated')
log.error("Future exception was never retrieved\\nfuture: <Future finished exception=%r> cpp",
          status)
log.error("Task exception was never retrieved\\nfuture: <Task finished coro=<_wrap_awaitable()>"
          " task", exc_info=status)
"""


@pytest.mark.fast
def test_an_unread_orbax_write_task_is_not_logged():
  """When asyncio collects a failed orbax write task nobody awaited (under load, before the run
  has said its one line) its log goes, and so does a future failed in orbax's code (verify
  beside a run rotating steps printed 12-76 lines of them); asyncio's other logs stay."""
  proc = subprocess.run([sys.executable, "-c", UNREAD_TASK], cwd=REPO, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "orbax" not in proc.stderr, proc.stderr
  assert "mine()" in proc.stderr and "> ours" in proc.stderr and "> theirs" not in proc.stderr
  assert "FAILED_PRECONDITION" not in proc.stderr


# A read coroutine in a file under orbax/ (as orbax's _read_array_index_and_device_put) and one
# of ours, both suspended, then dropped: each raises again from its GeneratorExit as Python
# collects it, which Python reports as "Exception ignored in: <coroutine ...>" on stderr.
DROPPED_READS = """
import sys
from nanotext import errors
if sys.argv[1] == "quiet":
  errors.quiet_background_errors()
SRC = (
    "class Pending:\\n"
    "  def __await__(self):\\n"
    "    yield\\n"
    "async def NAME():\\n"
    "  try:\\n"
    "    await Pending()\\n"
    "  except BaseException as e:\\n"
    "    raise Exception('Encountered error while reading array index') from e\\n")
for name, path in (("read_array", "/x/orbax/checkpoint/serialization.py"), ("mine", "/x/mine.py")):
  ns = {}
  exec(compile(SRC.replace("NAME", name), path, "exec"), ns)
  coroutine = ns[name]()
  coroutine.send(None)
  del coroutine
"""


@pytest.mark.fast
def test_a_dropped_orbax_read_is_not_reported():
  """A read that orbax abandoned (another array of a damaged step failed first: verify printed
  its traceback in 1 of 5 runs) goes unreported; any other coroutine's is reported."""
  seen = {}
  for mode in ("quiet", "plain"):
    proc = subprocess.run([sys.executable, "-c", DROPPED_READS, mode], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen[mode] = proc.stderr
  assert "read_array" in seen["plain"] and "mine" in seen["plain"]  # what Python does
  assert "read_array" not in seen["quiet"] and "Exception ignored in" in seen["quiet"]
  assert "mine" in seen["quiet"]


def test_the_tokenizer_file_under_a_file_size_limit(tmp_path):
  out = tmp_path / "tokenizer.json"
  assert_one_error_line(limited(2, "nanotext.data.tokenizer", "--train", "--vocab_size=300",
                                f"--out={out}"), 1, str(out), "File too large")
  assert os.listdir(tmp_path) == []


def test_prepared_shards_under_a_file_size_limit(tmp_path):
  out = tmp_path / "shards"
  assert_one_error_line(limited(64, "nanotext.data.prepare", f"--out={out}"), 1,
                        "File too large")
  assert not os.path.exists(out) or os.listdir(out) == []


@pytest.mark.plots
def test_a_plot_under_a_file_size_limit(tmp_path):
  run = fake_run(tmp_path / "run")
  assert_one_error_line(limited(4, "nanotext.plot", run, f"--out={tmp_path / 'x.png'}"), 1,
                        "File too large")
  assert os.listdir(tmp_path) == ["run"]


@pytest.mark.tpu
def test_compile_json_under_a_file_size_limit(tmp_path):
  out = tmp_path / "programs.jsonl"
  proc = limited(0, "nanotext.compile", BASE, *TINY, "--topology=v6e-8", "--programs=eval",
                 f"--json={out}")
  assert_one_error_line(proc, 1, "--json", "File too large")
  assert os.listdir(tmp_path) == []


LIMITED_WRITER = """
import json, resource, sys
from nanotext import metrics
from nanotext.errors import ResourceError
w = metrics.Writer(sys.argv[1], tensorboard=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))
try:
  for step in range(1, 1000):
    w.write(step, {"loss": 1.0 / step, "lr": 1e-3, "note": "x" * 37})
except ResourceError as e:
  print(e)
w.close()
"""


def test_metrics_and_tensorboard_rows_are_whole_or_absent(tmp_path):
  """A row cut off by the limit is taken back: every line of metrics.jsonl parses, the event
  file holds whole records; the failure is a ResourceError (one line, exit 1) in the caller's
  thread, never a writer thread dying while the run blocks on its queue."""
  proc = subprocess.run([sys.executable, "-c", LIMITED_WRITER, str(tmp_path)], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
  assert "File too large" in proc.stdout and "metrics.jsonl" in proc.stdout
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
  assert len(lines) > 5 and all(l.endswith("\n") and json.loads(l) for l in lines)
  from test_metrics import read_events
  assert len(read_events(str(tmp_path / "tb"))) >= 2 * len(lines) - 2


def test_a_full_disk_is_one_line_and_the_file_as_it_was(tmp_path):
  """ENOSPC (a write to /dev/full) is a ResourceError; what the file held stays."""
  fd = os.open("/dev/full", os.O_WRONLY)
  with pytest.raises(OSError) as e:
    fileio.append_whole(fd, b"row\n")
  os.close(fd)
  assert isinstance(errors.write_error(e.value, "cannot write 'x'"), errors.ResourceError)
  (tmp_path / "run").mkdir()
  os.symlink("/dev/full", tmp_path / "run" / "metrics.jsonl")
  w = metrics.Writer(str(tmp_path / "run"), tensorboard=False)
  with pytest.raises(errors.ResourceError, match="metrics.jsonl.*No space left"):
    w.write(1, {"loss": 1.0})
  w.close()


@pytest.mark.fast
def test_a_full_disk_under_stdout_names_standard_output(monkeypatch):
  """`verify DIR > log` on a full disk said "cannot write 'a file'": the failed print is
  stdout's, which now says so; an unnamed write elsewhere still says 'a file'."""
  full = open("/dev/full", "w")
  monkeypatch.setattr(sys, "stdout", full)
  full.write("a report line\n")  # buffered: the failed flush leaves it there
  with pytest.raises(OSError) as e:
    full.flush()
  line, status = errors.explain(e.value)
  assert status == 1 and line.startswith(
      "cannot write 'standard output': No space left on device; free some space"), line
  null = os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, full.fileno())  # the stuck bytes go
  os.close(null)
  assert errors.explain(OSError(28, "No space left on device"))[0].startswith(
      "cannot write 'a file'")
  full.close()


@pytest.mark.fast
def test_stdout_at_the_file_size_limit_unbuffered_names_standard_output(monkeypatch, tmp_path):
  """PYTHONUNBUFFERED (as in many containers): a failed print leaves nothing to flush again,
  and `> log` past `ulimit -f` still said 'a file'."""
  log = open(tmp_path / "log", "wb", buffering=0)
  monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(log, write_through=True))
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
  try:
    with pytest.raises(OSError) as e:
      for _ in range(3):  # the first fills the file to the limit, the next fails
        print("x" * 1000, flush=True)
    line, status = errors.explain(e.value)
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    log.close()
  assert status == 1 and line.startswith("cannot write 'standard output': File too large"), line


def test_library_errors_that_name_an_errno():
  """tensorstore, safetensors and tokenizers name the errno in their own words."""
  for text in ("OUT_OF_RANGE: Failed to write 361710 bytes to file 7: File too large "
               "[os_error_code='27']", "Error while serializing: I/O error: File too large "
               "(os error 27)", "No space left on device (os error 28)"):
    assert isinstance(errors.write_error(ValueError(text), "w"), errors.ResourceError), text
  assert errors.write_error(ValueError("shapes differ"), "w") is None
