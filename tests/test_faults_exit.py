"""Every process ends (issue 27 items 5 and 6): an error ends it promptly with one line whatever
threads are still running, and a signal before the first step stops it even while its main
thread is inside a long call that does not return to Python."""

import io
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import BASE, PROCESS_TIMEOUT_S, REPO, TINY
from nanotext import errors, signals

# A tool whose main leaves a non-daemon thread running (as orbax, grain or a metrics writer
# can), then fails as argv[1] says. Python's shutdown would join that thread for ever.
TOOL = """
import sys, threading
from nanotext import cli, errors
def main(args):
  threading.Thread(target=threading.Event().wait, name="stuck", daemon=False).start()
  kind = sys.argv[1]
  if kind == "user":
    raise errors.UserError("bad input")
  if kind == "resource":
    raise OSError(28, "No space left on device", "/x/metrics.jsonl")
  if kind == "xla":
    raise type("JaxRuntimeError", (RuntimeError,), {})("INTERNAL: YNNPACK operation failed")
  if kind == "pipe":  # stdout's reader has exited (the test closed it): `| head`
    for i in range(100000):
      print("line", i, flush=True)
  if kind == "socket":  # a broken pipe that is not stdout's is a bug like any other
    raise BrokenPipeError(32, "Broken pipe")
  raise ZeroDivisionError("a bug")
cli.run(main, "usage: tool", argv=["tool"])
"""

pytestmark = pytest.mark.fast  # one-line errors of tiny programs: seconds


@pytest.mark.parametrize("kind,status,needle", [
    ("user", 2, "bad input"), ("resource", 1, "No space left on device"),
    ("xla", 1, "XLA failed while running a program: INTERNAL: YNNPACK"),
    ("bug", 1, "unexpected ZeroDivisionError: a bug"),
    ("socket", 1, "unexpected BrokenPipeError")])
def test_an_error_ends_the_process_with_a_live_thread(kind, status, needle):
  proc = subprocess.run([sys.executable, "-c", TOOL, kind], cwd=REPO, capture_output=True,
                        text=True, timeout=60)  # a process that outlives its error times out
  assert proc.returncode == status, proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("nanotext: error:") and needle in last, proc.stderr
  assert ("Traceback" in proc.stderr) == (kind in ("bug", "socket"))  # a bug keeps its place


def widowed_pipe():
  """The write end of a pipe whose reader has already gone, as stdout for a process."""
  read, write = os.pipe()
  os.close(read)
  return write


def widowed_socket():
  """A stream socket whose reader shut it down after reading all it was sent (a journal that
  restarted): POLLHUP, not a pipe's POLLERR, and writes fail with EPIPE."""
  ours, theirs = socket.socketpair()
  theirs.shutdown(socket.SHUT_RDWR)
  theirs.close()
  return ours.detach()


@pytest.mark.parametrize("widowed", [widowed_pipe, widowed_socket])
def test_a_closed_stdout_ends_a_tool_quietly(widowed):
  """`tool | head`: once head has read its lines, the tool stops with 141 (as a tool that
  SIGPIPE ends) and prints nothing, no traceback."""
  write = widowed()
  try:
    proc = subprocess.run([sys.executable, "-c", TOOL, "pipe"], cwd=REPO, stdout=write,
                          stderr=subprocess.PIPE, text=True, timeout=60)
  finally:
    os.close(write)
  assert proc.returncode == 141 and proc.stderr == "", proc.stderr


class Unread(io.StringIO):
  """A stdout on file descriptor `fd` whose next write fails with `error` (its reader gone)."""

  def __init__(self, fd: int, error: OSError):
    super().__init__()
    self.fd, self.error = fd, error

  def fileno(self):
    return self.fd

  def write(self, text):
    if self.error:
      error, self.error = self.error, None
      raise error
    return super().write(text)


@pytest.mark.parametrize("error", [BrokenPipeError(32, "Broken pipe"),
                                   ConnectionResetError(104, "Connection reset by peer")])
def test_training_goes_on_when_its_stdout_socket_has_no_reader(monkeypatch, error):
  """`train` under systemd, stdout a journal's socket, the journal restarted: EPIPE (it had read
  all), ECONNRESET (it left lines unread); the run died unsaved with 'unexpected
  BrokenPipeError' where a pipe's reader leaving lets it go on."""
  fd = widowed_socket()
  stderr = io.StringIO()
  monkeypatch.setattr(sys, "stdout", Unread(fd, error))
  monkeypatch.setattr(sys, "stderr", stderr)
  try:
    errors.print_log("step 1")
    errors.print_log("step 2")
    assert os.path.samestat(os.fstat(fd), os.stat(os.devnull))  # the rest goes nowhere
  finally:
    os.close(fd)
  assert stderr.getvalue().count("stdout was closed; training goes on") == 1, stderr.getvalue()


def test_training_goes_on_when_its_stdout_file_cannot_be_written(monkeypatch):
  """`train ... > log` with the log's disk full (output_dir on another with room): the run died
  at its next line, unsaved, its log in metrics.jsonl all the same; it goes on, saying once on
  stderr that standard output cannot be written, and why."""
  stderr = io.StringIO()
  with open("/dev/full", "w") as full:  # every write: ENOSPC
    monkeypatch.setattr(sys, "stdout", full)
    monkeypatch.setattr(sys, "stderr", stderr)
    errors.print_log("step 1")
    errors.print_log("step 2")
    assert os.path.samestat(os.fstat(full.fileno()), os.stat(os.devnull))
  assert stderr.getvalue().splitlines() == [
      "nanotext: cannot write standard output (No space left on device); training goes on, "
      "its log in the run's metrics.jsonl"]


def raise_exit(status):
  raise SystemExit(status)


@pytest.mark.parametrize("ending", ["refusal", "signal"])
def test_an_end_with_stdout_closed_keeps_its_line_and_status(monkeypatch, capfd, ending):
  """`verify /nonexistent >&-` (Python's sys.stdout is None): the refusal's line came out, then
  AttributeError: 'NoneType' object has no attribute 'flush', exit 1 for 2; a signal after a
  run's work (signals._end) killed the watching thread instead, the signal unheeded."""
  monkeypatch.setattr(sys, "stdout", None)
  monkeypatch.setattr(os, "_exit", raise_exit)  # the process stays: the test's own
  with pytest.raises(SystemExit) as e:
    if ending == "refusal":
      errors.fail("bad input")
    else:
      signals._end(signal.SIGTERM, "received {}: saved")
  out, err = capfd.readouterr()
  if ending == "refusal":
    assert e.value.code == 2 and err == "nanotext: error: bad input\n", err
  else:
    assert e.value.code == 0 and out == "received SIGTERM: saved\n", out


# A tool started with its standard streams closed (`>&- 2>&- <&-`, a daemon): it opens argv[1],
# writes to fd 2 as the signal lines do, and to stderr, then says which fd the file had.
CLOSED = """
import sys
from nanotext import cli, signals
def main(args):
  with open(sys.argv[1], "w") as f:
    signals.say(2, "a signal's line")
    print("an error line", file=sys.stderr, flush=True)
    f.write(f"fd {f.fileno()}")
cli.run(main, "usage: tool", argv=["tool"])
"""


@pytest.mark.parametrize("closed", [">&- 2>&- <&-", "2>&-"])
def test_a_tool_started_with_its_standard_streams_closed_writes_none_into_its_files(tmp_path,
                                                                                    closed):
  """All three closed: the signal pipe took fds 0 and 1 and the run's metrics.jsonl fd 2, where
  SIGHUP's line (signals.say(2, ...)) and watch's stop line were written: a row that is not
  JSON. stderr alone closed: its error lines went to stdout (print's file=None)."""
  marker = tmp_path / "file"
  proc = subprocess.run(["bash", "-c", f'exec "$0" -c "$1" "$2" {closed}', sys.executable,
                         CLOSED, str(marker)], cwd=REPO, capture_output=True, text=True,
                        timeout=60)
  assert proc.returncode == 0 and proc.stdout == "", proc.stdout
  fd = marker.read_text()
  assert fd.startswith("fd ") and int(fd[3:]) > 2, fd


def test_text_the_standard_streams_cannot_encode_is_escaped(monkeypatch):
  """PYTHONIOENCODING=ascii and a run in runs/ü: the resume's first line raised
  UnicodeEncodeError, a traceback and exit 1 (generate: with a non-ASCII prompt)."""
  streams = {name: io.TextIOWrapper(io.BytesIO(), encoding="ascii") for name in ("out", "err")}
  monkeypatch.setattr(sys, "stdout", streams["out"])
  monkeypatch.setattr(sys, "stderr", streams["err"])
  errors.open_standard_streams()
  print("resumed runs/ü", flush=True)
  print("nanotext: error: runs/ü", file=sys.stderr, flush=True)
  assert streams["out"].buffer.getvalue() == b"resumed runs/\\xfc\n"
  assert streams["err"].buffer.getvalue() == b"nanotext: error: runs/\\xfc\n"


def test_help_into_a_closed_stdout_is_quiet():
  """`compile --help | true`: the help was printed before the tools' pipe handling and came out
  as a BrokenPipeError traceback, exit 1."""
  write = widowed_pipe()
  try:
    proc = subprocess.run([sys.executable, "-m", "nanotext.verify", "--help"], cwd=REPO,
                          stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
  finally:
    os.close(write)
  assert proc.returncode == 141 and proc.stderr == "", proc.stderr


# A tool whose main thread is inside a call that does not return to Python (as in an XLA
# compile or backend start on a loaded machine): signals blocked there, then a long sleep.
STUCK = """
import os, signal, sys, time
from nanotext import cli, signals
# "stuck": the test waits out the grace period, so a short one; "python": the handler unwinds as
# soon as the main thread runs, and a loaded machine may take more than a second to schedule it.
signals.GRACE_S = 0.5 if sys.argv[1] == "stuck" else 60
def main(args):
  if sys.argv[1] == "stuck":
    signal.pthread_sigmask(signal.SIG_BLOCK, signals.SIGNALS)
  open(sys.argv[2], "w").close()
  time.sleep(600)
cli.run(main, "usage: tool", argv=["tool"])
"""


def signalled(script, args, signum, marker, env=None, stderr=subprocess.PIPE):
  """Start `python -c script *args`, wait for `marker`, send `signum`; the finished process."""
  proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=stderr,
                          env=dict(os.environ, **(env or {})))
  deadline = time.time() + PROCESS_TIMEOUT_S
  while not os.path.exists(marker):
    assert proc.poll() is None and time.time() < deadline, str(proc.communicate()[1])[-3000:]
    time.sleep(0.05)
  proc.send_signal(signum)
  try:
    out, err = proc.communicate(timeout=120)  # a process that ignores the signal times out
  finally:
    proc.kill()  # none left behind by a failure
  return proc.returncode, out, err


@pytest.mark.parametrize("signum,message", [(signal.SIGTERM, "stopped by SIGTERM"),
                                            (signal.SIGINT, "interrupted")])
def test_a_signal_in_python_code_unwinds_and_is_one_line(tmp_path, signum, message):
  status, _, err = signalled(STUCK, ["python", str(tmp_path / "m")], signum, tmp_path / "m")
  assert status == 128 + signum and "Traceback" not in err, err
  assert err.strip().splitlines() == [f"nanotext: error: {message}"]


# A tool at its start (signals.at_once): a signal ends it from the watching thread at once.
AT_ONCE = """
import sys, time
from nanotext import cli
def main(args):
  open(sys.argv[1], "w").close()
  time.sleep(600)
cli.run(main, "usage: tool", argv=["tool"], at_once="stopped by {}")
"""


@pytest.mark.parametrize("script", ["stuck", "at once", "train"])
def test_a_signal_ends_the_process_when_stderr_cannot_take_its_line(tmp_path, script):
  """stderr on a full disk (or a pipe whose reader left): writing the line failed, the watching
  thread died with it, and the signal was lost (a run trained on to its end) or hung the run."""
  marker = tmp_path / "m"
  program, args = {"stuck": (STUCK, ["stuck", str(marker)]),
                   "at once": (AT_ONCE, [str(marker)]),
                   "train": (TRAIN_STUCK, [str(marker), BASE, *TINY,
                                           f"output_dir={tmp_path / 'run'}"])}[script]
  with open("/dev/full", "w") as full:
    status, _, _ = signalled(program, args, signal.SIGTERM, marker, stderr=full)
  assert status == 128 + signal.SIGTERM


# The same tool, started with SIGHUP ignored (nohup) where argv[3] says so, and finishing once a
# second marker file appears.
HANGUP = """
import os, signal, sys, time
# as started from a terminal, or under nohup (the test itself may run under nohup)
signal.signal(signal.SIGHUP, signal.SIG_IGN if sys.argv[3] == "nohup" else signal.SIG_DFL)
from nanotext import cli
def main(args):
  open(sys.argv[1], "w").close()
  while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
  print("done")
cli.run(main, "usage: tool", argv=["tool"])
"""


@pytest.mark.parametrize("started", ["plain", "nohup"])
def test_sighup_is_sigterm_unless_the_tool_started_under_nohup(tmp_path, started):
  """A closed terminal's SIGHUP killed a tool with no word (a run unsaved): it is SIGTERM now.
  Under nohup it stays ignored and the tool finishes."""
  marker, go = tmp_path / "m", tmp_path / "go"
  proc = subprocess.Popen([sys.executable, "-c", HANGUP, str(marker), str(go), started],
                          cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  deadline = time.time() + PROCESS_TIMEOUT_S
  while not marker.exists():
    assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
    time.sleep(0.05)
  proc.send_signal(signal.SIGHUP)  # an ignored signal is dropped here, at the sending
  if started == "nohup":
    go.touch()
  try:
    out, err = proc.communicate(timeout=120)
  finally:
    proc.kill()  # none left behind by a failure
  if started == "nohup":
    assert (proc.returncode, out, err) == (0, "done\n", ""), err
  else:
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert err.strip().splitlines() == [
        "nanotext: SIGHUP (the terminal or session closed): stopping as for SIGTERM",
        "nanotext: error: stopped by SIGTERM"]


# A tool that finished its work, signalled while Python shuts down (jax's atexit teardown of its
# backends takes seconds): the signal arrives inside an atexit callback.
# The callback is registered in main, or before cli.run as jax's is where a tool's module
# imports jax at its top.
LATE = """
import atexit, os, signal, sys, time
from nanotext import cli
late = lambda: (os.kill(os.getpid(), int(sys.argv[1])), time.sleep(60), print("not reached"))
if sys.argv[3] == "first":
  atexit.register(late)
def main(args):
  if sys.argv[3] == "in main":
    atexit.register(late)
  print("done")
  if sys.argv[2] == "sys.exit":  # as verify ends
    sys.exit(1)
cli.run(main, "usage: tool", argv=["tool"])
"""


@pytest.mark.parametrize("ending,registered", [("return", "in main"), ("sys.exit", "in main"),
                                               ("return", "first")])
@pytest.mark.parametrize("signum", signals.SIGNALS)
def test_a_signal_while_the_process_exits_is_one_line(signum, ending, registered):
  """Terminated raised into the atexit callback: Python printed 'Exception ignored in atexit
  callback' with its traceback, and the process exited 0 as if no signal had come. A callback
  registered before cli.run met the signals ignored already (status 0 after it)."""
  proc = subprocess.run([sys.executable, "-c", LATE, str(int(signum)), ending, registered],
                        cwd=REPO, text=True, capture_output=True, timeout=PROCESS_TIMEOUT_S)
  assert proc.returncode == 128 + signum and proc.stdout == "done\n", (proc.stdout, proc.stderr)
  name = signal.Signals(signum).name
  assert proc.stderr.splitlines() == [f"nanotext: error: stopped by {name} (while exiting, its "
                                      "work done)"], proc.stderr


# A signal raised into code that swallows it (jax's gc callback: "Exception ignored in"), the
# tool's work finishing before the grace period ends.
SWALLOWED = """
import os, signal, sys, time
from nanotext import cli
def main(args):
  try:
    os.kill(os.getpid(), int(sys.argv[1]))
    time.sleep(1)
  except BaseException:  # as a library callback's caller does
    pass
  print("done")
cli.run(main, "usage: tool", argv=["tool"])
"""


@pytest.mark.parametrize("signum", signals.SIGNALS)
def test_a_signal_a_library_swallowed_still_ends_the_tool_in_one_line(signum):
  """convert params-only under Ctrl-C: 'Exception ignored in: <function _xla_gc_callback>
  ... KeyboardInterrupt', then the tool wrote --out and exited 0 (3 tries in 14)."""
  proc = subprocess.run([sys.executable, "-c", SWALLOWED, str(int(signum))], cwd=REPO, text=True,
                        capture_output=True, timeout=PROCESS_TIMEOUT_S)
  name = signal.Signals(signum).name
  assert proc.returncode == 128 + signum and proc.stdout == "done\n", (proc.stdout, proc.stderr)
  assert proc.stderr.splitlines() == [f"nanotext: error: stopped by {name} (received while the "
                                      "tool worked, and swallowed by a library; the work "
                                      "finished)"], proc.stderr


# The same at the very end: Python's finalization, past the exit handlers, collecting __main__.
FINAL = """
import os, sys, time
from nanotext import cli
class Late:
  def __del__(self, kill=os.kill, pid=os.getpid(), signum=int(sys.argv[1]), sleep=time.sleep):
    kill(pid, signum)
    sleep(0.5)
late = Late()
def main(args):
  print("done")
cli.run(main, "usage: tool", argv=["tool"])
"""


@pytest.mark.parametrize("signum", signals.SIGNALS)
def test_a_signal_as_python_finalizes_does_not_kill_the_finished_tool(signum):
  """Python's finalization resets the handlers to the default: a signal there killed the
  finished tool without a word (status -2 / -15; the convert, generate and evaluate runs of a
  probe, 0.6 s after their last line). Ignored there, the process ends as it was ending."""
  proc = subprocess.run([sys.executable, "-c", FINAL, str(int(signum))], cwd=REPO, text=True,
                        capture_output=True, timeout=PROCESS_TIMEOUT_S)
  assert (proc.returncode, proc.stdout, proc.stderr) == (0, "done\n", ""), proc.stderr


@pytest.mark.parametrize("signum", signals.SIGNALS)  # every signal the tools honour
def test_a_signal_while_the_main_thread_is_inside_a_call(tmp_path, signum):
  """Python would run the handler only once the call returned: the watching thread ends the
  process after the grace period instead (issue 27 item 6: SIGTERM not honoured in 20 s)."""
  status, _, err = signalled(STUCK, ["stuck", str(tmp_path / "m")], signum, tmp_path / "m")
  assert status == 128 + signum, err
  assert err.strip().splitlines()[-1].startswith(
      f"nanotext: error: stopped by {signal.Signals(signum).name} (the main thread")


TRAIN_STUCK = """
import signal, sys, time
from nanotext import train, wiring
def stuck(*a, **k):  # the first state: an init compiled and run in the main thread
  signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGINT))
  open(sys.argv[1], "w").close()
  time.sleep(600)
wiring.initial_state = stuck
train.cli.run(train.main, train.USAGE, argv=["train", *sys.argv[2:]], jax=True)
"""


@pytest.mark.parametrize("signum", signals.SIGNALS)  # every signal the tools honour
def test_a_signal_before_the_first_step_while_the_main_thread_is_inside_a_call(tmp_path,
                                                                                signum):
  """The run stops at once, output_dir as it was (a new one removed), lock released."""
  out = tmp_path / "run"
  status, _, err = signalled(TRAIN_STUCK, [str(tmp_path / "m"), BASE, *TINY,
                                           f"output_dir={out}"], signum, tmp_path / "m")
  assert status == 128 + signum and "Traceback" not in err, err
  name = signal.Signals(signum).name
  assert err.strip().splitlines()[-1] == (f"nanotext: error: stopped by {name} before the first "
                                          f"step: nothing to save, output_dir '{out}' is as it "
                                          "was")
  assert not out.exists()


ENDING = """
import signal, sys, time
from nanotext import cli, signals
def main(args):
  with signals.ending_with("got {}"):
    signal.pthread_sigmask(signal.SIG_BLOCK, signals.SIGNALS)  # inside a call, as a decode
    open(sys.argv[1], "w").close()
    time.sleep(600)
cli.run(main, "usage: tool", argv=["tool"])
"""


@pytest.mark.parametrize("signum", signals.SIGNALS)  # every signal the tools honour
def test_work_that_ends_with_a_signal_exits_0_at_once(tmp_path, signum):
  status, out, err = signalled(ENDING, [str(tmp_path / "m")], signum, tmp_path / "m")
  assert (status, out, err) == (0, f"got {signal.Signals(signum).name}\n", "")


# Ctrl-C twice while convert --force swaps its output: the old one just set aside.
SWAP = """
import os, signal, sys, time
from nanotext import cli, outputs
out, real = sys.argv[1], os.replace
def replace(a, b):
  real(a, b)
  if a == out:
    for _ in range(2):
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.3)
os.replace = replace
def main(args):
  with outputs.staged_dir(out, force=True) as tmp:
    open(os.path.join(tmp, "NEW"), "w").close()
  print("not reached: the signal ends it once the output is whole")
cli.run(main, "usage: tool", argv=["tool"])
"""


def test_signals_during_an_outputs_swap_wait_for_it(tmp_path):
  """The second Ctrl-C ended the process from the watching thread between the two renames: no
  output at --out, the old one hidden aside. Both wait for the swap; one line says the output
  is whole."""
  out = tmp_path / "out"
  out.mkdir()
  (out / "OLD").write_text("the previous export")
  proc = subprocess.run([sys.executable, "-c", SWAP, str(out)], cwd=REPO, text=True,
                        capture_output=True, timeout=PROCESS_TIMEOUT_S)
  assert (proc.returncode, proc.stdout) == (130, ""), proc.stderr
  assert proc.stderr == ("nanotext: error: stopped by SIGINT after --out was written: it is "
                         "complete\n")
  assert os.listdir(tmp_path) == ["out"] and os.listdir(out) == ["NEW"]
