"""YAML configs -> locked ml_collections.ConfigDict, with inheritance, overrides and validation;
then, once derived values are filled in, typed frozen per-section objects.

Every key and its default lives in configs/base.yml; that file is the schema. A config file may
name a parent in `base:` and hold only the keys it changes. Overrides come as `key=value` strings
with dotted keys. Values are coerced to the type of the default. Derived values (those left at 0 or
-1 = "auto") are filled in by `finalize`, the one place that computes them; it returns a `Section`
tree (frozen dataclasses whose fields and types are made from base.yml, so a new key is added
there alone).
"""

import difflib
import math
import os
from pathlib import Path

import ml_collections
import yaml

from nanotext import sections
from nanotext.errors import UserError

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "configs" / "base.yml"

POSITIVE = ("train.steps", "train.batch_size", "train.seq_len", "train.grad_accum",
            "train.log_every", "train.eval_batches", "model.vocab_size", "model.num_layers",
            "model.d_model", "model.num_heads")
NON_NEGATIVE = ("train.eval_every", "checkpoint.every", "model.head_dim", "model.mlp_dim",
                "model.max_seq_len", "model.align", "optim.warmup_steps", "optim.grad_clip",
                "data.workers", "data.val_tokens", "sample.max_new_tokens", "sample.top_k",
                "sample.temperature", "model.logit_softcap", "model.attn_scale",
                "train.eval_seq_len", "optim.head_lr_record", "model.norm_eps",
                "model.init_std", "model.embed_std", "attention.window",
                "profile.steps", "train.target_val_loss", "optim.lr",
                "optim.muon_lr", "optim.embed_lr", "optim.head_lr", "optim.scalar_lr",
                "optim.weight_decay", "optim.final_lr_frac", "optim.eps", "optim.head_eps")
# Counters held in int32 on the device (the step) or in 32-bit grain indices.
INT32 = ("train.steps", "train.batch_size", "train.seq_len", "train.grad_accum",
         "train.log_every", "train.eval_every", "train.eval_batches", "checkpoint.every",
         "checkpoint.keep", "optim.warmup_steps", "optim.muon_momentum_warmup",
         "model.vocab_size", "model.num_layers", "model.d_model", "model.num_heads",
         "model.head_dim", "model.mlp_dim", "model.max_seq_len", "sample.max_new_tokens",
         "profile.start_step", "profile.steps")
# Keys a continued or resumed run may change without becoming "a different run".
# A mesh (or device count) change is a resume: restore reshards, the data position carries over.
RUN_IDENTITY_IGNORES = ("overwrite", "distributed", "mesh", "data.allow_changed", "train.steps",
                        "train.log_every", "train.eval_every", "train.eval_batches", "checkpoint",
                        "metrics", "sample", "output_dir",
                        "data.workers", "profile", "train.compile_cache_dir",
                        "train.target_val_loss", "model.remat", "train.loss_chunk",
                        "train.eval_loss_chunk")
# Keys whose -1 means "auto": nanotext.memory picks the value from the memory estimate.
AUTO_CHUNKS = ("train.loss_chunk", "train.eval_loss_chunk")

# Keys nanotext no longer has: a config file that holds one (a run's saved config.yml from an
# older version) still loads, the key ignored.
RETIRED = ("train.debug_nan_step",)


class _UniqueKeyLoader(yaml.SafeLoader):
  """A SafeLoader that refuses a key given twice in one mapping (YAML's default: last wins)."""

  def construct_mapping(self, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
      key = self.construct_object(key_node, deep=deep)
      if key in seen:
        raise yaml.constructor.ConstructorError(
            None, None, f"duplicate key '{key}'", key_node.start_mark)
      seen.add(key)
    return super().construct_mapping(node, deep)


# A config is a few kilobytes; these bounds keep a hostile file (a YAML alias bomb, a huge file)
# to one line instead of minutes of work and a MemoryError.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000
MAX_BASE_DEPTH = 32


def _read_yaml(path: Path) -> dict:
  if not path.exists():
    raise UserError(f"config file '{path}' does not exist")
  if not path.is_file():
    raise UserError(f"config path '{path}' is not a file")
  try:
    if path.stat().st_size > MAX_YAML_BYTES:
      raise UserError(f"config file '{path}' is {path.stat().st_size:,} bytes, more than a config "
                      f"can be ({MAX_YAML_BYTES:,})")
    with open(path, encoding="utf-8") as f:
      data = _load_bounded(f.read(MAX_YAML_BYTES + 1), f"config file '{path}'") or {}
  except UnicodeDecodeError as e:
    raise UserError(f"config file '{path}' is not UTF-8 text (byte {e.start})") from None
  except OSError as e:
    raise UserError(f"cannot read config file '{path}': {e.strerror}") from None
  except yaml.constructor.ConstructorError as e:
    line = e.problem_mark.line + 1 if e.problem_mark else "?"
    if (e.problem or "").startswith("duplicate key"):
      raise UserError(f"config file '{path}' has a {e.problem} (line {line}); each key may "
                      "appear once per section") from None
    raise UserError(f"config file '{path}' line {line}: {e.problem} (a config holds plain "
                    "values only: no !!python or other tags)") from None
  except yaml.YAMLError as e:
    line = getattr(getattr(e, "problem_mark", None), "line", None)
    where = f" (line {line + 1})" if line is not None else ""
    raise UserError(f"config file '{path}' is not valid YAML{where}") from None
  if not isinstance(data, dict):
    raise UserError(f"config file '{path}' must hold a mapping of keys, not {type(data).__name__}")
  return data


def read_file(path) -> dict:
  """A YAML mapping from a file, with the bounds of a config file (a run's saved config.yml)."""
  return _read_yaml(Path(path))


def _load_bounded(text: str, what: str):
  """yaml.load with _UniqueKeyLoader, refusing a document whose values, aliases expanded,
  number more than MAX_YAML_VALUES (counted on the node graph before anything is built);
  `what` names the text in that error."""
  loader = _UniqueKeyLoader(text)
  try:
    node = loader.get_single_node()
    if node is None:
      return None
    count, todo = 0, [node]
    while todo:  # aliases are shared nodes: each visit is one value of the expanded document
      n = todo.pop()
      count += 1
      if count > MAX_YAML_VALUES:
        raise UserError(f"{what} expands to more than {MAX_YAML_VALUES:,} values (YAML "
                        "aliases nested in one another?); a config holds a few hundred")
      if isinstance(n, yaml.SequenceNode):
        todo.extend(n.value)
      elif isinstance(n, yaml.MappingNode):
        todo.extend(v for kv in n.value for v in kv)
    return loader.construct_document(node)
  finally:
    loader.dispose()


def _flatten(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    key = f"{prefix}{k}"
    if isinstance(v, dict):
      out.update(_flatten(v, key + "."))
    else:
      out[key] = v
  return out


def _schema() -> dict:
  return _flatten(_read_yaml(SCHEMA_PATH))


def _unknown_key(key: str, known) -> UserError:
  close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
  if not close:  # a misspelled leaf under the right section, e.g. train.step
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in known], n=1)
    close = [k for k in known if close and k.endswith("." + close[0])][:1]
  hint = f"; did you mean '{close[0]}'?" if close else ""
  return UserError(f"unknown config key '{key}'{hint}")


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


def coerce(key: str, value, default):
  """Return `value` converted to the type of `default`, or raise UserError naming the key."""
  kind = type(default)
  def bad(expected):
    return UserError(f"config key '{key}' expects {expected}, got {value!r}")
  if kind is bool:
    if isinstance(value, bool):
      return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
      return value.strip().lower() in _TRUE
    raise bad("a boolean (true or false)")
  if kind is int:
    if isinstance(value, str):
      try:
        value = int(value.strip())
      except ValueError:
        pass
    if isinstance(value, int) and not isinstance(value, bool):
      if not -2**63 <= value < 2**63:
        raise bad("an integer that fits in 64 bits")
      return value
    raise bad("an integer")
  if kind is float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      number = value
    elif isinstance(value, str):
      try:
        number = float(value.strip())
      except ValueError:
        pass
    try:
      number = None if number is None else float(number)
    except OverflowError:
      number = float("inf")
    if number is None:
      raise bad("a number")
    if not math.isfinite(number):  # a NaN lr or temperature can only poison the run
      raise bad("a finite number")
    return number
  if kind is str:
    if isinstance(value, (str, int, float)) and not isinstance(value, bool):
      return str(value)
    raise bad("a string")
  if kind is list:
    if isinstance(value, str):
      try:
        value = _load_bounded(value, f"the value of {key}")
      except yaml.YAMLError:
        raise bad("a YAML list") from None
    if isinstance(value, list):
      return value
    raise bad("a list")
  raise UserError(f"config key '{key}' has an unsupported default type {kind.__name__}")


def _file_chain(path: Path) -> list:
  """The config files from the root ancestor down to `path`, each as a flat dict."""
  chain, seen = [], []
  while True:
    path = path.resolve() if path.exists() else path
    if path in seen:
      raise UserError(f"config file '{path}' inherits from itself (via 'base:')")
    if len(seen) >= MAX_BASE_DEPTH:
      raise UserError(f"config file '{seen[0]}' has a chain of 'base:' files more than "
                      f"{MAX_BASE_DEPTH} deep")
    seen.append(path)
    flat = _flatten(_read_yaml(path))
    parent = flat.pop("base", "") or ""
    if not isinstance(parent, str):
      raise UserError(f"config key 'base' in '{path}' must be a file path")
    chain.append((str(path), flat))
    if not parent:
      return chain[::-1]
    path = path.parent / parent


def parse_override(arg: str):
  """Split a `key=value` argument."""
  if "=" not in arg:
    raise UserError(f"argument '{arg}' is not of the form key=value")
  key, value = arg.split("=", 1)
  return key.strip(), value


def load(path, overrides=()) -> ml_collections.ConfigDict:
  """Load a config file (with its `base:` ancestors) and apply `key=value` overrides."""
  schema = _schema()
  values = dict(schema)
  for source, flat in _file_chain(Path(path)):
    for key, value in flat.items():
      if key in RETIRED:
        continue
      if key not in schema:
        raise UserError(f"{_unknown_key(key, schema)} (in '{source}')")
      values[key] = coerce(key, value, schema[key])
  for arg in overrides:
    key, value = parse_override(arg)
    if key == "base":
      raise UserError("'base' can only be set inside a config file, not as a key=value override")
    if key not in schema:
      raise _unknown_key(key, schema)
    values[key] = coerce(key, value, schema[key])
  values["base"] = ""
  cfg = _to_configdict(values)
  validate(cfg)
  return cfg


def _to_configdict(flat: dict) -> ml_collections.ConfigDict:
  tree: dict = {}
  for key, value in flat.items():
    node = tree
    *parents, leaf = key.split(".")
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  cfg = ml_collections.ConfigDict(tree)
  cfg.lock()
  return cfg


def check_choices(section: str, section_cfg, choices: dict) -> None:
  """UserError for the first key of a section whose value is not one of its choices."""
  for key, allowed in choices.items():
    if section_cfg[key] not in allowed:
      raise UserError(f"{section}.{key}={section_cfg[key]!r} is not one of: {', '.join(allowed)}")


def get(cfg, key: str):
  """Value of a dotted key, as YAML holds it (lists, not a typed section's tuples)."""
  node = cfg
  for part in key.split("."):
    node = node[part]
  return sections.plain(node)


def validate(cfg) -> None:
  """Checks of values and of keys across sections; each section's own choices and rules are
  checked by the module that owns them (nanotext.wiring.check calls those)."""
  for key in POSITIVE:
    if get(cfg, key) <= 0:
      raise UserError(f"{key}={get(cfg, key)} must be positive")
  for key in NON_NEGATIVE:
    if get(cfg, key) < 0:
      raise UserError(f"{key}={get(cfg, key)} must not be negative")
  for key in INT32:
    if get(cfg, key) >= 2**31:
      raise UserError(f"{key}={get(cfg, key)} is too large (at most {2**31 - 1})")
  for key in AUTO_CHUNKS:
    if get(cfg, key) < -1:
      raise UserError(f"{key}={get(cfg, key)} must be -1 (auto), 0 (whole rows) or positive")
  t, m = cfg.train, cfg.model
  if 0 < t.loss_chunk < t.seq_len and t.seq_len % t.loss_chunk:
    raise UserError(f"train.loss_chunk={t.loss_chunk} does not divide train.seq_len={t.seq_len}")
  eval_len = t.eval_seq_len or t.seq_len
  if 0 < t.eval_loss_chunk < eval_len and eval_len % t.eval_loss_chunk:
    raise UserError(f"train.eval_loss_chunk={t.eval_loss_chunk} does not divide the validation "
                    f"rows' {eval_len} tokens (train.eval_seq_len, or train.seq_len if 0)")
  if t.batch_size % t.grad_accum:
    raise UserError(f"train.batch_size={t.batch_size} is not divisible by "
                    f"train.grad_accum={t.grad_accum}")
  if m.max_seq_len and m.max_seq_len < t.seq_len:
    raise UserError(f"model.max_seq_len={m.max_seq_len} is shorter than train.seq_len="
                    f"{t.seq_len}")
  if cfg.profile.start_step < -1:
    raise UserError(f"profile.start_step={cfg.profile.start_step} must be a step >= 0 or -1 (off)")
  if cfg.checkpoint.keep < 1:
    raise UserError(f"checkpoint.keep={cfg.checkpoint.keep} must be at least 1")


def misaligned_dims(model_cfg) -> list:
  """Names and sizes of matmul dims that are not multiples of model.align."""
  a = model_cfg.align
  if not a:
    return []
  dims = {"model.d_model": model_cfg.d_model, "model.mlp_dim": model_cfg.mlp_dim,
          "model.vocab_size": model_cfg.vocab_size,
          "model.num_heads*model.head_dim": model_cfg.num_heads * model_cfg.head_dim}
  return [f"{k}={v}" for k, v in dims.items() if v % a]


def finalize(cfg, *, mesh_sizes: dict, peak_flops: float, data_dir: str,
             tokenizer_vocab: int | None = None, memory_plan=None) -> sections.Section:
  """Fill in every derived value (the only place that computes them); returns the typed,
  frozen config (a new object: `cfg` is not changed).

  Values that depend on the devices come from the caller (`nanotext.wiring.finalize`), so this
  module imports nothing above it: `mesh_sizes` {mesh.* key: size} with -1 resolved,
  `peak_flops` per device, `data_dir` the default for data.dir, `tokenizer_vocab` the
  tokenizer's vocabulary size (None: unknown) for model.embed_rows=-1, and `memory_plan` a
  function of the typed config with every other value derived that returns {dotted key: value}
  for model.remat=auto and the -1 loss chunks (nanotext.memory.Planner, from the devices'
  capacity), raising UserError for a config that cannot fit.
  """
  cfg = ml_collections.ConfigDict(cfg.to_dict())
  m = cfg.model
  m.head_dim = m.head_dim or m.d_model // m.num_heads
  m.mlp_dim = m.mlp_dim or 4 * m.d_model
  m.max_seq_len = m.max_seq_len or cfg.train.seq_len
  if m.embed_rows == -1:  # the record: 50,257-row tables under a head padded to 50,304
    m.embed_rows = min(tokenizer_vocab or m.vocab_size, m.vocab_size)
  if cfg.optim.head_lr_record:  # the record's head is sqrt(d) W: Adam's steps shrink by sqrt(d)
    cfg.optim.head_lr = cfg.optim.head_lr_record / m.d_model ** 0.5
  if not cfg.optim.head_eps:  # ... and its gradients by sqrt(d): the same eps is sqrt(d) larger here
    cfg.optim.head_eps = cfg.optim.eps * (m.d_model ** 0.5 if cfg.optim.head_lr_record else 1.0)
  for axis, size in mesh_sizes.items():
    cfg.mesh[axis] = size
  cfg.data.dir = cfg.data.dir or data_dir
  cfg.metrics.peak_flops = cfg.metrics.peak_flops or peak_flops
  bad = misaligned_dims(m)
  if bad and m.strict_align:
    raise UserError(f"matmul dims not multiples of model.align={m.align}: {', '.join(bad)} "
                    "(or set model.strict_align=false)")
  if memory_plan is None:
    return typed(cfg)
  for key, value in memory_plan(typed(cfg)).items():
    section, leaf = key.split(".")
    cfg[section][leaf] = value
  return typed(cfg)


def typed(cfg, schema: dict | None = None) -> sections.Section:
  """The frozen typed object of a config (ConfigDict or nested dict); fields from `schema`
  (default configs/base.yml), so adding a key to base.yml adds it here."""
  values = cfg if isinstance(cfg, dict) else cfg.to_dict()
  return sections.build(_read_yaml(SCHEMA_PATH) if schema is None else schema, values)


def to_yaml(cfg) -> str:
  return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=None)


def save(cfg, path) -> None:
  """Write the resolved config atomically."""
  from nanotext.data.fileio import atomic_write  # a failed write leaves no config.yml.tmp
  atomic_write(str(path), [to_yaml(cfg).encode("utf-8")])


def run_identity_diff(old: dict, new: dict) -> list:
  """Keys (with old -> new values) whose change makes `new` a different run than `old`.

  A key only one side has was added to (or removed from) nanotext between the two: not a change
  of the run (a resume takes the key's value from here on)."""
  a, b = _flatten(old), _flatten(new)
  def ignored(k):
    return any(k == p or k.startswith(p + ".") for p in RUN_IDENTITY_IGNORES)
  return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) & set(b))
          if not ignored(k) and a.get(k) != b.get(k)]
