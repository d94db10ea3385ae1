"""Targets you can compile for without owning them: TPU slices here, GPU hosts in gpus.py.

A TPU name is written as users rent it: `v6e-8`, `v5e-16` (chips), `v4-8`, `v5p-16` (TensorCores:
two per chip, one megacore device); a GPU name is the GPU and a count, `h100`, `h100-8`.
`parse(name)` gives the target, `devices(target)` its device descriptions (libtpu, or the jax CUDA
plugin), enough to build a mesh and compile for it; nothing runs.
"""

import dataclasses
import importlib
import glob
import os
import re

from nanotext import gpus
from nanotext.errors import UserError
from nanotext.roofline import Peaks


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation: how libtpu names it, and its per-chip peaks."""
  prefix: str  # libtpu topology prefix ("v6e" -> "v6e:2x4")
  config: str  # chip_config_name: megacore chips are one device of two cores
  cores_per_chip: int  # how the public name counts: v4-8 is 8 cores = 4 chips
  dims: int  # torus dimensions of the slice shape
  hbm_bytes: int  # HBM libtpu lets a program use (its RESOURCE_EXHAUSTED "available HBM")
  peak_flops: float  # dense bf16 FLOP/s (vendor spec sheet)
  hbm_bw: float  # HBM bytes/s (vendor spec sheet)


GIB = 2**30
# hbm_bytes: measured with libtpu 0.0.42.1 (a too-large program's error names the available HBM).
# Peaks: cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}.
CHIPS = {
    "v4": Chip("v4", "megacore", 2, 3, int(30.75 * GIB), 275e12, 1228e9),
    "v5e": Chip("v5e", "default", 1, 2, int(15.75 * GIB), 197e12, 819e9),
    "v5p": Chip("v5", "megacore", 2, 3, int(95.74 * GIB), 459e12, 2765e9),
    "v6e": Chip("v6e", "default", 1, 2, int(31.25 * GIB), 918e12, 1640e9),
}
# Slice shapes by chip count (the standard ones of each generation's slice list).
_SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8),
              128: (8, 16), 256: (16, 16)}
_SHAPES_3D = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4), 64: (4, 4, 4),
              128: (4, 4, 8), 256: (4, 8, 8), 512: (8, 8, 8), 1024: (8, 8, 16)}


@dataclasses.dataclass(frozen=True)
class Slice:
  name: str  # as the user wrote it, e.g. v6e-8
  chip: Chip
  shape: tuple  # chips along each torus axis
  platform = "tpu"

  @property
  def memory_bytes(self) -> int:
    return self.chip.hbm_bytes

  @property
  def memory_what(self) -> str:
    return "HBM"

  @property
  def peaks(self) -> Peaks:
    return Peaks(bf16=self.chip.peak_flops, bandwidth=self.chip.hbm_bw)

  @property
  def num_chips(self) -> int:
    n = 1
    for s in self.shape:
      n *= s
    return n

  @property
  def libtpu_name(self) -> str:
    return f"{self.chip.prefix}:{'x'.join(map(str, self.shape))}"


# device_kind as libtpu reports it -> generation (the topology descriptions have no memory stats).
_KINDS = {"tpu v4": "v4", "tpu v5 lite": "v5e", "tpu v5e": "v5e", "tpu v5p": "v5p", "tpu v5": "v5p",
          "tpu v6 lite": "v6e", "tpu v6e": "v6e"}


def chip_of_kind(device_kind: str):
  """The Chip of a TPU device_kind ('TPU v6 lite' -> v6e), or None if unknown."""
  gen = _KINDS.get(device_kind.strip().lower())
  return CHIPS.get(gen) if gen else None


def known() -> list:
  """Every target name this module knows: TPU slices generation by generation, then GPUs."""
  out = []
  for gen, chip in CHIPS.items():
    shapes = _SHAPES_3D if chip.dims == 3 else _SHAPES_2D
    out += [f"{gen}-{n * chip.cores_per_chip}" for n in shapes]
  return out + gpus.known()


def parse(name: str):
  """'v6e-8' -> Slice, 'h100-8' -> gpus.GpuHost; UserError listing the known names otherwise."""
  host = gpus.parse(name)
  if host is not None:
    return host
  m = re.fullmatch(r"(v4|v5e|v5p|v6e)-([0-9]+)", name.strip().lower())
  chip = CHIPS.get(m.group(1)) if m else None
  shapes = (_SHAPES_3D if chip.dims == 3 else _SHAPES_2D) if chip else {}
  cores = int(m.group(2)) if m else 0
  if chip is None or cores % chip.cores_per_chip or cores // chip.cores_per_chip not in shapes:
    raise UserError(f"unknown topology '{name}'; known: {', '.join(known())}")
  return Slice(name.strip().lower(), chip, shapes[cores // chip.cores_per_chip])


def host_has_tpu() -> bool:
  """True on a TPU VM (accelerator device files present)."""
  return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def devices(sl) -> list:
  """The target's device descriptions (compile-only: no chip is touched)."""
  if sl.platform == "gpu":
    return gpus.devices(sl)
  on_tpu = host_has_tpu()
  if not on_tpu:
    # libtpu's lockfile guards real chips; a host without any has nothing to guard, and without
    # this a CPU-only JAX process in the same environment (which loads libtpu too) would block us.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  # No GCE metadata server to ask off Cloud TPU: say what we compile for instead of warnings.
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # Off a TPU host the accelerator type is always this target's, never one left in the
  # environment by an earlier compile in this process or in the one that started it.
  if on_tpu:
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", sl.name)
  else:
    os.environ["TPU_ACCELERATOR_TYPE"] = sl.name
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  try:  # only to tell "not installed" apart from other failures
    importlib.import_module("libtpu")
  except ImportError:
    raise UserError("compiling for a TPU needs libtpu, which is not installed; run "
                    "pip install -e '.[tpu]' (libtpu matching the installed jax)") from None
  from jax.experimental import topologies
  bounds = tuple(min(s, b) for s, b in zip(sl.shape + (1,) * (3 - len(sl.shape)), (2, 2, 1)))
  try:
    topo = topologies.get_topology_desc(platform="tpu", topology_name=sl.libtpu_name,
                                        chip_config_name=sl.chip.config,
                                        chips_per_host_bounds=bounds, num_slices=1)
  except Exception as e:  # noqa: BLE001 -- libtpu reports its lockfile as a generic runtime error
    raise UserError(libtpu_problem(str(e))) from None
  return list(topo.devices)


def libtpu_problem(message: str) -> str:
  """One line for a libtpu start-up failure, naming the lockfile when that is the cause."""
  if "lockfile" in message:
    return ("libtpu is in use by another process (it allows one at a time and holds "
            "/tmp/libtpu_lockfile): wait for that process to finish, then run this again; "
            "if it uses no TPU chip, set ALLOW_MULTIPLE_LIBTPU_LOAD=1")
  return f"libtpu could not describe the topology: {message.splitlines()[0]}"
