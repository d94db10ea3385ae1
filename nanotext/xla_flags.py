"""XLA flags that make the CPU train step faster, set by the entry point before JAX starts.

Only when the run is certainly on CPU, the user has not set XLA_FLAGS themselves, and the
installed jaxlib is one these flags were measured on: XLA aborts the process on a flag it does
not know, and accelerator plugins parse XLA_FLAGS too.
"""

import glob
import os
import sys

# --xla_cpu_experimental_ynn_fusion_type=-individual_dot: XNNPACK ("ynn") no longer takes single
# dots out of XLA's own fusions. The issue that asked for it measured +7% on the base.yml step in
# 12 of 12 interleaved rounds; benchmarks/cpu_vs_torch.py had it faster in 3 of 3 (RESULTS.md).
CPU_FLAGS = ("--xla_cpu_experimental_ynn_fusion_type=-individual_dot",)
TESTED_JAXLIB = ("0.10.",)  # versions known to accept CPU_FLAGS
ACCELERATOR_NODES = ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/kfd")


def cpu_only(environ=os.environ) -> bool:
  """True when JAX can only pick the CPU: JAX_PLATFORMS says so, or no accelerator is present."""
  platforms = environ.get("JAX_PLATFORMS", "").strip()
  if platforms:
    return platforms.split(",")[0].strip() == "cpu"
  if sys.platform == "darwin":  # a Metal plugin may be installed; leave macOS alone
    return False
  return not any(glob.glob(pattern) for pattern in ACCELERATOR_NODES)


def maybe_set_cpu_flags(environ=os.environ) -> str | None:
  """Set XLA_FLAGS to CPU_FLAGS when it is safe; returns what was set, else None.

  Must run before JAX initialises a backend (XLA reads the variable once, at that point).
  """
  if "XLA_FLAGS" in environ or not cpu_only(environ):
    return None
  try:
    from importlib.metadata import version  # lazy: ~20 ms on every train start-up, read only on CPU
    jaxlib = version("jaxlib")
  except Exception:  # noqa: BLE001 -- no metadata: do not guess
    return None
  if not jaxlib.startswith(TESTED_JAXLIB):
    return None
  environ["XLA_FLAGS"] = " ".join(CPU_FLAGS)
  return environ["XLA_FLAGS"]


COUNT_FLAG = "--xla_force_host_platform_device_count"


def malformed(environ=os.environ) -> str:
  """What in XLA_FLAGS XLA cannot parse ('' if nothing we can tell): a word without its leading
  --, or a CPU device count that is no positive number (XLA aborts with its flag list, or with
  a process index it cannot find for 0)."""
  for word in environ.get("XLA_FLAGS", "").split():
    if not word.startswith("--"):
      return f"'{word}' does not start with --"
    name, _, value = word.partition("=")
    if name == COUNT_FLAG and not (value.isdigit() and int(value) > 0):
      return f"{word}: the device count must be a positive whole number"
  return ""


def unknown_flags(environ=os.environ) -> list:
  """The flags in XLA_FLAGS that no installed XLA library defines: XLA aborts the process on
  one when it starts a backend, so the entry points ask first. [] when all are known, or
  when the libraries cannot be found (then XLA itself decides)."""
  names = [t.split("=", 1)[0][2:] for t in environ.get("XLA_FLAGS", "").split()
           if t.startswith("--")]
  libraries = xla_libraries()
  if not names or not libraries:
    return []
  return [f"--{n}" for n in names if not any(_defines(lib, n) for lib in libraries)]


def xla_libraries() -> list:
  """The shared libraries holding XLA's flag definitions: jaxlib's, then the accelerator
  plugins' and libtpu's (their own flags, e.g. --xla_tpu_*)."""
  import importlib.util
  found = []
  for package, pattern in (("jaxlib", "libjax_common*.so"), ("jax_plugins", "*/*.so"),
                           ("libtpu", "libtpu*.so")):
    try:
      spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
      continue
    for folder in (spec.submodule_search_locations or []) if spec else []:
      found += sorted(glob.glob(os.path.join(folder, pattern)))
  return found


def _defines(library: str, name: str) -> bool:
  """Whether `library` holds the flag name as a string of its own (NUL on both sides)."""
  import mmap
  try:
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
      return m.find(b"\0" + name.encode() + b"\0") >= 0
  except (OSError, ValueError):
    return True  # cannot tell: leave it to XLA
