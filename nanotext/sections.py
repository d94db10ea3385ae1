"""Typed, frozen config sections: one dataclass per section of a schema tree (configs/base.yml).

The fields and their types come from the schema's defaults, so a key added to base.yml appears
here with no other edit. Imports nothing from nanotext.
"""

import dataclasses
import functools
import keyword


class Section:
  """Base of the typed config objects: frozen dataclasses with base.yml's keys and types.

  Read a key as an attribute (`cfg.model.d_model`) or an item (`cfg.checkpoint["async"]`: a key
  that is a Python keyword is the field `async_`). Lists are held as tuples, so a section is
  immutable all the way down and hashable.
  """

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if not (type(value) is f.type or issubclass(f.type, Section) and isinstance(value, f.type)):
        raise TypeError(f"{type(self).__name__}.{f.name} must be of type {f.type.__name__}, "
                        f"got {value!r}")

  def __getitem__(self, key: str):
    return getattr(self, _attr(key))

  def to_dict(self) -> dict:
    """Nested plain dict with sorted keys and lists, as ConfigDict.to_dict gives (YAML, saves)."""
    fields = sorted(dataclasses.fields(self), key=lambda f: f.metadata["key"])
    return {f.metadata["key"]: plain(getattr(self, f.name)) for f in fields}

  def __reduce__(self):  # the classes are made at run time: pickle by their spec, not by name
    return _from_spec, (self._name, self._spec, self.to_dict())


def _attr(key: str) -> str:
  return key + "_" if keyword.iskeyword(key) else key


def plain(value):
  """A value as YAML holds it: sections as dicts, tuples as lists."""
  if isinstance(value, Section):
    return value.to_dict()
  return [plain(v) for v in value] if isinstance(value, tuple) else value


def _frozen(kind: type, value):
  if kind is tuple:
    return tuple(_frozen(tuple, v) if isinstance(v, list) else v for v in value)
  return float(value) if kind is float and type(value) is int else value


def _spec(tree: dict) -> tuple:
  """((key, type or nested spec), ...) of a schema tree: a YAML list becomes a tuple."""
  return tuple((k, _spec(v) if isinstance(v, dict) else tuple if type(v) is list else type(v))
               for k, v in tree.items())


@functools.lru_cache(maxsize=None)
def _section_class(name: str, spec: tuple) -> type:
  """The frozen dataclass of one section (name "" = the whole config); one class per spec."""
  fields = [(_attr(key), _section_class(key, kind) if isinstance(kind, tuple) else kind,
             dataclasses.field(metadata={"key": key})) for key, kind in spec]
  cls = dataclasses.make_dataclass(f"{name.title()}Config", fields, bases=(Section,),
                                   frozen=True)
  cls._name, cls._spec, cls.__module__ = name, spec, __name__
  return cls


def _from_spec(name: str, spec: tuple, values: dict):
  cls = _section_class(name, spec)
  keys = [key for key, _ in spec]
  if set(values) != set(keys):
    raise ValueError(f"config section '{name}' has keys {sorted(set(values) - set(keys))} not "
                     f"in the schema and lacks {sorted(set(keys) - set(values))}")
  kw = {}
  for f in dataclasses.fields(cls):
    value = values[f.metadata["key"]]
    kw[f.name] = _from_spec(f.metadata["key"], f.type._spec, value) \
        if issubclass(f.type, Section) else _frozen(f.type, value)
  return cls(**kw)


def build(schema: dict, values: dict) -> Section:
  """The frozen object of nested `values` with the fields and types of the `schema` tree."""
  return _from_spec("", _spec(schema), values)
