"""The house rules of nanotext/ that a reader relies on, read from the source (ast): short
modules, a thin entry point, mesh axis names in sharding.py alone, every module in the README's
file tree (issue 25); and no unused import or undefined name anywhere (pyflakes)."""

import ast
import io
import os
import re

import pytest
from pyflakes import api, reporter

from test_imports import ROOT, _modules

pytestmark = pytest.mark.fast

MAX_LINES = 400
# The names of the device mesh's axes (sharding.MESH_AXES), as literals; read here without
# importing jax.
MESH_AXES = ("data", "fsdp", "tensor")


def _tree(path: str) -> ast.Module:
  with open(path) as f:
    return ast.parse(f.read(), path)


def test_no_module_over_the_limit():
  long = {m: n for m, p in _modules().items() if (n := len(open(p).readlines())) > MAX_LINES}
  assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_train_run_reads_in_under_60_lines():
  for name in ("run", "_run"):  # the entry, and the run from its config on
    fn = next(n for n in _tree(_modules()["nanotext.train"]).body
              if isinstance(n, ast.FunctionDef) and n.name == name)
    assert fn.end_lineno - fn.lineno + 1 < 60, name


def mesh_axis_uses(tree: ast.Module) -> list:
  """Lines that name a mesh axis: `x["fsdp"]`, `sizes.get("data")`, `dict(m, data=1)`, or the
  literal "fsdp" / "tensor" anywhere ("data" alone is also a config section and an item)."""
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and node.value in ("fsdp", "tensor"):
      found.append(node.lineno)
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
        and node.slice.value in MESH_AXES and re.search(r"mesh|size|shape",
                                                         ast.unparse(node.value)):
      found.append(node.lineno)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
        and node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant) \
        and node.args[0].value in MESH_AXES and re.search(r"mesh|size|shape",
                                                          ast.unparse(node.func.value)):
      found.append(node.lineno)
    elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "dict" and node.args \
        and re.search(r"mesh|size|shape", ast.unparse(node.args[0])) \
        and any(k.arg in MESH_AXES for k in node.keywords):
      found.append(node.lineno)
  return sorted(set(found))


def test_the_check_sees_mesh_axes_named():
  code = ('a = mesh.shape["data"]\nb = sizes.get("fsdp", 1)\nc = dict(sizes, data=1)\n'
          'd = {"tensor": 2}\ne = cfg["data"]\nf = dict(state=1, data=2)\n')
  assert mesh_axis_uses(ast.parse(code)) == [1, 2, 3, 4]


def test_mesh_axes_are_named_only_in_sharding():
  found = {m: lines for m, p in _modules().items() if m != "nanotext.sharding"
           and (lines := mesh_axis_uses(_tree(p)))}
  assert not found, f"mesh axis names outside nanotext/sharding.py (module: lines): {found}"


def test_every_module_is_in_the_readme_file_tree():
  with open(os.path.join(ROOT, "README.md")) as f:
    readme = f.read()
  tree = readme[readme.index("## Files"):]
  tree = tree[:tree.index("```", tree.index("```") + 3)]
  missing = [m for m, p in _modules().items()
             if not p.endswith("__init__.py") and os.path.basename(p) not in tree
             and os.path.basename(p)[:-3] not in tree]
  assert not missing, f"modules the README's file tree does not name: {missing}"


def pyflakes_report(check, *args) -> tuple:
  """(how many, what) pyflakes says of check(*args, its reporter)."""
  out = io.StringIO()
  count = check(*args, reporter.Reporter(out, out))
  return count, out.getvalue()


def test_the_check_sees_an_unused_import_and_an_undefined_name():
  assert pyflakes_report(api.check, "import os\nprint(x)\n", "example.py")[0] == 2


def test_pyflakes_finds_nothing_in_the_code_tests_and_benchmarks():
  count, said = pyflakes_report(api.checkRecursive, [os.path.join(ROOT, d) for d in
                                                     ("nanotext", "tests", "benchmarks")])
  assert count == 0, said
