"""nanotext's CPU train step against a PyTorch nanoGPT-style model of the same dimensions.

  python benchmarks/cpu_vs_torch.py [CONFIG [key=value ...]] [--rounds 3] [--steps 3]
      [--variants a,b,...]

Each variant lives in its own worker process (XLA reads XLA_FLAGS once per process), compiles
once, then waits; every round asks each worker in turn for `--steps` timed steps, so variants
see the same machine conditions and no two run at once. Prints a table of medians over rounds
(step time, tokens/s, ratio to PyTorch eager). Variants:

  nanotext        as `python -m nanotext.train` runs: attention.impl=auto (the cpu kernel) and
                  the entry point's CPU XLA flags (nanotext.xla_flags)
  nanotext-noflag the same without the XLA flags
  nanotext-xla    attention.impl=xla and no XLA flags: nanotext before the CPU work
  torch-eager     the same model in PyTorch: nn.Linear, F.scaled_dot_product_attention (causal),
                  tied embeddings, AdamW, grad-norm clip; float32
  torch-compile   that model under torch.compile (inductor)

The PyTorch model is written here from the config's dims (learned positions, LayerNorm, tanh
GELU, biases, tied head): it is only defined for the classic GPT-2 configs (configs/base.yml).
"""

import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
VARIANTS = ("nanotext", "nanotext-noflag", "nanotext-xla", "torch-eager", "torch-compile")


def nanotext_stepper(config_path: str, overrides, impl: str):
  """(step(n) -> seconds for n steps, dims) for nanotext's compiled train step."""
  sys.path.insert(0, REPO)
  import jax
  from nanotext import trainer, wiring
  setup = wiring.prepare(config_path, list(overrides) + ["data.source=synthetic",
                                                          f"attention.impl={impl}"])
  cfg = setup.cfg
  state = [setup.init_state()]
  batch = trainer.global_batch(setup, next(setup.train_iter()))
  step = trainer.make_train_step(setup).lower(state[0], batch).compile()
  schedule = trainer.schedule_of(setup)

  def run(n):
    t0 = time.perf_counter()
    for _ in range(n):
      state[0], m = step(state[0], batch, schedule)
    jax.block_until_ready(m)
    return time.perf_counter() - t0
  return run, cfg


def torch_stepper(config_path: str, overrides, compiled: bool):
  """(step(n) -> seconds, cfg) for a PyTorch GPT-2-style model with the config's dims."""
  sys.path.insert(0, REPO)
  import torch
  from torch import nn
  from torch.nn import functional as F
  from nanotext import wiring
  cfg = wiring.prepare(config_path, overrides).cfg  # every derived value filled in
  m, t = cfg.model, cfg.train
  D, H, V, T, B = m.d_model, m.num_heads, m.vocab_size, t.seq_len, t.batch_size

  class Block(nn.Module):
    def __init__(self):
      super().__init__()
      self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
      self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
      self.fc, self.proj = nn.Linear(D, m.mlp_dim), nn.Linear(m.mlp_dim, D)

    def forward(self, x):
      q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
      q, k, v = (a.view(B, T, H, D // H).transpose(1, 2) for a in (q, k, v))
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      x = x + self.o(y.transpose(1, 2).reshape(B, T, D))
      return x + self.proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

  class GPT(nn.Module):
    def __init__(self):
      super().__init__()
      self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
      self.blocks = nn.ModuleList(Block() for _ in range(m.num_layers))
      self.ln_f = nn.LayerNorm(D)

    def forward(self, idx, targets):
      x = self.wte(idx) + self.wpe(torch.arange(T))
      for block in self.blocks:
        x = block(x)
      logits = self.ln_f(x) @ self.wte.weight.T  # tied head
      return F.cross_entropy(logits.view(-1, V), targets.view(-1))

  torch.manual_seed(0)
  model = GPT()
  opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1,
                          cfg.optim.beta2), eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
  idx = torch.randint(0, V, (B, T))
  tgt = torch.randint(0, V, (B, T))

  def one():
    loss = model(idx, tgt)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
    opt.step()
    return loss
  if compiled:
    model = torch.compile(model)
  one()  # warm up (and compile)

  def run(n):
    t0 = time.perf_counter()
    for _ in range(n):
      one()
    return time.perf_counter() - t0
  return run, cfg


def worker(variant: str, config_path: str, overrides) -> None:
  """Serve `variant`: print 'ready', then answer each line 'N' with the seconds of N steps."""
  if variant.startswith("nanotext"):
    if variant == "nanotext":
      sys.path.insert(0, REPO)
      from nanotext.xla_flags import maybe_set_cpu_flags
      maybe_set_cpu_flags()
    run, _ = nanotext_stepper(config_path, overrides,
                              "xla" if variant == "nanotext-xla" else "auto")
  else:
    run, _ = torch_stepper(config_path, overrides, variant == "torch-compile")
  run(3)  # first executions allocate (and torch.compile may recompile): not timed
  print("ready", flush=True)
  for line in sys.stdin:
    print(f"{run(int(line)):.6f}", flush=True)


def start(variant: str, config_path: str, overrides):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  if variant.startswith("nanotext"):
    env.pop("XLA_FLAGS", None)  # the variant decides
  proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), f"--worker={variant}",
                           "--", config_path, *overrides], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True, env=env)
  line = proc.stdout.readline().strip()
  if line != "ready":
    proc.kill()
    return None
  return proc


USAGE = ("usage: python benchmarks/cpu_vs_torch.py [CONFIG [key=value ...]] [--rounds 3] "
         "[--steps 3] [--variants a,b,...]")


def check_mirrored(cfg) -> None:
  """UserError unless the PyTorch model here computes what nanotext does for `cfg`: GPT-2 as
  configs/base.yml (overhead.py's REQUIRED), heads that split d_model exactly (D // H here)."""
  import overhead
  from nanotext.errors import UserError
  overhead.check_supported(cfg, "cpu_vs_torch.py's PyTorch model")
  m = cfg.model
  head_dim = m.head_dim or m.d_model // m.num_heads
  if head_dim * m.num_heads != m.d_model:
    raise UserError(f"model.head_dim={head_dim} x model.num_heads={m.num_heads} is not "
                    f"model.d_model={m.d_model}: the PyTorch model splits d_model into heads of "
                    "d_model // num_heads; set model.head_dim=0 (or to d_model / num_heads)")


def main(argv) -> None:
  from absl import flags
  import bench_cli
  from nanotext import config
  from nanotext.errors import UserError
  f = flags.FLAGS
  args = argv[1:]
  if f.worker:
    worker(f.worker, args[0], args[1:])
    return
  rounds, steps, variants = f.rounds, f.steps, list(f.variants)
  bench_cli.at_least(1, rounds=rounds, steps=steps)
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown or not variants:
    raise UserError(f"--variants={','.join(variants)}: choose from {','.join(VARIANTS)}")
  config_path = args[0] if args else os.path.join(REPO, "configs", "base.yml")
  overrides = args[1:]
  cfg = config.load(config_path, overrides)
  check_mirrored(cfg)
  tokens = cfg.train.batch_size * cfg.train.seq_len
  procs = {}
  for v in variants:  # one at a time: compiles must not overlap either
    t0 = time.perf_counter()
    procs[v] = start(v, config_path, overrides)
    print(f"{v}: {'ready' if procs[v] else 'FAILED to start'} in {time.perf_counter() - t0:.1f} s",
          flush=True)
  live = {v: p for v, p in procs.items() if p}
  times = {v: [] for v in live}
  for r in range(rounds):
    for v, p in live.items():
      p.stdin.write(f"{steps}\n")
      p.stdin.flush()
      times[v].append(float(p.stdout.readline()) / steps)
    print(f"round {r + 1}: " + ", ".join(f"{v} {1e3 * times[v][-1]:.0f} ms" for v in live),
          flush=True)
  for p in live.values():
    p.stdin.close()
    p.wait()
  ref = statistics.median(times["torch-eager"]) if "torch-eager" in times else None
  print(f"\n{' '.join([config_path] + overrides)}: {cfg.train.batch_size}x{cfg.train.seq_len} tokens/step, "
        f"{rounds} rounds of {steps} steps, {os.cpu_count()} CPU cores\n")
  print("| variant | step time (median) | tokens/s | vs torch eager | rounds (ms) |")
  print("| --- | --- | --- | --- | --- |")
  for v in variants:
    if v not in times:
      print(f"| {v} | failed to start | | | |")
      continue
    med = statistics.median(times[v])
    rel = f"{ref / med:.2f}x" if ref else ""
    print(f"| {v} | {1e3 * med:.0f} ms | {tokens / med:,.0f} | {rel} | "
          f"{', '.join(f'{1e3 * t:.0f}' for t in times[v])} |")


if __name__ == "__main__":
  from absl import flags
  import bench_cli
  flags.DEFINE_integer("rounds", 3, "Rounds (the median is reported).")
  flags.DEFINE_integer("steps", 3, "Timed steps per variant and round.")
  flags.DEFINE_list("variants", list(VARIANTS), "Variants to time.")
  flags.DEFINE_string("worker", "", "Internal: serve this variant (the script starts these).")
  bench_cli.run(main, USAGE, __doc__)
