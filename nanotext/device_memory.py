"""How many bytes each device may hold: the machine probed (host RAM, cgroup and address-space
limits for CPU devices, the runtime's limit or the chip's spec for accelerators), the same on
every process. The memory plan (nanotext/memory_plan.py) plans against it."""

import os
import resource

import numpy as np

from nanotext import gpus, topology
from nanotext.errors import UserError

# Host RAM the plan takes as free, in GiB, instead of MemAvailable: CPU plans that do not move
# with what else the machine is running (the test suite sets it; cgroup and ulimit still apply).
HOST_MEMORY_ENV = "NANOTEXT_HOST_MEMORY_GIB"


def host_available() -> tuple:
  """(bytes this process may still allocate, where that comes from): the least of free RAM
  (MemAvailable, or $NANOTEXT_HOST_MEMORY_GIB), the cgroup's limit and the address-space limit
  (`ulimit -v`) left."""
  pinned = os.environ.get(HOST_MEMORY_ENV)
  found = [(_gib_bytes(pinned), f"{HOST_MEMORY_ENV}={pinned}")] if pinned else _free_ram()
  try:
    with open("/sys/fs/cgroup/memory.max") as f:
      limit = f.read().strip()
    with open("/sys/fs/cgroup/memory.current") as f:
      used = int(f.read())
    if limit != "max":
      found.append((int(limit) - used, "the cgroup's memory limit left"))
  except (OSError, ValueError):
    pass
  soft = resource.getrlimit(resource.RLIMIT_AS)[0]
  if soft != resource.RLIM_INFINITY:
    found.append((soft - _vm_size(), f"the address-space limit left (ulimit -v {soft // 1024})"))
  return min(found) if found else (None, "unknown")


def _gib_bytes(text: str) -> int:
  """$NANOTEXT_HOST_MEMORY_GIB's `text` in bytes; UserError unless it is a positive number."""
  try:
    gib = float(text)
  except ValueError:
    gib = 0.0
  if not gib > 0 or gib == float("inf"):
    raise UserError(f"{HOST_MEMORY_ENV}={text!r} is not a positive number of GiB; set it to the "
                    "host RAM the memory plan may use (e.g. 16), or unset it to use what is free")
  return int(gib * 2**30)


def _free_ram() -> list:
  """[(bytes, what)]: MemAvailable, else the free pages; [] if neither can be read."""
  try:
    with open("/proc/meminfo") as f:
      info = dict(line.split(":", 1) for line in f)
    return [(int(info["MemAvailable"].split()[0]) * 1024, "available host RAM")]
  except (OSError, KeyError, ValueError):
    try:
      return [(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free host RAM")]
    except (ValueError, OSError, AttributeError):
      return []


def _vm_size() -> int:
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmSize:"):
          return int(line.split()[1]) * 1024
  except (OSError, ValueError):
    pass
  return 0


def capacity(devices) -> tuple:
  """(bytes per device a program may use, or None if unknown; what it is)."""
  first = devices[0]
  if first.platform == "cpu":
    local = sum(d.process_index == first.process_index for d in devices)
    avail, what = host_available()
    if avail is None:
      return None, what
    return agreed(max(0, avail) // local), f"{what} / {local} CPU device(s)"
  try:
    limit = (first.memory_stats() or {}).get("bytes_limit")
  except Exception:  # noqa: BLE001 -- a TPU topology description has no memory stats
    limit = None
  if limit:
    return agreed(int(limit)), f"{first.device_kind} memory"
  if first.platform == "tpu":
    chip = topology.chip_of_kind(first.device_kind)
    if chip is not None:
      return chip.hbm_bytes, f"{first.device_kind} HBM"
  if first.platform == "gpu":  # a description to compile for (nanotext.gpus): no memory stats
    gpu = gpus.of_kind(first.device_kind)
    if gpu is not None:
      return int(gpus.pool_fraction() * gpu.memory_bytes), f"{first.device_kind}, JAX's pool"
  return None, "unknown"


def agreed(n: int) -> int:
  """The least of `n` over the processes, so every process makes the same plan."""
  import jax
  if jax.process_count() == 1:
    return n
  from jax.experimental import multihost_utils
  # In MiB: jax without x64 carries the gathered value as int32, and bytes past 2 GiB wrapped
  # negative (a 2-process CPU run was told its devices had -777 MiB and refused).
  mib = multihost_utils.process_allgather(np.asarray(n >> 20, np.int32))
  return int(np.min(mib)) << 20
