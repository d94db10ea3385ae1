"""The import graph of nanotext/: no module imports one that imports it back.

Read from the source (ast), not by importing, so the test is quick and sees imports made inside
functions too. `import a.b.c` also runs a/__init__ and a/b/__init__, so those count as edges.
"""

import ast
import os

import pytest

pytestmark = pytest.mark.fast

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules() -> dict:
  mods = {}
  for folder, _, files in os.walk(os.path.join(ROOT, "nanotext")):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(folder, f)
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        mods[name.removesuffix(".__init__")] = path
  return mods


def import_names(node, mods: dict) -> list:
  """The dotted names an import statement loads (`from a import b`: a.b where that is a module);
  [] for any other node."""
  if isinstance(node, ast.Import):
    return [a.name for a in node.names]
  if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
    return [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
            for a in node.names]
  return []


def import_graph(module_level_only: bool) -> dict:
  """{module: set of nanotext modules it imports} (at module level, or anywhere in it)."""
  mods = _modules()

  def targets(name: str) -> set:
    while name and name not in mods:
      name = name.rpartition(".")[0]
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts) + 1)}  # parent packages run too

  graph = {}
  for mod, path in mods.items():
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    nodes = tree.body if module_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
      for name in import_names(node, mods):
        if name.startswith("nanotext."):
          out |= targets(name)
    out.discard(mod)
    graph[mod] = {m for m in out if not mod.startswith(m + ".")}  # a package's own parents
  return graph


def cycles(graph: dict) -> list:
  """Strongly connected components of more than one module (Tarjan), each sorted."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph.get(v, ()):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        found.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def _describe(graph: dict, found: list) -> str:
  lines = []
  for comp in found:
    lines.append("cycle: " + ", ".join(comp))
    lines += [f"  {a} -> {b}" for a in comp for b in sorted(graph[a] & set(comp))]
  return "\n".join(lines)


def test_the_graph_counts_imports_inside_functions():
  """train.py imports the trainer only inside a function: the graph still has that edge."""
  assert "nanotext.trainer" not in import_graph(module_level_only=True)["nanotext.train"]
  assert "nanotext.trainer" in import_graph(module_level_only=False)["nanotext.train"]


def test_no_import_cycles_at_any_depth():
  """No circle in nanotext/, counting imports made inside functions (issue 25: two hid there)."""
  graph = import_graph(module_level_only=False)
  found = cycles(graph)
  assert not found, "\n" + _describe(graph, found)


def test_low_modules_do_not_reach_up():
  """The tree helpers, the checkpoint layer and the HF format mapping import nothing above
  them, not even inside a function (issue 20's crossed wires)."""
  graph = import_graph(module_level_only=False)
  assert graph["nanotext.trees"] <= {"nanotext.errors"}, graph["nanotext.trees"]
  assert not {m for m in graph["nanotext.checkpoint"] if m.startswith("nanotext.convert")}
  assert "nanotext.wiring" not in graph["nanotext.convert.hf"]
  found = [c for c in cycles(graph) if "nanotext.checkpoint" in c or "nanotext.convert" in c]
  assert not found, "\n" + _describe(graph, found)
