"""Framework overhead: `python benchmarks/overhead.py [CONFIG] [key=value ...] [--rounds N]`.

Times nanotext's train step for a GPT-2-style config (default configs/base.yml) against the
minimal hand-written JAX step of the same math in `benchmarks/reference_step.py`, on one device
and synthetic batches of the config's shape. Both start from the same parameters (nanotext's
init, copied into the reference's dict); their losses must agree to 1e-5 relative, which is what
makes the comparison one of the same computation. The steps run interleaved, `--rounds` rounds of
`--steps` steps each, alternating which goes first, so that load on a shared machine hits both;
the table gives median step times and the ratio nanotext / reference (target: within 5%).
"""

import os
import statistics
import sys
import time

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))



def _define_flags() -> None:
  # Defined only when run as a script: tests import several benchmarks into one absl registry.
  flags.DEFINE_integer("rounds", 7, "Interleaved timing rounds (medians are reported).")
  flags.DEFINE_integer("steps", 3, "Timed steps of each implementation per round.")
  flags.DEFINE_integer("warmup", 2, "Untimed steps of each after compilation (>= 1).")


DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                              "configs", "base.yml")
LOSS_RTOL = 1e-5
TARGET = 1.05
# The reference implements classic GPT-2 only; a config must keep these values to be comparable.
REQUIRED = {"model.positions": "learned", "model.norm": "layernorm", "model.mlp_act": "gelu",
            "model.bias": True, "model.tie_embeddings": True, "model.qk_norm": False,
            "model.logit_softcap": 0.0, "model.x0_mix": False, "model.attn_scale": 0.0,
            "model.dtype": "float32", "model.param_dtype": "float32", "attention.window": 0,
            "attention.window_pattern": "", "attention.window_schedule": False,
            "attention.doc_mask": False, "optim.name": "adamw", "train.grad_accum": 1,
            "train.on_nonfinite": "abort",
            "model.scan_layers": False}  # its weight copy reads blocks.{i}


def check_supported(cfg, who: str = "overhead.py") -> None:
  """UserError unless the config is the GPT-2 baseline the reference implements (`who`: what
  cannot compare it)."""
  from nanotext import config
  from nanotext.errors import UserError
  for key, want in REQUIRED.items():
    try:
      got = config.get(cfg, key)
    except (KeyError, AttributeError, UserError):
      continue  # a key this version of nanotext lacks cannot change the math
    if got != want:
      raise UserError(f"{key}={got!r}: the reference step implements GPT-2 as configs/base.yml "
                      f"does ({key}={want!r}); {who} cannot compare this config")


def hparams(cfg):
  """The reference's Hparams from a finalized nanotext config."""
  from reference_step import Hparams
  m, o = cfg.model, cfg.optim
  return Hparams(vocab_size=m.vocab_size, num_layers=m.num_layers, d_model=m.d_model,
                 num_heads=m.num_heads, head_dim=m.head_dim, mlp_dim=m.mlp_dim,
                 seq_len=m.max_seq_len, lr=o.lr, beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                 weight_decay=o.weight_decay, grad_clip=o.grad_clip, warmup_steps=o.warmup_steps,
                 cooldown_frac=o.cooldown_frac, final_lr_frac=o.final_lr_frac,
                 total_steps=cfg.train.steps)


def reference_params(nt: dict) -> dict:
  """Copy nanotext's parameter tree into the reference's dict layout (fresh buffers)."""
  import jax
  import jax.numpy as jnp
  cp = jnp.copy  # nanotext's state is donated to its step; the reference needs its own arrays
  blocks = []
  for i in sorted(nt["blocks"]):
    b = nt["blocks"][i]
    a, mlp = b["attn"], b["mlp"]
    blocks.append({
        "ln1_scale": cp(b["ln1"]["scale"]), "ln1_bias": cp(b["ln1"]["bias"]),
        "wq": cp(a["q"]["kernel"]), "bq": cp(a["q"]["bias"]),
        "wk": cp(a["k"]["kernel"]), "bk": cp(a["k"]["bias"]),
        "wv": cp(a["v"]["kernel"]), "bv": cp(a["v"]["bias"]),
        "wo": cp(a["o"]["kernel"]), "bo": cp(a["o"]["bias"]),
        "ln2_scale": cp(b["ln2"]["scale"]), "ln2_bias": cp(b["ln2"]["bias"]),
        "w_fc": cp(mlp["fc"]["kernel"]), "b_fc": cp(mlp["fc"]["bias"]),
        "w_proj": cp(mlp["proj"]["kernel"]), "b_proj": cp(mlp["proj"]["bias"])})
  out = {"wte": cp(nt["embed"]["embedding"]), "wpe": cp(nt["pos"]), "blocks": blocks,
         "lnf_scale": cp(nt["ln_f"]["scale"]), "lnf_bias": cp(nt["ln_f"]["bias"])}
  # Every nanotext parameter must have a place here, or the two models are not the same math.
  n_nt, n_ref = (sum(x.size for x in jax.tree.leaves(t)) for t in (nt, out))
  assert n_nt == n_ref, f"nanotext has {n_nt} parameters, the reference {n_ref}"
  return out


class Pair:
  """nanotext's compiled step and state beside the reference's, on one device, one batch."""

  def __init__(self, path, overrides):
    import jax
    import reference_step as ref
    from nanotext import trainer, wiring
    self.setup = wiring.prepare(path, list(overrides) + ["data.source=synthetic",
                                                         "data.tokenizer=none"],
                                devices=jax.devices()[:1])
    cfg = self.setup.cfg
    check_supported(cfg)
    self.cfg, self.hp = cfg, hparams(cfg)
    self.state = self.setup.init_state()
    self.batch = trainer.global_batch(self.setup, next(self.setup.train_iter()))
    self.params = reference_params(self.state["params"])
    self.tx = ref.make_optimizer(self.hp)
    self.opt_state = self.tx.init(self.params)
    t0 = time.perf_counter()
    compiled = trainer.make_train_step(self.setup).lower(self.state, self.batch).compile()
    schedule = trainer.schedule_of(self.setup)
    self.nt_step = lambda state, batch: compiled(state, batch, schedule)
    self.nt_compile_s = time.perf_counter() - t0
    x, y = self.batch["inputs"], self.batch["targets"]
    t0 = time.perf_counter()
    self.ref_step = ref.make_train_step(self.hp, self.tx).lower(
        self.params, self.opt_state, x, y).compile()
    self.ref_compile_s = time.perf_counter() - t0
    self.nt_losses, self.ref_losses = [], []

  def run_nanotext(self, n: int) -> float:
    """Seconds per step over n steps."""
    import jax
    t0 = time.perf_counter()
    for _ in range(n):
      self.state, m = self.nt_step(self.state, self.batch)
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t0) / n
    self.nt_losses.append(float(m["loss"]))
    return dt

  def run_reference(self, n: int) -> float:
    """Seconds per step over n steps."""
    import jax
    x, y = self.batch["inputs"], self.batch["targets"]
    t0 = time.perf_counter()
    for _ in range(n):
      self.params, self.opt_state, loss, _ = self.ref_step(self.params, self.opt_state, x, y)
    jax.block_until_ready(loss)
    dt = (time.perf_counter() - t0) / n
    self.ref_losses.append(float(loss))
    return dt


def measure(path, overrides, *, rounds: int, steps: int, warmup: int) -> dict:
  """Build both steps, check they compute the same loss, and time them interleaved."""
  import jax
  pair = Pair(path, overrides)
  # A step reports the loss before its update, so the first step's is the loss at the shared
  # initial params: the same-math check, without compiling a separate loss function.
  pair.run_nanotext(1)
  pair.run_reference(1)
  nt_loss, ref_loss = pair.nt_losses[0], pair.ref_losses[0]
  if warmup > 1:
    pair.run_nanotext(warmup - 1)
    pair.run_reference(warmup - 1)
  nt_t, ref_t = [], []
  for r in range(rounds):
    # Alternate who goes first, so a slow spell or a warm cache favours neither.
    if r % 2 == 0:
      nt_t.append(pair.run_nanotext(steps))
      ref_t.append(pair.run_reference(steps))
    else:
      ref_t.append(pair.run_reference(steps))
      nt_t.append(pair.run_nanotext(steps))
  cfg = pair.cfg
  nt_med, ref_med = statistics.median(nt_t), statistics.median(ref_t)
  return {"params": pair.setup.num_params, "backend": jax.default_backend(),
          "tokens": cfg.train.batch_size * cfg.train.seq_len,
          "shape": f"{cfg.train.batch_size}x{cfg.train.seq_len}",
          "nt_loss0": nt_loss, "ref_loss0": ref_loss,
          "loss_rel_diff": abs(nt_loss - ref_loss) / abs(ref_loss),
          "nt_loss_end": pair.nt_losses[-1], "ref_loss_end": pair.ref_losses[-1],
          "trained_steps": max(warmup, 1) + rounds * steps,
          "nt_compile_s": pair.nt_compile_s, "ref_compile_s": pair.ref_compile_s,
          "nt_step_s": nt_med, "ref_step_s": ref_med, "nt_all": nt_t, "ref_all": ref_t,
          "ratio": nt_med / ref_med,
          "paired_ratio": statistics.median(a / b for a, b in zip(nt_t, ref_t))}


def table(r: dict, title: str) -> str:
  """The markdown table of a `measure` result."""
  ms = lambda ts: ", ".join(f"{1e3 * t:.0f}" for t in ts)
  same = "yes" if r["loss_rel_diff"] <= LOSS_RTOL else "NO"
  within = "yes" if r["ratio"] <= TARGET else "no"
  rows = [
      ("parameters / batch", f"{r['params']:,} / {r['shape']} tokens, {r['backend']} x 1"),
      ("initial loss nanotext / reference", f"{r['nt_loss0']:.6f} / {r['ref_loss0']:.6f} "
       f"(rel. diff {r['loss_rel_diff']:.1e}; same math: {same})"),
      (f"loss at step {r['trained_steps']} (same batch every step)",
       f"{r['nt_loss_end']:.5f} / {r['ref_loss_end']:.5f}"),
      ("compile time nanotext / reference",
       f"{r['nt_compile_s']:.2f} s / {r['ref_compile_s']:.2f} s"),
      ("nanotext step (median)", f"{1e3 * r['nt_step_s']:.1f} ms (rounds: {ms(r['nt_all'])})"),
      ("reference step (median)", f"{1e3 * r['ref_step_s']:.1f} ms (rounds: {ms(r['ref_all'])})"),
      ("ratio nanotext / reference", f"{r['ratio']:.3f} (median of per-round ratios "
       f"{r['paired_ratio']:.3f}); within {100 * (TARGET - 1):.0f}%: {within}"),
  ]
  lines = [f"| overhead | {title} |", "| --- | --- |"]
  return "\n".join(lines + [f"| {k} | {v} |" for k, v in rows])


USAGE = "usage: python benchmarks/overhead.py [CONFIG] [key=value ...] [--rounds N]"


def main(argv):
  from nanotext.errors import UserError, fail
  path = argv[1] if len(argv) > 1 and "=" not in argv[1] else DEFAULT_CONFIG
  overrides = argv[2:] if len(argv) > 1 and "=" not in argv[1] else argv[1:]
  f = flags.FLAGS
  if min(f.rounds, f.steps, f.warmup) < 1:
    fail("--rounds, --steps and --warmup must be >= 1")
  try:
    r = measure(path, overrides, rounds=f.rounds, steps=f.steps, warmup=f.warmup)
  except UserError as e:
    fail(str(e))
  print(table(r, " ".join([os.path.relpath(path)] + list(overrides))))


if __name__ == "__main__":
  _define_flags()
  import bench_cli
  bench_cli.run(main, USAGE, __doc__)
