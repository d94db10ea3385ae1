"""Step-time benchmark: `python benchmarks/step_time.py CONFIG [key=value ...] [--steps N]`.

Builds the model, optimizer and shardings from the config exactly as training does, feeds
synthetic batches (data.source=synthetic), compiles the train step ahead of time, then times
`--repeats` windows of `--steps` steps each and prints a table of medians: compile time, step
time, tokens/s and MFU, with the compiled executable's own FLOP count beside the analytic one.
"""

import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per repeat.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repeats (the median is reported).")
_WARMUP = flags.DEFINE_integer("warmup", 2, "Untimed steps after compilation.")


def measure(path, overrides, *, steps, repeats, warmup) -> dict:
  """Compile and time the train step of a config on synthetic data."""
  import jax
  from nanotext import metrics, trainer, wiring

  setup = wiring.prepare(path, list(overrides) + ["data.source=synthetic"])
  cfg, state = setup.cfg, setup.init_state()
  batch = trainer.global_batch(setup, next(setup.train_iter()))
  t0 = time.perf_counter()
  compiled = trainer.make_train_step(setup).lower(state, batch).compile()
  compile_s = time.perf_counter() - t0
  for _ in range(warmup):
    state, m = compiled(state, batch)
  jax.block_until_ready(m)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(steps):
      state, m = compiled(state, batch)
    jax.block_until_ready(m)
    times.append((time.perf_counter() - t0) / steps)
  step_s = statistics.median(times)
  tokens = cfg.train.batch_size * cfg.train.seq_len
  flops = metrics.flops_per_token(cfg.model, cfg.train.seq_len, cfg.attention.window) * tokens
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  xla_flops = float(cost.get("flops", 0.0)) * jax.device_count() if cost else 0.0
  mem = compiled.memory_analysis()
  peak_bytes = (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
                - mem.alias_size_in_bytes) if mem is not None else 0
  return {"params": setup.num_params, "devices": jax.device_count(),
          "backend": jax.default_backend(), "compile_s": compile_s, "step_s": step_s,
          "step_s_all": times, "tokens_per_s": tokens / step_s,
          "mfu": flops / step_s / (cfg.metrics.peak_flops * jax.device_count()),
          "analytic_flops": flops, "xla_flops": xla_flops, "peak_bytes": peak_bytes,
          "peak_flops": cfg.metrics.peak_flops}


def main(argv):
  from nanotext.errors import UserError, fail
  if len(argv) < 2:
    fail("usage: python benchmarks/step_time.py CONFIG [key=value ...] [--steps N]")
  try:
    r = measure(argv[1], argv[2:], steps=_STEPS.value, repeats=_REPEATS.value,
                warmup=_WARMUP.value)
  except UserError as e:
    fail(str(e))
  print(f"| config | {' '.join(argv[1:])} |")
  print("| --- | --- |")
  rows = [
      ("backend / devices", f"{r['backend']} x {r['devices']}"),
      ("parameters", f"{r['params']:,}"),
      ("compile time", f"{r['compile_s']:.2f} s"),
      ("step time (median)", f"{1e3 * r['step_s']:.1f} ms "
       f"(repeats: {', '.join(f'{1e3 * t:.1f}' for t in r['step_s_all'])})"),
      ("tokens/s", f"{r['tokens_per_s']:,.0f}"),
      ("MFU", f"{100 * r['mfu']:.1f}% of {r['peak_flops'] * r['devices'] / 1e9:,.0f} GFLOP/s"),
      ("FLOPs/step analytic / XLA", f"{r['analytic_flops'] / 1e9:.2f} / "
       f"{r['xla_flops'] / 1e9:.2f} GFLOP"),
      ("per-device memory (args + temps)", f"{r['peak_bytes'] / 2**20:.1f} MiB"),
  ]
  for k, v in rows:
    print(f"| {k} | {v} |")


if __name__ == "__main__":
  app.run(main)
