"""Changes to what a training step computes from the same config: each checkpoint records the
revision that wrote it, and a resume says which later changes touch its config (its steps from
there on are not the ones the older code would have taken)."""

import os
from typing import Callable, NamedTuple


class Change(NamedTuple):
  revision: int
  commit: str  # where the change landed, for `git show`
  applies: Callable  # config -> bool: whether a run of that config computes otherwise now
  what: str


def _adam_low_precision(cfg) -> bool:
  m = cfg.model
  return cfg.optim.name == "adamw" and (m.param_dtype != "float32" or
                                        m.embed_dtype not in ("", "float32"))


# Append a Change whenever a step of an existing config computes other numbers than before (a
# golden curve re-recorded is the usual sign); a change that makes a saved run refuse to restore
# says so at the restore instead. Revision 0 is every checkpoint saved before this record began.
CHANGES = (
    Change(1, "356920f", lambda c: c.optim.name == "muon" and c.model.fused_qkv
           and c.optim.muon_scale == "fan_out",
           "Muon scales the fused QKV matrix's update by its real fan-out/fan-in"),
    Change(2, "8065c25", lambda c: c.optim.grad_clip > 0 and c.train.loss_reduction == "row_sum",
           "optim.grad_clip bounds the mean loss's gradient norm under row_sum too"),
    Change(3, "a818eac", _adam_low_precision,
           "AdamW computes in float32 over parameters stored in bfloat16"),
)
CURRENT = CHANGES[-1].revision


def stamp() -> dict:
  """What a checkpoint records of the code and settings that computed it."""
  return {"revision": CURRENT, "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "compiler": compiler()}


def compiler() -> str:
  """The jax and jaxlib versions and the device kind that compiled the steps: another of any
  rounds otherwise (a run carried between a GPU machine's jax and a laptop's)."""
  import jax
  import jaxlib
  return f"jax {jax.__version__}, jaxlib {jaxlib.__version__}, {jax.devices()[0].device_kind}"


def saved_revision(integrity) -> int:
  """The revision a step was saved at: 0 where it has none (saved before revisions were kept)."""
  value = integrity.get("revision", 0) if isinstance(integrity, dict) else 0
  return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def resume_note(integrity, cfg, step: int) -> str:
  """The lines naming what computes otherwise since step `step` was saved ('' if nothing): the
  changes to nanotext that touch `cfg`, XLA_FLAGS (the CPU flags nanotext sets only where it is
  unset change the arithmetic, as may any flag), and jax, jaxlib or the device kind."""
  record = integrity if isinstance(integrity, dict) else {}
  lines = [_code_note(integrity, cfg, step)]
  for key, now, said in (("xla_flags", os.environ.get("XLA_FLAGS", ""),
                          "under XLA_FLAGS='{}', this process runs under '{}'"),
                         ("compiler", compiler(), "by {}; this process runs {}")):
    then = record.get(key)  # unrecorded (an older checkpoint): nothing said; nor at step 0
    if isinstance(then, str) and then != now and step > 0:  # (a conversion's: no step taken)
      lines.append(f"note: the checkpoint of step {step} was saved {said.format(then, now)}: XLA "
                   "may round the steps from here otherwise than an uninterrupted run")
  return "\n".join(line for line in lines if line)


def _code_note(integrity, cfg, step: int) -> str:
  saved = saved_revision(integrity)
  if saved > CURRENT:
    return (f"note: the checkpoint of step {step} was saved by a newer nanotext (arithmetic "
            f"revision {saved}; this one knows {CURRENT}): its steps from here may compute "
            "otherwise than that code's")
  since = [c for c in CHANGES if c.revision > saved and c.applies(cfg)]
  if not since:
    return ""
  when = (f"at revision {saved} of nanotext's arithmetic (now {CURRENT})" if saved else
          "before nanotext recorded its arithmetic's revision (runs saved before 2026-12-06 "
          "precede every change below)")
  changes = "; ".join(f"{c.what} ({c.commit})" for c in since)
  return (f"note: the checkpoint of step {step} was saved {when}; since then, for this config: "
          f"{changes}. The steps from here compute as the current code does")
