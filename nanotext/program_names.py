"""The programs a run compiles, by name, and the `--programs` choice among them (nanotext.compile):
without jax, so a bad choice is refused before anything loads."""

from nanotext import window_schedule as ws
from nanotext.errors import UserError


def is_eval(name: str) -> bool:
  """Whether a program name (`eval`, `eval@1792`) is an eval program's."""
  return name.split("@")[0] == "eval"


def programs(cfg, impl: str = "") -> list:
  """[(name, window_schedule.Program, steps)] of the run as the trainer compiles them, where
  attention kernel `impl` serves it (see `program_list`)."""
  from nanotext.model.kernels.dispatch import takes_runtime_window
  return program_list(cfg, bool(impl) and takes_runtime_window(impl))


def program_list(cfg, runtime: bool) -> list:
  """[(name, window_schedule.Program, (first step, last step))] without jax: train programs in
  order of first use (one per stage (per-layer windows, row length), or with `runtime` one per
  row length), then the eval programs in order of use, the final evaluation's last (steps None;
  several with train.eval_windows=step). Names are unique: `train` (the only one), else train@
  and the program's windows (Program.label), and xROWS where row lengths differ; `eval`, else
  eval@ and its windows."""
  runs = ws.stage_runs(cfg, 0, cfg.train.steps)
  train = ws.plan(list(dict.fromkeys(stage for stage, _, _ in runs)), runtime)
  served = {}
  for stage, first, last in runs:
    lo, hi = served.get(train[stage], (first, last))
    served[train[stage]] = (min(lo, first), max(hi, last))
  lengths = {p.seq_len for p in served}
  out = [("train" if len(served) == 1 else f"train@{program.label()}"
          + (f"x{program.seq_len}" if len(lengths) > 1 else ""), program, steps)
         for program, steps in served.items()]
  # Windows never shrink as steps go by: the final evaluation's program is the last one used.
  evals = list(dict.fromkeys(ws.eval_plan(cfg, ws.eval_points(cfg.train), runtime).values()))
  return out + [("eval" if len(evals) == 1 else f"eval@{program.label()}", program, None)
                for program in evals]


def program_words(spec: str) -> list:
  """The items of a --programs value; UserError on an empty one."""
  words = [w.strip() for w in spec.split(",")]
  if not all(words):
    what = "is empty" if len(words) == 1 else "has an empty item"
    raise UserError(f"--programs={spec!r} {what}: give all, or a comma list of first, last, eval "
                    "or program names (train@1792)")
  return words


def select(progs: list, spec: str) -> list:
  """The programs `spec` names (all | first,last,eval | names), in run order; `last` is the last
  train stage's program alone, `eval` the final evaluation's. UserError on an empty item or an
  unknown name."""
  words = program_words(spec)
  names = [p[0] for p in progs]
  train = [name for name in names if not is_eval(name)]
  evals = [name for name in names if is_eval(name)]
  alias = {"first": train[0], "last": train[-1]} if train else {}
  if evals and "eval" not in names:
    alias["eval"] = evals[-1]
  unknown = [w for w in words if w != "all" and w not in alias and w not in names]
  if unknown:
    raise UserError(f"--programs names unknown program(s) {', '.join(unknown)}; choose from "
                    f"{', '.join(['all', *alias, *names])}")
  if "all" in words:
    return progs
  chosen = {alias.get(w, w) for w in words}
  return [p for p in progs if p[0] in chosen]


def check_programs(cfg, spec: str) -> None:
  """`select`'s check of --programs before jax loads, against attention.impl's programs; with
  auto, until jax resolves the kernel, a name of either kind counts (static windows or runtime
  ones; run_compile checks it again against the target's kernel, before the plan and the build)."""
  program_words(spec)
  static, runtime = (program_list(cfg, r) for r in (False, True))
  if cfg.attention.impl != "auto":  # a kernel named is every target's: its programs alone count
    static = runtime = runtime if cfg.attention.impl in ws.RUNTIME_WINDOW_IMPLS else static
  try:
    select(static, spec)
  except UserError as e:
    try:
      select(runtime, spec)
    except UserError:
      other = [p[0] for p in runtime if p[0] not in {q[0] for q in static}]
      raise UserError(f"{e}" + (f" (or, where the attention kernel takes the windows at run "
                                f"time, {', '.join(other)})" if other else "")) from None
