"""configs/modded_nanogpt_jax.yml against the port's own train.py: same weights, same data.

  git -C modded-nanogpt-jax show a9d3e04:train.py > /tmp/port_train.py && pip install einops
  python benchmarks/port_parity.py --port=/tmp/port_train.py [--write=tests/data/port_parity.npz]

The port (nikolageorgiev2000/modded-nanogpt-jax) runs in a subprocess (it sets jax's compilation
cache at import and writes logs/ into its working directory): its own init_params,
init_optimizer, load_dataset and train_step at tiny dims in float32 on a generated .bin shard.
nanotext then starts the recipe at the same dims from the port's initial weights
(nanotext.convert.mnjax), reads the same shard, and both loss curves are printed side by side.
The port's side never leaves this machine as code: --write keeps its weights, tokens and losses
as the fixture tests/test_port_recipe.py compares nanotext against.
"""

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "modded_nanogpt_jax.yml")
# 4 layers of 32 (2 heads of 16), vocab 128; 8 steps of 256 tokens: 8 rows of 32 for steps 0-3,
# then 4 rows of 64, in micro-batches of 2 rows; float32 (the port: Config.dtype).
PORT_CONFIG = dict(n_layers=4, d_model=32, n_heads=2, vocab_size=128, batch_size=8,
                   micro_batch_size=2, min_sequence_length=32, max_sequence_length=64,
                   sequence_warmup_intervals=32, n_train_iters=8, dtype="float32", seed=0)
OVERRIDES = ["model.num_layers=4", "model.d_model=32", "model.num_heads=2", "model.head_dim=16",
             "model.mlp_dim=128", "model.vocab_size=128", "model.dtype=float32",
             "model.param_dtype=float32", "model.norm_eps=1.1920929e-07",  # finfo(float32).eps
             "train.steps=8", "train.batch_size=4", "train.seq_len=64", "train.seq_len_start=32",
             "train.seq_len_step=32", "train.grad_accum=2", "train.loss_chunk=0",
             "model.remat=none", "train.eval_batches=1", "data.source=bin",
             "data.tokenizer=shakespeare", "optim.muon_layout=replicated"]

PORT_RUNNER = r'''
import importlib.util, sys
import jax, numpy as np
port_path, shard, out, cfg = sys.argv[1], sys.argv[2], sys.argv[3], eval(sys.argv[4])
spec = importlib.util.spec_from_file_location("port_train", port_path)
port = importlib.util.module_from_spec(spec)
spec.loader.exec_module(port)
config = port.Config(input_bin=shard, input_val_bin=shard, val_tokens=0, **cfg)
# The port's jax made meshes with Auto axes; jax >= 0.7's make_mesh defaults to Explicit, under
# which its embedding gather does not trace. Same mesh, the axis type of its day; math untouched.
Auto = jax.sharding.AxisType.Auto
mesh = jax.make_mesh(config.mesh_shape, config.mesh_axis_names,
                     axis_types=(Auto,) * len(config.mesh_axis_names))
with mesh:
  params, pre = port.init_params(config, mesh)
  init = jax.device_get(params)
  optimizer, opt_state = port.init_optimizer(config, params, mesh)
  batches = port.load_dataset(config, port.Logger(), mesh, True)
  step = jax.jit(port.train_step, static_argnames=("config", "optimizer"))
  losses = []
  for bx, by in batches:
    params, opt_state, m = step(config, params, pre, opt_state, optimizer, bx, by)
    losses.append(float(m["loss"]))
from nanotext.trees import flatten
np.savez(out, losses=np.array(losses), **{"param." + k: v for k, v in flatten(init).items()})
'''


def make_tokens(n: int, vocab: int, seed: int = 0) -> np.ndarray:
  """A learnable stream: a fixed random first-order Markov chain over `vocab` tokens."""
  rng = np.random.default_rng(seed)
  nxt = rng.integers(0, vocab, size=(vocab, 4))
  toks = np.empty(n, np.int64)
  toks[0] = 0
  choices = rng.integers(0, 4, size=n)
  for i in range(1, n):
    toks[i] = nxt[toks[i - 1], choices[i]]
  return toks


def run_port(port_path: str, shard: str, workdir: str) -> dict:
  """The port's initial params and per-step losses, computed by its own code."""
  out, runner = os.path.join(workdir, "port.npz"), os.path.join(workdir, "run_port.py")
  with open(runner, "w") as f:  # a file, not -c: the port's Logger copies sys.argv[0] into logs/
    f.write(PORT_RUNNER)
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, runner, port_path, shard, out, repr(PORT_CONFIG)],
                 cwd=workdir, env=env, check=True)
  f = np.load(out)
  return {"losses": f["losses"], "params": {k[6:]: f[k] for k in f.files
                                            if k.startswith("param.")}}


def nanotext_losses(params_flat: dict, shard: str, overrides=OVERRIDES) -> np.ndarray:
  """nanotext's per-step losses from the port's initial params on the shard."""
  import jax
  from nanotext import trainer, wiring
  from nanotext.programs import compile_train_steps
  from nanotext.trees import fill
  from nanotext.convert.mnjax import params_from_port
  from nanotext.window_schedule import step_stage
  # The shard holds the port's raw ids below its small vocabulary: no tokenizer's text.
  ov = list(overrides) + [f"data.train_files={shard}", f"data.val_files={shard}",
                          "data.tokenizer=none"]
  run = wiring.prepare(CONFIG, ov, devices=jax.devices()[:1])
  params = fill(run.abstract_state()["params"], params_from_port(params_flat, run.cfg.model),
                "modded-nanogpt-jax weights")
  state = run.state_from_params(params)
  it = run.train_iter()
  batches = [trainer.global_batch(run, next(it)) for _ in range(run.cfg.train.steps)]
  programs = compile_train_steps(run, state, batches[0], range(run.cfg.train.steps),
                                log=lambda line: None)
  losses = []
  for s, batch in enumerate(batches):
    state, m = programs(step_stage(run.cfg, s), state, batch)
    losses.append(float(m["loss"]))
  return np.array(losses)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--port", required=True, help="the port's train.py (a9d3e04)")
  ap.add_argument("--write", default="", help="save the port's side as a test fixture (.npz)")
  args = ap.parse_args()
  from nanotext.errors import fail
  if not os.path.isfile(args.port):
    fail(f"--port '{args.port}' is not a file: give the port's train.py")
  if args.write and (os.path.isdir(args.write) or
                     not os.path.isdir(os.path.dirname(os.path.abspath(args.write)))):
    fail(f"--write '{args.write}': name a file in a folder that exists")
  from nanotext.data import binfile
  with tempfile.TemporaryDirectory() as tmp:
    tokens = make_tokens(8 * 256 + 1 + 4096, PORT_CONFIG["vocab_size"])
    shard = os.path.join(tmp, "shard_000.bin")
    binfile.write_shard(shard, tokens)
    port = run_port(os.path.abspath(args.port), shard, tmp)
    ours = nanotext_losses(port["params"], shard)
  print("| step | port loss | nanotext loss | relative difference |")
  print("| --- | --- | --- | --- |")
  for i, (a, b) in enumerate(zip(port["losses"], ours)):
    print(f"| {i + 1} | {a:.6f} | {b:.6f} | {abs(a - b) / abs(a):.2e} |")
  if args.write:
    np.savez_compressed(args.write, losses=port["losses"], tokens=tokens.astype(np.uint16),
                        overrides=np.array(OVERRIDES),
                        **{"param." + k: v for k, v in port["params"].items()})
    print(f"wrote {args.write}")


if __name__ == "__main__":
  main()
