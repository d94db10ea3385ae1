"""YAML configs -> locked ml_collections.ConfigDict, with inheritance, overrides and validation;
then, once derived values are filled in, typed frozen per-section objects.

Every key and its default lives in configs/base.yml, the schema. A config file may name a parent
in `base:` and hold only the keys it changes. Overrides are `key.path=value` strings, coerced to
the default's type. Derived values (left at 0 or -1 = "auto") are filled in by `finalize`, the one
place that computes them; it returns a `Section` tree (frozen dataclasses whose fields and types
are made from base.yml, so a new key is added there alone).
"""

import dataclasses
import difflib
import operator
import os
import re
from pathlib import Path

import ml_collections

from nanotext import config_file, sections
from nanotext.config_file import coerce
from nanotext.errors import UserError
from nanotext.fileio import atomic_write

SCHEMA_PATH = Path(__file__).resolve().parent.parent / "configs" / "base.yml"

# Keys nanotext no longer has, with the value that meant "off": a file holding one so (a run's
# config.yml saved by an older version) loads, the key ignored; set to anything else, refused.
RETIRED = {"train.debug_nan_step": -1}
# Keys that are actions of one start, not settings of the run: a saved config.yml holds their
# defaults, and a run folder's config.yml (an older one saved them) is read without them, so a
# start from that file (a resume, docs/convert.md's start from its weights) does not act unasked.
# The distributed launch keys are one start's too (process 0's, saved, had a later resume of
# `train RUN/config.yml` wait distributed.init_timeout for a coordinator long gone).
LAUNCH = ("distributed.coordinator_address", "distributed.num_processes",
          "distributed.process_id", "distributed.local_device_count")
ONE_SHOT = ("overwrite", "data.allow_changed") + LAUNCH
MAX_BASE_DEPTH = 32  # a chain of base: files deeper than this is refused


def flatten(tree: dict, prefix: str = "") -> dict:
  """{dotted key: value}; UserError for a key given both dotted and nested (`train.steps: 5`
  beside `train: {steps: 6}`), which would have been last-wins."""
  out: dict = {}
  for k, v in tree.items():
    key = f"{prefix}{k}"
    opened = isinstance(v, dict) and v  # `{}`: an empty section's value, or a key's wrong type
    for leaf, value in (flatten(v, key + ".") if opened else {key: v}).items():
      if leaf in out:
        raise UserError(f"config key '{leaf}' is given twice (dotted, and nested in its "
                        "section): give it once")
      out[leaf] = value
  return out


def _schema() -> dict:
  return flatten(config_file.read(SCHEMA_PATH))


def _unknown_key(key: str, known) -> UserError:
  section = sorted(k for k in known if k.startswith(key + "."))
  if section:  # `model: 5`, or model=5
    return UserError(f"'{key}' is a section, not a key: set its keys ({section[0]}, ...) "
                     "one by one")
  close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
  if not close:  # a misspelled leaf under the right section, e.g. train.step
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in known], n=1)
    close = [k for k in known if close and k.endswith("." + close[0])][:1]
  hint = ("; it was retired (nanotext no longer does what it set): remove it" if key in RETIRED
          else f"; did you mean '{close[0]}'?" if close else "")
  return UserError(f"unknown config key '{key}'{hint}")


def file_chain(path) -> list:
  """The config files from the root ancestor down to `path`, each as a flat dict."""
  chain, seen, path = [], [], Path(path)
  while True:
    path = path.resolve() if path.exists() else path
    if path in seen:
      cycle = " -> ".join(f"'{p}'" for p in seen[seen.index(path):] + [path])
      raise UserError(f"config file '{path}' inherits from itself (via 'base:'): {cycle}"
                      if seen[-1] == path else
                      f"config files inherit in a circle (via 'base:'): {cycle}; remove one "
                      "'base:' line")
    if len(seen) >= MAX_BASE_DEPTH:
      raise UserError(f"config file '{seen[0]}' has a chain of 'base:' files more than "
                      f"{MAX_BASE_DEPTH} deep")
    seen.append(path)
    tree = config_file.read(path)
    try:
      flat = flatten(tree)
    except UserError as e:
      raise UserError(f"{e} (in '{path}')") from None
    # `train:` with its keys all commented out (YAML's null), or `train: {}`: an empty section
    if any(v in (None, {}) for v in flat.values()):  # base.yml read again only then (8 ms a file)
      section_names = {k.split(".")[0] for k in _schema() if "." in k}
      flat = {k: v for k, v in flat.items() if not (v in (None, {}) and k in section_names)}
    parent = flat.pop("base", None)  # `base:` alone (YAML's null): no parent
    if not isinstance(parent, (str, type(None))):  # {}, [], false or 0 too: not "no base"
      raise UserError(f"config key 'base' in '{path}' must be a file path")
    chain.append((str(path), flat))
    if not parent:
      return chain[::-1]
    path = config_file.base_of(path, parent)


def parse_override(arg: str):
  """Split a `key=value` argument."""
  if "=" not in arg:
    raise UserError(f"argument '{arg}' is not of the form key=value")
  key, value = arg.split("=", 1)
  return key.strip(), value


def check_known(flat: dict, source: str, schema: dict | None = None) -> None:
  """UserError naming the first key of `flat`, read from `source`, that nanotext does not know;
  a mapping under a key that takes none (`mesh.rules: {batch: data}`) is that key's wrong type."""
  schema = schema or _schema()
  for key in (k for k in flat if k not in schema and (k, flat[k]) not in RETIRED.items()):
    for top in (k for k in schema if key.startswith(k + ".")):  # flatten() opened the mapping
      coerce(top, {k[len(top) + 1:]: v for k, v in flat.items() if k.startswith(top + ".")},
             schema[top])  # no kind of value takes a mapping: it says which form is needed
    raise UserError(f"{_unknown_key(key, schema)} (in '{source}')")


def load(path, overrides=()) -> ml_collections.ConfigDict:
  """Load a config file (with its `base:` ancestors) and apply `key=value` overrides."""
  schema = _schema()
  values = dict(schema)
  for source, flat in file_chain(path):
    check_known(flat, source, schema)
    saved = in_run_folder(source)  # its one-shot keys were the start's that wrote it
    values.update((k, coerce(k, v, schema[k])) for k, v in flat.items()
                  if k in schema and not (saved and k in ONE_SHOT))
  for arg in overrides:
    key, value = parse_override(arg)
    if key == "base":
      raise UserError("'base' can only be set inside a config file, not as a key=value override")
    if key not in schema:
      raise _unknown_key(key, schema)
    values[key] = coerce(key, value, schema[key])
  values.update(base="", **{k: os.path.expanduser(values[k]) for k in  # ~ as a shell would
                             ("output_dir", "checkpoint.load_params_from", "profile.dir")})
  cfg = _to_configdict(values)
  validate(cfg)
  config_file.dump(cfg.to_dict())  # a run reads its config.yml back: one too big refused now
  return cfg


TRAINED = ("checkpoints", "metrics.jsonl")  # beside a training run's config.yml


def in_run_folder(source: str, marks=TRAINED + ("convert.json",)) -> bool:
  """Whether a config file is a run folder's own config.yml: a training run's (its checkpoints
  or metrics beside it) or a params-only folder's (convert.json)."""
  folder = os.path.dirname(source)
  return os.path.basename(source) == "config.yml" and any(
      os.path.lexists(os.path.join(folder, n)) for n in marks)


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


def key_rules() -> dict:
  """{dotted key or section: (rule, ...)}: the rules stated beside each key in the schema
  (`# [>0 int32 resume-ok]` opening its comment in configs/base.yml)."""
  return config_file.rules(str(SCHEMA_PATH))


_BOUND = re.compile(r"(?P<op>[<>]=?)(?P<bound>-?\d+)")
_BOUND_WORDS = {(">", 0): "must be positive", (">=", 0): "must not be negative"}
_OPS = {">=": (operator.ge, "at least"), ">": (operator.gt, "more than"),
        "<=": (operator.le, "at most"), "<": (operator.lt, "less than")}


def check_rule(key: str, value, rule: str) -> None:
  """UserError when `value` of `key` breaks one of its rules (see configs/base.yml's header)."""
  if rule == "resume-ok":
    return
  if isinstance(value, dict):
    raise ValueError(f"{SCHEMA_PATH}: rule '{rule}' of section '{key}' (a bound needs a number)")
  if rule == "int32":
    if not -2**31 <= value < 2**31:
      raise UserError(f"{key}={value} does not fit in 32 bits (from {-2**31} to {2**31 - 1})")
    return
  bound = _BOUND.fullmatch(rule)
  if not bound:
    raise ValueError(f"{SCHEMA_PATH}: unknown rule '{rule}' of {key}")
  limit, (holds, words) = int(bound["bound"]), _OPS[bound["op"]]
  if not holds(value, limit):
    words = _BOUND_WORDS.get((bound["op"], limit), f"must be {words} {limit}")
    raise UserError(f"{key}={value} {words}")


def validate(cfg) -> None:
  """Each key's own rules (beside it in base.yml), then rules between keys; each section's
  choices and rules are checked by the module that owns them (nanotext.wiring.check calls
  those)."""
  for key, rules in key_rules().items():
    for rule in rules:
      check_rule(key, get(cfg, key), rule)
  t, m = cfg.train, cfg.model
  if t.batch_size % t.grad_accum:
    raise UserError(f"train.batch_size={t.batch_size} is not divisible by "
                    f"train.grad_accum={t.grad_accum}")
  if t.eval_accum == 0 or (t.eval_accum > 0 and t.batch_size % t.eval_accum):
    why = f"does not divide train.batch_size={t.batch_size}" if t.eval_accum else "is not a value"
    raise UserError(f"train.eval_accum={t.eval_accum} {why}: give a divisor, or -1 (auto)")
  if m.max_seq_len and m.max_seq_len < t.seq_len:
    raise UserError(f"train.seq_len={t.seq_len} is longer than the model's positions "
                    f"(model.max_seq_len={m.max_seq_len}): use rows at most that long")
  table = m.max_seq_len or t.seq_len
  if m.positions == "learned" and t.eval_seq_len > table:
    raise UserError(f"train.eval_seq_len={t.eval_seq_len} is longer than the learned positions "
                    f"(model.max_seq_len={m.max_seq_len}, 0 = train.seq_len={t.seq_len}); "
                    "validate at most that long, or train with model.positions=rope")
  length = "eval_seq_len" if t.eval_seq_len > t.seq_len else "seq_len"
  tokens = t.batch_size * t[length]
  if tokens >= 2**31:  # jax indexes and counts a step's tokens in int32
    raise UserError(f"train.batch_size={t.batch_size} x train.{length}={t[length]} is "
                    f"{tokens:,} tokens in one step, more than int32 counts ({2**31 - 1:,}); "
                    "lower one of them")


def misaligned_dims(model_cfg) -> list:
  """Names and sizes of matmul dims that are not multiples of model.align."""
  a = model_cfg.align
  if not a:
    return []
  dims = {"model.d_model": model_cfg.d_model, "model.mlp_dim": model_cfg.mlp_dim,
          "model.vocab_size": model_cfg.vocab_size,
          "model.num_heads*model.head_dim": model_cfg.num_heads * model_cfg.head_dim}
  return [f"{k}={v}" for k, v in dims.items() if v % a]


def finalize(cfg, *, mesh_sizes: dict, data_dir: str,
             tokenizer_vocab: int | None = None) -> sections.Section:
  """Fill in every derived value (the only place that computes them); returns the typed,
  frozen config (a new object: `cfg` is not changed).

  Values that depend on the devices come from the caller (`nanotext.wiring.finalize`), so this
  module imports nothing above it: `mesh_sizes` {mesh.* key: size} with -1 resolved,
  `data_dir` the default for data.dir, `tokenizer_vocab` the tokenizer's vocabulary size (None:
  unknown) for model.embed_rows=-1. model.remat=auto and the -1 loss chunks are the memory
  plan's, which the caller sets with `with_values`. metrics.peak_flops=0 stays 0: its default is
  the devices' of each start (metrics.peak_flops), not saved for a resume on others.
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
  if not cfg.optim.head_eps:  # ... and its gradients by sqrt(d), so eps grows by sqrt(d) to match
    cfg.optim.head_eps = cfg.optim.eps * (m.d_model ** 0.5 if cfg.optim.head_lr_record else 1.0)
  for axis, size in mesh_sizes.items():
    cfg.mesh[axis] = size
  cfg.data.dir = cfg.data.dir or data_dir
  for k in ("dir", "train_files", "val_files"):  # saved whole: evaluate read (or prepared) them
    cfg.data[k] = cfg.data[k] and os.path.abspath(os.path.expanduser(cfg.data[k]))  # in its cwd
  bad = misaligned_dims(m)
  if bad and m.strict_align:
    raise UserError(f"matmul dims not multiples of model.align={m.align}: {', '.join(bad)} "
                    "(or set model.strict_align=false)")
  return typed(cfg)


def replace_sections(cfg, **changes) -> sections.Section:
  """The typed config `cfg` with keys replaced, a new object:
  replace_sections(cfg, model={"remat": "dots"})."""
  return dataclasses.replace(cfg, **{name: dataclasses.replace(cfg[name], **leaves)
                                     for name, leaves in changes.items()})


def with_values(cfg, values: dict) -> sections.Section:
  """The typed config `cfg` with {dotted key: value} set (a new object; `cfg` is not changed)."""
  by_section: dict = {}
  for key, value in values.items():
    section, leaf = key.split(".")
    by_section.setdefault(section, {})[leaf] = value
  return replace_sections(cfg, **by_section)


def typed(cfg, schema: dict | None = None) -> sections.Section:
  """The frozen typed object of a config (ConfigDict or nested dict); fields from `schema`
  (default configs/base.yml), so adding a key to base.yml adds it here."""
  values = cfg if isinstance(cfg, dict) else cfg.to_dict()
  return sections.build(config_file.read(SCHEMA_PATH) if schema is None else schema, values)


def saved_tree(cfg) -> dict:
  """The config as a run saves it: the ONE_SHOT keys at their defaults."""
  tree, schema = cfg.to_dict(), _schema()
  for key in ONE_SHOT:
    *parents, leaf = key.split(".")
    node = tree
    for p in parents:
      node = node[p]
    node[leaf] = schema[key]
  return tree


def save(cfg, path) -> None:
  """Write the resolved config atomically (a failed write leaves no config.yml.tmp)."""
  atomic_write(str(path), [config_file.dump(saved_tree(cfg)).encode("utf-8")])


# Keys whose default stands for another key's value, left so in a saved config: a resume that
# spells the value out (train.eval_seq_len=32 where seq_len is 32) is the same run.
_STANDS_FOR = {"train.eval_seq_len": (0, "train.seq_len"),
               "model.max_seq_len": (0, "train.seq_len"),
               "model.embed_rows": (0, "model.vocab_size"),
               "model.embed_dtype": ("", "model.param_dtype")}


def _spelled_out(flat: dict) -> dict:
  out = dict(flat)
  for key, (default, other) in _STANDS_FOR.items():
    if key in out and other in out and out[key] == default:
      out[key] = out[other]
  return out


# The model and attention keys that change how a model is computed (layout, precision, kernel),
# not which model it is: what a tool reading a checkpoint may take from elsewhere.
HOW_COMPUTED = ("model.scan_layers", "model.remat", "model.dtype", "model.param_dtype",
                "model.embed_dtype", "model.align", "model.strict_align", "attention.impl")


def changes_model(key: str) -> bool:
  """Whether `key` changes the function a checkpoint's weights compute."""
  return key.startswith(("model.", "attention.")) and key not in HOW_COMPUTED


def _as_typed(flat: dict) -> dict:
  """Each value coerced to its key's type as `load` does (YAML reads 1e-10 as a string, a file
  may spell 0.003 as 3e-3); one that does not coerce is kept as it is."""
  schema, out = _schema(), dict(flat)
  for k, v in flat.items():
    try:
      out[k] = coerce(k, v, schema[k]) if k in schema else v
    except UserError:
      pass
  return out


def run_identity_diff(old: dict, new: dict) -> list:
  """Keys (with old -> new values) whose change makes `new` a different run than `old`.

  A key only one side has was added to (or removed from) nanotext between the two: not a change
  of the run (a resume takes the key's value from here on)."""
  a, b = _spelled_out(_as_typed(flatten(old))), _spelled_out(_as_typed(flatten(new)))
  free = [k for k, rules in key_rules().items() if "resume-ok" in rules]
  def ignored(k):
    return k in ONE_SHOT or any(k == p or k.startswith(p + ".") for p in free)
  changed = {k for k in set(a) & set(b) if not ignored(k) and a[k] != b[k]}
  # a key that follows another (max_seq_len: train.seq_len's) after it: the one a user changed
  follows = lambda k: k in _STANDS_FOR and _STANDS_FOR[k][1] in changed
  return [f"{k}: {yaml_scalar(a[k])} -> {yaml_scalar(b[k])}"
          for k in sorted(changed, key=lambda k: (follows(k), k))]


def yaml_scalar(v) -> str:
  """A config value as a YAML file or `key=value` spells it: true, null, [1, 2], '' ."""
  if isinstance(v, bool):
    return str(v).lower()
  if v is None:
    return "null"
  if isinstance(v, (list, tuple)):
    return "[" + ", ".join(map(yaml_scalar, v)) + "]"
  return repr(v) if v == "" else str(v)
