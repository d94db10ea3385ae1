"""Sample text from a trained model: `python -m nanotext.generate output_dir=DIR prompt="..."`."""

import functools
import os

# jax and flax are imported inside the functions: a Ctrl-C while they load (seconds) is then
# caught by errors.run_cli and ends in one line, not a traceback.
from nanotext.errors import UserError

USAGE = ("usage: python -m nanotext.generate output_dir=DIR [prompt=TEXT] [max_new_tokens=N] "
         "[temperature=T] [top_k=K] [seed=S] [step=N] [num_samples=N]")
MAX_SAMPLES = 1000
INT64_MAX = 2**63 - 1


def choose(logits_V, key, temperature: float, top_k: int):
  """A token id from float32 logits: the argmax at temperature 0, else drawn from the softmax at
  `temperature` over the top_k logits (0 = all)."""
  import jax
  import jax.numpy as jnp
  if temperature <= 0:
    return jnp.argmax(logits_V)
  if top_k:
    kth = jax.lax.top_k(logits_V, min(top_k, logits_V.shape[-1]))[0][-1]
    logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
  # shifted by the maximum before the division: a temperature near 0 (1e-38) then makes the
  # others -inf, not every logit inf (whose draw was NaN's)
  return jax.random.categorical(key, (logits_V - jnp.max(logits_V)) / temperature)


@functools.lru_cache(maxsize=8)  # one set of programs for every sample of a command
def make_sampler(graphdef, max_len: int, temperature: float, top_k: int):
  """jit(params, buf_BT, pos, key) -> next token id after position `pos` of a buffer, the whole
  buffer run again (compiled once per buffer length)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  def next_token(params, buf, pos, key):
    logits_V = nnx.merge(graphdef, params)(buf, train=False)[0, pos].astype(jnp.float32)
    return choose(logits_V, key, temperature, top_k)
  del max_len
  return jax.jit(next_token)


@functools.lru_cache(maxsize=8)
def make_cached(graphdef, temperature: float, top_k: int):
  """(prompt, step): jit(params, caches, buf_BT, n, key) -> (the token after the first n of a
  buffer, caches holding their keys and values); jit(params, caches, token, pos, key) -> (the
  token after `token` at position pos, caches with it added). Compiled once per buffer and cache
  length; the caches' buffers are donated (written in place)."""
  import jax
  from flax import nnx
  def prompt(params, caches, buf, n, key):
    logits_BV, caches = nnx.merge(graphdef, params).extend(buf, caches, 0, n - 1)
    return choose(logits_BV[0], key, temperature, top_k), caches
  def step(params, caches, token, pos, key):
    logits_BV, caches = nnx.merge(graphdef, params).extend(token.reshape(1, 1), caches, pos, 0)
    return choose(logits_BV[0], key, temperature, top_k), caches
  return jax.jit(prompt, donate_argnums=1), jax.jit(step, donate_argnums=1)


def sample(graphdef, params, prompt_ids, *, max_len: int, max_new_tokens: int,
           temperature: float, top_k: int, seed: int, cache: bool = True) -> list:
  """Autoregressively extend `prompt_ids`; the context is the last `max_len` tokens."""
  return list(stream(graphdef, params, prompt_ids, max_len=max_len, max_new_tokens=max_new_tokens,
                     temperature=temperature, top_k=top_k, seed=seed, cache=cache))


def stream(graphdef, params, prompt_ids, *, max_len: int, max_new_tokens: int,
           temperature: float, top_k: int, seed: int, cache: bool = True):
  """`sample`'s tokens, each yielded as soon as it is drawn: from the key-value cache while the
  context fits in max_len (`cached`), then with the whole context of the last max_len tokens
  run again for each token (it slides, and every position moves)."""
  import jax
  import numpy as np
  if not prompt_ids:
    raise UserError("the prompt encodes to no tokens; give a non-empty prompt")
  tokens = list(prompt_ids)
  key = jax.random.key(seed)
  if cache and len(tokens) < max_len and max_new_tokens:
    key = yield from cached(graphdef, params, tokens, key, max_len=max_len,
                            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k)
  step_fn = make_sampler(graphdef, max_len, temperature, top_k)
  for _ in range(max_new_tokens - (len(tokens) - len(prompt_ids))):
    ctx = tokens[-max_len:]
    buf = np.zeros((1, bucket(len(ctx), max_len)), np.int32)
    buf[0, :len(ctx)] = ctx
    key, sub = jax.random.split(key)
    tokens.append(int(step_fn(params, buf, len(ctx) - 1, sub)))
    yield tokens[-1]


def cached(graphdef, params, tokens: list, key, *, max_len: int, max_new_tokens: int,
           temperature: float, top_k: int):
  """Tokens drawn after `tokens` (appended to it as they are yielded) while the context fits in
  max_len: the prompt runs once (in a bucket), then each token alone against every layer's cached
  keys and values (model/kv_cache.py). Returns the random key to go on with."""
  import jax
  import numpy as np
  from flax import nnx
  from nanotext.model import kv_cache
  prompt, step = make_cached(graphdef, temperature, top_k)
  length = bucket(min(len(tokens) + max_new_tokens, max_len), max_len)  # positions it may hold
  caches = kv_cache.empty(nnx.merge(graphdef, params), 1, length)
  buf = np.zeros((1, bucket(len(tokens), max_len)), np.int32)
  buf[0, :len(tokens)] = tokens
  key, sub = jax.random.split(key)
  token, caches = prompt(params, caches, buf, len(tokens), sub)
  for drawn in range(1, max_new_tokens + 1):
    tokens.append(int(token))
    yield tokens[-1]
    if drawn == max_new_tokens or len(tokens) > length:  # done, or the context slides from here
      return key
    key, sub = jax.random.split(key)
    token, caches = step(params, caches, np.int32(tokens[-1]), len(tokens) - 1, sub)
  return key


MIN_BUCKET = 128


def bucket(n: int, max_len: int) -> int:
  """The buffer a context of n tokens runs in: the next power of two from MIN_BUCKET, at most
  max_len. Causal attention makes the logits at n - 1 those of any longer buffer, so a short
  context need not pay for max_len (49,152 for the record); one program per bucket."""
  size = MIN_BUCKET
  while size < n:
    size *= 2
  return min(size, max_len)


MAX_PENDING = 8  # tokens held back while their text ends inside a character (UTF-8: 4 bytes)


def text_pieces(tokenizer, ids):
  """The text of token ids, piece by piece as they come: a token that ends inside a multi-byte
  character waits for the next one (at most MAX_PENDING tokens), so every piece is whole
  characters and the pieces join to tokenizer.decode(ids) (byte-level BPE, valid UTF-8)."""
  pending = []
  for i in ids:
    pending.append(i)
    piece = tokenizer.decode(pending)
    if not piece.endswith("\ufffd") or len(pending) >= MAX_PENDING:
      yield piece
      pending = []
  if pending:
    yield tokenizer.decode(pending)


def sample_ids(graphdef, params, cfg, tokenizer, prompt: str, seed: int | None = None):
  """The continuation's token ids of prompt text as they are drawn, with cfg.sample's settings
  (`seed` in place of sample.seed where given)."""
  s = cfg.sample
  return stream(graphdef, params, encode_prompt(tokenizer, prompt), max_len=cfg.model.max_seq_len,
                max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                seed=s.seed if seed is None else seed)


def sample_text(graphdef, params, cfg, tokenizer, prompt: str) -> str:
  """Prompt text -> sampled continuation text, with the settings in cfg.sample."""
  return tokenizer.decode(list(sample_ids(graphdef, params, cfg, tokenizer, prompt)))


def encode_prompt(tokenizer, prompt: str) -> list:
  """The prompt's token ids; UserError for one that encodes to none (checked before a run
  trains and before generate reads a checkpoint, not after)."""
  ids = tokenizer.encode(prompt)
  if not ids:
    raise UserError(f"sample.prompt={prompt!r} encodes to no tokens; give a non-empty prompt "
                    "(or sample.max_new_tokens=0 for no sample)")
  return ids


def in_model_order(abstract_params, params, where: str):
  """A restored params tree rebuilt in the model's own tree, matched name by name.

  Saved trees key list items by strings, so a restore without a target returns layers in
  string order ('0', '1', '10', '11', '2', ...): merged by position, 11 or more layers would be
  permuted. Shapes are checked; dtypes stay as saved (a params-only folder may be bfloat16)."""
  from nanotext.trees import fill, flatten
  return fill(abstract_params, flatten(params), f"checkpoint '{where}'", cast=False)


def restore(out: str, cfg, step: int = -1, *, checked: bool = False) -> tuple:
  """(step, graphdef, params) of a run's newest (or given) checkpoint, or of a params-only
  folder, on one local device in the model's own tree. The model is built from `cfg` (as
  config.load reads it; `checked`: wiring.check already ran) by wiring, as training builds it."""
  import jax
  from nanotext import wiring
  from nanotext.convert.common import read_params
  _, graphdef, abstract_params = wiring.for_sampling(cfg, jax.local_devices(), checked=checked)
  step, params = read_params(out, step, "output_dir", "step=")
  return step, graphdef, in_model_order(abstract_params, params, f"{out} step {step}")


def parse(argv) -> tuple:
  """(output_dir, step, number of samples, config path, sample.* overrides) from `key=value`
  arguments."""
  from nanotext import config, rundir
  args = dict(config.parse_override(a) for a in argv)
  allowed = {"output_dir", "prompt", "max_new_tokens", "temperature", "top_k", "seed", "step",
             "num_samples"}
  for k in args:
    if k not in allowed:
      raise UserError(f"unknown argument '{k}'; {USAGE}")
  if "output_dir" not in args:
    raise UserError(f"output_dir is required; {USAGE}")
  out = args.pop("output_dir")
  rundir.check_no_glob(os.path.abspath(out), "output_dir")
  rundir.check_run_dir(out, "output_dir")
  cfg_path = os.path.join(out, "config.yml")
  step = int(config.coerce("step", args.pop("step", "-1"), 0))
  if step < -1:
    raise UserError(f"step={step} is not a checkpoint step: give a step >= 0, or leave it out "
                    "for the newest")
  num = int(config.coerce("num_samples", args.pop("num_samples", "1"), 0))
  if not 1 <= num <= MAX_SAMPLES:
    raise UserError(f"num_samples={num} must lie between 1 and {MAX_SAMPLES}")
  overrides = [f"sample.{k}={v}" for k, v in args.items()]
  return out, step, num, cfg_path, overrides


def precheck(argv) -> None:
  """The arguments and the run's config for them (file, keys, types), checked before jax loads."""
  from nanotext import config
  _, _, num, path, overrides = parse(argv)
  check_seeds(config.load(path, overrides), num)


def check_seeds(cfg, num: int) -> None:
  """Sample i draws with sample.seed + i: the last must still be a 64-bit seed."""
  if cfg.sample.seed + num - 1 > INT64_MAX:
    raise UserError(f"sample.seed={cfg.sample.seed} with num_samples={num} passes {INT64_MAX} "
                    "(sample i draws with seed + i): give a smaller seed")


def main(argv) -> None:
  from nanotext import wiring
  from nanotext.data.tokenizer import get_tokenizer
  out, step, num, cfg_path, overrides = parse(argv)
  cfg = wiring.load(cfg_path, overrides)  # checked as train checks it
  check_seeds(cfg, num)
  tokenizer = get_tokenizer(cfg.data.tokenizer)
  encode_prompt(tokenizer, cfg.sample.prompt)  # before the checkpoint is read
  step, graphdef, params = restore(out, cfg, step, checked=True)
  for i in range(num):  # sample i draws with seed + i: the first is the one-sample command's
    seed = cfg.sample.seed + i
    label = f"step {step}" if num == 1 else f"step {step}, sample {i + 1} of {num}, seed {seed}"
    print(f"[{label}] {cfg.sample.prompt}", end="", flush=True)
    ids = sample_ids(graphdef, params, cfg, tokenizer, cfg.sample.prompt, seed)
    for piece in text_pieces(tokenizer, ids):  # as it is sampled: long samples take minutes
      print(piece, end="", flush=True)
    print()


if __name__ == "__main__":
  from nanotext import cli
  cli.run(main, USAGE, __doc__, jax=True, precheck=precheck)
