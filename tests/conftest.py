"""Test setup: 8 fake CPU devices (set before jax is imported) and shared helpers."""

import atexit
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The float32 agreement tests (1e-5 tolerances) assume full float32 matmuls: the CPU's default
# (its programs give the same bits at "highest"), not a GPU's (TF32-like there: 1.4e-3 apart), so
# the GPU tier (JAX_PLATFORMS=cuda,cpu pytest) asks for "highest". On the CPU it stays unset: what
# the tests compile for a TPU or a GPU (nanotext.compile, in-process and in the CLI runs that
# inherit this environment) is then the program a run builds. At "highest" each float32 matmul
# compiled for a TPU was a multi-pass one (a v5e eval program: 10.6 MiB of code, not 5.2; 12.6 s
# of compiling, not 5.7).
if os.environ["JAX_PLATFORMS"].split(",")[0] != "cpu":
  os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# One thread in PyTorch's OpenMP pool and NumPy's BLAS, here and in the CLI runs the tests start:
# pytest-xdist runs two workers on two cores. On a loaded machine (load 7) a pool of two
# threads made the record's bf16 reference (tests/test_record_training.py) 10-15x slower: one
# 4,096-token step took 1.3 s with one thread and 13-21 s with two. Under .ci/run's two workers
# alone it changes nothing (91.2 s against 91.9 s for the bf16 comparison; a quiet run of one
# file gives up the second core: 0.7 s a step there). The references' sums then also do not
# depend on the core count (benchmarks/RESULTS.md, "Test suite time"). JAX's CPU backend has a
# thread pool of its own.
for _pool in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
  os.environ.setdefault(_pool, "1")
# CPU memory plans (remat, loss chunks) against a fixed 16 GiB of host RAM, not MemAvailable: a
# second suite beside this one halves what is free, and a plan, hence a program, would follow it.
os.environ.setdefault("NANOTEXT_HOST_MEMORY_GIB", "16")
# One persistent compilation cache for the session, shared with the CLI runs the tests start:
# many tests train the same tiny model, and each new process or jit object would compile its
# programs again. A fresh folder per session (removed at exit): no stale entries across versions.
# Each pytest-xdist worker (they inherit this environment) takes a folder of its own inside it:
# jax writes an entry in place, so a worker could read one another process is still writing and
# print a warning where CLI tests count stderr lines (and jax's locked mode, a size limit, warned
# on entries whose access-time file was not written yet: 66 warnings in one run).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _CACHE = tempfile.mkdtemp(prefix="nanotext-tests-jax-cache-")
  atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and os.path.basename(os.environ["JAX_COMPILATION_CACHE_DIR"]) != _WORKER:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"],
                                                         _WORKER)

import pytest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(REPO, "configs", "base.yml")
SPEEDRUN = os.path.join(REPO, "configs", "speedrun.yml")

# A model small enough that a few steps take well under a second on 2 cores.
TINY = ["model.num_layers=2", "model.d_model=64", "model.num_heads=2", "model.head_dim=32",
        "model.vocab_size=512", "model.align=0", "train.batch_size=8", "train.seq_len=32",
        "train.steps=4", "train.log_every=1", "train.eval_every=2", "train.eval_batches=2",
        "train.eval_seq_len=0",
        "data.source=synthetic", "data.tokenizer=none", "data.eot_id=0",
        "metrics.tensorboard=false",
        "checkpoint.every=0"]


def compiling_env() -> dict:
  """This environment without the shared compilation cache: a process started with it compiles
  its programs, so a signal sent while it compiles cannot land after them (a cache hit loads
  a program in a moment)."""
  return {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}


def saved_run(path, overrides, out, step: int = 3, noise: float = 0.0):
  """A run directory as training leaves one, without training: config.yml and a checkpoint of
  the fresh state at `step`; (run, host params). For tests of tools that read a run. `noise`
  > 0 adds N(0, noise) to every parameter (seeded), so none sits at a zero or shared init value,
  as after training, without compiling a train step."""
  import jax
  import numpy as np
  from nanotext import checkpoint, config, wiring
  run = wiring.prepare(path, [*overrides, f"output_dir={out}"])
  state = run.init_state()
  if noise:
    rng = np.random.default_rng(0)
    moved = lambda x: jax.device_put(  # on the host: no program compiled per parameter shape
        (np.asarray(x, np.float32) + noise * rng.standard_normal(x.shape)).astype(x.dtype),
        x.sharding)
    state = {**state, "params": jax.tree.map(moved, state["params"])}
  config.save(run.cfg, os.path.join(out, "config.yml"))
  manager = checkpoint.make_manager(out, keep=1)
  checkpoint.save(manager, step, state, {}, {})
  checkpoint.wait(manager)
  manager.close()
  return run, jax.device_get(state["params"])


def train_command(pause: str | None = None) -> list:
  """The train CLI, or with `pause` ("STEP:MARKER") tests/pause_in_save.py holding that save."""
  if not pause:
    return [sys.executable, "-m", "nanotext.train"]
  return [sys.executable, os.path.join(REPO, "tests", "pause_in_save.py"), *pause.split(":", 1)]


def mesh_sizes(**sizes) -> dict:
  """Every mesh axis (sharding.MESH_AXES) at size 1 but the named ones: tests name only the axes
  they use, so adding a mesh axis changes none of them."""
  from nanotext import sharding
  unknown = set(sizes) - set(sharding.MESH_AXES)
  assert not unknown, f"not mesh axes: {unknown}"
  return {a: sizes.get(a, 1) for a in sharding.MESH_AXES}


def mesh(devices=None, **sizes):
  """sharding.make_mesh over the first prod(sizes) devices (or `devices`), axes as mesh_sizes."""
  import math
  import jax
  from nanotext import sharding
  n = math.prod(sizes.values())
  return sharding.make_mesh(mesh_sizes(**sizes), jax.devices()[:n] if devices is None else devices)


# How long a CLI process a test starts may take before it counts as hung. A bound on hangs, not a
# timing: the record's 49,152-token row (about 1 min quiet) took over 300 s with the suite
# running three times over on 2 cores (load 13-14).
PROCESS_TIMEOUT_S = 900


def run_cli(*args, env=None, timeout=PROCESS_TIMEOUT_S):
  """Run `python -m ARGS...` from the repo root; returns the CompletedProcess."""
  full_env = dict(os.environ, **(env or {}))
  return subprocess.run([sys.executable, "-m", *args], cwd=REPO, env=full_env,
                        capture_output=True, text=True, timeout=timeout)


def forward(graphdef, params, *args, **kwargs):
  """The model's forward pass on `params` as one compiled program, as a numpy array. Called
  eagerly, each of its ops compiles as a program of its own: ~100 programs for 12 layers, 15-25 s
  of a test's time on 2 cores."""
  import jax
  import numpy as np
  from flax import nnx
  return np.asarray(jax.jit(lambda p: nnx.merge(graphdef, p)(*args, **kwargs))(params))


TRITON = "__gpu$xla.gpu.triton"  # the custom call a Pallas kernel lowers to for CUDA


def cuda_mlir(fn, *args) -> str:
  """`fn(*args)` (ShapeDtypeStructs) built for CUDA from this CPU host with jax.export: its
  StableHLO text, Pallas kernels as Triton custom calls. The GPU they are lowered for is an H100
  (jax 0.11's Triton lowering asks the mesh for one where no GPU is attached; 0.10 lowered for
  any). PTX compilation needs a GPU, or nanotext.compile's plugin. Its axis is Auto, as
  nanotext's meshes are (jax 0.11 makes it Explicit by default)."""
  import jax
  from jax import export
  h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None,
                                     platform="gpu")
  auto = (jax.sharding.AxisType.Auto,)
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), axis_types=auto,
                                                                abstract_device=h100)):
    return export.export(jax.jit(fn), platforms=["cuda"],
                         disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON)])(
                             *args).mlir_module()


def record_syncs(monkeypatch) -> list:
  """os.fsync and os.replace calls from now on, in order: ("fsync", inode), ("replace", dst)."""
  events, real_fsync, real_replace = [], os.fsync, os.replace

  def fsync(fd):
    events.append(("fsync", os.fstat(fd).st_ino))
    real_fsync(fd)

  def replace(src, dst, **kwargs):
    events.append(("replace", os.fspath(dst)))
    real_replace(src, dst, **kwargs)
  monkeypatch.setattr(os, "fsync", fsync)
  monkeypatch.setattr(os, "replace", replace)
  return events


def synced_around_rename(events, paths, out) -> None:
  """Assert each of `paths` was fsynced before the last rename onto `out`, and its folder after
  (or a power cut after the rename can leave `out` empty, or the rename undone)."""
  out = os.fspath(out)
  rename = len(events) - 1 - events[::-1].index(("replace", out))
  for path in paths:
    assert ("fsync", os.stat(path).st_ino) in events[:rename], path
  assert ("fsync", os.stat(os.path.dirname(out)).st_ino) in events[rename:], out


def one_line_error(proc, *needles):
  """Assert a CLI run failed with exit 2 and one `nanotext: error:` line holding `needles`."""
  assert proc.returncode == 2, (proc.stdout, proc.stderr)
  lines = [line for line in proc.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("nanotext: error:"), proc.stderr
  for n in needles:
    assert n in lines[0], lines[0]


@pytest.fixture
def restore_jax_cache_config():
  """For a test whose run sets train.compile_cache_dir in-process: the worker's cache settings
  as they were afterwards (its later compiles would go to the test's folder)."""
  import jax
  keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
          "jax_persistent_cache_min_entry_size_bytes")
  saved = {k: getattr(jax.config, k) for k in keys}
  yield
  for k, v in saved.items():
    jax.config.update(k, v)
  try:  # forget a cache this process may have opened in the test's directory
    from jax._src import compilation_cache
    compilation_cache.reset_cache()
  except (ImportError, AttributeError):
    pass


def opted_in(*kernels):
  """An autouse fixture for a test module of nanotext's opt-in kernels (per_device.OWN_KERNELS):
  a run takes them only opted in; the module's tests build their programs with them taken."""
  @pytest.fixture(autouse=True)
  def opting_in():
    from nanotext.model.kernels import per_device
    with per_device.opting_in(*kernels):
      yield
  return opting_in


@pytest.fixture
def tiny():
  return list(TINY)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
  """(output_dir, train.run's result) of a finished run shared by the tests that only read one:
  2 steps of TINY under FSDP=8 (all 8 devices), no eval, its final step saved. Copy it first to
  change it."""
  from nanotext.train import run
  out = str(tmp_path_factory.mktemp("tiny_run") / "run")
  result = run(BASE, TINY + ["train.steps=2", "train.eval_every=0", "sample.max_new_tokens=0",
                             f"output_dir={out}"], log=lambda line: None)
  return out, result


# Markers of tests that need an optional package: marker -> (module, the install that brings it).
# `pip install -e .` (the main job's install) has none of them; `.[test,tpu]` (CI's) has them all.
EXTRAS = {
    "tpu": ("libtpu", "pip install -e '.[tpu]'"),
    "torch": ("torch", "pip install -e '.[test]'"),
    "transformers": ("transformers", "pip install -e '.[test]'"),
    "tfds": ("tensorflow_datasets", "pip install -e '.[tfds]'"),
    "plots": ("matplotlib", "pip install -e '.[plots]'"),
    "gpu_compile": ("jax_plugins.xla_cuda13", "pip install -e '.[gpu-compile]'"),
}


def _missing(marker: str) -> str:
  """The skip reason of a test marked `marker` when its package is missing, else ""."""
  module, install = EXTRAS[marker]
  try:
    found = importlib.util.find_spec(module) is not None
  except ImportError:  # a dotted name whose package is missing
    found = False
  if found:
    return ""
  return f"needs {module} ({install})"


def extra(marker: str):
  """The module of an extra, imported for a test file that needs it throughout (or the whole
  file skipped, with the reason, when it is missing); the file also sets `pytestmark`."""
  reason = _missing(marker)
  if reason:
    pytest.skip(reason, allow_module_level=True)
  return importlib.import_module(EXTRAS[marker][0])


def pytest_collection_modifyitems(config, items):
  """Skip, with a reason, a test whose extra is missing (see EXTRAS), and `gpu`-marked tests
  where jax has no GPU backend (JAX_PLATFORMS=cuda,cpu pytest -m gpu runs them). Then order the
  files heaviest first (heaviest_files_first)."""
  heaviest_files_first(items)
  import jax
  on_gpu = jax.default_backend() == "gpu"
  reasons = {m: _missing(m) for m in EXTRAS}
  for item in items:
    if "gpu" in item.keywords and not on_gpu:
      item.add_marker(pytest.mark.skip(reason="needs a GPU: run with JAX_PLATFORMS=cuda,cpu"))
    for marker, reason in reasons.items():
      if reason and item.get_closest_marker(marker) is not None:
        item.add_marker(pytest.mark.skip(reason=reason))


def heaviest_files_first(items) -> None:
  """Sort the tests file by file, the files with the most tests not marked `fast` first (each
  file's tests keep their order). pytest-xdist hands whole files to its workers in this order
  (pytest.ini: --dist loadfile --no-loadscope-reorder); its own order, the most tests first,
  started test_record_training.py (5 tests, 135 s) last and left the other worker idle for
  about 28 s at the end. A model of the schedule from each file's measured time reproduced two
  runs' wall to 0.5 s, and puts this order within 1 s of an even split; a run measured 14.6 s
  over it, start-up and hand-off the model leaves out (benchmarks/RESULTS.md, "Test suite
  time")."""
  weight = {}
  for item in items:
    path = str(item.path)
    weight[path] = weight.get(path, 0) + (item.get_closest_marker("fast") is None)
  items.sort(key=lambda item: (-weight[str(item.path)], str(item.path)))
