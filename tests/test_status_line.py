"""The status line a terminal shows while XLA compiles (programs.StatusLine): rewritten in place,
cleared before each log line, and absent where stdout is a file or a pipe."""

import concurrent.futures
import io
import os
import pty
import re
import select
import subprocess
import sys

import jax
import pytest

from conftest import BASE, PROCESS_TIMEOUT_S, REPO, TINY
from nanotext.programs import StatusLine, compile_showing, wait_compiling


class Terminal(io.StringIO):
  def isatty(self):
    return True


def screen(raw: str) -> tuple:
  """(the lines a terminal shows after `raw`, the line the cursor is on), spaces stripped."""
  lines, line, col = [], [], 0
  for ch in raw:
    if ch == "\r":
      col = 0
    elif ch == "\n":
      lines.append("".join(line).rstrip())
      line, col = [], 0
    else:
      line[col:col + 1] = [ch]
      col += 1
  return lines, "".join(line).rstrip()


@pytest.mark.fast
def test_a_terminal_gets_one_line_rewritten_and_cleared():
  term = Terminal()
  status = StatusLine(term)
  status.show("compiling 3 program(s): 0 done, 12 s")
  status.show("compiling: 13 s")  # shorter: the rest of the old text is blanked
  assert screen(term.getvalue()) == ([], "compiling: 13 s")
  status.clear()
  assert screen(term.getvalue()) == ([], "")
  for stream in (io.StringIO(), open(os.devnull, "w")):  # a pipe or a file: nothing written
    with stream:
      quiet = StatusLine(stream)
      quiet.show("compiling")
      quiet.clear()
      assert stream.tell() == 0


@pytest.mark.fast
def test_a_terminal_that_goes_away_stops_the_line_not_the_work():
  class Gone(Terminal):
    def write(self, text):
      raise BrokenPipeError(32, "Broken pipe")
  status = StatusLine(Gone())
  status.show("compiling")
  status.clear()
  assert status.stream is None
  closed = Terminal()
  closed.close()
  StatusLine(closed).show("compiling")  # isatty of a closed stream raises: no line


@pytest.mark.fast
def test_log_lines_are_whole_between_the_status_lines():
  term = Terminal()
  futures = {}
  for key in ("train", "eval"):
    f = concurrent.futures.Future()
    f.set_result(f"{key} done")
    futures[f] = key
  seen = []

  def finished(key, result):
    seen.append((key, result))
    print(f"compiled {key}", file=term)
  wait_compiling(futures, finished, "compiling 2 program(s)", StatusLine(term))
  assert sorted(seen) == [("eval", "eval done"), ("train", "train done")]
  assert re.search(r"\rcompiling 2 program\(s\): 0 done, \d+ s", term.getvalue())
  assert screen(term.getvalue()) == ([f"compiled {key}" for key, _ in seen], "")


@pytest.mark.fast
def test_a_compile_keeps_its_errors_and_clears_the_line(monkeypatch):
  term = Terminal()
  monkeypatch.setattr(sys, "stdout", term)
  lowered = jax.jit(lambda x: x + 1).lower(1.0)
  compiled = compile_showing(lowered, "cpu", None, "compiling add")
  assert float(compiled(2.0)) == 3.0
  assert re.search(r"\rcompiling add: \d+ s", term.getvalue())
  assert screen(term.getvalue()) == ([], "")
  with pytest.raises(Exception, match="no_such_option"):
    compile_showing(lowered, "cpu", {"no_such_option": 1}, "compiling add")
  assert screen(term.getvalue()) == ([], "")


def test_the_train_cli_on_a_terminal(tmp_path):
  """A real terminal (a pty): the status line while the programs compile, every log line whole
  and at its start, nothing of the status line left at the end."""
  main, child = pty.openpty()
  with open(tmp_path / "stderr", "w") as err:
    proc = subprocess.Popen([sys.executable, "-m", "nanotext.train", BASE, *TINY,
                             f"output_dir={tmp_path / 'run'}"], cwd=REPO, stdout=child,
                            stderr=err, stdin=subprocess.DEVNULL)
  os.close(child)
  raw = b""
  try:
    while select.select([main], [], [], PROCESS_TIMEOUT_S)[0]:
      try:
        chunk = os.read(main, 65536)
      except OSError:  # EIO: the child's end is closed
        break
      if not chunk:
        break
      raw += chunk
  finally:
    os.close(main)
    code = proc.wait(timeout=PROCESS_TIMEOUT_S)
  assert code == 0, (tmp_path / "stderr").read_text()[-3000:]
  text = raw.decode()
  assert re.search(r"\rcompiling 2 program\(s\): 0 done, \d+ s", text)  # train and eval
  lines, last = screen(text)
  assert last == ""
  assert not [l for l in lines if "compiling" in l], lines
  compiled = [l for l in lines if "compiled" in l]
  assert len(compiled) == 3 and all(l.startswith("compiled ") for l in compiled), lines
  assert any(l.startswith("step      4/4 | loss ") for l in lines), lines
