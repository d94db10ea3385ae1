"""Every benchmark imports without side effects: tests load several by path into one process."""

import glob
import importlib.util
import os

import pytest
from absl import app, flags, logging

from conftest import REPO

# Imported for the flags they define on import: absl's own, there before the check counts.
ABSL_FLAG_MODULES = (app, logging)

pytestmark = pytest.mark.fast

EXTRAS = {"torch", "transformers", "matplotlib", "tensorflow_datasets", "tiktoken",
          "huggingface_hub"}
BENCHMARKS = sorted(glob.glob(os.path.join(REPO, "benchmarks", "*.py")))


@pytest.mark.parametrize("path", BENCHMARKS, ids=os.path.basename)
def test_importing_a_benchmark_defines_no_flags(path):
  before = set(flags.FLAGS)
  name = "import_check_" + os.path.basename(path)[:-3]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] not in EXTRAS:
      raise
    pytest.skip(f"needs the optional package {e.name}")
  added = set(flags.FLAGS) - before
  assert not added, f"{os.path.basename(path)} defines flags at import: {sorted(added)}"
