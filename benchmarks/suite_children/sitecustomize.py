"""suite_compile_time's eye in the processes a test starts (a CLI run, a worker): Python imports
this at start-up when benchmarks/suite_children is on PYTHONPATH, which the plugin arranges.

In a process started during a test (PYTEST_CURRENT_TEST inherited) it listens to jax's compile
events once jax is imported, and at exit (os._exit included: the CLI's error path) appends one
JSON line to NANOTEXT_SUITE_TIMES: the test, the command, wall and CPU seconds, jax's compile,
trace and lowering seconds and the number of programs compiled. Elsewhere it does nothing.
"""

import atexit
import collections
import importlib.machinery
import json
import os
import sys
import time

from jax_events import column as event_column  # this folder is on PYTHONPATH


def _install(out: str, test: str) -> None:
  start, sums = time.perf_counter(), collections.Counter()

  def listen(event, duration, **kwargs):
    column = event_column(event)
    if column:
      sums[column] += duration
      sums["programs"] += column == "compile"

  class AfterJax:
    """Registers the listener right after `import jax` runs, not before: a process that
    never imports jax does not pay for it."""

    def find_spec(self, name, path=None, target=None):
      if name != "jax":
        return None
      sys.meta_path.remove(self)
      spec = importlib.machinery.PathFinder.find_spec(name, path)
      if spec is not None:
        run = spec.loader.exec_module

        def exec_module(module):
          run(module)
          module.monitoring.register_event_duration_secs_listener(listen)
        spec.loader.exec_module = exec_module
      return spec

  def write():
    """Best effort, silent: the process may be under a file-size limit or a full disk, as the
    fault tests put it, and its stderr is what they check."""
    try:
      line = json.dumps({"test": test, "child": " ".join(sys.orig_argv[1:3])[:200],
                         "wall": time.perf_counter() - start, "cpu": time.process_time(),
                         **sums}) + "\n"
      fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
      try:
        os.write(fd, line.encode())  # one write: lines from many processes do not interleave
      finally:
        os.close(fd)
    except BaseException:  # noqa: BLE001 -- a measurement must not change what it measures
      pass

  exit_now = os._exit

  def _exit(status):
    try:
      write()
    finally:
      exit_now(status)

  sys.meta_path.insert(0, AfterJax())
  atexit.register(write)
  os._exit = _exit


if os.environ.get("NANOTEXT_SUITE_TIMES") and os.environ.get("PYTEST_CURRENT_TEST"):
  _install(os.environ["NANOTEXT_SUITE_TIMES"],
           os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0])
