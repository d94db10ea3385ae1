"""Every tool's command line behaves the same (issue 27 item 7): `--help` is usage on stdout and
exit 0, an unknown flag one `nanotext: error:` line and exit 2, dashed flag names accepted."""

import pytest

from conftest import run_cli

# Each tool as run, and the words its usage line starts with.
TOOLS = {
    "train": ["nanotext.train"],
    "generate": ["nanotext.generate"],
    "convert": ["nanotext.convert"],
    "convert to-hf": ["nanotext.convert", "to-hf"],
    "verify": ["nanotext.verify"],
    "plot": ["nanotext.plot"],
    "compile": ["nanotext.compile"],
    "data.prepare": ["nanotext.data.prepare"],
    "data.fineweb": ["nanotext.data.fineweb"],
    "data.tokenizer": ["nanotext.data.tokenizer"],
}


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("flag", ["--help", "-h", "--helpfull"])
def test_help_is_usage_on_stdout_and_exit_0(tool, flag):
  proc = run_cli(*TOOLS[tool], flag, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith(f"usage: python -m {' '.join(TOOLS[tool])}"), proc.stdout
  assert not proc.stderr.strip()


@pytest.mark.parametrize("tool", TOOLS)
def test_unknown_flag_is_one_line_and_exit_2(tool):
  proc = run_cli(*TOOLS[tool], "--no_such_flag=1", timeout=120)
  assert proc.returncode == 2, (proc.stdout, proc.stderr)
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("nanotext: error:"), proc.stderr
  assert "no_such_flag" in lines[0] and "usage: python -m nanotext." in lines[0]
  assert not proc.stdout.strip()


def test_help_lists_the_tools_own_flags():
  out = run_cli("nanotext.compile", "--help").stdout
  assert "--topology" in out and "--min_headroom" in out and "--verbosity" not in out
  assert "--config" in run_cli("nanotext.train", "--help").stdout


def test_dashed_flag_names():
  """`--vocab-size` is `--vocab_size` for every tool (absl itself knows one spelling)."""
  proc = run_cli("nanotext.data.tokenizer", "--vocab-size=100", "extra", timeout=120)
  assert proc.returncode == 2 and "unexpected arguments: extra" in proc.stderr, proc.stderr
