"""NVIDIA GPUs you can compile for without owning one: specs, XLA's target description, devices.

A name is the GPU with an optional count: `h100` (one), `h100-8` (one 8-GPU host). XLA's GPU
compiler runs on a CPU-only machine when it is handed a description of the target
(`GpuTargetConfigProto`, built here from the spec sheet); the jax CUDA plugin wheels must be
installed (the `gpu-compile` extra) but no GPU, driver or CUDA runtime is needed. Nothing runs.
"""

import dataclasses
import importlib
import os
import re

from nanotext.errors import UserError
from nanotext.roofline import Peaks

# Per-compile XLA options for a machine with nothing to time on: no autotuning, and dots to
# cuBLAS rather than untuned Triton GEMMs (with them, the FP8 head stayed a dequantize + float32
# dot; without, it is cuBLASLt FP8 GEMMs, as the autotuned program on a real H100 was).
COMPILER_OPTIONS = {"xla_gpu_autotune_level": 0, "xla_gpu_enable_triton_gemm": False}
POOL_FRACTION = 0.75  # JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION: the share it pre-allocates
# The workspace XLA gives each cuBLAS call (its GemmConfig, after NVIDIA's advice for
# cublasSetWorkspace): 32 MiB from Hopper (compute capability 9) on, 4 MiB on earlier GPUs.
HOPPER_WORKSPACE, EARLIER_WORKSPACE = 32 * 2**20, 4 * 2**20


@dataclasses.dataclass(frozen=True)
class Gpu:
  """One GPU model: what XLA's cost model and code generator need, and its published peaks."""
  description: str  # device_kind as CUDA names it
  capability: tuple  # (major, minor)
  sms: int
  fp32_lanes: int  # FP32 units per SM
  clock_ghz: float
  l2_bytes: int
  memory_bytes: int  # what CUDA reports as the device's total memory
  smem_per_sm: int
  smem_optin: int  # shared memory a block may opt in to
  peaks: Peaks  # dense FLOP/s (bf16, FP8 where the chip has it, TF32 for float32) and HBM bytes/s

  def target_config(self, dnn=(9, 19), cuda=(13, 0)) -> str:
    """The GpuTargetConfigProto text XLA compiles against."""
    major, minor = self.capability
    info = {"threads_per_block_limit": 1024, "threads_per_warp": 32,
            "shared_memory_per_block": 48 * 1024, "shared_memory_per_core": self.smem_per_sm,
            "threads_per_core_limit": 2048, "core_count": self.sms,
            "fpus_per_core": self.fp32_lanes, "block_dim_limit_x": 2**31 - 1,
            "block_dim_limit_y": 65535, "block_dim_limit_z": 65535,
            "memory_bandwidth": int(self.peaks.bandwidth), "l2_cache_size": self.l2_bytes,
            "clock_rate_ghz": self.clock_ghz, "device_memory_size": self.memory_bytes,
            "shared_memory_per_block_optin": self.smem_optin,
            "registers_per_core_limit": 65536, "registers_per_block_limit": 65536}
    body = "\n".join(f"  {k}: {v}" for k, v in info.items())
    return (f"gpu_device_info {{\n{body}\n  cuda_compute_capability {{ major: {major} minor: "
            f"{minor} }}\n}}\nplatform_name: \"CUDA\"\n"
            f"dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} }}\n"
            f"runtime_version {{ major: {cuda[0]} minor: {cuda[1]} }}\n"
            f"device_description_str: \"{self.description}\"\n")


KIB, GIB = 2**10, 2**30
# Vendor spec sheets (SXM parts, dense peaks). The H100's memory is what the lent one reported
# through CUDA; with JAX's default pool (75%) that left 59.4 GiB to programs, as measured there.
GPUS = {
    "h100": Gpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 1.98, 50 * 2**20, 84_978_434_048,
                228 * KIB, 227 * KIB, Peaks(bf16=989e12, fp8=1979e12, f32=494.5e12,
                                            bandwidth=3.35e12)),
    "h200": Gpu("NVIDIA H200", (9, 0), 132, 128, 1.98, 50 * 2**20, 150_754_820_096,
                228 * KIB, 227 * KIB, Peaks(bf16=989e12, fp8=1979e12, f32=494.5e12,
                                            bandwidth=4.8e12)),
    "a100-80gb": Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 1.41, 40 * 2**20, 85_094_285_312,
                     164 * KIB, 163 * KIB, Peaks(bf16=312e12, f32=156e12, bandwidth=2.039e12)),
    "b200": Gpu("NVIDIA B200", (10, 0), 148, 128, 1.965, 126 * 2**20, 191_514_673_152,
                228 * KIB, 227 * KIB, Peaks(bf16=2250e12, fp8=4500e12, f32=1100e12,
                                            bandwidth=7.7e12)),
}
COUNTS = (1, 2, 4, 8)  # GPUs on one host


@dataclasses.dataclass(frozen=True)
class GpuHost:
  """`count` GPUs of one model on one host: the target of `python -m nanotext.compile`."""
  name: str  # as the user wrote it: h100, h100-8
  gpu: Gpu
  count: int
  platform = "gpu"

  @property
  def num_chips(self) -> int:
    return self.count

  @property
  def memory_bytes(self) -> int:
    """What a program may use per GPU: JAX's pool, XLA_PYTHON_CLIENT_MEM_FRACTION of it."""
    return int(pool_fraction() * self.gpu.memory_bytes)

  @property
  def memory_what(self) -> str:
    f = pool_fraction()  # a share below 1% was '0%': with a decimal, or '<0.1%'
    share = f"{f:.0%}" if f >= 0.01 else f"{f:.1%}" if f >= 0.001 else "<0.1%"
    return f"JAX's pool, {share} of {self.gpu.memory_bytes / GIB:.1f} GiB"

  @property
  def peaks(self) -> Peaks:
    return self.gpu.peaks

  @property
  def device_kind(self) -> str:
    return self.gpu.description


def pool_fraction() -> float:
  """XLA_PYTHON_CLIENT_MEM_FRACTION as JAX reads it (default 0.75)."""
  try:
    value = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", POOL_FRACTION))
  except ValueError:
    raise UserError("XLA_PYTHON_CLIENT_MEM_FRACTION must be a number in (0, 1], e.g. 0.9") \
        from None
  if not 0 < value <= 1:
    raise UserError(f"XLA_PYTHON_CLIENT_MEM_FRACTION={value} must be in (0, 1]")
  return value


def of_kind(device_kind: str):
  """The Gpu whose description is `device_kind`, or None."""
  return next((g for g in GPUS.values() if g.description == device_kind), None)


def gemm_workspace(device) -> int:
  """Bytes of the workspace XLA gives each cuBLAS call on `device` (a target's description or a
  real GPU, which names its compute capability); 0 off a GPU."""
  if device.platform != "gpu":
    return 0
  gpu = of_kind(device.device_kind)
  major = gpu.capability[0] if gpu else \
      int(str(getattr(device, "compute_capability", "9")).split(".")[0])
  return HOPPER_WORKSPACE if major >= 9 else EARLIER_WORKSPACE


def known() -> list:
  return [f"{g}" if n == 1 else f"{g}-{n}" for g in GPUS for n in COUNTS]


def parse(name: str):
  """'h100-8' -> GpuHost, or None when `name` names no GPU."""
  m = re.fullmatch(r"(h100|h200|a100-80gb|b200)(?:-([0-9]+))?", name.strip().lower())
  if not m:
    return None
  count = int(m.group(2) or 1)
  if count not in COUNTS:
    raise UserError(f"GPU target '{name}': one host holds {', '.join(map(str, COUNTS))} GPUs; "
                    f"known: {', '.join(known())}")
  return GpuHost(name.strip().lower(), GPUS[m.group(1)], count)


def devices(host: GpuHost) -> list:
  """The host's GPU device descriptions (compile-only: no GPU, driver or CUDA runtime used)."""
  try:
    importlib.import_module("jax_plugins.xla_cuda13")
  except ImportError:
    raise UserError("compiling for a GPU needs the jax CUDA plugin, which is not installed; run "
                    "pip install -e '.[gpu-compile]' (jax-cuda13-plugin and jax-cuda13-pjrt "
                    "matching the installed jax)") from None
  from jax.experimental import topologies
  try:
    topo = topologies.get_topology_desc(platform="cuda", target_config=host.gpu.target_config(),
                                        topology=f"1x1x{host.count}")
  except Exception as e:  # noqa: BLE001 -- the plugin reports every problem as a runtime error
    raise UserError(f"the jax CUDA plugin could not describe {host.name}: "
                    f"{str(e).splitlines()[0]}") from None
  return list(topo.devices)
