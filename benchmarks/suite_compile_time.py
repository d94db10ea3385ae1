"""Where the test suite's time goes: per test file, wall time against jax's own trace, lowering
and XLA compile times, and the number of programs compiled (cache misses).

As a pytest plugin, each process (an xdist worker too) appends one JSON line per test to FILE:

  NANOTEXT_SUITE_TIMES=FILE PYTHONPATH=benchmarks python -m pytest -q -n 2 -p suite_compile_time

then `python benchmarks/suite_compile_time.py FILE [--tests N] [--programs N]` prints the table
(and the N slowest tests; the N programs, by name, that took the most XLA compile time, with how
many times each compiled: one name compiled many times is a program the tests could share). The
processes a test starts (CLI runs) are seen too: the plugin puts benchmarks/suite_children on
PYTHONPATH, whose sitecustomize.py writes a line per process (its CPU seconds and jax's compile
seconds, in the table's last three columns; their wall is inside the test's). A test that sets
PYTHONPATH for its process itself hides that process.
"""

import argparse
import collections
import importlib.util
import json
import os
import sys
import time

import pytest

CHILDREN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "suite_children")
# Loaded by path: tests load this file by path too, without benchmarks/ on sys.path.
_spec = importlib.util.spec_from_file_location("suite_jax_events",
                                               os.path.join(CHILDREN, "jax_events.py"))
_events = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_events)
event_column = _events.column

_current = {"test": None}
_times = collections.defaultdict(collections.Counter)
_programs = collections.defaultdict(lambda: collections.defaultdict(collections.Counter))


def _listen(event, duration, **kwargs):
  column = event_column(event)
  if column and _current["test"]:
    _times[_current["test"]][column] += duration
    if column == "compile":
      _times[_current["test"]]["programs"] += 1


def _named(compile_fn):
  """compile_fn timed per program name (the module's sym_name: jit_train_step, ...)."""
  def wrapper(backend, module, *args, **kwargs):
    start = time.perf_counter()
    try:
      return compile_fn(backend, module, *args, **kwargs)
    finally:
      if _current["test"]:
        name = str(module.operation.attributes["sym_name"]).strip('"')
        _programs[_current["test"]][name].update(count=1, seconds=time.perf_counter() - start)
  return wrapper


def pytest_configure(config):
  import jax
  from jax._src import compiler
  # Inherited by the workers and, through them, by what each test starts; the test's own name
  # reaches a process as PYTEST_CURRENT_TEST, which pytest sets while a test runs (not left from
  # an outer session this one runs in).
  os.environ.pop("PYTEST_CURRENT_TEST", None)
  paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
  os.environ["PYTHONPATH"] = os.pathsep.join([CHILDREN] + [p for p in paths if p != CHILDREN])
  jax.monitoring.register_event_duration_secs_listener(_listen)
  compiler.backend_compile_and_load = _named(compiler.backend_compile_and_load)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  """Around each test where it runs (an xdist worker; its controller only relays reports)."""
  _current["test"] = item.nodeid
  start = time.perf_counter()
  try:
    yield
  finally:
    _times[item.nodeid]["wall"] += time.perf_counter() - start
    _current["test"] = None


def pytest_sessionfinish(session):
  with open(os.environ.get("NANOTEXT_SUITE_TIMES", "suite_times.jsonl"), "a") as f:
    for test, t in _times.items():
      named = {k: dict(v) for k, v in _programs.get(test, {}).items()}
      f.write(json.dumps({"test": test, **t, "named": named}) + "\n")


COLUMNS = ["wall", "compile", "trace", "lower", "programs", "processes", "their CPU",
           "their compile"]


def table(rows, key) -> str:
  """Per key(test): the tests' own columns, and the processes they started (rows with
  "child")."""
  sums = collections.defaultdict(collections.Counter)
  for r in rows:
    s = sums[key(r["test"])]
    if "child" in r:
      s.update({"processes": 1, "their CPU": r.get("cpu", 0), "their compile": r.get("compile", 0)})
    else:
      s.update({c: r.get(c, 0) for c in COLUMNS[:5]})
  total = collections.Counter()
  for s in sums.values():
    total.update(s)
  whole = lambda c: c in ("programs", "processes")
  lines = ["| " + " | ".join(["tests"] + COLUMNS) + " |", "| --- |" + " ---: |" * len(COLUMNS)]
  for name, s in sorted(sums.items(), key=lambda kv: -kv[1]["wall"]) + [("total", total)]:
    lines.append(f"| {name} | " + " | ".join(
        f"{s[c]:.0f}" if whole(c) else f"{s[c]:.1f}" for c in COLUMNS) + " |")
  return "\n".join(lines)


def program_table(rows, n: int) -> str:
  """The n program names with the most compile seconds: times compiled, seconds, test files."""
  by_name = collections.defaultdict(collections.Counter)
  files = collections.defaultdict(set)
  for r in rows:
    for name, c in r.get("named", {}).items():
      by_name[name].update(c)
      files[name].add(r["test"].split("::")[0].rsplit("/", 1)[-1])
  lines = ["| program | compiled | seconds | test files |", "| --- | ---: | ---: | --- |"]
  for name, c in sorted(by_name.items(), key=lambda kv: -kv[1]["seconds"])[:n]:
    lines.append(f"| {name} | {c['count']} | {c['seconds']:.1f} | {len(files[name])} |")
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("file", help="the JSON lines the plugin wrote")
  p.add_argument("--tests", type=int, default=0, help="also the N slowest tests")
  p.add_argument("--programs", type=int, default=0,
                 help="also the N program names with the most compile time")
  args = p.parse_args(argv)
  try:
    with open(args.file) as f:
      rows = [json.loads(line) for line in f if line.strip()]
  except (OSError, ValueError) as e:
    sys.exit(f"suite_compile_time: cannot read {args.file}: {e}")
  print(table(rows, lambda test: test.split("::")[0]))
  if args.tests:
    tests = [r for r in rows if "child" not in r]
    slowest = {r["test"] for r in sorted(tests, key=lambda r: -r.get("wall", 0))[:args.tests]}
    slowest = [r for r in rows if r["test"] in slowest]
    print()
    print(table(slowest, lambda test: test))
  if args.programs:
    print()
    print(program_table(rows, args.programs))


if __name__ == "__main__":
  main()
