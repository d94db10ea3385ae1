"""benchmarks/parallelism.py: the HLO collective parser, the layout parser, one tiny run."""

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import BASE, PROCESS_TIMEOUT_S, REPO, TINY, one_line_error
from nanotext.errors import UserError
from nanotext.hlo import shape_bytes

_spec = importlib.util.spec_from_file_location(
    "parallelism_bench", os.path.join(REPO, "benchmarks", "parallelism.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

# Sync and async forms, a tuple with /*index=N*/ comments, and lines that only mention a
# collective by name (operands, get-tuple-element, metadata) and must not count.
HLO = """
HloModule jit_step
ENTRY %main (p0: f32[64,128]) -> f32[64,128] {
  %p0 = f32[64,128]{1,0} parameter(0)
  %all-reduce.1 = (f32[64]{0}, f32[32,64]{1,0}, /*index=2*/bf16[8]{0}) all-reduce(%a, %b, %c)
  %gte = f32[64]{0} get-tuple-element(%all-reduce.1), index=0, metadata={op_name="all-reduce(x)"}
  %all-gather-start = (f32[8,128]{1,0}, f32[64,128]{1,0}) all-gather-start(%p0), dimensions={0}
  %all-gather-done = f32[64,128]{1,0} all-gather-done(%all-gather-start)
  %reduce-scatter.3 = bf16[4,16]{1,0:T(4,128)} reduce-scatter(%x), dimensions={0}, to_apply=%add
  %cp-start = (f32[10]{0}, f32[10]{0}, u32[], u32[]) collective-permute-start(%y)
  %cp-done = f32[10]{0} collective-permute-done(%cp-start)
  all-to-all.2 = s32[2,3]{1,0} all-to-all(s32[2,3]{1,0} %z), dimensions={0}
  %fusion = f32[64]{0} fusion(f32[64]{0} %all-reduce.1, pred[] %all-gather-done), kind=kLoop
  ROOT %r = f32[64,128]{1,0} copy(%all-gather-done)
}
"""


def test_collectives_counts_and_bytes():
  got = bench.collectives(HLO)
  assert got["all-reduce"] == {"count": 1, "bytes": 64 * 4 + 32 * 64 * 4 + 8 * 2}
  assert got["all-gather"] == {"count": 1, "bytes": 64 * 128 * 4}
  assert got["reduce-scatter"] == {"count": 1, "bytes": 4 * 16 * 2}
  assert got["collective-permute"] == {"count": 1, "bytes": 10 * 4}
  assert got["all-to-all"] == {"count": 1, "bytes": 2 * 3 * 4}


def test_shape_bytes():
  assert shape_bytes("f32[]") == 4
  assert shape_bytes("(pred[3], f8e4m3fn[2,2], u64[0])") == 3 + 4
  assert shape_bytes("token[]") == 0  # not an array type


@pytest.mark.parametrize("text, name, shape", [
    ("dp8", "dp8", (8, 1, 1)),
    ("FSDP8", "fsdp8", (1, 8, 1)),
    ("tp4xdp2", "dp2xtp4", (2, 1, 4)),
    ("dp2xfsdp2xtp2", "dp2xfsdp2xtp2", (2, 2, 2)),
    ("dp1xfsdp8", "fsdp8", (1, 8, 1)),
])
def test_parse_layout(text, name, shape):
  assert bench.parse_layout(text, 8) == (name, shape)


@pytest.mark.parametrize("text, match", [
    ("dp=8", "not like"), ("fsdp4*tp2", "not like"), ("dp0xfsdp8", "not like"),
    ("dp2xdp4", "not like"), ("pp8", "not like"), ("", "not like"),
    ("fsdp4", "uses 4 devices but there are 8"),
])
def test_parse_layout_errors(text, match):
  with pytest.raises(UserError, match=match):
    bench.parse_layout(text, 8)


def test_layout_lists():
  assert [n for n, _ in bench.parse_layouts("", 8)] == \
      ["dp8", "fsdp8", "tp8", "fsdp4xtp2", "dp2xfsdp2xtp2"]
  assert [n for n, _ in bench.parse_layouts("", 1)] == ["dp1"]
  assert bench.parse_layouts("dp8, fsdp8,dp8", 8) == [("dp8", (8, 1, 1)), ("fsdp8", (1, 8, 1))]
  with pytest.raises(UserError, match="names no layout"):
    bench.parse_layouts(" , ", 8)


def test_tiny_run_losses_agree_and_fsdp_shards_state():
  layouts = [("dp8", (8, 1, 1)), ("fsdp8", (1, 8, 1)), ("tp8", (1, 1, 8))]
  # One layer keeps the two compiles (the cost of this test) short.
  rows = bench.measure(BASE, TINY + ["model.num_layers=1"], layouts, steps=2, timed_steps=1,
                       repeats=1)
  dp, fsdp, tp = rows
  assert "num_heads=2 is not divisible by mesh.tensor=8" in tp["invalid"]
  assert len(dp["losses"]) == 2
  assert fsdp["losses"] == pytest.approx(dp["losses"], rel=1e-4)
  assert dp["state_bytes"] >= 7 * fsdp["state_bytes"]
  assert dp["collectives"]["all-reduce"]["count"] >= 1
  assert fsdp["collectives"]["all-gather"]["count"] >= 1
  assert "| tp8 | 1×1×8 | invalid:" in bench.table(rows)


NOTE = ("(tensor=2 shards no array of this model under mesh.rules: everything is replicated "
        "over it)")
UNUSED_TENSOR = ["mesh.rules=[[batch, [data, fsdp]], [embed, fsdp]]"]


def test_a_layout_axis_that_shards_nothing_says_so_in_its_row():
  """fsdp4xtp2 under rules that never name tensor: its row read as tensor parallelism while
  every step was done twice over (train's start-up line says so, the table did not)."""
  rows = bench.measure(BASE, TINY + ["model.num_layers=1"] + UNUSED_TENSOR,
                       [("fsdp4xtp2", (1, 4, 2))], steps=1, timed_steps=1, repeats=1)
  assert f"| fsdp4xtp2 | 1×4×2 {NOTE} | " in bench.table(rows)


@pytest.mark.tpu
def test_a_compiled_layout_axis_that_shards_nothing_says_so_in_its_row():
  small = ["model.num_layers=1", "model.d_model=128", "model.num_heads=2", "model.head_dim=64",
           "model.vocab_size=512", "train.batch_size=16", "train.seq_len=128"]
  rows = bench.measure_topology(BASE, small + UNUSED_TENSOR, "v6e-8",
                                [("fsdp4xtp2", (1, 4, 2)), ("fsdp8", (1, 8, 1))], "eval")
  text = bench.topology_table(rows)
  assert f"| fsdp4xtp2 | 1×4×2 {NOTE} | eval | " in text and "| fsdp8 | 1×8×1 | eval | " in text


@pytest.mark.fast
def test_bad_config_is_a_user_error():
  with pytest.raises(UserError, match="unknown config key"):
    bench.measure(BASE, TINY + ["model.num_layer=2"], [("dp8", (8, 1, 1))])


@pytest.mark.parametrize("args, match", [
    (["--layouts=dp4xfsdp4"], "uses 16 devices but there are 8"),
    (["model.num_heads=0"], "model.num_heads=0 must be positive"),
])
def test_cli_bad_input_exits_2(args, match, tmp_path):
  script = os.path.join(REPO, "benchmarks", "parallelism.py")
  proc = subprocess.run([sys.executable, script, BASE, *args, f"--out={tmp_path}/x"],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2, proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("nanotext: error: ") and match in lines[0]
  assert not os.listdir(tmp_path)


@pytest.mark.fast
def test_the_default_output_is_named_by_config_and_target():
  """A --topology table went to parallelism_base.md by default, over the committed CPU run's;
  and the default was the committed benchmarks/ tables: now the current directory."""
  assert bench.default_out(BASE, "") == "parallelism_base"
  assert bench.default_out("configs/speedrun.yml", "v6e-8") == "parallelism_speedrun_v6e-8"


def test_an_unwritable_out_is_refused_before_measuring(tmp_path):
  """An --out whose .md is a folder, or whose folder is missing: one line, nothing measured."""
  (tmp_path / "x.md").mkdir()
  script = os.path.join(REPO, "benchmarks", "parallelism.py")
  for out, match in ((tmp_path / "x", "is a folder"), (tmp_path / "no" / "x", "does not exist")):
    proc = subprocess.run([sys.executable, script, BASE, *TINY, f"--out={out}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    one_line_error(proc, match)
    assert "dp8" not in proc.stderr  # no layout was measured
  assert os.listdir(tmp_path) == ["x.md"]


@pytest.mark.plots
def test_a_run_writes_in_the_current_directory_and_says_so(tmp_path):
  script = os.path.join(REPO, "benchmarks", "parallelism.py")
  proc = subprocess.run([sys.executable, script, BASE, *TINY, "--layouts=dp8", "--steps=1",
                         "--timed_steps=1", "--repeats=1"], cwd=tmp_path, capture_output=True,
                        text=True, timeout=PROCESS_TIMEOUT_S)
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.splitlines()[-1] == "wrote parallelism_base.md and parallelism_base.png"
  assert sorted(os.listdir(tmp_path)) == ["parallelism_base.md", "parallelism_base.png"]
