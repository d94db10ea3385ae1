"""Where Pallas kernels run: the platform a program is built for, and one call per device."""

import contextlib

import jax

from nanotext import sharding

_target = []  # set by building_for: a trace that stands for a program on another platform

# nanotext's own GPU kernels that ran slower on an H200 than what they replace (the record's
# step: 186.6 ms with the first three, 113.3 ms with none; benchmarks/RESULTS.md, 2026-12-04).
# Built and tested (interpreted on CPU), taken only where opted in: benchmarks/gpu_step.py
# --own_kernels, for an A/B on a GPU.
OWN_KERNELS = (
    "flash_gpu_qkv",  # QK-norm, rotation and the value mix inside flash_gpu's kernels: 1.55x
    "fp8_head",  # the FP8 head's forward GEMM with its exp-sum inside: 17.7 ms vs 10.6
    "relu2_mlp",  # the MLP's squared ReLU inside its GEMMs
    "flash_gpu_one_backward",  # flash_gpu's dq and dk/dv in one kernel: 20.3 ms vs 16.1 (two)
)
_opted_in = []  # names, set by opting_in


def platform() -> str:
  """The platform the program is built for: building_for's, else the active mesh's devices, else
  the default backend.

  Pallas kernels are Mosaic or interpreted by this, never by the host's default backend alone: a
  CPU host compiling for a TPU topology must get the TPU kernel."""
  if _target:
    return _target[-1]
  active = sharding.active()
  return jax.default_backend() if active is None else active[1].devices.flat[0].platform


@contextlib.contextmanager
def building_for(target: str):
  """Trace as for `target` with no mesh of its devices (the memory plan's traces): the head takes
  that platform's slices (model/head_loss.py)."""
  _target.append(target)
  try:
    yield
  finally:
    _target.pop()


def opted_in(kernel: str) -> bool:
  """Whether `kernel` (one of OWN_KERNELS) is taken where it applies."""
  return kernel in _opted_in


@contextlib.contextmanager
def opting_in(*kernels: str):
  """Build programs with these OWN_KERNELS taken where they apply."""
  unknown = set(kernels) - set(OWN_KERNELS)
  if unknown:
    raise ValueError(f"not one of nanotext's own kernels {OWN_KERNELS}: {sorted(unknown)}")
  _opted_in.extend(kernels)
  try:
    yield
  finally:
    del _opted_in[len(_opted_in) - len(kernels):]


def per_device(local, q_BTHK, k_BTHK, v_BTHK, segment_ids_BT, *extra):
  """`local(q, k, v[, segment ids], *extra)` per device on its batch/head shard under a mesh;
  `extra` are replicated (e.g. a runtime window)."""
  args = (q_BTHK, k_BTHK, v_BTHK) + (() if segment_ids_BT is None else (segment_ids_BT,))
  # A Pallas kernel is opaque to the SPMD partitioner (it would gather everything onto every
  # device), so it runs per device: batch and heads split as the rules say, the sequence whole.
  names = ("batch", None, "act_heads", None)
  in_axes = (names,) * 3 + (() if segment_ids_BT is None else (("batch", None),))
  in_axes += tuple((None,) * jax.numpy.ndim(x) for x in extra)
  return sharding.per_device(local, args + tuple(extra), in_axes, names)
