"""Entry point: `python -m nanotext.train CONFIG [key=value ...]`.

Thin on purpose: config -> mesh -> state -> data -> loop. Overrides can also be given as absl
flags: `--config=CONFIG --set=train.steps=50 --set=model.num_layers=2`.
"""

import contextlib
import os
import time

from absl import flags

from nanotext import cli, signals
from nanotext.errors import ResourceError, UserError, fail, print_log
from nanotext.generate import encode_prompt, past_rows, sample_text
from nanotext.xla_flags import maybe_set_cpu_flags

_STARTED = time.perf_counter()  # the start-up line's clock: from the entry point's import
USAGE = ("usage: python -m nanotext.train CONFIG.yml [key=value ...] "
         "(or --config=CONFIG.yml [--set=key=value ...])")

_FLAGS = {}  # define_flags(): name -> absl flag holder


def define_flags() -> None:
  """--config and --set, defined by the command line alone: a script that imports this module
  (to call run) and defines its own --config (a flax example's) clashed with them."""
  if not _FLAGS:
    # Multi: a second --config is refused, not silently the one used.
    _FLAGS["config"] = flags.DEFINE_multi_string("config", [], "")
    # absl's help of a multi flag says to repeat it: this one is given once
    flags.FLAGS["config"].help = "Config YAML (instead of the first argument), given once."
    _FLAGS["set"] = flags.DEFINE_multi_string("set", [], "A key=value override")


def _flag(name: str) -> list:
  """An absl flag's values where the command line defined it (define_flags), else none."""
  return list(_FLAGS[name].value or []) if name in _FLAGS else []


def parse_args(argv) -> tuple:
  """(config path, overrides) from positional arguments and the absl flags."""
  args, given = list(argv), _flag("config")
  if len(given) > 1:
    raise UserError(f"--config is given {len(given)} times ({', '.join(given)}): give one "
                    "config file")
  if given and args and (os.path.splitext(args[0])[1] in (".yml", ".yaml")
                         or os.path.isfile(args[0])):
    raise UserError(f"two config files: --config={given[0]} and '{args[0]}'; give one")
  if given and not given[0].strip():
    raise UserError(f"--config is empty: give a config file's path; {USAGE}")
  if given:
    return given[0], args + _flag("set")
  if not args or not cli.names_config(args[0]):
    raise UserError(f"no config file given; {USAGE}")
  return args.pop(0), args + _flag("set")


def precheck(args) -> None:
  """The config file, its keys and their types, checked before jax loads (run checks it all)."""
  from nanotext import config
  config.load(*parse_args(args))


def check_only(args) -> None:
  """--only_check_args: the config and output_dir as a start checks them before the devices
  (every section's rules; a run there resumed, refused or replaced under overwrite=true; a fresh
  start's own rules and parameter source where none resumes); nothing written."""
  precheck(args)  # a bad key or type: said before jax loads
  from nanotext import identity, rundir, wiring
  path, overrides = parse_args(args)
  cfg = wiring.load(path, overrides, fresh=False)
  identity.check_source(path, overrides, cfg)
  out = rundir.check_output_dir_path(cfg.output_dir)
  saved = rundir.has_checkpoint(out)  # resumed if the same run; else refused or replaced
  if not saved or identity.check_run(identity.as_saved(cfg, out), out):
    wiring.check(cfg)
    if cfg.checkpoint.load_params_from:
      identity.check_folder(cfg.checkpoint.load_params_from, "checkpoint.load_params_from")


@contextlib.contextmanager
def compile_cache(path: str):
  """JAX's persistent compilation cache in `path` while the block runs ('' leaves it as it is):
  later runs reuse every compiled program. Every program is cached (no minimum compile time or
  size): a window schedule has many step programs, and a restart should compile none of them
  again. The process's own settings come back after (a notebook's later jits, a later run whose
  config says '', went on caching into this run's folder)."""
  if not path:
    yield
    return
  import jax
  from jax.experimental.compilation_cache import compilation_cache
  before = {k: getattr(jax.config, k) for k in CACHE_KEYS}
  # JAX opens its cache at the first compilation and keeps that folder: a run started in a
  # process that compiled before (a notebook, tests) would otherwise cache elsewhere or nowhere.
  compilation_cache.reset_cache()
  jax.config.update("jax_compilation_cache_dir", os.path.abspath(os.path.expanduser(path)))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  try:
    yield
  finally:
    compilation_cache.reset_cache()
    for key, value in before.items():
      jax.config.update(key, value)


CACHE_KEYS = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
              "jax_persistent_cache_min_entry_size_bytes")


def data_lines(cfg, train_iter, val_local, log) -> None:
  """Start-up lines where the data holds less than the config reads: fewer validation batches,
  or training sequences read more than once."""
  if len(val_local) < cfg.train.eval_batches:
    log(f"validation: {len(val_local)} batch{'es' if len(val_local) > 1 else ''}, all the "
        f"validation data holds (train.eval_batches={cfg.train.eval_batches})")
  if (epochs := train_iter.epochs(cfg.train.steps)) > 1:  # each sequence read again
    log(f"training data: {train_iter.windows:,} sequences of {cfg.train.seq_len + 1} tokens, "
        f"{epochs:.1f} epochs in train.steps={cfg.train.steps} of {train_iter.rows} rows")


def run(path: str, overrides, log=print, started: float | None = None):
  """Load, check and train; returns the loop result. Raises UserError on bad input.

  `log`: what takes each line (None: no lines). `started` (a time.perf_counter()) is where the
  start-up line's clock starts; default now.
  """
  from nanotext import identity, wiring
  from nanotext.watch import StartupClock

  log = log or (lambda line: None)
  clock = StartupClock(started)
  clock.lap("imports")
  cfg = wiring.load(path, overrides, fresh=False)  # a fresh start's own rules: Session's
  identity.check_source(path, overrides, cfg)
  with compile_cache(cfg.train.compile_cache_dir):  # before this process's first compilation
    return _run(cfg, log, clock)


def _run(cfg, log, clock):
  """run() from its config on: devices, wiring, session, first state, loop, report."""
  import jax
  from nanotext import checkpoint, distributed, memory_plan, sharding, wiring
  from nanotext.session import Session
  from nanotext.watch import Preemption
  clock.lap("config")
  # Joining the other processes must precede the first backend use (device counts in finalize).
  distributed.maybe_initialize(cfg.distributed)
  jax.devices()  # starts the backend: its own phase on the start-up line
  distributed.check_same_config(cfg.to_dict())
  clock.lap("backend")
  # A resumed run keeps the remat and loss chunks it chose before, where they still fit.
  # Checks, derived values and the vocabulary / process-count rules all happen in wiring.
  prefer = memory_plan.saved_choice(cfg.output_dir)
  try:
    run_ = wiring.from_config(cfg, prefer=prefer, checked=True, log=log)
  except sharding.NotDivisible as e:
    if e.key.startswith("train.") or not resumes_with(cfg, e.key, e.size):
      raise
    raise e.mesh_only("the run in output_dir resumes with the model it was trained as") \
        from None
  if prefer and cfg.overwrite and replaces(run_.cfg):  # the choices of the run replaced
    run_ = wiring.from_config(cfg, prefer={}, checked=True, log=lambda line: None)  # said
    run_.log = log
  run_.memory.require("train", "eval")  # every run validates at its end
  loaded, cfg = cfg, run_.cfg
  # Everything up to `session.open` is only read: a mistake found there changes nothing.
  session = Session(cfg, log, fresh_rules=lambda: wiring.check(loaded))
  clock.lap("config")
  check_sample(cfg, log)
  train_iter, val_local = run_.train_iter(), run_.val_batches()
  data_fingerprint = distributed.same_data(cfg.data)  # processes on other files refused
  clock.lap("data")
  # Signals: before the first step they stop the run at once (output_dir put back); from then
  # on they only set a flag, and the loop saves and stops (the final save included).
  with Preemption(on_early_stop=session.stop_early) as preemption, \
      contextlib.closing(train_iter), \
      session.open(preemption, state_bytes(run_)), \
      checkpoint.make_manager(cfg.output_dir, keep=cfg.checkpoint.keep,
                              async_save=cfg.checkpoint["async"], fingerprint=data_fingerprint,
                              on_confirmed=session.confirmed) as manager:
    from nanotext.model.kernels.dispatch import interpreted  # a Pallas kernel off its chip
    log(f"model: {run_.num_params:,} parameters | {sharding_summary(run_)} | "
        f"{cfg.train.batch_size}x{cfg.train.seq_len} tokens/step"
        f"{interpreted(run_.impl, run_.backend, ' | ')}")
    log(run_.memory.line())
    data_lines(cfg, train_iter, val_local, log)
    clock.lap("output_dir")
    result = _train(run_, cfg, manager, train_iter, val_local, preemption, log, clock)
  finish(run_, cfg, result, preemption.received, log)
  return result


def finish(run_, cfg, result, received: str | None, log) -> None:
  """A run that went to its end reports (a sample) unless a signal came after its last step
  (while its files were closed). The processes of one run all report, each running the
  sample's collectives (one skipping it left the others waiting for ever), and say it after."""
  import jax
  late = "received {} after the last step: the final checkpoint is saved"
  if result.preempted:
    return
  if received and jax.process_count() == 1:
    log(late.format(received))
    return
  report(run_, cfg, result, log)
  if received or signals.late():
    log(late.format(received or signals.late()))


def resumes_with(cfg, key: str, size) -> bool:
  """Whether this run resumes the one in output_dir, which saved `key` (a model's, or a
  parameter's dimension) as `size`: on a resume only the mesh can change; only reads."""
  from nanotext import config, config_file, rundir
  if cfg.overwrite or not rundir.has_checkpoint(cfg.output_dir):
    return False
  try:
    saved = config.flatten(config_file.read(os.path.join(cfg.output_dir, "config.yml")))
  except UserError:  # said where it counts, when the session opens
    return False
  return key not in saved or saved[key] == size


def replaces(cfg) -> bool:
  """Whether this run (overwrite=true) replaces the run in output_dir; only reads."""
  from nanotext import identity
  try:
    return identity.check_run(cfg, cfg.output_dir)
  except UserError:  # said again, where it counts, when the session opens
    return False


def report(run_, cfg, result, log) -> None:
  """After a run that went to its end: whether it reached train.target_val_loss, a sample."""
  from nanotext.data.tokenizer import get_tokenizer, known_vocab_size
  target = cfg.train.target_val_loss
  if target:
    reached = result.val_loss <= target
    log(f"target val_loss <= {target}: {'reached' if reached else 'not reached'} "
        f"(final val_loss {result.val_loss:.4f})")
  if known_vocab_size(cfg.data.tokenizer) is None or not cfg.sample.max_new_tokens:
    if cfg.sample.max_new_tokens:  # said, as every other reason a sample is skipped
      log("no sample: data.tokenizer=none has no text to decode ids into (set data.tokenizer to "
          "the data's, or sample.max_new_tokens=0 for no sample)")
    return
  try:
    tokenizer = get_tokenizer(cfg.data.tokenizer)
  except UserError as e:  # e.g. tiktoken offline: the run itself succeeded
    log(f"no sample: {e}")  # where a library caller's lines go, as the other reasons
    return
  why = past_rows(cfg, encode_prompt(tokenizer, cfg.sample.prompt))  # a synthetic run's table
  if why:
    log(f"no sample: {why}")
    return
  with signals.ending_with("received {} during the end-of-run sample: skipped it; the run is "
                           "complete, its final checkpoint saved"):
    text = sample_text(run_.graphdef, result.state["params"], cfg, tokenizer, cfg.sample.prompt)
  log(f"sample: {cfg.sample.prompt}{text}")


def check_sample(cfg, log=print) -> None:
  """The tokenizer and the end-of-run sample's prompt, checked before training rather than
  after it: a tokenizer that cannot load (tiktoken missing or offline) is said at the start."""
  from nanotext.data.tokenizer import get_tokenizer, known_vocab_size
  if known_vocab_size(cfg.data.tokenizer) is None:
    return
  try:
    tokenizer = get_tokenizer(cfg.data.tokenizer)
  except UserError as e:  # the run trains, without what needs the text
    sample = " and its closing sample" if cfg.sample.max_new_tokens else ""
    log(f"warning: {e}; this run trains without val_bpb{sample}")
    return
  if cfg.sample.max_new_tokens:
    encode_prompt(tokenizer, cfg.sample.prompt)


def state_bytes(run_) -> int:
  """Bytes of the whole train state (what one checkpoint holds)."""
  import jax
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(run_.abstract_state()))


def _train(run_, cfg, manager, train_iter, val_local, preemption, log, clock):
  """Initial state, then the loop, then the wait for the last save (the run's end)."""
  import jax
  from nanotext import checkpoint, config, loop, metrics, trainer, wiring
  from nanotext.data.pipeline import val_bytes_per_token
  start = wiring.initial_state(run_, manager, log)
  clock.lap("state")
  skipped = 0
  if start.data is not None:
    train_iter.set_state(start.data["iterator"])
    skipped = start.data.get("skipped_steps", 0)
  # A finished run started again only evaluates (and samples): its config.yml, rows and
  # TensorBoard folder stay those of its training. One ended now, train.steps lowered to its
  # newest step, is recorded as ending there (a killed run's rows past that step dropped).
  path = os.path.join(cfg.output_dir, "config.yml")
  ends_here = jax.process_index() == 0 and ended_here(cfg, start, path)
  writes = jax.process_index() == 0 and (start.step < cfg.train.steps or ends_here)
  if writes and not ends_here:
    config.save(cfg, path)
  writer = metrics.Writer(cfg.output_dir, tensorboard=cfg.metrics.tensorboard, enabled=writes,
                          resumed_at=start.step)
  clock.lap("output_dir")
  val = [trainer.global_batch(run_, b) for b in val_local]
  try:
    result = loop.train(run_, start.state, train_iter, val, writer=writer, manager=manager,
                        start_step=start.step, config_dict=cfg.to_dict(), log=log,
                        skipped_steps=skipped, preemption=preemption,
                        bytes_per_token=val_bytes_per_token(
                            cfg.data, trainer.every_process(val_local)), clock=clock)
    checkpoint.wait(manager)  # the run is not over until its last save is on disk
  finally:
    writer.close()
  if ends_here:  # its end recorded: later starts find a finished run (no second final row)
    config.save(cfg, path)
  if not result.preempted:  # once the run gives the signals back (closing its workers, saves)
    signals.work_done("received {} after the last step: the final checkpoint is saved",
                      together=jax.process_count() > 1)
  return result


def ended_here(cfg, start, path: str) -> bool:
  """Whether this start ends at its checkpoint a run saved under another train.steps (lowered
  to that step; or its final step, an extension past it dead before its next checkpoint) whose
  end is not recorded yet: config.yml, saved once the final row is, holds another train.steps."""
  from nanotext import config_file
  if start.step != cfg.train.steps or start.saved_steps is None:
    return False
  try:
    train = config_file.read(path).get("train")
  except UserError:  # none, or unreadable: nothing says the end was recorded
    return start.saved_steps != start.step
  return not isinstance(train, dict) or train.get("steps") != start.step


def sharding_summary(run_) -> str:
  """'mesh data=1 fsdp=8 tensor=1 on 8 cpu device(s)' for the start-up line."""
  from nanotext import sharding
  return (f"mesh {sharding.describe(run_.mesh)} on {run_.mesh.size} {run_.backend} device(s)"
          + sharding.unused_note(run_.mesh, run_.rules, run_.axes))


def main(args) -> None:
  """The CLI: `args` are the positional arguments (absl has taken the flags)."""
  cpu_flags = maybe_set_cpu_flags()  # before JAX starts a backend, which reads XLA_FLAGS once
  if cpu_flags:
    print_log(f"XLA_FLAGS={cpu_flags} (CPU defaults; set XLA_FLAGS to choose your own)")
  from nanotext.watch import NonFiniteError
  try:
    path, overrides = parse_args(args)
    run(path, overrides, log=_log_line, started=_STARTED)
  except UserError:
    raise  # run_cli says it, after a joined run's processes meet (errors.BEFORE_REFUSAL)
  except (NonFiniteError, ResourceError) as e:  # a failed checkpoint write is a ResourceError
    # Not bad input (status 2) but a failed run: one line, status 1, checkpoints left intact.
    fail(str(e), 1)
  except Exception as e:  # of runtime errors, only a device out of memory is expected
    if not out_of_memory(e):
      raise
    fail(out_of_memory(e), 1)
  except KeyboardInterrupt:  # before the handlers of the run are installed: nothing written
    fail("interrupted", 130)


def out_of_memory(e: Exception) -> str:
  """The one line for a device allocation that failed (XLA's RESOURCE_EXHAUSTED), else "";
  a kernel's tiles past the GPU's shared memory say so, as no memory setting helps them."""
  import jax
  head = (str(e).splitlines() or [""])[0]
  if not isinstance(e, jax.errors.JaxRuntimeError) or not head.startswith("RESOURCE_EXHAUSTED"):
    return ""
  if "Shared memory" in head:  # Triton's: a Pallas kernel's tiles, not the device's memory
    return (f"a Pallas kernel's tiles do not fit in the GPU's shared memory "
            f"({head[len('RESOURCE_EXHAUSTED: '):][:120]}), which no memory setting changes; "
            "checkpoints already written are intact. Take another attention kernel: "
            "attention.impl=blocked or xla")
  return (f"the device ran out of memory ({head[len('RESOURCE_EXHAUSTED: '):][:120]}); checkpoints "
          "already written are intact. Lower the memory per device: model.remat=dots, "
          "train.loss_chunk=256, train.grad_accum, train.eval_accum, train.eval_seq_len, or more "
          "devices on mesh.fsdp (python -m nanotext.compile reports what each program needs)")


def _is_main() -> bool:
  import jax
  return jax.process_index() == 0


def _log_line(line: str) -> None:
  """A line of the run's log, printed by process 0."""
  if _is_main():
    print_log(line)


if __name__ == "__main__":
  define_flags()
  # Until the run takes the signals (watch.Preemption) it has only read: a signal stops it.
  cli.run(main, USAGE, __doc__, jax=True, precheck=precheck, aot=True, check_only=check_only,
          at_once="stopped by {} before the first step: nothing to save, nothing written")
