"""Tests of nanotext.config: loading, inheritance, overrides, validation, finalize, round trip."""

import dataclasses
import os
import pickle
import re

import jax
import pytest
import yaml

from conftest import BASE, SPEEDRUN, TINY
from nanotext import config, config_file, identity, sections, sharding, wiring
from nanotext.errors import UserError

pytestmark = pytest.mark.fast

SECTIONS = ("model", "attention", "train", "optim", "mesh", "data", "checkpoint", "metrics",
            "sample")


def load(*overrides, path=BASE):
  return config.load(path, list(overrides))


def write(path, text):
  path.write_text(text)
  return str(path)


def error(*overrides, path=BASE) -> str:
  with pytest.raises(UserError) as e:
    wiring.load(path, list(overrides))
  return str(e.value)


# Loading.

def test_base_has_all_sections_and_is_locked():
  cfg = load()
  for name in SECTIONS:
    assert name in cfg
  assert cfg.train.steps == 200 and cfg.model.d_model == 256
  with pytest.raises(AttributeError):
    cfg.no_such_key = 1
  with pytest.raises(AttributeError):
    cfg.train.step = 5


# Overrides and type coercion.

def test_a_config_file_is_one_mapping_of_plain_values(tmp_path):
  """config_file.read, under every load: a key twice and a Python tag are refused in one line."""
  assert config_file.read(write(tmp_path / "a.yml", "train:\n  steps: 3\n")) == {
      "train": {"steps": 3}}
  with pytest.raises(UserError, match="duplicate key 'steps'"):
    config_file.read(write(tmp_path / "b.yml", "train:\n  steps: 3\n  steps: 4\n"))
  with pytest.raises(UserError, match="plain values only"):
    config_file.read(write(tmp_path / "c.yml", "seed: !!python/name:os.system\n"))
  with pytest.raises(UserError, match="line 2: a key that is not a plain name"):  # a TypeError
    config_file.read(write(tmp_path / "d.yml", "seed: 1\n? [a, b]\n: 2\n"))


def test_a_key_given_dotted_and_nested_is_refused(tmp_path):
  """train.steps: 5 beside train: {steps: 6} loaded, the last one winning, where a key given
  twice in one section is refused."""
  for text in ("train.steps: 5\ntrain:\n  steps: 6\n", "train:\n  steps: 6\ntrain.steps: 5\n"):
    path = write(tmp_path / "t.yml", f"base: {BASE}\n{text}")
    with pytest.raises(UserError, match=r"config key 'train.steps' is given twice \(dotted, and "
                                        rf"nested in its section\): give it once \(in '{path}'\)"):
      config.load(path)
  assert config.load(write(tmp_path / "u.yml", f"base: {BASE}\ntrain.steps: 5\n")).train.steps == 5


def test_override_int_and_str():
  cfg = load("train.steps=7", "output_dir=/tmp/x", "sample.prompt=12")
  assert cfg.train.steps == 7 and type(cfg.train.steps) is int
  assert cfg.output_dir == "/tmp/x"
  assert cfg.sample.prompt == "12"


@pytest.mark.parametrize("value,expected", [("1e-3", 1e-3), ("3", 3.0), ("0.5", 0.5)])
def test_override_float(value, expected):
  lr = load(f"optim.lr={value}").optim.lr
  assert lr == expected and type(lr) is float


@pytest.mark.parametrize("value,expected", [("true", True), ("false", False), ("yes", True),
                                            ("no", False), ("1", True), ("0", False),
                                            ("True", True)])
def test_override_bool(value, expected):
  assert load(f"model.bias={value}").model.bias is expected


def test_override_list():
  cfg = load("mesh.rules=[[batch, fsdp]]")
  assert list(cfg.mesh.rules) == [["batch", "fsdp"]]


def test_later_override_wins():
  assert load("train.steps=3", "train.steps=9").train.steps == 9


def test_override_without_equals_sign():
  assert "key=value" in error("train.steps")


# Inheritance.

def test_child_inherits_with_absolute_base(tmp_path):
  child = write(tmp_path / "child.yml", f"base: {BASE}\ntrain:\n  steps: 11\n")
  cfg = load(path=child)
  assert cfg.train.steps == 11
  assert cfg.train.batch_size == 16  # from the parent
  assert cfg.base == ""


def test_child_inherits_with_relative_base(tmp_path):
  rel = os.path.relpath(BASE, tmp_path)
  child = write(tmp_path / "child.yml", f"base: {rel}\nmodel:\n  d_model: 128\n")
  assert load(path=child).model.d_model == 128


def test_multi_level_inheritance_and_overrides(tmp_path):
  write(tmp_path / "parent.yml", f"base: {BASE}\ntrain:\n  steps: 11\n  seq_len: 64\n")
  child = write(tmp_path / "child.yml", "base: parent.yml\ntrain:\n  steps: 22\n")
  cfg = load(path=child)
  assert (cfg.train.steps, cfg.train.seq_len, cfg.train.batch_size) == (22, 64, 16)
  cfg = load("train.steps=33", "train.seq_len=128", path=child)
  assert (cfg.train.steps, cfg.train.seq_len) == (33, 128)


def test_inheritance_cycle(tmp_path):
  write(tmp_path / "a.yml", "base: b.yml\n")
  b = write(tmp_path / "b.yml", "base: a.yml\n")
  # Not 'b.yml inherits from itself': the circle, named file by file.
  assert f"in a circle (via 'base:'): '{b}' -> '{tmp_path / 'a.yml'}' -> '{b}'" in error(path=b)
  own = write(tmp_path / "own.yml", "base: own.yml\n")
  assert "own.yml' inherits from itself" in error(path=own)


def test_missing_parent(tmp_path):
  """Named only '.../nope.yml' does not exist, not which file's base: pointed there, or how."""
  child = write(tmp_path / "child.yml", "base: nope.yml\n")
  assert error(path=child) == (f"config file '{child}' has base: nope.yml, but "
                               f"'{tmp_path / 'nope.yml'}' does not exist (base: is a path from "
                               "the folder of the file that names it)")
  assert "'/' is not a file" in error(path=write(tmp_path / "dir.yml", "base: /\n"))


def test_a_base_under_home_is_read_as_a_shell_would(tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path))
  write(tmp_path / "parent.yml", f"base: {BASE}\ntrain:\n  steps: 11\n")
  (tmp_path / "exp").mkdir()
  assert load(path=write(tmp_path / "exp" / "c.yml", "base: ~/parent.yml\n")).train.steps == 11


def test_speedrun_loads():
  if not os.path.exists(SPEEDRUN):
    pytest.skip("configs/speedrun.yml does not exist yet")
  cfg = load(path=SPEEDRUN)
  assert cfg.base == "" and cfg.to_dict() != load().to_dict()


# Errors.

@pytest.mark.parametrize("key,suggestion", [("train.step", "train.steps"),
                                            ("model.num_layer", "model.num_layers"),
                                            ("optim.weight_decy", "optim.weight_decay")])
def test_unknown_key_suggests(key, suggestion):
  msg = error(f"{key}=5")
  assert f"unknown config key '{key}'" in msg and f"did you mean '{suggestion}'" in msg


def test_base_override_rejected_without_self_suggestion():
  msg = error("base=other.yml")
  assert "'base'" in msg and "did you mean 'base'" not in msg


def test_unknown_key_in_file(tmp_path):
  child = write(tmp_path / "child.yml", f"base: {BASE}\ntrain:\n  step: 5\n")
  msg = error(path=child)
  assert "'train.step'" in msg and "'train.steps'" in msg and "child.yml" in msg


def test_unknown_section():
  assert "'trian.steps'" in error("trian.steps=5")


@pytest.mark.parametrize("arg,expected", [("train.steps=abc", "an integer"),
                                          ("train.steps=1.5", "an integer"),
                                          ("model.bias=maybe", "a boolean"),
                                          ("optim.lr=fast", "a number"),
                                          ("mesh.rules=[oops", "a YAML list"),
                                          ("mesh.rules=7", "a list")])
def test_wrong_type(arg, expected):
  key, value = arg.split("=", 1)
  msg = error(arg)
  assert f"'{key}'" in msg and value in msg and expected in msg


def test_wrong_type_in_file(tmp_path):
  child = write(tmp_path / "child.yml", f"base: {BASE}\ntrain:\n  steps: [1, 2]\n")
  assert "'train.steps'" in error(path=child)


def test_missing_file(tmp_path):
  assert "does not exist" in error(path=str(tmp_path / "nope.yml"))


@pytest.mark.parametrize("text,said", [
    ("train:\n  steps: [1,\n", "line 3: a quote or bracket left open"),
    ("train:\n\tsteps: 3\n", "line 2: a tab character (YAML indents with spaces only)"),
    ("seed: 1\n---\nseed: 2\n", "line 2: more than one document (a --- line): a config is one"),
    ("train:\n  steps: 3\n batch_size: 4\n", "line 3: a key indented unlike the keys beside it"),
    ("sample:\n  prompt: ROMEO: hi\n", "line 2: a ': ' where no key can be: quote a value"),
    ("seed: *nope\n", "line 1: found undefined alias 'nope'")])  # any other: the parser's words
def test_invalid_yaml_says_what_is_wrong(tmp_path, text, said):
  """Said only 'not valid YAML (line 2)': a tab, a second document were left to be guessed."""
  bad = write(tmp_path / "bad.yml", text)
  assert error(path=bad).startswith(f"config file '{bad}' is not valid YAML ({said}")


def test_non_mapping_yaml(tmp_path):
  bad = write(tmp_path / "list.yml", "- 1\n- 2\n")
  assert "mapping" in error(path=bad)


# Validation.

@pytest.mark.parametrize("key", ["train.steps", "train.batch_size", "train.seq_len"])
@pytest.mark.parametrize("value", ["0", "-3"])
def test_must_be_positive(key, value):
  msg = error(f"{key}={value}")
  assert key in msg and "positive" in msg


def test_a_value_for_a_whole_section_names_its_keys(tmp_path):
  """`model: 5` was "unknown config key 'model'; did you mean 'model.norm'?"."""
  path = write(tmp_path / "c.yml", f"base: {BASE}\nmodel: 5\n")
  with pytest.raises(UserError, match="'model' is a section, not a key: set its keys"):
    load(path=path)
  assert "'train' is a section" in error("train=3")


@pytest.mark.fast
def test_a_mapping_under_a_key_that_takes_none_is_that_keys_wrong_type(tmp_path):
  """`mesh.rules` written as a YAML mapping in a file was "unknown config key 'mesh.rules.batch';
  did you mean 'mesh.rules'?", where the command line's `mesh.rules={batch: data}` says the key
  expects a list: a file says so too, for any key whose value is not a section."""
  rules = write(tmp_path / "r.yml", f"base: {BASE}\nmesh:\n  rules:\n    batch: [data, fsdp]\n"
                "    embed: fsdp\n")
  assert error(path=rules) == ("config key 'mesh.rules' expects a list, got {'batch': ['data', "
                               "'fsdp'], 'embed': 'fsdp'}")
  assert error("mesh.rules={batch: data}") == ("config key 'mesh.rules' expects a list, got "
                                               "{'batch': 'data'}")
  steps = write(tmp_path / "s.yml", f"base: {BASE}\ntrain:\n  steps: {{at: 5}}\n")
  assert error(path=steps) == "config key 'train.steps' expects an integer, got {'at': 5}"


@pytest.mark.fast
def test_an_empty_mapping_under_a_key_is_its_wrong_type_and_an_empty_section_is_empty(tmp_path):
  """`mesh: {rules: {}}` was read as no key at all: the base's rules were used, unsaid."""
  rules = write(tmp_path / "r.yml", f"base: {BASE}\nmesh:\n  rules: {{}}\n")
  assert error(path=rules) == "config key 'mesh.rules' expects a list, got {}"
  top = write(tmp_path / "t.yml", f"base: {BASE}\noutput_dir: {{}}\n")
  assert error(path=top) == "config key 'output_dir' expects a string, got {}"
  with pytest.raises(UserError, match="unknown config key 'foo'"):
    load(path=write(tmp_path / "u.yml", f"base: {BASE}\nfoo: {{}}\n"))
  empty = write(tmp_path / "e.yml", f"base: {BASE}\nmesh: {{}}\ntrain: {{}}\n")
  assert load(path=empty).mesh.rules == load(path=BASE).mesh.rules


@pytest.mark.parametrize("value", ["{}", "[]", "false", "0", "5"])
def test_a_base_that_is_no_path_is_refused_even_if_empty(tmp_path, value):
  """`base: {}`, `[]`, `false` and `0` read as "no base" and the file's keys stood alone."""
  path = write(tmp_path / "b.yml", f"base: {value}\ntrain: {{steps: 3}}\n")
  assert error(path=path) == f"config key 'base' in '{path}' must be a file path"


def test_a_load_reads_the_schema_once(monkeypatch):
  """Each file of a chain read once and base.yml once more as the schema: 097cde9 read the
  schema again for each file of the chain (8 ms each, a fifth of a refusal's time)."""
  reads, read = [], config_file.read
  monkeypatch.setattr(config_file, "read", lambda p: reads.append(str(p)) or read(p))
  config.load(SPEEDRUN, ["train.steps=3"])
  assert sorted(reads) == sorted([str(config.SCHEMA_PATH), SPEEDRUN, str(config.SCHEMA_PATH)])


def test_a_section_whose_keys_are_all_commented_out_is_empty(tmp_path):
  """`train:` then only comments (YAML's null) was refused as "'train' is a section, not a key"."""
  path = write(tmp_path / "c.yml", f"base: {BASE}\ntrain:\n  # steps: 5\nseed: 3\n")
  cfg = load(path=path)
  assert cfg.seed == 3 and cfg.train.steps == load().train.steps
  path = write(tmp_path / "d.yml", f"base: {BASE}\nseed:\n")  # a key left empty still is not
  with pytest.raises(UserError, match="seed"):
    load(path=path)


def test_bad_choice():
  msg = error("attention.impl=foo")
  assert "attention.impl" in msg and "'foo'" in msg and "xla" in msg


def test_batch_not_divisible_by_grad_accum():
  msg = error("train.batch_size=6", "train.grad_accum=4")
  assert "train.batch_size=6" in msg and "train.grad_accum=4" in msg
  assert load("train.batch_size=8", "train.grad_accum=4").train.grad_accum == 4


def test_validation_rows_longer_than_the_learned_positions_are_refused():
  """A position past the learned table has no row: the eval step failed to trace (TypeError)."""
  msg = error("train.seq_len=256", "train.eval_seq_len=512")
  assert "train.eval_seq_len=512" in msg and "model.max_seq_len" in msg
  assert load("train.eval_seq_len=512", "model.max_seq_len=512").train.eval_seq_len == 512
  assert load("train.eval_seq_len=512", "model.positions=rope").train.eval_seq_len == 512
  # Rows first: a run's evaluate takes train.* and refuses model.* (it read "model.max_seq_len=64
  # is shorter than train.seq_len=128", "set model.positions=rope").
  msg = error("model.max_seq_len=64", "train.seq_len=128")
  assert msg.startswith("train.seq_len=128 is longer") and "(model.max_seq_len=64)" in msg
  assert "or train with model.positions=rope" in error("train.seq_len=64", "train.eval_seq_len=128")


@pytest.mark.parametrize("length", ["seq_len", "eval_seq_len"])
def test_a_step_of_more_tokens_than_int32_counts_is_refused(length):
  """16 rows of 10^9 tokens: refused before anything is traced (the memory plan's trace of the
  loss overflowed in jax, an OverflowError, where a user needs the keys to change)."""
  rope = "model.positions=rope"  # a learned table would refuse the eval rows first
  msg = error("train.batch_size=16", f"train.{length}=1000000000", rope)
  assert f"train.{length}=1000000000" in msg and "train.batch_size=16" in msg
  assert load("train.batch_size=2", f"train.{length}=1000000000", rope).train.batch_size == 2


# finalize.

def finalize(*overrides, num_devices=8, path=BASE):
  return wiring.finalize(load(*overrides, path=path), jax.devices()[:num_devices])


def test_finalize_fills_derived_values():
  cfg = finalize("model.head_dim=0", "train.seq_len=128")
  m = cfg.model
  assert m.head_dim == 256 // 4 and m.mlp_dim == 4 * 256 and m.max_seq_len == 128
  assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (1, 8, 1)
  assert cfg.data.dir and cfg.metrics.peak_flops == 0  # each start's devices': see below
  with pytest.raises(AttributeError):
    cfg.new_key = 1


@pytest.mark.fast

def test_finalize_with_an_empty_home(monkeypatch):
  """HOME="": the embedded corpus's default folder would be /.cache/nanotext/shakespeare, so a
  run that needs it is refused; data.dir given, or a source that reads no folder, starts."""
  monkeypatch.setenv("HOME", "")
  monkeypatch.delenv("NANOTEXT_CACHE", raising=False)
  with pytest.raises(UserError, match="HOME is empty.*data.dir"):
    finalize("data.source=shakespeare")
  assert finalize("data.source=shakespeare", "data.dir=/d").data.dir == "/d"
  assert finalize("data.source=synthetic").data.dir == ""

def test_shard_globs_are_saved_whole(monkeypatch, tmp_path):
  """A relative data.val_files was saved as given: evaluate from another folder read that
  folder's shards (6.73 for the run's 5.46), without a word; a relative data.dir had evaluate
  prepare the corpus again in its own folder."""
  monkeypatch.chdir(tmp_path)
  cfg = finalize("data.source=bin", "data.train_files=sh/train_*.bin", "data.val_files=",
                 "data.dir=shards")
  assert cfg.data.train_files == f"{tmp_path}/sh/train_*.bin" and cfg.data.val_files == ""
  assert cfg.data.dir == f"{tmp_path}/shards"


def test_finalize_keeps_explicit_values_and_input():
  raw = load("model.mlp_dim=512", "model.max_seq_len=512", "data.dir=/d", "metrics.peak_flops=5")
  cfg = wiring.finalize(raw, jax.devices()[:8])
  assert (cfg.model.mlp_dim, cfg.model.max_seq_len) == (512, 512)
  assert cfg.data.dir == "/d" and cfg.metrics.peak_flops == 5.0
  assert raw.mesh.fsdp == -1  # the input is not modified


def test_finalize_batch_not_divisible_by_mesh():
  with pytest.raises(UserError) as e:
    wiring.prepare(BASE, ["train.batch_size=6"])
  msg = str(e.value)
  assert "train.batch_size=6" in msg and "mesh.data" in msg and "mesh.fsdp" in msg


def test_finalize_mesh_product_mismatch():
  with pytest.raises(UserError, match="8 devices"):
    finalize("mesh.fsdp=2")
  with pytest.raises(UserError, match="at most one"):
    finalize("mesh.data=-1")


def test_finalize_strict_align():
  with pytest.raises(UserError, match=r"model\.d_model=100"):
    finalize("model.d_model=100", "model.strict_align=true", num_devices=4)
  cfg = finalize("model.d_model=100", "model.strict_align=false", num_devices=4)
  assert "model.d_model=100" in config.misaligned_dims(cfg.model)
  assert config.misaligned_dims(finalize().model) == []



def test_wiring_checks_vocab_where_tokens_are_read_and_processes(monkeypatch):
  """The checks train.py made after wiring are wiring's, with the same words: the tokenizer's
  vocabulary where tokens are read (train and every benchmark on data), the processes' shares of
  the batch for every wiring.prepare / from_config user (compile, convert, the benchmarks)."""
  run = wiring.prepare(BASE, TINY + ["data.tokenizer=shakespeare", "model.vocab_size=512",
                                     "data.source=shakespeare"], devices=jax.devices()[:1])
  for read in (run.train_iter, run.val_batches):
    with pytest.raises(UserError, match=r"model\.vocab_size=512 is smaller than the "
                                        r"'shakespeare' tokenizer's vocabulary \(8192\)"):
      read()
  synthetic = wiring.prepare(BASE, TINY + ["data.tokenizer=shakespeare", "model.vocab_size=512",
                                           "data.source=synthetic"], devices=jax.devices()[:1])
  assert len(synthetic.val_batches()) >= 1  # ids drawn below the tables' rows: no tokenizer
  seen = []
  monkeypatch.setattr(sharding, "row_groups", lambda batch, rows: seen.append((batch, rows)))
  run = wiring.prepare(BASE, TINY + ["train.batch_size=6"], devices=jax.devices()[:2])
  assert seen == [(run.batch_sharding, 6)]  # the processes' shares of the rows, checked


def test_prepare_checks_once(monkeypatch):
  calls = []
  check = wiring.check
  monkeypatch.setattr(wiring, "check", lambda cfg, *a: calls.append(1) or check(cfg, *a))
  wiring.prepare(BASE, TINY, devices=jax.devices()[:1])
  assert len(calls) == 1


# Round trip and run identity.

def test_save_load_round_trip(tmp_path):
  cfg = finalize("train.steps=5", "mesh.rules=[[batch, fsdp], [embed, null]]")
  path = tmp_path / "sub" / "config.yml"
  config.save(cfg, path)
  assert config.load(str(path)).to_dict() == cfg.to_dict()
  assert os.listdir(path.parent) == ["config.yml"]  # no temporary file left


def test_a_saved_config_holds_no_values_of_one_start_on_its_devices(tmp_path):
  """A run of 2 processes saved process 0's distributed.* launch values, and the computed peak
  FLOP/s of its devices: `train RUN/config.yml` (the documented resume, one process) waited
  distributed.init_timeout for a coordinator long gone, then failed; on other devices its MFU
  was against the old peak (halved). Saved at their defaults now, a peak set by hand kept; a
  run folder's older config.yml is read without the launch values, and is the same run."""
  from nanotext import distributed
  run = tmp_path / "run"
  run.mkdir()
  launch = ["distributed.coordinator_address=127.0.0.1:1234", "distributed.num_processes=2",
            "distributed.process_id=1", "distributed.local_device_count=4"]
  cfg = finalize(*launch, f"output_dir={run}")
  config.save(cfg, run / "config.yml")
  saved = config_file.read(run / "config.yml")
  assert saved["distributed"] == config_file.read(config.SCHEMA_PATH)["distributed"]
  assert saved["metrics"]["peak_flops"] == 0
  config.save(finalize("metrics.peak_flops=5"), tmp_path / "mine.yml")
  assert config_file.read(tmp_path / "mine.yml")["metrics"]["peak_flops"] == 5
  older = cfg.to_dict()  # as an older nanotext saved it
  older["metrics"]["peak_flops"] = 125e9
  older["distributed"].update(coordinator_address="127.0.0.1:1234", num_processes=2,
                              process_id=0, local_device_count=2)
  (run / "config.yml").write_text(config_file.dump(older))
  (run / "metrics.jsonl").write_text("")
  again = load(path=run / "config.yml")
  assert distributed.plan(again.distributed) is None  # one process: nothing to join
  assert again.distributed.local_device_count == 0
  assert identity.check_run(finalize(f"output_dir={run}"), str(run)) is False  # resumed
  assert load(*launch, path=run / "config.yml").distributed.process_id == 1  # given: it acts


@pytest.mark.parametrize("prompt", ["\u00e9t\u00e9 \U0001F600", "a\x85b", "a\u2028b\u2029",
                                    "\ufeffROMEO", "line\nbreak", "\x00\x1b[31m", "yes", "'\""])
def test_a_saved_prompt_reads_back_as_it_was(tmp_path, prompt):
  path = tmp_path / "config.yml"
  config.save(load(f"sample.prompt={prompt}"), path)
  assert config.load(str(path)).sample.prompt == prompt


def test_a_saved_config_yml_is_no_bigger_than_a_config_can_be(tmp_path):
  """A 600 KB prompt of \u00e9 trained, then its config.yml (escaped, 1.3 MB) was refused."""
  path = tmp_path / "config.yml"
  config.save(load("sample.prompt=" + "\u00e9" * 300_000), path)  # written as is: 2 bytes each
  assert config.load(str(path)).sample.prompt == "\u00e9" * 300_000
  with pytest.raises(UserError, match=r"config.yml of 1,\d+,\d+ bytes, more than a config can be "
                     r"\(1,048,576\).*shorten sample.prompt"):  # refused before any training
    load("sample.prompt=" + "\x01" * 270_000)  # each written as the 4 bytes "\x01"


def test_run_identity_diff():
  old = finalize().to_dict()
  same = finalize("train.steps=9", "train.log_every=3", "checkpoint.every=7",
                  "sample.prompt=x", "output_dir=elsewhere").to_dict()
  assert config.run_identity_diff(old, same) == []
  diff = config.run_identity_diff(old, finalize("model.d_model=512").to_dict())
  assert any(d.startswith("model.d_model: 256 -> 512") for d in diff)
  assert config.run_identity_diff(old, finalize("seed=1").to_dict()) == ["seed: 0 -> 1"]



def test_run_identity_diff_compares_values_as_their_keys_types(tmp_path):
  """config.yml spelling a value another way (3e-3, which YAML reads as a string; JSON's 1e-10
  copied back from a checkpoint) was 'a different run (optim.lr: 3e-3 -> 0.003)'."""
  cfg = config.load(BASE, [f"output_dir={tmp_path}"])
  config.save(cfg, tmp_path / "config.yml")
  text = (tmp_path / "config.yml").read_text()
  assert "lr: 0.003," in text and "eps: 1.0e-08," in text
  (tmp_path / "config.yml").write_text(text.replace("lr: 0.003,", "lr: 3e-3,")
                                       .replace("eps: 1.0e-08,", "eps: 1e-8,"))
  assert identity.check_run(cfg, str(tmp_path)) is False
  old = config_file.read(tmp_path / "config.yml")
  assert old["optim"]["lr"] == "3e-3" and config.run_identity_diff(old, cfg.to_dict()) == []
  old["optim"]["lr"] = "4e-3"
  assert config.run_identity_diff(old, cfg.to_dict()) == ["optim.lr: 0.004 -> 0.003"]

# Typed sections: built once by finalize from base.yml's keys and types.

def test_typed_sections_are_frozen():
  cfg = finalize()
  for section, key in (("model", "d_model"), ("train", "steps"), ("mesh", "fsdp")):
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(cfg[section], key, 1)
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.seed = 1
  assert isinstance(cfg, sections.Section) and isinstance(cfg.model, sections.Section)
  assert isinstance(cfg.mesh.rules, tuple) and hash(cfg.model) == hash(finalize().model)
  assert cfg.checkpoint["async"] is cfg.checkpoint.async_ is True  # a keyword as a key
  assert dataclasses.replace(cfg.train, steps=9).steps == 9 and cfg.train.steps == 200


def test_typed_field_types_are_base_yml_types():
  with open(BASE, encoding="utf-8") as f:
    schema = yaml.safe_load(f)
  cfg = finalize()
  for section, tree in schema.items():
    for key, default in (tree.items() if isinstance(tree, dict) else [(None, tree)]):
      obj = cfg if key is None else cfg[section]
      field = {f.metadata["key"]: f for f in dataclasses.fields(obj)}[key or section]
      want = tuple if isinstance(default, list) else type(default)
      assert field.type is want and type(obj[key or section]) is want, (section, key)
  with pytest.raises(TypeError, match="TrainConfig.steps must be of type int"):
    dataclasses.replace(cfg.train, steps="9")


def test_a_key_added_to_base_yml_is_typed_with_no_other_edit(tmp_path, monkeypatch):
  text = open(BASE, encoding="utf-8").read().replace(
      "\nmodel:\n", "\nmodel:\n  new_knob: 2.5  # a new key\n  new_list: [1, 2]\n", 1)
  schema = write(tmp_path / "base.yml", text)
  monkeypatch.setattr(config, "SCHEMA_PATH", tmp_path / "base.yml")
  cfg = finalize(path=schema)
  assert cfg.model.new_knob == 2.5 and cfg.model.new_list == (1, 2)
  assert finalize("model.new_knob=3", path=schema).model.new_knob == 3.0
  assert cfg.to_dict()["model"]["new_list"] == [1, 2]


def test_every_rule_beside_a_key_is_known_and_on_a_key_of_the_schema():
  """A typo in a `# [...]` rule of base.yml fails here, not in some user's run."""
  defaults = config.load(BASE)
  rules = config.key_rules()
  assert rules["train.steps"] == (">0", "int32", "resume-ok") and rules["mesh"] == ("resume-ok",)
  for key, key_rules in rules.items():
    for rule in key_rules:
      config.check_rule(key, config.get(defaults, key), rule)  # ValueError if unknown


def test_a_key_added_to_base_yml_with_rules_is_checked_with_no_other_edit(tmp_path, monkeypatch):
  text = open(BASE, encoding="utf-8").read().replace(
      "\ntrain:\n", "\ntrain:\n  new_count: 3  # [>=1 int32 resume-ok] a new counter\n", 1)
  write(tmp_path / "base.yml", text)
  monkeypatch.setattr(config, "SCHEMA_PATH", tmp_path / "base.yml")
  path = str(tmp_path / "base.yml")
  with pytest.raises(UserError, match="train.new_count=0 must be at least 1"):
    config.load(path, ["train.new_count=0"])
  with pytest.raises(UserError, match=r"train.new_count=2147483648 does not fit in 32 bits"):
    config.load(path, [f"train.new_count={2**31}"])
  old, new = (config.load(path, [f"train.new_count={n}"]).to_dict() for n in (3, 4))
  assert config.run_identity_diff(old, new) == []  # resume-ok: a resume may change it


def test_typed_config_round_trips_and_pickles():
  cfg = finalize()
  assert config.typed(cfg.to_dict()) == cfg and pickle.loads(pickle.dumps(cfg)) == cfg
  assert config.get(cfg, "mesh.rules")[0] == ["batch", ["data", "fsdp"]]


def test_a_key_added_since_the_run_started_is_not_a_change():
  old = finalize().to_dict()
  del old["optim"]["head_eps"]  # a config.yml written before the key existed
  assert config.run_identity_diff(old, finalize().to_dict()) == []


def test_a_retired_key_in_an_old_runs_config_is_ignored(tmp_path):
  path = tmp_path / "config.yml"
  path.write_text("base: %s\ntrain:\n  debug_nan_step: -1\n" % os.path.abspath(BASE))
  assert config.load(str(path)).train.steps == config.load(BASE).train.steps


def test_a_retired_key_set_in_a_file_is_refused_as_on_the_command_line(tmp_path):
  """train.debug_nan_step: 5 in a config file was ignored unsaid (refused as an override)."""
  path = tmp_path / "mine.yml"
  path.write_text("base: %s\ntrain:\n  debug_nan_step: 5\n" % os.path.abspath(BASE))
  line = ("unknown config key 'train.debug_nan_step'; it was retired (nanotext no longer does "
          "what it set): remove it")
  with pytest.raises(UserError, match=re.escape(f"{line} (in '{path}')")):
    config.load(str(path))
  with pytest.raises(UserError, match=re.escape(line)):
    load("train.debug_nan_step=5")


@pytest.mark.fast
@pytest.mark.parametrize("override,message", [
    (f"seed={2**31}", "does not fit in 32 bits"),  # a traceback from jnp.int32 in init_state
    (f"seed={-2**31 - 1}", "does not fit in 32 bits"),
    ("attention.window_block=0", "must be positive"),  # a ZeroDivisionError in the schedule
    ("model.rope_base=0", "must be positive"),  # a ZeroDivisionError in rope
    ("optim.beta1=7", "optim.beta1=7.0 must be in [0, 1)"),  # trained, exit 0
    ("optim.beta2=1", "optim.beta2=1.0 must be in [0, 1)"),
    # NaN params at step 1: AdamW's 0/0 on a parameter whose gradient is 0
    ("optim.eps=0", "optim.eps=0.0 must be positive"),
    ("optim.eps=1e-50", "optim.eps=1e-50 is 0 in float32"),
    ("optim.name=muon optim.head_eps=1e-50", "optim.head_eps=1e-50 is 0 in float32"),
    ("optim.beta1=0.99999999", "optim.beta1=0.99999999 is 1.0 in float32"),  # [0, 1) in float64
    ("optim.beta2=0.99999999", "optim.beta2=0.99999999 is 1.0 in float32"),
    ("optim.final_lr_frac=50", "must be in [0, 1]"),
    ("optim.muon_momentum=1.5", "must be in [0, 1]"),
    ("optim.muon_ns_steps=0", "must be positive"),
    ("optim.muon_momentum_warmup=-5", "must not be negative"),
    ("data.eot_id=-7", "must be at least -1"),
    # a traceback where -32 divided train.seq_len; a warmup silently off; an MFU of -4.9e10 %
    ("train.seq_len_start=-32", "train.seq_len_start=-32 must not be negative"),
    ("train.seq_len_step=-8", "train.seq_len_step=-8 must not be negative"),
    ("metrics.peak_flops=-5", "metrics.peak_flops=-5.0 must not be negative"),
    ("model.vocab_size=1", "model.vocab_size=1 must be more than 1"),  # a loss of 0 "learned"
    # a TypeError traceback: XLA takes it (plus a grace) as a C++ int
    ("distributed.init_timeout=3000000000", "distributed.init_timeout=3000000000 must be at "
                                            "most 86400"),
    # 65 s and 4 GB making CPU devices before anything was refused
    ("distributed.local_device_count=30000", "distributed.local_device_count=30000 must be at "
                                             "most 4096"),
    # hundreds of grain worker processes: a machine's load at 120, down (checked at load only)
    ("data.workers=100000", "data.workers=100000 must be at most 256"),
    # an ablation under muon: two identical runs
    ("optim.name=muon optim.weight_decay=0.1", "optim.weight_decay=0.1 is read only by "
                                               "optim.name=adamw"),
])
def test_values_that_trained_nonsense_or_crashed_are_refused(override, message):
  from nanotext import wiring
  with pytest.raises(UserError, match=re.escape(message)):
    wiring.load(BASE, override.split())


# Ints that reach a jitted computation or an int32 array: past 32 bits, attention.window=3e9
# trained, saved, then the end-of-run sample and every `generate` died of an OverflowError.
@pytest.mark.parametrize("key", [
    "attention.window", "attention.window_start", "attention.window_block", "model.embed_rows",
    "model.value_embeds", "train.seq_len_start", "train.seq_len_step", "train.eval_seq_len",
    "train.loss_chunk", "train.eval_loss_chunk", "train.eval_accum", "data.eot_id",
    "sample.top_k"])
def test_an_int_a_jitted_step_takes_must_fit_in_32_bits(key):
  assert f"{key}={2**31} does not fit in 32 bits" in error(f"{key}={2**31}")


def test_a_head_lr_the_records_head_lr_replaces_is_refused(tmp_path):
  """optim.head_lr on speedrun.yml (head_lr_record 0.22) was replaced by 0.22 / sqrt(d) unsaid;
  the finalized config, as config.yml saves it for a resume, still loads."""
  assert "would be replaced by optim.head_lr_record=0.22" in error("optim.head_lr=0.01",
                                                                   path=SPEEDRUN)
  mine = wiring.load(SPEEDRUN, ["optim.head_lr=0.01", "optim.head_lr_record=0"])
  assert mine.optim.head_lr == 0.01
  saved = finalize("model.num_layers=2", path=SPEEDRUN, num_devices=1)  # a plan in 1 s, not 7
  assert saved.optim.head_lr == 0.22 / saved.model.d_model ** 0.5
  config.save(saved, tmp_path / "config.yml")
  assert wiring.load(str(tmp_path / "config.yml")).optim.head_lr == saved.optim.head_lr
