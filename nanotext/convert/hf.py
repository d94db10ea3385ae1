"""Hugging Face GPT2LMHeadModel <-> nanotext classic GPT-2 (learned positions, LayerNorm, GELU).

HF GPT-2 stores Conv1D weights as [in, out], the nanotext kernel layout, so matrices copy as they
are; only the merged c_attn [d, 3d] splits into q | k | v (head-major within each, as nanotext),
or into a model.merged_qkv run's one [3, d, d] kernel and [3, d] bias per block.
"""

import json
import os

import numpy as np

from nanotext.convert.common import RUN_OWN, load_run, per_layer, require
from nanotext.outputs import check_out, staged_dir
from nanotext.convert.hf_tokenizer import generation_config, special_ids, write_tokenizer
from nanotext.errors import UserError
from nanotext.trees import flatten
from nanotext.rundir import check_no_glob, check_run_dir

# What --force may replace: a folder holding only what to-hf writes (a model card, notes or a
# source checkout beside them are refused, not deleted); from-hf's run folder: common.RUN_OWN.
HF_OWN = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
          "tokenizer_config.json", "special_tokens_map.json")
LN_EPS = 1e-5  # LayerNorm's epsilon at model.norm_eps=0 (layers.Norm); GPT-2's too
# HF activations equal to jax.nn.gelu's default (approximate=True, the tanh form).
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
# Buffers some older GPT-2 files carry; they are masks, not weights.
IGNORED = (".attn.bias", ".attn.masked_bias")

# nanotext architecture of a classic GPT-2: what to-hf needs and from-hf writes.
CLASSIC = {"model.positions": "learned", "model.norm": "layernorm", "model.mlp_act": "gelu",
           "model.bias": True, "model.tie_embeddings": True, "model.logit_softcap": 0.0,
           "model.x0_mix": False, "model.qk_norm": False, "model.value_embeds": 0,
           "model.unet_skips": False, "model.value_residual": False,
           "model.fused_qkv": False, "model.no_attention_layers": [],
           "model.attn_scale_learned": False, "model.fp8_head": False,
           "model.zero_init_head": False, "attention.window": 0,
           "attention.window_pattern": "", "attention.window_schedule": False,
           "attention.block_windows": False, "attention.doc_mask": False}


def _block_names(i: int) -> dict:
  """nanotext name -> HF name (without 'transformer.') for the one-to-one tensors of block i."""
  h, b = f"h.{i}", f"blocks.{i}"
  return {f"{b}.ln1.scale": f"{h}.ln_1.weight", f"{b}.ln1.bias": f"{h}.ln_1.bias",
          f"{b}.ln2.scale": f"{h}.ln_2.weight", f"{b}.ln2.bias": f"{h}.ln_2.bias",
          f"{b}.attn.o.kernel": f"{h}.attn.c_proj.weight",
          f"{b}.attn.o.bias": f"{h}.attn.c_proj.bias",
          f"{b}.mlp.fc.kernel": f"{h}.mlp.c_fc.weight", f"{b}.mlp.fc.bias": f"{h}.mlp.c_fc.bias",
          f"{b}.mlp.proj.kernel": f"{h}.mlp.c_proj.weight",
          f"{b}.mlp.proj.bias": f"{h}.mlp.c_proj.bias"}


def _shared_names() -> dict:
  return {"embed.embedding": "wte.weight", "pos": "wpe.weight", "ln_f.scale": "ln_f.weight",
          "ln_f.bias": "ln_f.bias"}


def merged(cfg, flat: dict) -> dict:
  """Flat params under q|k|v names as a model.merged_qkv run stores them (one [3, D, D] kernel
  and [3, D] bias per block); other runs' unchanged."""
  if not cfg.model.merged_qkv:
    return flat
  out = dict(flat)
  for i in range(cfg.model.num_layers):
    for kind in ("kernel", "bias"):
      out[f"blocks.{i}.attn.qkv.{kind}"] = np.stack(
          [out.pop(f"blocks.{i}.attn.{n}.{kind}") for n in "qkv"])
  return out


def split_qkv(cfg, flat: dict) -> dict:
  """Inverse of `merged`: a model.merged_qkv run's qkv tensors under q|k|v names."""
  if not cfg.model.merged_qkv:
    return flat
  out = dict(flat)
  for i in range(cfg.model.num_layers):
    for kind in ("kernel", "bias"):
      out.update(zip((f"blocks.{i}.attn.{n}.{kind}" for n in "qkv"),
                     np.asarray(out.pop(f"blocks.{i}.attn.qkv.{kind}"))))
  return out


# ---------------------------------------------------------------------------------------------
# from-hf

def _read_hf_config(hf: str) -> dict:
  path = os.path.join(hf, "config.json")  # read_hf checked it is there
  try:
    with open(path) as f:
      c = json.load(f)
  except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"cannot read '{path}': {e}") from None
  if not isinstance(c, dict):
    raise UserError(f"'{path}' holds a JSON {type(c).__name__}, not the object of a Hugging "
                    "Face config")
  if c.get("model_type") != "gpt2":
    raise UserError(f"'{path}' has model_type={c.get('model_type')!r}; only gpt2 converts")
  unsupported = {
      "activation_function": lambda v: v in TANH_GELUS,  # nanotext has the tanh GELU only
      "scale_attn_by_inverse_layer_idx": lambda v: not v,
      "add_cross_attention": lambda v: not v,
      "tie_word_embeddings": lambda v: v is None or v,
      "layer_norm_epsilon": lambda v: not isinstance(v, bool) and isinstance(v, (int, float))
                                      and 0 < v < 1,
  }
  for key, ok in unsupported.items():
    if key in c and not ok(c[key]):
      raise UserError(f"Hugging Face option {key}={c[key]!r} in '{path}' has no nanotext "
                      "equivalent")
  for key in SIZES:  # what the tensors' shapes and the nanotext config are derived from
    v = c.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
      raise UserError(f"'{path}' gives {key}={v!r}: a GPT-2 config needs a positive integer")
  v = c.get("n_inner")  # None: 4 * n_embd
  if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
    raise UserError(f"'{path}' gives n_inner={v!r}: a positive integer, or null for "
                    "4 * n_embd")
  # reorder_and_upcast_attn only changes where the float32 upcast happens: same function.
  return c


SIZES = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")


def _read_hf_tensors(hf: str) -> dict:
  """All tensors of model.safetensors (or its shards) as numpy, 'transformer.' stripped."""
  from safetensors.numpy import load_file
  single = os.path.join(hf, "model.safetensors")
  index = os.path.join(hf, "model.safetensors.index.json")
  if os.path.isfile(single):
    files = [single]
  elif os.path.isfile(index):
    files = [os.path.join(hf, n) for n in _shard_names(index)]
  else:
    raise UserError(f"'{hf}' holds no model.safetensors (a pytorch_model.bin must be re-saved "
                    "with save_pretrained(safe_serialization=True) first)")
  out = {}
  for path in files:
    try:
      tensors = load_file(path)
    except Exception as e:  # safetensors raises its own error types for damaged files
      raise UserError(f"cannot read '{path}': {str(e).splitlines()[0][:200]}") from None
    for name, value in tensors.items():
      out[name.removeprefix("transformer.")] = value
  return out


def _shard_names(index: str) -> list:
  """The shard files a model.safetensors.index.json names (its weight_map's values: plain file
  names in its folder); a damaged index is one line."""
  try:
    with open(index, "rb") as f:
      names = json.loads(f.read().decode("utf-8"))["weight_map"].values()
    names = sorted(set(names))
    if not names or not all(isinstance(n, str) and n and os.path.basename(n) == n
                            and n not in (".", "..") for n in names):
      raise ValueError("its weight_map names no shard files of its folder")
  except OSError as e:
    raise UserError(f"cannot read '{index}': {e.strerror}") from None
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise UserError(f"'{index}' is not a safetensors index ({type(e).__name__}: "
                    f"{str(e)[:120]}); save the model again with save_pretrained") from None
  return names


def _hf_to_flat(c: dict, t: dict) -> dict:
  """HF tensors -> {nanotext dotted name: float32 array}."""
  t = {k: v for k, v in t.items() if not k.endswith(IGNORED)}
  head = t.pop("lm_head.weight", None)
  if head is not None and not np.array_equal(head, t.get("wte.weight")):
    raise UserError("lm_head.weight differs from wte.weight (an untied head); nanotext's "
                    "classic GPT-2 ties them")
  d = c["n_embd"]
  flat = {ours: t.pop(theirs, None) for ours, theirs in _shared_names().items()}
  for i in range(c["n_layer"]):
    flat.update({ours: t.pop(theirs, None) for ours, theirs in _block_names(i).items()})
    w, b = t.pop(f"h.{i}.attn.c_attn.weight", None), t.pop(f"h.{i}.attn.c_attn.bias", None)
    if w is None or b is None or w.shape != (d, 3 * d) or b.shape != (3 * d,):
      raise UserError(f"block {i}: attn.c_attn must be weight [{d}, {3 * d}] and bias "
                      f"[{3 * d}]; got {getattr(w, 'shape', None)} and {getattr(b, 'shape', None)}")
    for j, name in enumerate("qkv"):
      flat[f"blocks.{i}.attn.{name}.kernel"] = w[:, j * d:(j + 1) * d]
      flat[f"blocks.{i}.attn.{name}.bias"] = b[j * d:(j + 1) * d]
  missing = [k for k, v in flat.items() if v is None]
  if missing:
    raise UserError(f"the Hugging Face checkpoint lacks tensors for {', '.join(missing[:5])}")
  if t:
    raise UserError(f"the Hugging Face checkpoint has tensors nanotext cannot place: "
                    f"{', '.join(sorted(t)[:5])}")
  out = {k: np.asarray(v, np.float32) for k, v in flat.items()}
  bad = [k for k, v in out.items() if not np.isfinite(v).all()]
  if bad:
    raise UserError(f"the Hugging Face checkpoint holds NaN or infinite values in "
                    f"{', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}: nothing to train on")
  return out


def hf_overrides(c: dict) -> dict:
  """nanotext config keys (dotted) that a HF GPT-2 config determines."""
  d, h = c["n_embd"], c["n_head"]
  if d % h:
    raise UserError(f"n_embd={d} is not divisible by n_head={h}")
  derived = {"model.vocab_size": c["vocab_size"], "model.num_layers": c["n_layer"],
             "model.d_model": d, "model.num_heads": h, "model.head_dim": d // h,
             "model.mlp_dim": c.get("n_inner") or 4 * d, "model.max_seq_len": c["n_positions"],
             # scale_attn_weights=false is plain q.k, which nanotext states as attn_scale=1.
             "model.attn_scale": 0.0 if c.get("scale_attn_weights", True) else 1.0,
             "model.norm_eps": _norm_eps(c.get("layer_norm_epsilon", LN_EPS)),
             # float32 storage, as the file's: a bfloat16 table (speedrun's embed_dtype) rounded
             # GPT-2's weights, and to-hf gave back another wte
             "model.param_dtype": "float32", "model.embed_dtype": ""}
  derived.update(CLASSIC)
  return derived


def _norm_eps(hf_eps) -> float:
  """model.norm_eps of a HF layer_norm_epsilon: 0 (LayerNorm's own default) for GPT-2's 1e-5."""
  return 0.0 if abs(float(hf_eps) - LN_EPS) <= 1e-12 else float(hf_eps)


def read_hf(hf: str, out: str, overrides=(), *, config_path: str = "", force: bool = False):
  """(config, flat params) of a HF GPT-2 directory, the first half of `nanotext.convert.from_hf`:
  --out checked, the HF config mapped onto nanotext keys and the tensors onto nanotext names.

  The caller builds the run from the config (wiring, a layer above this module) and hands it,
  with the tensors under the model's names (`merged`), to `common.write_run`.
  """
  from nanotext import config
  check_no_glob(os.path.abspath(out), "--out")  # orbax writes its checkpoint there
  check_run_dir(hf, "--hf", holds="config.json", kind="a Hugging Face model directory")
  check_out(os.path.abspath(out), force=force, protect=(hf,), own=RUN_OWN)
  c = _read_hf_config(hf)
  flat = _hf_to_flat(c, _read_hf_tensors(hf))
  derived = hf_overrides(c)
  out_abs = os.path.abspath(out)
  # Sequences no longer than the position table unless the user says otherwise (then validated).
  base = config_path or config.SCHEMA_PATH
  seq = min(config.load(base).train.seq_len, c["n_positions"])
  if c["vocab_size"] == 50257:  # the real GPT-2 vocabulary: train on with its tokenizer
    derived.setdefault("data.tokenizer", "gpt2")
  # model.align=0: the widths are the checkpoint's (GPT-2's vocabulary of 50,257 warned on every
  # import, a line before any refusal); an override still sets it
  args = [f"{k}={v}" for k, v in derived.items()] + [f"train.seq_len={seq}", "model.align=0"] + \
      list(overrides)
  try:
    cfg = config.load(base, args + [f"output_dir={out_abs}"])
    eos = c.get("eos_token_id")
    if cfg.data.tokenizer == "none" and cfg.data.eot_id < 0 and type(eos) is int and \
        0 <= eos < c["vocab_size"]:  # its documents' boundary (to-hf exports it back)
      cfg = config.load(base, args + [f"data.eot_id={eos}", f"output_dir={out_abs}"])
  except UserError as e:  # model.* keys are the checkpoint's: name them as its config.json does
    if "model.max_seq_len" not in str(e):
      raise
    raise UserError(f"{e} (model.max_seq_len is the Hugging Face checkpoint's "
                    f"n_positions={c['n_positions']})") from None
  for key, want in derived.items():
    have = config.get(cfg, key)
    if key == "model.norm_eps":  # 0 is LayerNorm's own 1e-5: an explicit 1e-5 is the same
      have, want = have or LN_EPS, want or LN_EPS
    if key == "model.embed_dtype":  # "" is param_dtype's: an explicit float32 is the same
      have, want = have or cfg.model.param_dtype, want or "float32"
    if key.startswith(("model.", "attention.")) and have != want:
      raise UserError(f"{key}={have!r} conflicts with the Hugging Face "
                      f"checkpoint, which needs {want!r}")
  return cfg, flat


# ---------------------------------------------------------------------------------------------
# to-hf

def check_classic(cfg) -> None:
  """Refuse architectures that HF GPT-2 cannot express, naming the config key."""
  why = ("Hugging Face GPT-2 cannot express this model (configs/base.yml trains one it can; "
         "export-torch writes speedrun-architecture runs)")
  m = cfg.model
  # Indices past the last layer build nothing (base.yml): the model is GPT-2's all the same.
  require(cfg, dict(CLASSIC, **{"model.no_attention_layers": lambda layers: all(
      i >= m.num_layers for i in layers)}), why)
  if m.num_heads * m.head_dim != m.d_model:
    raise UserError(f"{why}: model.num_heads*model.head_dim={m.num_heads * m.head_dim} differs "
                    f"from model.d_model={m.d_model}")
  if m.embed_rows not in (0, m.vocab_size):  # one table is GPT-2's wte and its head
    raise UserError(f"{why}: model.embed_rows={m.embed_rows} differs from model.vocab_size="
                    f"{m.vocab_size} (GPT-2's one table is its embedding and its head)")
  if m.attn_scale and m.attn_scale != 1.0 and abs(m.attn_scale * np.sqrt(m.head_dim) - 1) > 1e-6:
    raise UserError(f"{why}: model.attn_scale={m.attn_scale} is neither 1/sqrt(head_dim) nor 1")


def hf_config(cfg) -> dict:
  """config.json of the GPT2LMHeadModel equivalent to a classic nanotext model."""
  m = cfg.model
  c = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m.vocab_size,
       "n_positions": m.max_seq_len, "n_embd": m.d_model, "n_layer": m.num_layers,
       "n_head": m.num_heads, "n_inner": m.mlp_dim, "activation_function": "gelu_new",
       "layer_norm_epsilon": m.norm_eps or LN_EPS, "initializer_range": m.init_std or 0.02,
       "scale_attn_weights": m.attn_scale != 1.0, "scale_attn_by_inverse_layer_idx": False,
       "reorder_and_upcast_attn": False, "tie_word_embeddings": True, "use_cache": True,
       # nanotext trains without dropout; HF's 0.1 defaults would change fine-tuning behaviour.
       "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "dtype": "float32"}
  # HF would default bos/eos to GPT-2's 50256, out of range for other vocabularies.
  c.update(special_ids(cfg.data.tokenizer, cfg.data.eot_id))
  return c


def to_hf(run: str, out: str, *, step: int = -1, force: bool = False, log=print) -> str:
  """A classic-GPT-2 nanotext checkpoint -> HF directory: config.json, generation_config.json,
  model.safetensors and the tokenizer files (`AutoTokenizer` / `pipeline` load it offline)."""
  from safetensors.numpy import save_file
  check_out(os.path.abspath(out), force=force, protect=(run,), own=HF_OWN)
  cfg, step, params = load_run(run, step)
  check_classic(cfg)
  flat = split_qkv(cfg, per_layer(cfg, flatten(params)))
  tensors = {theirs: flat.pop(ours) for ours, theirs in _shared_names().items()}
  for i in range(cfg.model.num_layers):
    tensors.update({theirs: flat.pop(ours) for ours, theirs in _block_names(i).items()})
    a = f"blocks.{i}.attn"
    tensors[f"h.{i}.attn.c_attn.weight"] = np.concatenate(
        [flat.pop(f"{a}.{n}.kernel") for n in "qkv"], axis=1)
    tensors[f"h.{i}.attn.c_attn.bias"] = np.concatenate(
        [flat.pop(f"{a}.{n}.bias") for n in "qkv"])
  if flat:
    raise UserError(f"run '{run}' has parameters with no GPT-2 counterpart: "
                    f"{', '.join(sorted(flat)[:5])}")
  # The tied lm_head is left out, as save_pretrained does; from_pretrained ties it to wte.
  tensors = {f"transformer.{k}": np.ascontiguousarray(v, np.float32) for k, v in tensors.items()}
  out_abs = os.path.abspath(out)
  with staged_dir(out_abs, force=force, protect=(run,), own=HF_OWN) as tmp:
    c = hf_config(cfg)
    with open(os.path.join(tmp, "config.json"), "w") as f:
      json.dump(c, f, indent=2)
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
      json.dump(generation_config(special_ids(cfg.data.tokenizer, cfg.data.eot_id)), f, indent=2)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    tok = write_tokenizer(cfg.data.tokenizer, tmp, c["n_positions"])
  log(f"wrote {out_abs} (GPT2LMHeadModel, step {step} of {run}; {tok})")
  return out_abs
