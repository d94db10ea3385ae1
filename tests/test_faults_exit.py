"""Every process ends (issue 27 items 5 and 6): an error ends it promptly with one line whatever
threads are still running, and a signal before the first step stops it even while its main
thread is inside a long call that does not return to Python."""

import os
import subprocess
import sys

import pytest

from conftest import REPO

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
  raise ZeroDivisionError("a bug")
cli.run(main, "usage: tool", argv=["tool"])
"""


@pytest.mark.parametrize("kind,status,needle", [
    ("user", 2, "bad input"), ("resource", 1, "No space left on device"),
    ("xla", 1, "XLA failed while running a program: INTERNAL: YNNPACK"),
    ("bug", 1, "unexpected ZeroDivisionError: a bug")])
def test_an_error_ends_the_process_with_a_live_thread(kind, status, needle):
  proc = subprocess.run([sys.executable, "-c", TOOL, kind], cwd=REPO, capture_output=True,
                        text=True, timeout=60)  # a process that outlives its error times out
  assert proc.returncode == status, proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("nanotext: error:") and needle in last, proc.stderr
  assert ("Traceback" in proc.stderr) == (kind == "bug")  # a bug keeps where it happened
