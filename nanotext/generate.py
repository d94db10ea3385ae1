"""Sample text from a trained model: `python -m nanotext.generate output_dir=DIR prompt="..."`."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nanotext.errors import UserError, run_cli

USAGE = ("usage: python -m nanotext.generate output_dir=DIR [prompt=TEXT] [max_new_tokens=N] "
         "[temperature=T] [top_k=K] [seed=S] [step=N]")


def make_sampler(graphdef, max_len: int, temperature: float, top_k: int):
  """jit(params, buf_BT, pos, key) -> next token id after position `pos` of a fixed buffer."""
  def next_token(params, buf, pos, key):
    logits_V = nnx.merge(graphdef, params)(buf, train=False)[0, pos].astype(jnp.float32)
    if temperature <= 0:
      return jnp.argmax(logits_V)
    logits_V = logits_V / temperature
    if top_k:
      kth = jax.lax.top_k(logits_V, min(top_k, logits_V.shape[-1]))[0][-1]
      logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
    return jax.random.categorical(key, logits_V)
  del max_len
  return jax.jit(next_token)


def sample(graphdef, params, prompt_ids, *, max_len: int, max_new_tokens: int,
           temperature: float, top_k: int, seed: int) -> list:
  """Autoregressively extend `prompt_ids`; the context is the last `max_len` tokens."""
  if not prompt_ids:
    raise UserError("the prompt encodes to no tokens; give a non-empty prompt")
  step_fn = make_sampler(graphdef, max_len, temperature, top_k)
  tokens = list(prompt_ids)
  key = jax.random.key(seed)
  for _ in range(max_new_tokens):
    ctx = tokens[-max_len:]
    buf = np.zeros((1, max_len), np.int32)
    buf[0, :len(ctx)] = ctx
    key, sub = jax.random.split(key)
    tokens.append(int(step_fn(params, buf, len(ctx) - 1, sub)))
  return tokens[len(prompt_ids):]


def sample_text(graphdef, params, cfg, tokenizer, prompt: str) -> str:
  """Prompt text -> sampled continuation text, with the settings in cfg.sample."""
  ids = sample(graphdef, params, tokenizer.encode(prompt), max_len=cfg.model.max_seq_len,
               max_new_tokens=cfg.sample.max_new_tokens, temperature=cfg.sample.temperature,
               top_k=cfg.sample.top_k, seed=cfg.sample.seed)
  return tokenizer.decode(ids)


def main(argv) -> None:
  from nanotext import checkpoint, config, wiring
  from nanotext.data.tokenizer import get_tokenizer

  args = dict(config.parse_override(a) for a in argv)
  allowed = {"output_dir", "prompt", "max_new_tokens", "temperature", "top_k", "seed", "step"}
  for k in args:
    if k not in allowed:
      raise UserError(f"unknown argument '{k}'; {USAGE}")
  if "output_dir" not in args:
    raise UserError(f"output_dir is required; {USAGE}")
  out = args.pop("output_dir")
  cfg_path = os.path.join(out, "config.yml")
  if not os.path.isfile(cfg_path):
    raise UserError(f"output_dir '{out}' holds no config.yml (is it a nanotext run directory?)")
  step = int(config.coerce("step", args.pop("step", "-1"), 0))
  overrides = [f"sample.{k}={v}" for k, v in args.items()]
  cfg = config.load(cfg_path, overrides)
  tokenizer = get_tokenizer(cfg.data.tokenizer)
  if os.path.isdir(os.path.join(out, "params")):  # a params-only folder (nanotext.convert)
    from nanotext.convert import load_params
    step, params = load_params(out)
  else:
    step, params = checkpoint.latest_params(out, step)
  graphdef = wiring.abstract_model(cfg, jax.default_backend())[0]  # params come restored
  print(f"[step {step}] {cfg.sample.prompt}", end="", flush=True)
  print(sample_text(graphdef, params, cfg, tokenizer, cfg.sample.prompt))


if __name__ == "__main__":
  run_cli(main, sys.argv[1:])
