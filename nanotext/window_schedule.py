"""The per-step schedules that shape programs: sliding windows and row length, in one place.

The trainer (which program runs a step, which the eval uses), the metrics (FLOPs per step), the
logs (attn_window) and the model (its default windows) all read them from here. Row lengths shape
arrays, so each is its own compiled program. Windows are static Python ints per stage; a kernel
that takes the window as a runtime input (kernels/dispatch.takes_runtime_window) runs every
window stage of a row length in one program (`plan`), the windows an int32 [layers] argument.
"""

import dataclasses

from nanotext.errors import UserError

# Kernels whose window may be a traced int32 (masks built from it; blocked sizes its strips by a
# static bound; flash_gpu's block tables come from it). Splash builds block-sparsity tables from a
# static mask, cuDNN takes a static local_window_size and flash has no window: one program per
# window stage for them. Here, not in kernels/dispatch (jax), so that compile's check of
# --programs before jax loads knows the programs of a kernel named.
RUNTIME_WINDOW_IMPLS = ("xla", "blocked", "cpu", "einsum", "flash_gpu")


def check_config(t) -> None:
  """train.seq_len_start / seq_len_step: every warmup length must divide train.seq_len."""
  if not t.seq_len_start:
    return
  if t.seq_len_start > t.seq_len:
    raise UserError(f"train.seq_len_start={t.seq_len_start} must not exceed train.seq_len="
                    f"{t.seq_len}")
  bad = [n for n in seq_lens(t) if t.seq_len % n]
  if bad:
    raise UserError(f"sequence-length warmup rows of {bad[0]} tokens do not divide "
                    f"train.seq_len={t.seq_len} (each step reads batch_size x seq_len tokens and "
                    "cuts them into shorter rows): change train.seq_len_start / seq_len_step")


def seq_lens(train_cfg) -> tuple:
  """The row lengths of the sequence-length warmup, shortest first (one: train.seq_len)."""
  t = train_cfg
  if not t.seq_len_start or t.seq_len_start >= t.seq_len:
    return (int(t.seq_len),)
  inc = t.seq_len_step or t.seq_len - t.seq_len_start
  return tuple(range(t.seq_len_start, t.seq_len, inc)) + (int(t.seq_len),)


def row_keys(train_cfg) -> list:
  """[(length, the config key naming it)] of the rows a run's programs take besides
  train.seq_len's: the sequence-length warmup's and validation's (train.eval_seq_len)."""
  t = train_cfg
  rows = [(n, "train.seq_len_start" if not k else f"train.seq_len_start + {k} x seq_len_step")
          for k, n in enumerate(seq_lens(t)[:-1])]
  return rows + ([(t.eval_seq_len, "train.eval_seq_len")]
                 if t.eval_seq_len not in (0, t.seq_len) else [])


def seq_len_at(train_cfg, step: int) -> int:
  """Row length of 0-based train `step`: each warmup length gets an equal share of the steps.

  modded-nanogpt-jax (a9d3e04) `_get_shape_for_step`: `int(step / steps * n)` picks the length;
  exact integer arithmetic here. Tokens per step stay batch_size * seq_len.
  """
  lens = seq_lens(train_cfg)
  return lens[min(len(lens) - 1, max(step, 0) * len(lens) // max(train_cfg.steps, 1))]


def long_window(attn_cfg, step: int, steps: int) -> int:
  """The long sliding window (tokens) at 0-based `step` of `steps`: the schedule, or the config.

  With attention.window_schedule the window grows in whole blocks of `b` = window_block tokens,
  from window_start to window over the run, as modded-nanogpt train_gpt.py (587b45fb)
  get_window_size_blocks: `next_multiple_of_n(1728 * step / num_iterations, n=128)`, i.e.
  128 * max(1, ceil(13.5 * progress)) for 128 -> 1792. In blocks, with s = start / b and
  e = window / b, that is max(s, s - 1 + ceil((e - s + 1/2) * progress)): every size in between
  gets an equal share of the run, the final one half a share. Exact integer arithmetic (the
  record's float product can land one block apart exactly at a block boundary).
  """
  if not attn_cfg.window_schedule:
    return int(attn_cfg.window)
  b = attn_cfg.window_block
  s, e = attn_cfg.window_start // b, attn_cfg.window // b
  step = min(max(step, 0), steps)
  grown = s - 1 - (-(2 * (e - s) + 1) * step // (2 * steps))  # s - 1 + ceil(...)
  return b * min(e, max(s, grown))


def short_window(attn_cfg, long: int) -> int:
  """Window of an 'S' layer: half the long one in whole blocks, at least one block.

  The record halves the block count (`sliding_window_num_blocks // 2`); its 0-block short window
  at the first size still attends within the query's own block (its block mask clamps the
  partial blocks to at least one), exactly as a 1-block window does with attention.block_windows,
  so one block is the floor here. Without window_block alignment it is long // 2 tokens.
  """
  b = attn_cfg.window_block
  if long % b:
    return max(1, long // 2)
  return b * max(1, long // b // 2)


def layer_windows(attn_cfg, num_layers: int, long: int) -> tuple:
  """Per-layer windows (static ints) for a long window: attention.window_pattern letters map
  L -> long, S -> short_window; the pattern repeats (or is cut) to num_layers; '' = all long."""
  pattern = attn_cfg.window_pattern
  if not pattern or not long:  # no window at all: every layer plain causal
    return (int(long),) * num_layers
  short = short_window(attn_cfg, long)
  return tuple(int(long) if pattern[i % len(pattern)] == "L" else short
               for i in range(num_layers))


def windows_at(attn_cfg, num_layers: int, step: int, steps: int) -> tuple:
  """Per-layer windows of 0-based train step `step` (step == steps: the final ones)."""
  return layer_windows(attn_cfg, num_layers, long_window(attn_cfg, step, steps))


def effective_windows(windows, seq_len: int) -> tuple:
  """Windows as the kernel sees them: one covering the whole sequence is plain causal (0).

  Two schedule stages with the same effective windows share one compiled program.
  """
  return tuple(0 if not w or w >= seq_len else int(w) for w in windows)


def step_windows(cfg, step: int) -> tuple:
  """Per-layer windows, as the kernels see them, of 0-based train step `step`.

  Steps whose windows agree (e.g. every window >= train.seq_len, i.e. plain causal) share a
  compiled program; step == train.steps gives the final windows.
  """
  w = windows_at(cfg.attention, cfg.model.num_layers, step, cfg.train.steps)
  return effective_windows(w, seq_len_at(cfg.train, step))


def step_stage(cfg, step: int) -> tuple:
  """(per-layer windows, row length) of 0-based train `step`: the key of its compiled program."""
  return step_windows(cfg, step), seq_len_at(cfg.train, step)


def eval_windows(cfg, done: int) -> tuple:
  """Per-layer windows of the evaluation after `done` steps, for rows of train.eval_seq_len.

  train.eval_windows=step: the windows of step `done`, as the record (`get_window_size_blocks(
  step)`), one eval program per distinct tuple; final: the schedule's last ones, one program.
  """
  t = cfg.train
  step = done if t.eval_windows == "step" else t.steps
  w = windows_at(cfg.attention, cfg.model.num_layers, step, t.steps)
  return effective_windows(w, t.eval_seq_len or t.seq_len)


def model_windows(attn_cfg, model_cfg, seq_len: int = 0) -> tuple:
  """A model's per-layer windows when its caller names none: the final ones; scanned, as the
  kernels see them at rows of model.max_seq_len, the longest it takes (windows covering every
  row: one causal window, as one scanned block takes; unfinalized 0: `seq_len`'s rows)."""
  final = layer_windows(attn_cfg, model_cfg.num_layers, attn_cfg.window)
  rows = model_cfg.max_seq_len or seq_len
  return effective_windows(final, rows) if model_cfg.scan_layers and rows else final


def windows_differ(attn_cfg, model_cfg, cfg=None) -> bool:
  """Whether layers' windows, as the kernels see them, differ at some row: of `cfg`'s train
  steps, evaluations and sampling, else of model.max_seq_len's."""
  runs = [model_windows(attn_cfg, model_cfg)] if cfg is None else run_windows(cfg)
  return any(len(set(w)) > 1 for w in runs)


def run_windows(cfg) -> list:
  """Every per-layer windows tuple, as the kernels see them, of the run's train steps, its
  evaluations and sampling (rows up to model.max_seq_len)."""
  a, m = cfg.attention, cfg.model
  evals = eval_plan(cfg, eval_points(cfg.train), False)
  sampled = effective_windows(layer_windows(a, m.num_layers, a.window),
                              m.max_seq_len or cfg.train.seq_len)
  return stages(cfg, 0, cfg.train.steps, step_windows) + [w for w, _ in evals] + [sampled]


def applied_window(cfg) -> int:
  """The longest window, as the kernels see it, that any program of the run applies
  (`run_windows`); 0 where every window covers its rows (plain causal attention throughout)."""
  return long_of([long_of(w) for w in run_windows(cfg)])


def stage_runs(cfg, start: int, stop: int, key=step_stage) -> list:
  """[(stage, first step, last step)]: each run of 0-based steps start..stop-1 with one `key`.

  O(stages * log steps), not O(steps): windows and row lengths never shrink as steps go by, so a
  stage is one run of steps whose end is found by bisection (train.steps may be in the billions).
  """
  out, step = [], start
  while step < stop:
    w = key(cfg, step)
    lo, hi = step, stop  # invariant: step lo is in stage w, step hi is past it
    while hi - lo > 1:
      mid = (lo + hi) // 2
      lo, hi = (mid, hi) if key(cfg, mid) == w else (lo, mid)
    out.append((w, step, hi - 1))
    step = hi
  return out


def stages(cfg, start: int, stop: int, key=step_stage) -> list:
  """The distinct stages (`key` of a step) of 0-based steps start..stop-1, in order of use."""
  return list(dict.fromkeys(w for w, _, _ in stage_runs(cfg, start, stop, key)))


@dataclasses.dataclass(frozen=True)
class Program:
  """One compiled step: its row length and per-layer windows as the kernels see them (0 = causal).

  With `runtime`, `windows` are per-layer static bounds (0 = none) of the windows the program is
  given as an int32 [layers] input each step: kernels size their work by the bound and mask by
  the input. `span` (the per-layer windows of the first and last stage served) only names it."""
  seq_len: int
  windows: tuple
  runtime: bool = False
  span: tuple = dataclasses.field(default=((), ()), compare=False)

  def label(self) -> str:
    """Its windows in a word, unique among the programs of one row length: '128..1792' (the
    stages a runtime program serves), '1792', 'causal', 'causal+896' (see `window_name`)."""
    if self.runtime:
      return "..".join(window_name(w) for w in self.span)
    return window_name(self.windows)

  def describe(self, with_len: bool = False) -> str:
    """'windows 128..1792, runtime', 'windows 1792', 'causal' (+ the row length)."""
    label = self.label()
    text = f"windows {label}, runtime" if self.runtime else \
        label if label == "causal" else f"windows {label}"
    return text + (f", rows of {self.seq_len}" if with_len else "")


def long_of(windows) -> int:
  """The largest of per-layer windows, 0 when every layer is plain causal."""
  return max(windows) if any(windows) else 0


def window_name(windows) -> str:
  """Per-layer windows (as the kernels see them) in a word that tells stages apart: the long
  window ('1792'); 'causal' where every layer sees the whole row; 'causal+896' where the long
  layers do (their window reached the row length) and the short ones have 896 (a stage the
  long window alone would name as an earlier one)."""
  long = long_of(windows)
  return "causal" if not long else f"causal+{long}" if 0 in windows else str(long)


def window_bounds(tuples) -> tuple:
  """Per-layer upper bounds of several per-layer window tuples (0 = causal bounds nothing)."""
  return tuple(0 if 0 in col else max(col) for col in zip(*tuples))


def plan(stage_list, runtime: bool) -> dict:
  """{(windows, row length): Program} for distinct stages in order of use: one static program
  per stage, or with `runtime` one program per row length for all its window stages (a single
  stage stays static: a compile-time window is the tighter program)."""
  by_len = {}
  for windows, seq_len in stage_list:
    by_len.setdefault(seq_len, []).append(tuple(windows))
  out = {}
  for seq_len, ws in by_len.items():
    if runtime and len(ws) > 1:
      shared = Program(seq_len, window_bounds(ws), True, (ws[0], ws[-1]))
      out.update({(w, seq_len): shared for w in ws})
    else:
      out.update({(w, seq_len): Program(seq_len, w) for w in ws})
  return out


def train_plan(cfg, start: int, stop: int, runtime: bool) -> dict:
  """{step_stage: Program} of 0-based train steps start..stop-1 (see `plan`)."""
  return plan(stages(cfg, start, stop), runtime)


def eval_points(train_cfg, start_step: int = 0) -> list:
  """The evaluations (after how many steps) of a run from `start_step`: every train.eval_every,
  the final one, and step 0 with train.eval_at_start on a fresh run."""
  t = train_cfg
  every = t.eval_every
  dones = range(every * (start_step // every + 1), t.steps, every) if every else range(0)
  return [0] * bool(t.eval_at_start and start_step == 0) + list(dones) + [t.steps]


def eval_plan(cfg, dones, runtime: bool) -> dict:
  """{(windows, eval row length): Program} of the evaluations after `dones` steps (ascending):
  windows never shrink as steps go by, so each distinct one is found by bisection, not by
  computing every point's (train.steps=2**31-1 stalled minutes before its first step)."""
  seq_len = cfg.train.eval_seq_len or cfg.train.seq_len
  windows, i = [], 0
  while i < len(dones):
    w = eval_windows(cfg, dones[i])
    lo, hi = i, len(dones) - 1  # the last point with these windows
    while lo < hi:
      mid = (lo + hi + 1) // 2
      lo, hi = (mid, hi) if eval_windows(cfg, dones[mid]) == w else (lo, mid - 1)
    windows.append(w)
    i = lo + 1
  return plan([(w, seq_len) for w in windows], runtime)


def steps_change_line(cfg, was: int, step: int) -> str:
  """What a resume under another train.steps changes from `step` on: these schedules and the
  learning rate's cooldown count in train.steps (Muon's momentum warmup counts optimizer steps:
  it does not change)."""
  now = cfg.train.steps
  changes = ((["the learning rate's cooldown"] if cfg.optim.cooldown_frac else [])
             + (["the row length (train.seq_len_start)"]
                if len(seq_lens(cfg.train)) > 1 else [])
             + (["the attention windows"] if cfg.attention.window_schedule else []))
  if not changes:
    return f"train.steps {was} -> {now}: no schedule here counts in train.steps; only the end moves"
  return (f"train.steps {was} -> {now}: {', '.join(changes)} follow{'s' * (len(changes) == 1)} "
          f"{now} steps from step {step} on")
