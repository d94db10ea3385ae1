"""The entry point's CPU XLA flags: set only on a CPU-only run whose user left XLA_FLAGS alone."""

import pytest

from nanotext import xla_flags

pytestmark = pytest.mark.fast


@pytest.fixture
def jaxlib(monkeypatch):
  def use(v):
    monkeypatch.setattr("importlib.metadata.version", lambda name: v)
  return use


def test_set_on_cpu_when_unset(jaxlib):
  jaxlib("0.10.2")
  env = {"JAX_PLATFORMS": "cpu"}
  assert xla_flags.maybe_set_cpu_flags(env) == " ".join(xla_flags.CPU_FLAGS)
  assert env["XLA_FLAGS"] == " ".join(xla_flags.CPU_FLAGS)


def test_left_alone(jaxlib, monkeypatch):
  jaxlib("0.10.2")
  mine = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  assert xla_flags.maybe_set_cpu_flags(mine) is None
  assert mine["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
  gpu = {"JAX_PLATFORMS": "cuda,cpu"}
  assert xla_flags.maybe_set_cpu_flags(gpu) is None and "XLA_FLAGS" not in gpu
  jaxlib("0.99.0")  # an untested jaxlib might abort on a flag it does not know
  assert xla_flags.maybe_set_cpu_flags({"JAX_PLATFORMS": "cpu"}) is None


def test_accelerator_device_nodes_mean_not_cpu_only(monkeypatch):
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.setattr(xla_flags.glob, "glob", lambda p: ["/dev/nvidia0"] if "nvidia" in p else [])
  assert not xla_flags.cpu_only()
  monkeypatch.setattr(xla_flags.glob, "glob", lambda p: [])
  assert xla_flags.cpu_only() == (xla_flags.sys.platform != "darwin")
