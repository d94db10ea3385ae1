"""The fast tier (`python -m pytest -m fast`) reaches every module of nanotext/: each is imported
by at least one test file with fast tests, at its top or inside a fast test or a helper.

Read from the source (ast), as tests/test_imports.py reads the package: which tests are fast is
what their marks say (`pytestmark` of the file, or `@pytest.mark.fast` on a test or its class).
"""

import ast
import os

import pytest

from test_imports import ROOT, _modules, import_names

pytestmark = pytest.mark.fast

TESTS = os.path.join(ROOT, "tests")


def _marks_fast(decorators) -> bool:
  """Whether a decorator list (or a pytestmark value) holds pytest.mark.fast."""
  return any(isinstance(n, ast.Attribute) and n.attr == "fast" and
             isinstance(n.value, ast.Attribute) and n.value.attr == "mark"
             for d in decorators for n in ast.walk(d))


def _imported(nodes, mods: dict) -> set:
  """The nanotext modules (and their parent packages) that import statements under `nodes` load."""
  out = set()
  for node in (n for top in nodes for n in ast.walk(top)):
    for name in import_names(node, mods):
      while name and name not in mods:
        name = name.rpartition(".")[0]
      parts = name.split(".") if name.startswith("nanotext") else []
      out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
  return out


def fast_imports(path: str, mods: dict) -> set:
  """The nanotext modules a test file's fast tier imports; empty when it has no fast test.

  Counted: imports at the top of the file, and inside fast tests, fixtures and helpers (any
  function that is not a test); not those inside tests that are not fast."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  whole = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark"
                                                for t in n.targets) and _marks_fast([n.value])
              for n in tree.body)
  counted, any_fast = [], whole
  for node in tree.body:
    tests = [node]
    if isinstance(node, ast.ClassDef):
      fast_class = whole or _marks_fast(node.decorator_list)
      tests = [n for n in node.body if isinstance(n, ast.FunctionDef)]
    else:
      fast_class = whole
    for fn in tests:
      if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_"):
        fast = fast_class or _marks_fast(fn.decorator_list)
        any_fast |= fast
        if fast:
          counted.append(fn)
      else:
        counted.append(fn)  # imports, constants, fixtures, helpers
  return _imported(counted, mods) if any_fast else set()


def test_every_module_is_imported_by_the_fast_tier():
  mods = _modules()
  reached = set()
  for name in sorted(os.listdir(TESTS)):
    if name.startswith("test_") and name.endswith(".py"):
      reached |= fast_imports(os.path.join(TESTS, name), mods)
  missing = sorted(set(mods) - reached)
  assert not missing, "no fast test file imports: " + ", ".join(missing)


def test_the_check_sees_marks_and_skips_tests_that_are_not_fast(tmp_path):
  """A file whose fast test imports one module and whose other test imports another."""
  mods = {"nanotext": "", "nanotext.a": "", "nanotext.b": "", "nanotext.c": ""}
  path = tmp_path / "test_x.py"
  path.write_text("import pytest\nfrom nanotext import a\n\n"
                  "@pytest.mark.fast\ndef test_one():\n  from nanotext import b\n\n"
                  "def test_two():\n  from nanotext import c\n")
  assert fast_imports(str(path), mods) == {"nanotext", "nanotext.a", "nanotext.b"}
  path.write_text("from nanotext import a\n\ndef test_two():\n  pass\n")
  assert fast_imports(str(path), mods) == set()
