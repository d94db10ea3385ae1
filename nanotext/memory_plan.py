"""The memory plan: before anything is built or compiled, check that a run's train and eval
programs fit its devices (nanotext.memory's estimate against the devices' capacity), resolve
model.remat=auto and the -1 (auto) loss chunks, and refuse in one line, naming the keys that
would make it fit, a config that cannot. wiring.finalize_plan asks a Planner for those values
once config.finalize has derived the rest; what a device holds is nanotext.device_memory's.
"""

import dataclasses
import math
import os

import ml_collections
import numpy as np
import yaml

from nanotext import config, gpus, memory, sharding
from nanotext.errors import UserError
from nanotext.memory import gib
from nanotext.window_schedule import seq_lens


HEADROOM = 0.10  # auto leaves this share of a device free: runtime buffers, fragmentation
# The estimate's measured accuracy (benchmarks/RESULTS.md): refuse only beyond capacity * (1 +
# this). Against XLA's GPU compiler every program of the shipped configs came within 15% (0.90-
# 1.11 planned / compiled); its TPU compiler's schedule keeps more alive in a long forward pass,
# and the CPU's buffer reuse is less predictable.
TOLERANCE = {"gpu": 0.15, "tpu": 0.25, "cpu": 0.25}
KEYS = ("model.remat", "train.loss_chunk", "train.eval_loss_chunk", "train.eval_accum")


class DoesNotFit(UserError):
  """A program's leanest estimate exceeds the device (the message says by what, and what
  would fit); `choice` is the ladder's choice that estimate is of (None: none traced)."""

  def __init__(self, message: str, estimate, choice=None):
    super().__init__(message)
    self.estimate, self.choice = estimate, choice


@dataclasses.dataclass
class Plan:
  """What the planner chose and why, with the estimates it chose by."""
  choice: dict  # {key: value} for KEYS
  train: object  # memory.Estimate
  eval: object
  capacity: int | None
  source: str
  why: str
  eval_problem: str = ""  # why the eval step cannot fit ("": it can)
  train_problem: str = ""  # why the train step cannot fit ("": it can)

  def require(self, *programs) -> None:
    """UserError if one of `programs` ("train", "eval") cannot fit. Checked where the programs
    will run (the train CLI, compile), before anything is traced: a run built only to look at
    the model (its shapes, an export, a test at the shipped config) is not refused."""
    if "train" in programs and self.train_problem:
      raise UserError(self.train_problem)
    if "eval" in programs and self.eval_problem:
      raise UserError(self.eval_problem)

  def line(self) -> str:
    """The start-up log line."""
    c = self.choice
    chosen = (f"remat={c['model.remat']}, loss_chunk={c['train.loss_chunk']}, "
              f"eval_loss_chunk={c['train.eval_loss_chunk']}"
              + (f", eval_accum={c['train.eval_accum']}" if c["train.eval_accum"] > 1 else ""))
    of = f" of {gib(self.capacity)} per device ({self.source})" if self.capacity else \
        " per device (device memory unknown)"
    return (f"memory plan: {chosen} ({self.train.program} ~{gib(self.train.total)}, "
            f"{self.eval.program} ~{gib(self.eval.total)}{of}: {self.why})")


def auto_chunk(lengths) -> int:
  """The loss chunk auto tries: the largest divisor of every row length up to memory.CHUNK and
  shorter than the rows (0: rows of one position cannot be cut)."""
  g = 0
  for n in lengths:
    g = math.gcd(g, int(n))
  return max((c for c in range(1, min(memory.CHUNK, g - 1) + 1) if g % c == 0), default=0)


def cuts(chunk: int, length: int) -> bool:
  """Whether a loss chunk can cut rows of `length` (loss.check_config's rule)."""
  return not 0 < chunk < length or length % chunk == 0


def whole(chunk: int, length: int) -> int:
  """A loss chunk as it cuts rows of `length` (the longest): one as long as the rows, or longer,
  is the whole row (0), so the plan line, compile's report and config.yml say what runs."""
  return 0 if chunk >= length else chunk


def passes(rows: int) -> list:
  """The train.eval_accum values that split `rows` validation rows per device evenly."""
  return [a for a in range(1, rows + 1) if rows % a == 0]


def more_passes(rows: int, accum: int) -> int:
  """The next train.eval_accum above a fixed `accum` that splits `rows` evenly (0: none; auto
  has tried them all)."""
  return next((a for a in passes(rows) if a > accum), 0) if accum > 0 else 0


def parameter_floor(cfg) -> int:
  """A lower bound on parameter bytes, from the config alone (no model is built): every block's
  two MLP matrices and the token table. Enough to refuse absurd sizes at once."""
  m = cfg.model
  item = lambda name: np.dtype(name).itemsize
  rows = m.embed_rows if m.embed_rows > 0 else m.vocab_size
  return (m.num_layers * 2 * m.d_model * m.mlp_dim * item(m.param_dtype)
          + rows * m.d_model * item(m.embed_dtype or m.param_dtype))


class Planner:
  """config.finalize's memory_plan: {KEYS: values} for a typed config, auto keys resolved.

  Raises UserError when even the leanest choice exceeds `capacity` (bytes per device; None =
  unknown: nothing is refused, auto takes the plain step) by more than its TOLERANCE. `prefer`:
  {key: value} of a resumed run, kept where it fits. `workspace`: memory.Model's.
  """

  def __init__(self, backend: str, mesh_sizes: dict, capacity, source: str = "",
               prefer=None, workspace: int = gpus.HOPPER_WORKSPACE):
    self.backend, self.mesh_sizes, self.workspace = backend, dict(mesh_sizes), workspace
    self.tolerance = TOLERANCE.get(backend, TOLERANCE["cpu"])
    self.capacity, self.source = capacity, source or "given"
    self.prefer = {k: v for k, v in (prefer or {}).items() if k in KEYS}
    self.plan = None

  def __call__(self, cfg) -> dict:
    devices = math.prod(self.mesh_sizes.values())
    floor = 2 * parameter_floor(cfg) / devices  # the parameters and their gradients
    if self.capacity is not None and floor > self.capacity * (1 + self.tolerance):
      raise UserError(
          f"the model is too large: its parameters and their gradients alone need at least "
          f"{gib(floor)} per device, sharded over all {devices} device(s), and a device has "
          f"{gib(self.capacity)} ({self.source}); use a smaller model (model.num_layers, "
          "model.d_model, model.mlp_dim, model.vocab_size) or more devices")
    model = memory.model_of(cfg, self.backend, self.mesh_sizes, self.workspace)
    t, m = cfg.train, cfg.model
    remats = memory.REMATS if m.remat == "auto" else (m.remat,)
    chunk = auto_chunk(seq_lens(t))
    chunks = ((0, chunk) if chunk else (0,)) if t.loss_chunk == -1 else \
        (whole(t.loss_chunk, t.seq_len),)
    train_ladder = sorted(((r, c) for r in remats for c in chunks),
                          key=lambda rc: (remats.index(rc[0]) + bool(rc[1]), bool(rc[1])))
    train_ladder = self._preferred(train_ladder, KEYS[:2], (m.remat == "auto",
                                                             t.loss_chunk == -1),
                                   lambda rc: all(cuts(rc[1], n) for n in seq_lens(t)))
    train_problem = ""
    try:
      self._attention_first(model, "train")  # kept as the eval step's: compile --programs=eval
      (remat, chunk), train, why = self._choose(
          train_ladder, lambda rc: model.train(*rc), cfg, model, "train")
    except DoesNotFit as e:  # kept for Plan.require, as the eval step's below
      train_problem, why, train = str(e), "the train step does not fit", e.estimate
      remat, chunk = e.choice or train_ladder[-1]  # the choice whose estimate the line shows
    if t.eval_accum > 0 and model.eval_rows % t.eval_accum:  # before a trace of no rows
      raise UserError(f"train.eval_accum={t.eval_accum} does not divide each device's "
                      f"{model.eval_rows} validation row(s) (train.batch_size={t.batch_size} "
                      f"over the devices the batch is split on): give a divisor of "
                      f"{model.eval_rows}, or -1 (auto)")
    eval_chunk = auto_chunk([model.eval_len])
    eval_chunks = ((0, eval_chunk) if eval_chunk else (0,)) if t.eval_loss_chunk == -1 else \
        (whole(t.eval_loss_chunk, model.eval_len),)
    # Whole rows at once first; then each device's rows in 2, 3, ... passes (a forward pass
    # keeps nothing between them).
    accums = passes(model.eval_rows) if t.eval_accum == -1 else [t.eval_accum]
    eval_ladder = [(c, a) for a in accums for c in eval_chunks]
    eval_ladder = self._preferred(eval_ladder, KEYS[2:], (t.eval_loss_chunk == -1,
                                                          t.eval_accum == -1),
                                  lambda ca: cuts(ca[0], model.eval_len)
                                  and model.eval_rows % ca[1] == 0)
    problem = ""
    try:
      self._attention_first(model, "eval")
      (eval_chunk, eval_accum), evaluation, eval_why = self._choose(
          eval_ladder, lambda ca: model.eval(*ca), cfg, model, "eval")
    except DoesNotFit as e:  # kept for Plan.require: only a run that evaluates is refused
      problem, eval_why, evaluation = str(e), "the eval step does not fit", e.estimate
      eval_chunk, eval_accum = e.choice or eval_ladder[-1]
    if (t.eval_loss_chunk == -1 and eval_chunk) or (t.eval_accum == -1 and eval_accum > 1) \
        or eval_why.startswith(("may", "the eval")):
      why = f"{why}; {eval_why}"  # said only when it changes something
    self.plan = Plan(dict(zip(KEYS, (remat, chunk, eval_chunk, eval_accum))), train, evaluation,
                     self.capacity, self.source, why, problem, train_problem)
    return self.plan.choice

  def _preferred(self, ladder: list, keys: tuple, auto: tuple, valid) -> list:
    """`ladder` with the resumed run's choice first (for the keys left to auto) where it is
    `valid` here: an eval_accum saved for another device count may not divide each device's
    rows now (it was kept, and evaluate then refused the run's own config.yml)."""
    want = tuple(self.prefer.get(k, c) if a else c for k, a, c in zip(keys, auto, ladder[0]))
    if any(self.prefer.get(k) is None for k, a in zip(keys, auto) if a) or not valid(want):
      return ladder
    return [want] + [c for c in ladder if c != want]

  def _choose(self, ladder, estimate, cfg, model, program) -> tuple:
    """(choice, its estimate, why): the first choice in `ladder` that fits with headroom."""
    tried = []
    for choice in ladder:
      est = estimate(choice)
      if self.capacity is None:
        return choice, est, "device memory unknown: nothing held back"
      if est.total <= self.capacity * (1 - HEADROOM):
        return choice, est, self._why(ladder, choice, tried, program)
      tried.append((choice, est))
    choice, est = min(tried, key=lambda ce: ce[1].total)
    if est.total <= self.capacity * (1 + self.tolerance):
      return choice, est, (f"may not fit: the {program} step is within the estimate's accuracy "
                           "of the device")
    raise DoesNotFit(self._refusal(est, cfg, model, program), est, choice)

  def _why(self, ladder, choice, tried, program) -> str:
    if len(ladder) == 1:
      return "it fits as configured"
    keys = KEYS[:2] if program == "train" else KEYS[2:]
    if self.prefer and tuple(self.prefer.get(k) for k in keys) == choice:
      return "kept from the run's config.yml"
    if not tried:  # the plain step only where no key was set away from it
      plain = choice == ((memory.REMATS[0], 0) if program == "train" else (0, 1))
      return f"the plain {program} step fits" if plain else "the cheapest choice fits"
    return f"the plain {program} step needs ~{gib(tried[0][1].total)}"

  def _attention_first(self, model, program: str) -> None:
    """Refuse dense attention that cannot fit before anything traces it (its [T, T] masks are
    built on the host while tracing)."""
    need = dense_attention(model, program)
    if self.capacity is not None and need > self.capacity * (1 + self.tolerance):
      est = memory.Estimate(f"{program} step", (("attention scores", int(need)),))
      raise DoesNotFit(self._refusal(est, model.cfg, model, program), est)

  def _refusal(self, est, cfg, model, program) -> str:
    tips = advice(cfg, model, program, est, self.capacity)
    return (f"the {est.describe()} does not fit a device's {gib(self.capacity)} "
            f"({self.source}); {tips}")


def for_devices(devices, mesh_sizes: dict, capacity, source: str, prefer=None) -> Planner:
  """The Planner of a run on `devices`: their backend, and on a GPU its cuBLAS workspace."""
  return Planner(devices[0].platform, mesh_sizes, capacity, source, prefer,
                 gpus.gemm_workspace(devices[0]))


def advice(cfg, model, program: str, est, capacity: int) -> str:
  """'try K=V (~X), ... or more devices': single-key changes that lower the dominant term of
  `est`, each re-estimated (those that fit first)."""
  tried = []
  for text, try_cfg, sizes in changes(cfg, model, program, est, capacity):
    try:
      other = memory.model_of(try_cfg, model.backend, sizes, model.workspace)
      if dense_attention(other, program) > capacity:
        continue  # still cannot fit, and tracing it would build its [T, T] masks
      total = _leanest(other, try_cfg, program).total
    except UserError:
      continue  # the change breaks another rule (divisibility): not advice
    if total < est.total:
      tried.append((total > capacity, total, f"{text} (~{gib(total)})"))
  ranked = sorted(tried)
  fits = [t for t in ranked if not t[0]]  # a change that fits leaves out those that do not
  tips = [t for _, _, t in (fits or ranked)[:3]]
  if est.dominant() in ("parameters", "optimizer state", "gradients"):
    tips.append("a smaller model (model.num_layers, model.d_model)")
  if not tips:
    return "use more devices"
  if tried and not fits:
    return f"no single change fits; the nearest: {', '.join(tips)}; or more devices"
  return "try " + ", ".join(tips + ["or more devices"])


def dense_attention(model, program: str) -> float:
  """One layer's dense attention scores (0 for other kernels): known before any trace."""
  if model.impl not in memory.DENSE_KERNELS:
    return 0.0
  if program == "train":
    return model.attention_bytes(model.rows, model.cfg.train.seq_len, train=True)
  return model.attention_bytes(model.eval_rows, model.eval_len, train=False)


def _leanest(model, cfg, program):
  """The smallest estimate of `program` over the choices auto (or the config) allows."""
  t, m = cfg.train, cfg.model
  if program == "eval":
    chunks = {0, auto_chunk([model.eval_len])} if t.eval_loss_chunk == -1 else \
        {t.eval_loss_chunk}
    accum = model.eval_rows if t.eval_accum == -1 else t.eval_accum  # one row a pass
    return min((model.eval(c, accum) for c in chunks), key=lambda e: e.total)
  remat = "full" if m.remat == "auto" else m.remat
  chunk = auto_chunk(seq_lens(t)) if t.loss_chunk == -1 else t.loss_chunk
  return model.train(remat, chunk)


def changes(cfg, model, program: str, est, capacity: int) -> list:
  """[(override text, changed config, mesh sizes)] that lower the dominant term of `est`."""
  t, m = cfg.train, cfg.model
  sizes, dominant = model.mesh_sizes, est.dominant()
  out = []

  def change(text, **sections):
    new = config.replace_sections(cfg, **sections)
    try:  # a change that breaks another rule (a chunk that does not divide the rows) is no advice
      config.validate(ml_collections.ConfigDict(new.to_dict()))
    except UserError:
      return
    out.append((text, new, sizes))
  if program == "train" and dominant in ("activations", "recompute and attention",
                                         "logits and loss"):
    if m.remat in ("none", "dots") and model.backend != "cpu":  # CPU: remat changes nothing
      change("model.remat=full", model={"remat": "full"})
    if t.loss_chunk == 0 and auto_chunk([t.seq_len]):
      change(f"train.loss_chunk={auto_chunk([t.seq_len])}",
             train={"loss_chunk": auto_chunk([t.seq_len])})
    # Micro-batches of 1/k the rows: twice, and as many as the per-row terms say would fit.
    fixed = sum(b for name, b in est.terms if name in ("parameters", "optimizer state",
                                                        "gradients", "gathered parameters"))
    room = max(capacity * (1 - HEADROOM) - 2 * fixed, 1.0)  # accumulation adds gradients
    fit = 2 ** math.ceil(math.log2(max(2.0, (est.total - fixed) / room)))
    for k in sorted({2, min(fit, model.rows)}):
      if model.rows % k == 0:
        change(f"train.grad_accum={t.grad_accum * k}", train={"grad_accum": t.grad_accum * k})
  if program == "eval" and t.eval_loss_chunk == 0:
    c = auto_chunk([model.eval_len])
    if c:
      change(f"train.eval_loss_chunk={c}", train={"eval_loss_chunk": c})
  more = more_passes(model.eval_rows, t.eval_accum)
  if program == "eval" and more:
    change(f"train.eval_accum={more}", train={"eval_accum": more})
  if program == "eval" and t.eval_seq_len > t.seq_len:
    change(f"train.eval_seq_len={t.seq_len}", train={"eval_seq_len": t.seq_len})
  if model.impl in memory.DENSE_KERNELS and dominant in (
      "attention scores", "activations", "recompute and attention", "activations and logits"):
    impl = "splash" if model.backend == "tpu" else "blocked"
    change(f"attention.impl={impl}", attention={"impl": impl})
  # A learned position table of model.max_seq_len rows can outweigh the rest of the model (a
  # 2e9-row table was advised a smaller num_layers or d_model): rows the steps read are enough
  longest = max(t.seq_len, t.eval_seq_len)
  if dominant in ("parameters", "optimizer state", "gradients") and m.positions == "learned" \
      and m.max_seq_len > longest:
    change(f"model.max_seq_len={longest}", model={"max_seq_len": longest})
  folded = sharding.fsdp_for_data(sizes)
  if dominant in ("parameters", "optimizer state", "gradients") and folded:
    out.append((sharding.FSDP_FOR_DATA, cfg, folded))
  return out


def keys_that_help(cfg, mesh_sizes: dict, programs=("train",)) -> str:
  """The config changes that lower per-device memory of `programs` the compiler found too big
  (nanotext.compile), given what the run already does (remat and micro-batches do nothing for
  the eval step, a forward pass)."""
  t, m = cfg.train, cfg.model
  keys = []
  shards = sharding.shard_count(("batch",), sharding.parse_rules(cfg.mesh.rules), mesh_sizes)
  if any(p != "eval" for p in programs):
    if m.remat != "full":
      keys.append("model.remat=" + ("dots or full" if m.remat == "none" else "full"))
    if not t.loss_chunk and auto_chunk([t.seq_len]):
      keys.append(f"train.loss_chunk={auto_chunk([t.seq_len])}")
    if t.batch_size % (2 * t.grad_accum * shards) == 0:  # each device's rows split in two
      keys.append(f"train.grad_accum={2 * t.grad_accum} (half the activations per micro-batch)")
  if "eval" in programs:
    length = t.eval_seq_len or t.seq_len
    if not t.eval_loss_chunk and auto_chunk([length]):
      keys.append(f"train.eval_loss_chunk={auto_chunk([length])}")
    more = more_passes(t.batch_size // shards, t.eval_accum)
    if more:
      keys.append(f"train.eval_accum={more} (the validation rows in more passes)")
    keys.append("train.eval_seq_len" if t.eval_seq_len else "train.batch_size")
  if sharding.fsdp_for_data(mesh_sizes):
    keys.append(f"{sharding.FSDP_FOR_DATA} (shard parameters and optimizer state)")
  return ", ".join(keys) + ", or a larger topology"


def saved_choice(output_dir: str) -> dict:
  """{key: value} of KEYS in output_dir/config.yml (a run being resumed), {} if none."""
  try:
    with open(os.path.join(output_dir, "config.yml"), encoding="utf-8") as f:
      saved = yaml.safe_load(f)
    found = {k: saved[k.split(".")[0]][k.split(".")[1]] for k in KEYS
             if k.split(".")[1] in (saved.get(k.split(".")[0]) or {})}
  except (OSError, ValueError, yaml.YAMLError, AttributeError, TypeError):
    return {}  # no run there, or a damaged file (not UTF-8, not YAML): rundir says so later
  ok = lambda k, v: v in memory.REMATS if k == "model.remat" else \
      type(v) is int and v >= (1 if k == "train.eval_accum" else 0)  # a resolved choice
  return {k: v for k, v in found.items() if ok(k, v)}
