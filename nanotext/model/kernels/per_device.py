"""Where Pallas kernels run: the platform a program is built for, and one call per device."""

import jax

from nanotext import sharding


def platform() -> str:
  """The platform the program is built for: the active mesh's devices, else the default backend.

  Pallas kernels are Mosaic or interpreted by this, never by the host's default backend alone: a
  CPU host compiling for a TPU topology must get the TPU kernel."""
  active = sharding.active()
  return jax.default_backend() if active is None else active[1].devices.flat[0].platform


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
