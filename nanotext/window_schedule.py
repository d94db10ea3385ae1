"""The sliding-window schedule: which window each layer uses at each step, in one place.

The trainer (which program runs a step, which the eval uses), the metrics (FLOPs per step), the
logs (attn_window) and the model (its default windows) all read it from here. Windows are static
Python ints: each distinct per-layer tuple is its own compiled program.
"""


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
  return effective_windows(w, cfg.train.seq_len)


def eval_windows(cfg, done: int) -> tuple:
  """Per-layer windows of the evaluation after `done` steps, for rows of train.eval_seq_len.

  train.eval_windows=step: the windows of step `done`, as the record (`get_window_size_blocks(
  step)`), one eval program per distinct tuple; final: the schedule's last ones, one program.
  """
  t = cfg.train
  step = done if t.eval_windows == "step" else t.steps
  w = windows_at(cfg.attention, cfg.model.num_layers, step, t.steps)
  return effective_windows(w, t.eval_seq_len or t.seq_len)


def stage_windows(cfg, start: int, stop: int) -> list:
  """The distinct window tuples of 0-based steps start..stop-1, in order of use.

  O(stages * log steps), not O(steps): windows never shrink as steps go by, so a stage is one
  run of steps whose end is found by bisection (train.steps may be in the billions).
  """
  out, step = [], start
  while step < stop:
    w = step_windows(cfg, step)
    out.append(w)
    lo, hi = step, stop  # invariant: step lo has windows w, step hi is past this stage
    while hi - lo > 1:
      mid = (lo + hi) // 2
      lo, hi = (mid, hi) if step_windows(cfg, mid) == w else (lo, mid)
    step = hi
  return list(dict.fromkeys(out))
