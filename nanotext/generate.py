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


def choose(logits_V, key, temperature: float, top_k: int, ids: int | None = None):
  """A token id from float32 logits: the argmax at temperature 0, else drawn from the softmax at
  `temperature` over the top_k logits (0 = all); only ids below `ids` (None: any)."""
  import jax
  import jax.numpy as jnp
  V = logits_V.shape[-1]
  if ids is not None and ids < V:  # the head's padding rows: no token table row, no text
    logits_V = jnp.where(jnp.arange(V) < ids, logits_V, -jnp.inf)
    V = ids
  if temperature <= 0:
    return jnp.argmax(logits_V)
  if top_k:
    kth = jax.lax.top_k(logits_V, min(top_k, V))[0][-1]
    logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
  # shifted by the maximum before the division: a temperature near 0 (1e-38) then makes the
  # others -inf, not every logit inf (whose draw was NaN's)
  return jax.random.categorical(key, (logits_V - jnp.max(logits_V)) / temperature)


def pick(temperature: float, top_k: int, ids: int | None = None):
  """`choose` for each row: (float32 logits [B, V], keys [B]) -> token ids [B]; row i is the
  token `choose` gives for logits i and key i alone."""
  import jax
  return jax.vmap(lambda logits_V, key: choose(logits_V, key, temperature, top_k, ids))


def split(keys):
  """(keys to go on with, subkeys to draw with) [B] each: row i jax.random.split(keys[i])'s."""
  return _split_rows()(keys)


@functools.lru_cache(maxsize=1)
def _split_rows():
  import jax
  def both(keys):
    pairs = jax.vmap(jax.random.split)(keys)
    return pairs[:, 0], pairs[:, 1]
  return jax.jit(both)


def seed_keys(seeds):
  """One PRNG key per seed, [B]: key i is jax.random.key(seeds[i]), all 64 bits of it. Without
  jax_enable_x64 jax.random.key keeps the low 32 (seeds 2**32 apart drew the same text); the
  threefry key of a 64-bit seed is its two 32-bit halves, high first."""
  import jax
  import numpy as np
  if jax.random.key_data(jax.random.key(0)).shape != (2,):  # another PRNG: as jax makes it
    data = np.stack([np.asarray(jax.random.key_data(jax.random.key(s))) for s in seeds])
  else:
    data = np.array([[(s >> 32) & 0xFFFFFFFF, s & 0xFFFFFFFF] for s in seeds], np.uint32)
  return jax.random.wrap_key_data(data)


def documents(buf_BT, eot: int | None):
  """The document ids of token buffers, as training masks them (None: no document masks)."""
  from nanotext.model.kernels.masks import segment_ids_from_tokens
  return None if eot is None else segment_ids_from_tokens(buf_BT, eot)


@functools.lru_cache(maxsize=8)  # one set of programs for every sample of a command
def make_sampler(graphdef, max_len: int, temperature: float, top_k: int, eot: int | None = None,
                 ids: int | None = None):
  """jit(params, buf_BT, pos, keys_B) -> each row's next token id (below `ids`) after position
  `pos` of a buffer, the whole buffer run again (compiled once per buffer shape); with `eot` (the
  model's attention.doc_mask) each token sees only its own document, as in training."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  def next_tokens(params, buf, pos, keys):
    logits_BV = nnx.merge(graphdef, params)(buf, documents(buf, eot), train=False)[:, pos]
    return pick(temperature, top_k, ids)(logits_BV.astype(jnp.float32), keys)
  del max_len
  return jax.jit(next_tokens)


@functools.lru_cache(maxsize=8)
def make_cached(graphdef, temperature: float, top_k: int, eot: int | None = None,
                ids: int | None = None):
  """(prompt, step): jit(params, caches, buf_BT, n, keys_B) -> (each row's token after the first
  n of a buffer, caches holding their keys and values); jit(params, caches, tokens_B, docs_B,
  pos, keys_B) -> (each row's token after its token at position pos, in document docs_B (None
  without `eot`), caches with it added); tokens below `ids`. Compiled once per buffer and cache
  shape; the caches' buffers are donated (written in place)."""
  import jax
  from flax import nnx
  def prompt(params, caches, buf, n, keys):
    logits_BV, caches = nnx.merge(graphdef, params).extend(buf, caches, 0, n - 1,
                                                           documents(buf, eot))
    return pick(temperature, top_k, ids)(logits_BV, keys), caches
  def step(params, caches, tokens, docs, pos, keys):
    logits_BV, caches = nnx.merge(graphdef, params).extend(
        tokens[:, None], caches, pos, 0, None if docs is None else docs[:, None])
    return pick(temperature, top_k, ids)(logits_BV, keys), caches
  return jax.jit(prompt, donate_argnums=1), jax.jit(step, donate_argnums=1)


def sample(graphdef, params, prompt_ids, *, seed: int, **kw) -> list:
  """Autoregressively extend `prompt_ids`; the context is the last `max_len` tokens (`stream_rows`'
  keywords)."""
  return list(stream(graphdef, params, prompt_ids, seed=seed, **kw))


def stream(graphdef, params, prompt_ids, *, seed: int, **kw):
  """`sample`'s tokens, each yielded as soon as it is drawn (`stream_rows` of one seed)."""
  for tokens in stream_rows(graphdef, params, prompt_ids, seeds=(seed,), **kw):
    yield tokens[0]


def stream_rows(graphdef, params, prompt_ids, *, seeds, max_len: int, max_new_tokens: int,
                temperature: float, top_k: int, cache: bool = True, eot: int | None = None,
                ids: int | None = None):
  """A sample per seed, drawn together as the rows of one batch: a list of each row's token per
  step, yielded as they are drawn. From the key-value cache while the context fits in max_len
  (`cached`), then with the whole context of the last max_len tokens run again for each token
  (it slides, and every position moves). Row i draws what seed i alone would, but for logits
  that a batch rounds differently from one row and that tie at that rounding. `eot`: documents
  begin at this token and see nothing before it (a model trained with attention.doc_mask).
  `ids`: draw only ids below it (the tokenizer's vocabulary size), and never one past the token
  table's rows (a head padded past them, as the record's: fed back, such an id was a NaN row)."""
  import numpy as np
  if not prompt_ids:
    raise UserError("the prompt encodes to no tokens; give a non-empty prompt")
  table = params["embed"]["embedding"].shape[0]  # model.embed_rows, resolved
  ids = table if ids is None else min(ids, table)
  rows = [list(prompt_ids) for _ in seeds]
  keys = seed_keys(seeds)
  if cache and len(prompt_ids) < max_len and max_new_tokens:
    keys = yield from cached(graphdef, params, rows, keys, max_len=max_len, eot=eot, ids=ids,
                             max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k)
  step_fn = make_sampler(graphdef, max_len, temperature, top_k, eot, ids)
  for _ in range(max_new_tokens - (len(rows[0]) - len(prompt_ids))):
    ctx = np.asarray([r[-max_len:] for r in rows], np.int32)
    buf = np.zeros((len(rows), bucket(ctx.shape[1], max_len)), np.int32)
    buf[:, :ctx.shape[1]] = ctx
    keys, sub = split(keys)
    yield append(rows, step_fn(params, buf, ctx.shape[1] - 1, sub))


def append(rows: list, tokens) -> list:
  """Each row's new token (a [B] array) appended to it; returned as a list of ints."""
  import numpy as np
  new = np.asarray(tokens).tolist()
  for r, t in zip(rows, new):
    r.append(t)
  return new


def cached(graphdef, params, rows: list, keys, *, max_len: int, max_new_tokens: int,
           temperature: float, top_k: int, eot: int | None = None, ids: int | None = None):
  """Tokens drawn after each row (appended to it as they are yielded) while the context fits in
  max_len: the prompt runs once (in a bucket), then each row's token alone against every
  layer's cached keys and values (model/kv_cache.py). Returns the random keys to go on with."""
  import numpy as np
  from flax import nnx
  from nanotext.model import kv_cache
  prompt, step = make_cached(graphdef, temperature, top_k, eot, ids)
  n = len(rows[0])
  length = bucket(min(n + max_new_tokens, max_len), max_len)  # positions it may hold
  caches = kv_cache.empty(nnx.merge(graphdef, params), len(rows), length)
  buf = np.zeros((len(rows), bucket(n, max_len)), np.int32)
  buf[:, :n] = rows[0]  # one prompt for every row
  keys, sub = split(keys)
  tokens, caches = prompt(params, caches, buf, n, sub)
  docs = None if eot is None else np.full(len(rows), rows[0].count(eot), np.int32)
  for drawn in range(1, max_new_tokens + 1):
    new = append(rows, tokens)
    yield new
    if drawn == max_new_tokens or len(rows[0]) > length:  # done, or the context slides from here
      return keys
    keys, sub = split(keys)
    if docs is not None:  # each row's document: an end-of-text token opens the next
      docs = docs + (np.asarray(new) == eot)
    tokens, caches = step(params, caches, np.asarray(new, np.int32), docs, len(rows[0]) - 1, sub)
  return keys


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
  character waits for the next one, so every piece is whole characters and the pieces join to
  tokenizer.decode(ids) (byte-level BPE). Bytes that never complete one (an undertrained
  model's) still print, MAX_PENDING tokens at a time, less the last few, which may yet start a
  character (UTF-8: at most 3 bytes of one before its last)."""
  pending = []
  for i in ids:
    pending.append(i)
    piece = tokenizer.decode(pending)
    if not piece.endswith("\ufffd"):
      yield piece
      pending = []
    elif len(pending) >= MAX_PENDING:
      cut = _cut(tokenizer, pending, piece)
      yield tokenizer.decode(pending[:cut])
      pending = pending[cut:]
  if pending:
    yield tokenizer.decode(pending)


def _cut(tokenizer, pending: list, whole: str) -> int:
  """Where `pending` (decoding to `whole`) splits into two that decode to it, keeping at least
  its last 3 tokens; all of it where no such split exists."""
  for cut in range(len(pending) - 3, 0, -1):
    if tokenizer.decode(pending[:cut]) + tokenizer.decode(pending[cut:]) == whole:
      return cut
  return len(pending)


def sample_ids(graphdef, params, cfg, tokenizer, prompt: str, seed: int | None = None):
  """The continuation's token ids of prompt text as they are drawn, with cfg.sample's settings
  (`seed` in place of sample.seed where given)."""
  s = cfg.sample
  return stream(graphdef, params, encode_prompt(tokenizer, prompt), max_len=cfg.model.max_seq_len,
                max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                seed=s.seed if seed is None else seed, eot=doc_eot(cfg), ids=tokenizer.vocab_size)


def doc_eot(cfg) -> int | None:
  """The token that opens a document where the model was trained with document masks, else None."""
  from nanotext import wiring
  return wiring.doc_mask_eot(cfg) if cfg.attention.doc_mask else None


def sample_text(graphdef, params, cfg, tokenizer, prompt: str) -> str:
  """Prompt text -> sampled continuation text, with the settings in cfg.sample."""
  return tokenizer.decode(list(sample_ids(graphdef, params, cfg, tokenizer, prompt)))


def encode_prompt(tokenizer, prompt: str, key: str = "sample.prompt") -> list:
  """The prompt's token ids; UserError for one that encodes to none (checked before a run
  trains and before generate reads a checkpoint, not after). `key`: the argument's name."""
  ids = tokenizer.encode(prompt)
  if not ids:
    other = " (or sample.max_new_tokens=0 for no sample)" if key == "sample.prompt" else ""
    raise UserError(f"{key}={prompt!r} encodes to no tokens; give a non-empty prompt{other}")
  return ids


def restore(out: str, cfg, step: int = -1, *, checked: bool = False) -> tuple:
  """(step, graphdef, params) of a run's newest (or given) checkpoint, or of a params-only
  folder, on one local device in the model's own tree (convert.common.model_params)."""
  from nanotext.convert.common import model_params
  return model_params(out, cfg, step, "output_dir", "step=", checked=checked)


def parse(argv) -> tuple:
  """(output_dir, step, number of samples, config path, sample.* overrides) from `key=value`
  arguments."""
  from nanotext import config, rundir
  args = {}
  for key, value in map(config.parse_override, argv):
    if key in args:
      raise UserError(f"{key}= is given twice; give it once")
    args[key] = value
  allowed = {"output_dir", "prompt", "max_new_tokens", "temperature", "top_k", "seed", "step",
             "num_samples"}
  for k in args:
    if k not in allowed:
      raise UserError(f"unknown argument '{k}'; {USAGE}")
  if "output_dir" not in args:
    raise UserError(f"output_dir is required; {USAGE}")
  out = os.path.expanduser(args.pop("output_dir"))
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
  from nanotext import config, rundir
  out, _, num, path, overrides = parse(argv)
  check_seeds(rundir.run_config(out, "output_dir", lambda: config.load(path, overrides)), num)


def past_rows(cfg, ids) -> str:
  """Why prompt `ids` cannot be read by the model ('' where they can): an id past its token
  table's rows, which a lookup would clamp (the samples then garbage)."""
  rows = cfg.model.embed_rows if cfg.model.embed_rows > 0 else cfg.model.vocab_size
  if max(ids, default=0) < rows:
    return ""
  return (f"the prompt's token id {max(ids)} (tokenizer '{cfg.data.tokenizer}') is past the "
          f"model's {rows} token rows")


def check_seeds(cfg, num: int) -> None:
  """Sample i draws with sample.seed + i: the last must still be a 64-bit seed."""
  if cfg.sample.seed + num - 1 > INT64_MAX:
    raise UserError(f"sample.seed={cfg.sample.seed} with num_samples={num} passes {INT64_MAX} "
                    "(sample i draws with seed + i): give a smaller seed")


def main(argv) -> None:
  from nanotext import identity, rundir, wiring
  from nanotext.data.tokenizer import get_tokenizer
  out, step, num, cfg_path, overrides = parse(argv)
  # checked as train checks a resume (fresh=False: a fresh start's own rules are no saved run's)
  cfg = rundir.run_config(out, "output_dir", lambda: wiring.load(cfg_path, overrides, False))
  identity.check_unedited(out, cfg.to_dict())
  check_seeds(cfg, num)
  if cfg.data.tokenizer == "none":  # no data.* argument here: the run's file names it
    raise UserError(f"data.tokenizer is 'none' (the run read token ids, no text): set it in "
                    f"'{cfg_path}' to the tokenizer that made them (no model key: the checkpoint "
                    "still reads; set none back before training resumes into output_dir)")
  tokenizer = get_tokenizer(cfg.data.tokenizer)
  prompt_ids = encode_prompt(tokenizer, cfg.sample.prompt, "prompt")  # before the checkpoint
  why = past_rows(cfg, prompt_ids)
  if why:
    raise UserError(f"{why}: give a prompt of other text")
  step, graphdef, params = restore(out, cfg, step, checked=True)
  rows = batch_rows(graphdef, params, cfg, len(prompt_ids), num)
  for first in range(0, num, rows):  # sample i draws with seed + i
    seeds = [cfg.sample.seed + i for i in range(first, min(num, first + rows))]
    print_batch(graphdef, params, cfg, tokenizer, prompt_ids, seeds, step, first, num)


def print_batch(graphdef, params, cfg, tokenizer, prompt_ids, seeds, step, first, num) -> None:
  """The samples of `seeds`, drawn as one batch: the first printed as it is drawn (long samples
  take minutes), the others as the batch ends."""
  s = cfg.sample
  at = step if step >= 0 else "unknown (no convert.json)"  # a params-only folder's
  label = lambda i: f"step {at}" if num == 1 else \
      f"step {at}, sample {first + i + 1} of {num}, seed {seeds[i]}"
  drawn = [[] for _ in seeds]

  def first_row():
    for tokens in stream_rows(graphdef, params, prompt_ids, seeds=seeds,
                              max_len=cfg.model.max_seq_len, max_new_tokens=s.max_new_tokens,
                              temperature=s.temperature, top_k=s.top_k, eot=doc_eot(cfg),
                              ids=tokenizer.vocab_size):
      for ids, t in zip(drawn, tokens):
        ids.append(t)
      yield tokens[0]
  print(f"[{label(0)}] {s.prompt}", end="", flush=True)
  for piece in text_pieces(tokenizer, first_row()):
    print(piece, end="", flush=True)
  print()
  for i in range(1, len(seeds)):
    print(f"[{label(i)}] {s.prompt}{tokenizer.decode(drawn[i])}", flush=True)


BATCH_BYTES = 2**30  # the most a batch of samples holds in caches and logits
MAX_ROWS = 64


def batch_rows(graphdef, params, cfg, prompt_len: int, num: int) -> int:
  """How many samples to draw together: each row holds its key-value caches, and, once the
  context slides, the logits of a whole buffer; at most BATCH_BYTES for all, MAX_ROWS rows."""
  from flax import nnx
  from nanotext.model import kv_cache
  max_len, new = cfg.model.max_seq_len, cfg.sample.max_new_tokens
  per_row = kv_cache.row_bytes(nnx.merge(graphdef, params),
                               bucket(min(prompt_len + new, max_len), max_len))
  if prompt_len + new > max_len:
    per_row += max_len * cfg.model.vocab_size * 4
  return max(1, min(num, MAX_ROWS, BATCH_BYTES // max(per_row, 1)))


if __name__ == "__main__":
  from nanotext import cli
  cli.run(main, USAGE, __doc__, jax=True, precheck=precheck, at_once=cli.READ_ONLY_STOP)
