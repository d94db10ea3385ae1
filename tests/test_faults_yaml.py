"""Hostile config files: each is one line at once, never a RecursionError, a MemoryError after a
minute, or a message about something else. Issue 21."""

import pytest

from conftest import BASE
from nanotext import config
from nanotext.errors import UserError

pytestmark = pytest.mark.fast


def refused(path, *overrides, match):
  with pytest.raises(UserError, match=match):  # the bound's own message: refused by the bound
    config.load(str(path), overrides)


def test_a_base_chain_1500_files_deep_is_bounded(tmp_path):
  (tmp_path / "c0.yml").write_text(f"base: {BASE}\n")
  for i in range(1, 1500):
    (tmp_path / f"c{i}.yml").write_text(f"base: c{i - 1}.yml\n")
  refused(tmp_path / "c1499.yml", match="chain of 'base:' files more than 32 deep")
  config.load(str(tmp_path / "c20.yml"))  # a deep but sane chain still loads


def test_a_base_cycle_is_named(tmp_path):
  (tmp_path / "a.yml").write_text("base: b.yml\n")
  (tmp_path / "b.yml").write_text("base: a.yml\n")
  refused(tmp_path / "a.yml", match="inherit in a circle")


def bomb(levels: int, mapping: bool) -> list:
  """YAML lines defining &l0 .. &l{levels-1}, each nine references to the one before."""
  lines = ["l0: &l0 [x, x, x, x, x, x, x, x, x]"]
  for i in range(1, levels):
    refs = [f"k{j}: *l{i - 1}" for j in range(9)] if mapping else [f"*l{i - 1}"] * 9
    body = "{" + ", ".join(refs) + "}" if mapping else "[" + ", ".join(refs) + "]"
    lines.append(f"l{i}: &l{i} {body}")
  return lines


@pytest.mark.parametrize("mapping", [False, True])
def test_an_alias_bomb_under_an_unknown_key_is_refused_at_once(tmp_path, mapping):
  path = tmp_path / "bomb.yml"
  path.write_text("\n".join(bomb(10, mapping)) + "\n")
  refused(path, match="expands to more than 100,000 values")


def test_an_alias_bomb_inside_a_list_valued_key_or_override(tmp_path):
  path = tmp_path / "bomb.yml"
  lines = bomb(10, mapping=False)
  path.write_text(f"base: {BASE}\nanchors:\n" + "\n".join("  " + l for l in lines) +
                  "\nmesh:\n  rules: *l9\n")
  refused(path, match="expands to more than 100,000 values")
  flow = "[&a [x, x, x, x, x, x, x, x, x]" + "".join(
      f", &{c} [{', '.join(['*' + p] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")) + "]"
  refused(BASE, f"mesh.rules={flow}", match="the value of mesh.rules expands to more than")


def test_a_recursive_alias_is_refused(tmp_path):
  path = tmp_path / "loop.yml"
  path.write_text(f"base: {BASE}\nmesh:\n  rules: &r [*r]\n")
  refused(path, match="expands to more than")


def test_a_python_tag_is_named_as_such(tmp_path):
  """It was refused (good) but the message called it a duplicate key."""
  path = tmp_path / "tag.yml"
  path.write_text(f"base: {BASE}\ntrain:\n  steps: !!python/object/apply:os.system [echo]\n")
  with pytest.raises(UserError) as e:
    config.load(str(path))
  assert "line 3" in str(e.value) and "no !!python or other tags" in str(e.value)
  assert "duplicate" not in str(e.value)


def test_a_huge_config_file_is_refused_unread(tmp_path):
  path = tmp_path / "huge.yml"
  with open(path, "w") as f:
    f.write("# " + "x" * (2 << 20) + "\n")
  refused(path, match="more than a config can be")


@pytest.mark.parametrize("value", ["010", "0x10", "0b11", "1:00", "-1:30", "1:30.5"])
def test_yaml_11_numbers_in_other_bases_are_refused(tmp_path, value):
  """steps: 010 trained 8 steps (octal) and 1:30 read as 90 (base 60), saved so without a word,
  where train.steps=010 on the command line is 10."""
  path = tmp_path / "n.yml"
  path.write_text(f"base: {BASE}\ntrain:\n  steps: {value}\n")
  refused(path, match=f"line 3: {value} reads as a .*number.*write it in decimal")
  path.write_text(f"base: {BASE}\ntrain:\n  steps: 10\noptim:\n  lr: 0.001\n  warmup_steps: 0\n")
  cfg = config.load(str(path))  # decimal, 0 and a float with a leading 0 read as they did
  assert (cfg.train.steps, cfg.optim.lr, cfg.optim.warmup_steps) == (10, 0.001, 0)


def test_a_merge_key_is_named_not_called_a_tag(tmp_path):
  path = tmp_path / "m.yml"
  path.write_text(f"base: {BASE}\nd: &d\n  steps: 3\ntrain:\n  <<: *d\n")
  with pytest.raises(UserError) as e:
    config.load(str(path))
  assert "merge key (<<)" in str(e.value) and "tag" not in str(e.value)


@pytest.mark.parametrize("value,read", [("no", "False"), ("2024-01-01", "datetime.date"),
                                        ("null", "None"), ("1.10", "1.1"), ("1_000", "1000")])
def test_a_string_key_given_what_yaml_reads_as_another_value_says_quote_it(tmp_path, value, read):
  """'expects a string, got datetime.date(2024, 1, 1)' left the fix to the user; a number was
  taken as its str(), another spelling (output_dir: 1.10 trained into '1.1')."""
  path = tmp_path / "s.yml"
  path.write_text(f"base: {BASE}\noutput_dir: {value}\n")
  refused(path, match=f"output_dir' expects a string .*quote it\\), got {read}")
