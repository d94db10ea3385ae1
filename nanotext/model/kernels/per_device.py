"""Where Pallas kernels run: the platform a program is built for, and one call per device."""

import contextlib

import jax

from nanotext import sharding

_target = []  # set by building_for: a trace that stands for a program on another platform


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
