"""A config file read safely: UTF-8 text, one YAML mapping of plain values (no tags), no key given
twice, and bounds that keep a hostile file (an alias bomb, a huge file) to one line; and the
schema's rules, read from the `# [rule ...]` opening a key's comment (`rules`); a value coerced
to its key's type (`coerce`)."""

import datetime
import functools
import os
import re
from pathlib import Path

import yaml

from nanotext.errors import CWD_DELETED, UserError, cwd_deleted


class _UniqueKeyLoader(yaml.SafeLoader):
  """A SafeLoader that refuses a key given twice in one mapping (YAML's default: last wins)."""

  def construct_mapping(self, node, deep=False):
    seen = set()
    for key_node, _ in node.value:
      key = self.construct_object(key_node, deep=deep)
      if not isinstance(key, (str, int, float, bool)) and key is not None:  # a list, a mapping
        raise yaml.constructor.ConstructorError(
            None, None, "a key that is not a plain name", key_node.start_mark)
      if key in seen:
        raise yaml.constructor.ConstructorError(
            None, None, f"duplicate key '{key}'", key_node.start_mark)
      seen.add(key)
    return super().construct_mapping(node, deep)

  def construct_yaml_int(self, node):
    digits = str(node.value).replace("_", "").lstrip("+-")
    if ":" in digits or (len(digits) > 1 and digits[0] == "0"):  # 010 was 8, 1:30 was 90
      raise yaml.constructor.ConstructorError(
          None, None, f"{node.value} reads as a number in another base (YAML 1.1's octal, hex, "
          "binary or base 60); write it in decimal, or quote it to mean a string",
          node.start_mark)
    return super().construct_yaml_int(node)

  def construct_yaml_float(self, node):
    if ":" in str(node.value):
      raise yaml.constructor.ConstructorError(
          None, None, f"{node.value} reads as a base-60 number (YAML 1.1); write it in decimal, "
          "or quote it to mean a string", node.start_mark)
    return super().construct_yaml_float(node)

  def construct_yaml_str(self, node):
    text = super().construct_yaml_str(node)
    try:  # JSON's "\\ud83d\\ude00" (a checkpoint's saved config) is one character, as in JSON
      return text.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeDecodeError:  # a lone surrogate: kept, as YAML reads it
      return text


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:str", _UniqueKeyLoader.construct_yaml_str)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float",
                                 _UniqueKeyLoader.construct_yaml_float)


FLOAT32_MAX = 3.4028234663852886e38  # every float key is used in float32
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


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
    if not abs(number) <= FLOAT32_MAX:  # NaN or inf (in float32, as the step computes) can
      raise bad("a finite number (float32: at most 3.4e38)")  # only poison the run
    return number
  if kind is str:
    if isinstance(value, str):
      return value
    # YAML read it as one; a number's str() is another spelling (3.10 -> '3.1', 1_000 -> '1000')
    if isinstance(value, (bool, int, float, datetime.date)) or value is None:
      raise bad("a string (YAML reads numbers, yes/no/on/off/true/false, null and dates as "
                "such values: quote it)")
    raise bad("a string")
  if kind is list:
    if isinstance(value, str):
      try:
        value = parse(value, f"the value of {key}")
      except yaml.YAMLError:
        raise bad("a YAML list") from None
    if isinstance(value, list):
      return value
    raise bad("a list")
  raise UserError(f"config key '{key}' has an unsupported default type {kind.__name__}")


# A config is a few kilobytes; these bounds keep a hostile file (a YAML alias bomb, a huge file)
# to one line instead of minutes of work and a MemoryError.
MAX_YAML_BYTES = 1 << 20
MAX_YAML_VALUES = 100_000


# The parser's words for the mistakes people make, in theirs; any other problem as it says it.
_CAUSES = (("'\\t' that cannot start", "a tab character (YAML indents with spaces only)"),
           ("another document", "more than one document (a --- line): a config is one"),
           ("mapping values are not allowed", "a ': ' where no key can be: quote a value "
            "holding ': ', or check the indentation"),
           ("expected <block end>", "a key indented unlike the keys beside it"),
           ("end of stream", "a quote or bracket left open"),
           ("<stream end>", "a quote or bracket left open"))


def _cause(e: yaml.YAMLError) -> str:
  """What the parser found wrong, in a few words."""
  problem = str(getattr(e, "problem", None) or e).split("\n")[0]
  return next((said for found, said in _CAUSES if found in problem), problem)


def read(path) -> dict:
  """The mapping in a config file (a run's saved config.yml included); UserError, one line, for
  anything else."""
  path = Path(path)
  if not path.exists():
    raise UserError(f"config file '{path}' does not exist" + (
        f": {CWD_DELETED}" if not path.is_absolute() and cwd_deleted() else ""))
  if not path.is_file():
    raise UserError(f"config path '{path}' is not a file")
  try:
    if path.stat().st_size > MAX_YAML_BYTES:
      raise UserError(f"config file '{path}' is {path.stat().st_size:,} bytes, more than a config "
                      f"can be ({MAX_YAML_BYTES:,})")
    with open(path, encoding="utf-8") as f:
      data = parse(f.read(MAX_YAML_BYTES + 1), f"config file '{path}'") or {}
  except UnicodeDecodeError as e:
    raise UserError(f"config file '{path}' is not UTF-8 text (byte {e.start})") from None
  except OSError as e:
    raise UserError(f"cannot read config file '{path}': {e.strerror}") from None
  except yaml.constructor.ConstructorError as e:
    line = e.problem_mark.line + 1 if e.problem_mark else "?"
    if (e.problem or "").startswith("duplicate key"):
      raise UserError(f"config file '{path}' has a {e.problem} (line {line}); each key may "
                      "appear once per section") from None
    problem = e.problem or ""
    if "tag:yaml.org,2002:merge" in problem:
      problem = "a YAML merge key (<<) is not read here: write the keys out"
    elif "constructor" in problem:
      problem += " (a config holds plain values only: no !!python or other tags)"
    raise UserError(f"config file '{path}' line {line}: {problem}") from None
  except yaml.YAMLError as e:
    line = getattr(getattr(e, "problem_mark", None), "line", None)
    where = f"line {line + 1}: " if line is not None else ""
    raise UserError(f"config file '{path}' is not valid YAML ({where}{_cause(e)})") from None
  if not isinstance(data, dict):
    raise UserError(f"config file '{path}' must hold a mapping of keys, not {type(data).__name__}")
  return data


def base_of(path, base: str) -> Path:
  """The file a config file's `base:` names: relative to that file's folder, `~` as a shell
  reads it; UserError naming both files where it is none."""
  parent = Path(path).parent / os.path.expanduser(base)
  if not parent.is_file():
    raise UserError(f"config file '{path}' has base: {base}, but '{parent}' "
                    f"{'is not a file' if parent.exists() else 'does not exist'} (base: is a "
                    "path from the folder of the file that names it)")
  return parent


def parse(text: str, what: str):
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


class _Dumper(yaml.SafeDumper):
  """safe_dump's writer, a string holding a character YAML reads as a line break (NEL, U+2028,
  U+2029) double-quoted: written raw (allow_unicode) it came back as a space."""


_Dumper.add_representer(str, lambda dumper, s: dumper.represent_scalar(
    "tag:yaml.org,2002:str", s, style='"' if any(c in s for c in "\x85\u2028\u2029") else None))


def dump(tree: dict) -> str:
  """`tree` as config.yml holds it; UserError, naming the largest value, where that file would
  be more than `read` reads back. Non-ASCII text is written as is: escaped (4 to 10 bytes a
  character), a config under the bound made a config.yml over it."""
  def text(t):
    return yaml.dump(t, Dumper=_Dumper, sort_keys=False, default_flow_style=None,
                     allow_unicode=True)
  out = text(tree)
  if len(out.encode("utf-8")) > MAX_YAML_BYTES:
    flat = _flat(tree)
    key = max(flat, key=lambda k: len(text({k: flat[k]}).encode("utf-8")))
    raise UserError(f"this config's values make a config.yml of {len(out.encode('utf-8')):,} "
                    f"bytes, more than a config can be ({MAX_YAML_BYTES:,}), which the run could "
                    f"not read back: shorten {key} (the largest)")
  return out


def _flat(tree: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in tree.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


_KEY_LINE = re.compile(r"(?P<indent> *)(?P<key>[A-Za-z_]\w*):(?P<rest>.*)")
_RULES = re.compile(r"\[(?P<rules>[^\]]*)\]")


@functools.lru_cache(maxsize=None)
def rules(path) -> dict:
  """{dotted key or section: (rule, ...)} of a schema file, from the `# [rule ...]` opening a
  key's comment (the file's own lines: YAML drops comments). Keys nest by indentation."""
  out, parents = {}, []
  for line in Path(path).read_text(encoding="utf-8").splitlines():
    m = _KEY_LINE.fullmatch(line)
    if not m:
      continue
    indent = len(m["indent"])
    while parents and parents[-1][0] >= indent:
      parents.pop()
    key = ".".join([k for _, k in parents] + [m["key"]])
    value, _, comment = m["rest"].partition(" #")
    if not value.strip():  # a section, or a list on the lines below
      parents.append((indent, m["key"]))
    found = _RULES.match(comment.lstrip())
    if found:
      out[key] = tuple(found["rules"].split())
  return out
