"""nanotext.plot: curves of one or several runs from metrics.jsonl, and its refusals."""

import json
import os

import pytest

from conftest import one_line_error, run_cli

pytestmark = pytest.mark.fast


def fake_run(path, *, tokens=(8, 64), final=5.0, bpb=True):
  """A run directory holding what the trainer writes: config.yml and metrics.jsonl."""
  os.makedirs(path)
  with open(os.path.join(path, "config.yml"), "w") as f:
    f.write(f"train:\n  batch_size: {tokens[0]}\n  seq_len: {tokens[1]}\n")
  with open(os.path.join(path, "metrics.jsonl"), "w") as f:
    for step in range(1, 21):
      f.write(json.dumps({"step": step, "loss": 9.0 - step * (9.0 - final) / 20, "lr": 1e-3}) + "\n")
      if step % 10 == 0:
        row = {"step": step, "val_loss": final + 0.2 * (20 - step) / 10}
        if bpb:
          row["val_bpb"] = row["val_loss"] / 0.693 / 3.3
        f.write(json.dumps(row) + "\n")
  return str(path)


@pytest.mark.plots
def test_plots_several_runs(tmp_path):
  a = fake_run(tmp_path / "muon", final=4.8)
  b = fake_run(tmp_path / "adamw", final=5.3, tokens=(16, 256), bpb=False)
  out = tmp_path / "cmp.png"
  proc = run_cli("nanotext.plot", a, b, f"--out={out}")
  assert proc.returncode == 0, proc.stderr
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
  assert f"wrote {out}" in proc.stdout
  assert "muon: step 20 val_loss 4.8000, val_bpb 2.0989" in proc.stdout
  assert "adamw: step 20 val_loss 5.3000\n" in proc.stdout
  assert sorted(os.listdir(tmp_path)) == ["adamw", "cmp.png", "muon"]  # no temporary left


def test_help_exits_0():
  proc = run_cli("nanotext.plot", "--help")
  assert proc.returncode == 0 and "usage: python -m nanotext.plot" in proc.stdout


@pytest.mark.plots
def test_refusals(tmp_path):
  run = fake_run(tmp_path / "run")
  one_line_error(run_cli("nanotext.plot", run), "--out")
  one_line_error(run_cli("nanotext.plot", f"--out={tmp_path / 'x.png'}"), "no run directory")
  empty = tmp_path / "empty"
  empty.mkdir()
  one_line_error(run_cli("nanotext.plot", str(empty), f"--out={tmp_path / 'x.png'}"),
                 "no metrics.jsonl", str(empty))
  one_line_error(run_cli("nanotext.plot", os.path.join(run, "metrics.jsonl"),
                         f"--out={tmp_path / 'x.png'}"), "is a file")
  one_line_error(run_cli("nanotext.plot", run, f"--out={tmp_path / 'no' / 'x.png'}"),
                 "does not exist")
  assert not (tmp_path / "x.png").exists()


def test_an_out_under_a_file_names_the_file(tmp_path):
  """--out=afile/x.png where afile is a regular file said "folder '.../afile' does not exist"."""
  from nanotext import plot
  from nanotext.errors import UserError
  (tmp_path / "afile").write_text("")
  for out in ("afile/x.png", "afile/sub/x.png"):
    with pytest.raises(UserError, match=f"'{tmp_path / 'afile'}' is a file, not a folder$"):
      plot.parse([str(tmp_path)], str(tmp_path / out), "")
  with pytest.raises(UserError, match=f"folder '{tmp_path / 'no'}' does not exist$"):
    plot.parse([str(tmp_path)], str(tmp_path / "no" / "x.png"), "")


def test_without_matplotlib(tmp_path):
  # A matplotlib that cannot be imported, first on the path.
  shadow = tmp_path / "shadow" / "matplotlib"
  shadow.mkdir(parents=True)
  (shadow / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
  path = os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")])
  run = fake_run(tmp_path / "run")
  one_line_error(run_cli("nanotext.plot", run, f"--out={tmp_path / 'x.png'}",
                         env={"PYTHONPATH": path}), "matplotlib", "pip install")


@pytest.mark.plots
def test_odd_numbers_are_drawn_or_named_never_a_traceback(tmp_path):
  """A val_loss of 0 (no bits-per-byte scale from it), values near 1e308 (matplotlib's layout
  fails on them: drawn as gaps), and a file of lines that are none of them metrics rows."""
  from nanotext import plot
  run = tmp_path / "run"
  run.mkdir()
  metrics = run / "metrics.jsonl"
  metrics.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "val_loss": 0.0, "val_bpb": 1.5}\n'
                     '{"step": 3, "loss": 1.7e308, "val_loss": 1e308, "val_bpb": 1e308}\n'
                     '{"step": 1e308, "loss": 1.0}\n{"step": -5, "loss": 1.0}\n'
                     '{"step": 4, "loss": null}\n')  # a skipped step's non-finite loss
  got = plot.read_run(str(run))
  assert [s for s, _ in got["train"]] == [1, 3, 4]  # steps no run has are not metrics rows
  assert plot._bpb_scale(got) is None and got["train"][1][1] != got["train"][1][1]  # NaN
  assert got["train"][2][1] != got["train"][2][1] and got["skipped"] == [4, 5]
  proc = run_cli("nanotext.plot", str(run), f"--out={tmp_path / 'x.png'}")
  assert proc.returncode == 0 and (tmp_path / "x.png").stat().st_size > 0, proc.stderr
  metrics.write_bytes(b'garbage\n\x00\xff\n{"ste')
  one_line_error(run_cli("nanotext.plot", str(run), f"--out={tmp_path / 'y.png'}"),
                 "no line of the metrics.jsonl")


def test_the_tokens_axis_says_why_tokens_per_step_are_unknown(tmp_path):
  """An empty config.yml was labelled 'no config.yml: tokens per step unknown'."""
  from nanotext import plot
  run = fake_run(tmp_path / "run")
  config = os.path.join(run, "config.yml")
  assert plot.tokens_unknown([plot.read_run(run)]) == ""
  for text, why in (("", "config.yml is empty"), ("train: [\n", "config.yml unreadable"),
                    ("seed: 1\n", "no train.batch_size, seq_len in config.yml"),
                    (None, "no config.yml")):
    if text is None:
      os.remove(config)
    else:
      with open(config, "w") as f:
        f.write(text)
    got = plot.read_run(run)
    assert (got["tokens_per_step"], got["tokens_unknown"]) == (None, why)
    assert plot.tokens_unknown([got, got]) == f"{why}: tokens per step unknown"
  assert plot.tokens_unknown([got, plot.read_run(fake_run(tmp_path / "b"))]) == ""


@pytest.mark.plots
def test_an_empty_tokens_panel_has_no_token_counts_on_its_axis(tmp_path, monkeypatch):
  """A run without val_bpb (data.tokenizer=none): the empty bits-per-byte-vs-tokens panel's 0..1
  axis read '0, 200m, 400m, 600m, 800m, 1' (tokens as the filled panel above writes them)."""
  import matplotlib.pyplot as plt
  from nanotext import plot
  figures = []
  monkeypatch.setattr(plt, "close", figures.append)  # the figure, kept to read its axes
  run = plot.read_run(fake_run(tmp_path / "run", bpb=False))
  plot.plot([run], str(tmp_path / "x.png"))
  top, bottom = (figures[0].axes[i].get_xticklabels() for i in (1, 3))
  assert [t.get_text() for t in top if t.get_text().endswith("k")], "no tokens axis above"
  assert not [t.get_text() for t in bottom if t.get_text().endswith("m")], bottom
  plt.close(figures[0])


@pytest.mark.plots
def test_dollars_in_a_title_or_run_name_are_text(tmp_path):
  """matplotlib read '$...$' as math: a title or a run folder named 'cost $x^$' was a
  ValueError traceback, exit 1."""
  run = fake_run(tmp_path / "pr$^$")
  out = tmp_path / "o.png"
  proc = run_cli("nanotext.plot", run, f"--out={out}", "--title=cost $\\frac$ and $x^$")
  assert proc.returncode == 0 and out.exists(), proc.stderr


def test_a_loss_with_no_finite_neighbour_gets_a_marker():
  """A one-row run, or a row between skipped steps, was a line of one point: nothing drawn."""
  from nanotext import plot
  nan = float("nan")
  assert plot.isolated([(1, 5.0)]) == [(1, 5.0)]
  got = plot.isolated([(1, 5.0), (2, nan), (3, 4.0), (4, nan), (5, 3.0), (6, 2.9)])
  assert got == [(1, 5.0), (3, 4.0)]  # 5 and 6 make a line
  assert plot.isolated([]) == [] and plot.isolated([(1, nan)]) == []
