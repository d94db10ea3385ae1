"""Multi-process start: join the JAX distributed runtime before any backend exists.

One process per host (or several on one host for testing) each run the same command; after
`maybe_initialize` every process sees all devices of all processes in `jax.devices()`, so the
mesh, the shardings and the train step are unchanged. The `distributed:` config section selects
the mode; `NANOTEXT_COORDINATOR_ADDRESS`, `NANOTEXT_NUM_PROCESSES` and `NANOTEXT_PROCESS_ID` fill
keys left at their defaults (launchers find env vars easier to set per process than arguments).
"""

import dataclasses
import errno
import os
import socket
import threading

from nanotext import errors
from nanotext.errors import UserError

ENV_PREFIX = "NANOTEXT_"
# XLA's own deadline comes this much after distributed.init_timeout, so the watchdog's line is
# what a user sees: at XLA's, the process aborts with a C++ check failure (exit 134, ~45 lines).
XLA_GRACE_S = 60


@dataclasses.dataclass(frozen=True)
class Plan:
  """What to pass to jax.distributed.initialize; None = let JAX detect it."""
  coordinator_address: str | None
  num_processes: int | None
  process_id: int | None
  auto: bool
  init_timeout: int


def _env_int(name: str, key: str):
  raw = os.environ.get(ENV_PREFIX + name)
  if raw is None or raw.strip() == "":
    return None
  try:
    return int(raw)
  except ValueError:
    raise UserError(f"environment variable {ENV_PREFIX}{name}={raw!r} (for {key}) must be an "
                    "integer") from None


def plan(dist_cfg) -> Plan | None:
  """The checked distributed settings (config, then NANOTEXT_* env), or None for one process."""
  address = dist_cfg.coordinator_address.strip() or \
      os.environ.get(ENV_PREFIX + "COORDINATOR_ADDRESS", "").strip()
  num = dist_cfg.num_processes or _env_int("NUM_PROCESSES", "distributed.num_processes") or 0
  pid = dist_cfg.process_id
  if pid == -1:
    env_pid = _env_int("PROCESS_ID", "distributed.process_id")
    pid = -1 if env_pid is None else env_pid
  if num < 0:
    raise UserError(f"distributed.num_processes={num} must not be negative (0 = not set)")
  if pid < -1:
    raise UserError(f"distributed.process_id={pid} must be -1 (not set) or in "
                    "[0, distributed.num_processes)")
  if dist_cfg.local_device_count < 0:
    raise UserError(f"distributed.local_device_count={dist_cfg.local_device_count} must not be "
                    "negative (0 = the platform's own count)")
  if dist_cfg.init_timeout <= 0:
    raise UserError(f"distributed.init_timeout={dist_cfg.init_timeout} must be positive")
  if address:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
      raise UserError(f"distributed.coordinator_address={address!r} must be HOST:PORT, e.g. "
                      "127.0.0.1:12345 (the address of process 0)")
  if not dist_cfg.auto:
    if not address:
      if num or pid != -1:
        given = [f"{ENV_PREFIX}{name}={os.environ[ENV_PREFIX + name]}" for key, name in
                 (("num_processes", "NUM_PROCESSES"), ("process_id", "PROCESS_ID"))
                 if getattr(dist_cfg, key) in (0, -1) and os.environ.get(ENV_PREFIX + name)]
        raise UserError("distributed.num_processes and distributed.process_id need "
                        "distributed.coordinator_address (or distributed.auto=true)"
                        + (f"; set here by the environment: {', '.join(given)}" if given else ""))
      return None
    if num < 1:
      raise UserError(f"distributed.coordinator_address={address!r} needs "
                      "distributed.num_processes >= 1 (the number of processes in the run)")
    if pid == -1:
      raise UserError(f"distributed.coordinator_address={address!r} needs "
                      "distributed.process_id (0 for the coordinator, 1.. for the others)")
  if num and pid >= num:
    raise UserError(f"distributed.process_id={pid} must be in [0, distributed.num_processes="
                    f"{num})")
  return Plan(address or None, num or None, None if pid == -1 else pid, dist_cfg.auto,
              dist_cfg.init_timeout)


def maybe_initialize(dist_cfg, log=print) -> bool:
  """Set the CPU device count and join the distributed runtime if configured; True if joined.

  Must run before anything touches a JAX backend (jax.devices(), jax.device_count(), arrays).
  """
  import jax

  p = plan(dist_cfg)  # validate first: bad keys fail fast, before any network wait
  n = dist_cfg.local_device_count
  if n and jax.config.jax_num_cpu_devices != n:
    try:  # jax refuses the change once a backend exists
      jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:
      raise UserError(f"distributed.local_device_count={n} must be set before JAX starts; "
                      "this process already uses JAX (run it from a fresh process)") from None
  if p is None:
    return False
  if jax.distributed.is_initialized():
    check_device_counts(jax.devices())
    return True  # an in-process caller (a notebook, a test) already joined
  if p.process_id == 0 and p.coordinator_address:
    check_coordinator_port(p.coordinator_address)
  watchdog = threading.Timer(p.init_timeout, errors.fail, (not_joined(p),))
  watchdog.daemon = True
  watchdog.start()
  try:
    jax.distributed.initialize(
        coordinator_address=p.coordinator_address, num_processes=p.num_processes,
        process_id=p.process_id, initialization_timeout=p.init_timeout + XLA_GRACE_S,
        # Only auto mode may consult SLURM/MPI/TPU env; explicit settings must win as given.
        cluster_detection_method=None if p.auto else "deactivate")
  except (ValueError, RuntimeError) as e:
    if "must be called before" in str(e):  # jax refuses to join once a backend exists
      raise UserError("the distributed: settings need a fresh process (JAX is already running "
                      "here)") from None
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
    where = p.coordinator_address or "auto-detected coordinator"
    hint = " (distributed.auto=true found no cluster: set distributed.coordinator_address)" \
        if p.auto and p.coordinator_address is None else ""
    raise UserError(f"cannot join the distributed run at {where}: {first}{hint}") from None
  finally:
    watchdog.cancel()
  errors.BEFORE_REFUSAL.append(leave_together)
  log(f"process {jax.process_index()}/{jax.process_count()} on host {socket.gethostname()} "
      f"with {jax.local_device_count()} local devices ({jax.device_count()} in all)")
  check_device_counts(jax.devices())
  return True


def check_coordinator_port(address: str) -> None:
  """Refuse, on process 0, a coordinator port another program holds on this host: the
  coordination service it hosts failed to bind ('Failed to add port to server') and XLA took the
  process down with a segmentation fault (exit 139). Binds where jax would, then lets go."""
  given = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS", "")  # jax's override of where
  bind = given or "[::]:" + address.rpartition(":")[2]  # jax's default: every interface
  host, _, port = bind.rpartition(":")
  if not port.isdigit():
    return  # jax says what it makes of it
  host, port = host.strip("[]"), int(port)
  key = (f"JAX_COORDINATOR_BIND_ADDRESS={given!r}" if given else
         f"distributed.coordinator_address={address!r}")
  tries = [(socket.AF_INET6 if ":" in host else socket.AF_INET, host)]
  if host == "::":  # gRPC falls back to IPv4 alone on a host without IPv6
    tries.append((socket.AF_INET, "0.0.0.0"))
  for family, where in tries:
    try:
      with socket.socket(family, socket.SOCK_STREAM) as s:
        # as gRPC does: a port whose last connections linger in TIME_WAIT is free to listen on
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # dual-stack, as gRPC's: IPv4's listeners count too
          s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.bind((where, port))
        s.listen(1)
      return
    except OSError as e:
      if e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
        continue
      in_use = e.errno == errno.EADDRINUSE
      what = "is in use on this host" if in_use else f"cannot be opened here ({e.strerror})"
      raise UserError(f"port {port} {what}: process 0 hosts the run's coordinator there "
                      f"({key}); give every process another port"
                      + (", or stop the program that holds it" if in_use else "")) from None


def leave_together(timeout_s: float = 10.0) -> None:
  """Before a refusal's exit in a joined run: wait (bounded) until every process reaches one,
  process 0 a moment longer. Process 0 hosts the coordination service: gone first, it aborted
  a process still on its way to the same refusal (SIGABRT in XLA's coordination agent)."""
  import time

  import jax
  from jax._src import distributed as jax_distributed
  try:
    jax_distributed.global_state.client.wait_at_barrier("nanotext_refusal", int(timeout_s * 1e3))
  except Exception:  # pylint: disable=broad-except  # a process that refused alone: exit now
    return
  if jax.process_index() == 0:
    time.sleep(1.0)


def check_device_counts(devices) -> None:
  """Refuse, on every process, processes with different numbers of devices: each process's
  all-gathers (check_same_config's first) reshape to [processes, local devices] and crashed
  them with a traceback. Read from the global device list every process holds: no collective."""
  counts: dict = {}
  for d in devices:
    counts[d.process_index] = counts.get(d.process_index, 0) + 1
  if len(set(counts.values())) > 1:
    by_count: dict = {}
    for p, n in sorted(counts.items()):
      by_count.setdefault(n, []).append(p)
    each = "; ".join(f"{n} on process{'es' if len(ps) > 1 else ''} "
                     f"{', '.join(map(str, ps[:3]))}{', ...' if len(ps) > 3 else ''}"
                     for n, ps in sorted(by_count.items()))
    raise UserError(f"the processes hold different numbers of devices (jax.local_device_count(): "
                    f"{each}): give every process the same number (distributed."
                    "local_device_count on CPUs; as many visible accelerators on each host)")


def not_joined(p: Plan) -> str:
  """The line for a run whose processes did not all meet within distributed.init_timeout (the
  main thread then waits inside XLA: the watchdog prints it and exits 2)."""
  who = f"process {p.process_id} of {p.num_processes}" if p.num_processes else "this process"
  where = p.coordinator_address or "the auto-detected coordinator"
  return (f"cannot join the distributed run at {where}: {who} waited distributed.init_timeout="
          f"{p.init_timeout} s and not every process joined (start all of them, with the same "
          "coordinator address, process 0 the one at it, or raise the timeout)")


def _every_process(codes):
  """Every process's `codes` (numpy), stacked [processes, ...] by one all-gather; None where the
  run has one process."""
  import jax
  import numpy as np
  if jax.process_count() == 1:
    return None
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(codes))


def _real_path(path: str) -> str:
  """`path` resolved (absolute, links followed); as spelt where the OS cannot resolve it (a NUL
  byte, a lone surrogate: refused later, by the run's own checks)."""
  try:
    return os.path.realpath(path)
  except ValueError:
    return path


# keys naming files or folders: one place spelt otherwise per process (relative from a cwd,
# absolute, through a link) is one place
PATH_KEYS = ("output_dir", "checkpoint.load_params_from", "profile.dir", "train.compile_cache_dir",
             "data.dir", "data.train_files", "data.val_files")


def check_same_config(cfg_dict: dict) -> None:
  """Refuse, on every process, a run whose processes were given different configs (distributed.*
  aside): another train.steps hung both in a collective past SIGTERM, another model crashed
  them in gloo, another seed trained silently. A path (PATH_KEYS) agrees where spelt alike or
  where it resolves to one place."""
  import zlib

  import numpy as np
  from nanotext.config import flatten
  flat = flatten(cfg_dict)
  keys = sorted(k for k in flat if not k.startswith("distributed."))
  paths = [k for k in PATH_KEYS if k in flat]  # one list on every process: one gather's shape
  real = {k: _real_path(flat[k]) if flat[k] else "" for k in paths}
  codes = [zlib.crc32(f"{k}={flat[k]!r}".encode()) for k in keys]
  every = _every_process(  # [processes, keys + the paths' real paths]
      np.array(codes + [zlib.crc32(repr(real[k]).encode()) for k in paths], np.uint32))
  if every is None:
    return
  same = every == every[0]
  for i, k in enumerate(paths):  # the same spelling passes: where output_dir names a folder
    same[:, keys.index(k)] |= same[:, len(keys) + i]  # local to each host, check_shared_file
    # says so
  differ = np.nonzero(~same[:, :len(keys)].all(axis=0))[0]
  if differ.size:
    key = keys[differ[0]]
    other = next(p for p in range(len(every)) if not same[p, differ[0]])
    more = f" and {differ.size - 1} more key(s)" if differ.size > 1 else ""
    here = f"{flat[key]!r}" + (f", resolved {real[key]!r}" if real.get(key, flat[key]) !=
                               flat[key] else "")
    raise UserError(f"process {other} was given another {key} than process 0 ({here} "
                    f"here{more}): give every process the same config and overrides (only "
                    "distributed.process_id differs)")


def same_data(data_cfg) -> list:
  """This process's training data fingerprint (nanotext.data.fingerprint), after refusing, on
  every process, processes whose training or validation files differ: data.train_files spelt
  the same (a relative path, a folder local to each host) named other tokens on each, and the run
  trained on their mix silently, its config.yml naming process 0's files alone."""
  import zlib

  import jax
  import numpy as np
  from nanotext.data.fingerprint import fingerprint
  train = fingerprint(data_cfg)
  if jax.process_count() == 1:
    return train
  prints = {"train": train, "val": fingerprint(data_cfg, "val")}
  every = _every_process(  # [processes, splits]
      np.array([zlib.crc32(repr(p).encode()) for p in prints.values()], np.uint32))
  for j, split in enumerate(prints):
    other = next((p for p in range(len(every)) if every[p, j] != every[0, j]), None)
    if other is not None:
      # the keys that name the files: data.dir holds the built-in corpus's prepared shards
      key = f"data.{split}_files" if data_cfg.source == "bin" else "data.dir"
      raise UserError(f"process {other} reads other {key} than process 0 "
                      f"({data_cfg[key.removeprefix('data.')]!r} here): every host must see "
                      "the same files; give every process a path to the same shards (on a file "
                      "system they share, or the same copy on each host)")
  return train


def check_shared_file(path: str, what: str) -> None:
  """Refuse, on every process, a run whose processes do not see process 0's file `path` as it
  wrote it: `what` (output_dir) spelt the same on every host but a folder local to each failed
  at the first save (a traceback on one process, a hang or an abort on the others)."""
  import zlib

  import numpy as np
  try:
    with open(path, "rb") as f:
      code = zlib.crc32(f.read()) + 1  # 0: not there or not readable
  except OSError:
    code = 0
  every = _every_process(np.array(code, np.int64))
  blind = [] if every is None else [p for p in range(len(every)) if every[p] != every[0]]
  if blind:
    raise UserError(f"{what} is not one folder that every process sees: process {blind[0]} does "
                    f"not find process 0's {os.path.basename(path)} in it; give every process a "
                    "path on a file system they share")
