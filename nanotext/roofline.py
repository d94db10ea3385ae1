"""A roofline estimate of one step of a compiled program, from its launches (nanotext/hlo.py).

Each launch is priced at max(FLOPs / peak, bytes / bandwidth): a lower bound that cannot see
launch gaps, atomics, kernels running below peak or FLOPs inside custom kernels (the caller
prices those analytically). Never a measured time.
"""

import collections
import dataclasses
import re

from nanotext.hlo import Kernel, kernels, parse
from nanotext.hlo_loops import loops


@dataclasses.dataclass(frozen=True)
class Peaks:
  """What the roofline prices with: FLOP/s by math kind and memory bytes/s of one device."""
  bf16: float
  bandwidth: float
  fp8: float = 0.0  # 0: as bf16
  f32: float = 0.0  # 0: as bf16 (a TPU's default precision); a GPU's TF32 rate

  def flops_per_s(self, kind: str) -> float:
    return {"fp8": self.fp8, "f32": self.f32}.get(kind) or self.bf16


def seconds(k: Kernel, peaks: Peaks) -> float:
  """The launch's lower bound, times its count per step."""
  return k.count * max(k.flops / peaks.flops_per_s(k.math), k.bytes / peaks.bandwidth)


ATTENTION = "attention_kernel"  # the jax scope of the attention kernels (model/attention.py)
UNPRICED = ("launch gaps between kernels, atomics (scatter-adds), kernels running below peak, "
            "and the FLOPs inside custom kernels beyond the analytic attention count")


def inventory(text: str, peaks: Peaks, *, logits_elements: int = 0, logits_bytes: float = 0.0,
              vocab: int = 0, custom_flops: float = 0.0, top: int | None = 8) -> dict:
  """Launches by kind and a roofline estimate of one step of a compiled program.

  `logits_elements`: the size of the [tokens, vocab] logits one head kernel works on (a slice
  of the tokens, model/head_loss.py); kernels (not collectives) with an operand or result at
  least half that size touch the logits, and their bytes over `logits_bytes` (one read of the
  whole bf16 logits) say how many passes over the logits the step makes besides its GEMMs.
  `custom_flops`: the analytic FLOPs of the custom kernels (attention), which their HLO does not
  show; they are
  priced as a whole at the bf16 peak, or at their bytes where that is slower. `slowest_ops`:
  the `top` (None: every) non-GEMM launches summed by the jax op that made them, every layer's
  as one (block_3 -> block_N): (op, seconds, launches, bytes a launch moves on average), slowest
  first. `unknown_loops`: loops whose trip count nothing says (counted once); `unstated_loops`:
  loops run more than once whose backend config does not say so (XLA's cost analysis counts
  their bodies once: its FLOPs are short).
  """
  parsed = parse(text)
  ks, lp = kernels(text, parsed), loops(parsed[0])
  count = lambda *kinds: sum(k.count for k in ks if k.kind in kinds)
  gemms = {m: sum(k.count for k in ks if k.kind.startswith("gemm") and k.math == m)
           for m in ("bf16", "f32", "fp8")}
  # The attention kernels as a whole at the analytic FLOPs (their HLO does not show them); a
  # custom kernel named outside attention (elementwise work, kernels/qk_rope.py) at its bytes.
  own = lambda k: k.kind in ("custom", "cudnn") and k.op and ATTENTION not in k.op
  custom = [k for k in ks if k.kind in ("custom", "cudnn") and not own(k)]
  custom_s = max(sum(k.count * k.bytes for k in custom) / peaks.bandwidth,
                 custom_flops / peaks.bf16) if custom else 0.0
  custom_s += sum(seconds(k, peaks) for k in ks if own(k))
  # Not collectives: those with a vocab-wide array gather the head weight (FSDP), once per loss
  # chunk in a chunked head; the logits themselves stay on their device.
  big = [k for k in ks if logits_elements and k.largest * 2 >= logits_elements
         and (not vocab or vocab in k.dims) and k.kind != "collective"]
  parts = {"gemm": sum(seconds(k, peaks) for k in ks if k.kind.startswith("gemm")),
           "custom": custom_s,
           "logits passes": sum(seconds(k, peaks) for k in big if not k.kind.startswith("gemm")),
           "other": sum(seconds(k, peaks) for k in ks if k.kind not in ("custom", "cudnn")
                        and not k.kind.startswith("gemm") and k not in big)}
  passes = collections.defaultdict(lambda: [0.0, 0, 0.0])  # non-GEMM launches by jax op
  for k in ks:
    if k.kind not in ("custom", "cudnn") and not k.kind.startswith("gemm"):
      group = passes[re.sub(r"_\d+\b", "_N", k.op) or "(no op name)"]
      group[0] += seconds(k, peaks)
      group[1] += k.count
      group[2] += k.count * k.bytes
  return {"launches": sum(k.count for k in ks), "gemm_calls": gemms,
          "fp8_fast_accum": sum(k.count for k in ks if k.fast_accum),
          "own_gemms": sum(k.count for k in ks if k.own),  # Pallas GEMMs (model/kernels)
          "own_gemm_calls": {m: sum(k.count for k in ks if k.own and k.math == m) for m in gemms},
          "gemm_flops": sum(k.count * k.flops for k in ks if k.kind.startswith("gemm")),
          "custom_kernels": count("custom"), "cudnn_calls": count("cudnn"),
          "fusions": count("fusion"), "scatters": count("scatter"), "copies": count("copy"),
          "collective_launches": count("collective"), "other": count("other"),
          "logits_kernels": sum(k.count for k in big if not k.kind.startswith("gemm")),
          "logits_gemms": sum(k.count for k in big if k.kind.startswith("gemm")),
          "logits_passes": sum(k.count * k.bytes for k in big if not k.kind.startswith("gemm"))
                           / logits_bytes if logits_bytes else 0.0,
          "unknown_loops": sum(1 for _, n, _ in lp if not n),
          "unstated_loops": sum(1 for _, n, stated in lp if n != 1 and not stated),
          "estimate_s": sum(parts.values()), "estimate_parts_s": parts,
          "passes_s": sum(sec for sec, _, _ in passes.values()),  # every non-GEMM launch's
          "slowest_ops": sorted(((op, sec, n, b / max(n, 1))
                                 for op, (sec, n, b) in passes.items()),
                                key=lambda row: -row[1])[:top]}
