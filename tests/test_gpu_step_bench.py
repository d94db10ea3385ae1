"""benchmarks/gpu_step.py on CPU at toy shapes: the table's figures, and its trace reader."""

import importlib.util
import os

import pytest

from conftest import REPO

_spec = importlib.util.spec_from_file_location("gpu_step_bench",
                                               os.path.join(REPO, "benchmarks", "gpu_step.py"))
gpu_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_step)

RECORD = os.path.join(REPO, "configs", "speedrun_record.yml")
TOY = ["model.num_layers=2", "model.d_model=64", "model.num_heads=1", "model.head_dim=64",
       "model.mlp_dim=128", "model.vocab_size=512", "model.embed_rows=0", "model.align=0",
       "train.seq_len=512", "train.batch_size=8", "train.steps=4", "attention.window=256",
       "attention.window_start=128", "train.eval_seq_len=0"]


@pytest.mark.slow
def test_measure_reports_every_figure(tmp_path):
  hlo = tmp_path / "step.hlo"
  r = gpu_step.measure(RECORD, TOY, steps=1, repeats=2, warmup=0, schedule=True, trace_steps=1,
                       top=5, hlo=str(hlo))
  assert "ENTRY" in hlo.read_text()  # the timed program, as compiled
  assert r["step_s"] > 0 and r["schedule_step_s"] > 0 and 0 < r["mfu"] < 1
  assert len(r["compiled"]) == 1 and "runtime" in r["compiled"][0]  # one program, all windows
  assert r["to_first_step_s"] > 0
  assert r["peak_bytes"] > 0 and r["tokens_per_s"] == pytest.approx(8 * 512 / r["step_s"])
  # The CPU runtime names its ops in a trace only sometimes (none in a full test session, all
  # when run alone); the table says which. kernel_table's reading is tested on events below.
  assert r["traced"] and all(ms >= 0 and "::" not in name for name, ms, _ in r["kernels"])
  text = gpu_step.table(r)
  assert "step at the final windows" in text
  assert ("kernel:" in text) == bool(r["kernels"]) != ("none named" in text)


def test_kernel_table_reads_device_streams_when_there_are_any():
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
  events = meta + [{"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "dur": 3000.0},
                   {"ph": "X", "pid": 1, "tid": 7, "name": "gemm", "dur": 3000.0},
                   {"ph": "X", "pid": 1, "tid": 8, "name": "softmax", "dur": 2000.0},
                   {"ph": "X", "pid": 2, "tid": 9, "name": "python", "dur": 99000.0}]
  rows = gpu_step.kernel_table(events, n_steps=2, top=5)
  assert rows == [("gemm", 3.0, 0.75), ("softmax", 1.0, 0.25)]


def test_kernel_table_on_a_host_counts_only_the_programs_instructions():
  """Any thread may run a CPU program's ops; the runtime's own spans and control flow don't count."""
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}]
  events = meta + [{"ph": "X", "pid": 1, "tid": 1, "name": "fusion.3", "dur": 4000.0},
                   {"ph": "X", "pid": 1, "tid": 2, "name": "fusion.3", "dur": 2000.0},
                   {"ph": "X", "pid": 1, "tid": 2, "name": "dot.1", "dur": 2000.0},
                   {"ph": "X", "pid": 1, "tid": 2, "name": "while.2", "dur": 9000.0},
                   {"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction(step)", "dur": 9000.0},
                   {"ph": "X", "pid": 1, "tid": 1, "name": "ThunkExecutor::Execute", "dur": 9e3}]
  rows = gpu_step.kernel_table(events, n_steps=1, top=5, ops={"fusion.3", "dot.1", "while.2"})
  assert rows == [("fusion.3", 6.0, 0.75), ("dot.1", 2.0, 0.25)]


@pytest.mark.fast
def test_kernels_are_traced_back_to_the_jax_ops_that_made_them():
  """A fusion's kernel by its own name (dots as underscores on a GPU), a library kernel (cuBLAS)
  by the HLO op its trace event names."""
  text = "\n".join([
      "ENTRY %main (p: bf16[8], a: f8e4m3fn[8], b: f8e4m3fn[8]) -> (bf16[8]) {",
      '  %loop_convert_fusion.23 = bf16[8]{0} fusion(%p), kind=kLoop, calls=%fc, '
      'metadata={op_name="jit(step_fn)/jvp(loss)/convert_element_type" stack_frame_id=3}',
      '  %custom-call.5 = (f32[8]{0}, s8[0]{0}) custom-call(%a, %b), '
      'custom_call_target="__cublas$lt$matmul$f8", metadata={op_name="jit(step_fn)/jvp(loss)/dot"}',
      "  ROOT %tuple.1 = (bf16[8]{0}) tuple(%loop_convert_fusion.23)",
      "}"])
  ops = gpu_step.op_names(text)
  assert ops["loop_convert_fusion.23"] == ops["loop_convert_fusion_23"] == \
      "jvp(loss)/convert_element_type"
  assert ops["tuple.1"] == ""
  events = [{"ph": "X", "name": "loop_convert_fusion_23", "dur": 1.0},
            {"ph": "X", "name": "nvjet_sm90_qqsss", "dur": 1.0,
             "args": {"hlo_op": "custom-call.5"}},
            {"ph": "X", "name": "memcpy", "dur": 1.0, "args": {"hlo_op": "tuple.1"}},
            {"ph": "X", "name": "cutlass_kernel", "dur": 1.0}]
  assert gpu_step.kernel_sources(events, ops) == {
      "loop_convert_fusion_23": "jvp(loss)/convert_element_type",
      "nvjet_sm90_qqsss": "jvp(loss)/dot"}
  r = {"config": "x", "device": "d", "devices": 1, "backend": "gpu", "jax": "0.11.2", "params": 1,
       "attention": "flash_gpu", "compiled": [], "to_first_step_s": 1.0, "step_s": 0.1,
       "step_s_all": [0.1], "schedule_step_s": None, "tokens_per_s": 1.0, "mfu": 0.3,
       "peak_flops": 1e15, "peak_bytes": 1, "kernels": [("nvjet_sm90_qqsss", 4.0, 0.5)],
       "kernel_ops": {"nvjet_sm90_qqsss": "jvp(loss)/dot"}, "traced": True, "gaps": None,
       "estimate": None}
  assert "| kernel: `nvjet_sm90_qqsss` | 4.00 ms/step (50.0%), from `jvp(loss)/dot` |" in \
      gpu_step.table(r)


def test_stream_gaps_are_the_idle_time_between_kernels_on_a_stream():
  meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}}]
  events = meta + [{"ph": "X", "pid": 1, "tid": 7, "name": "a", "ts": 0.0, "dur": 1000.0},
                   {"ph": "X", "pid": 1, "tid": 7, "name": "b", "ts": 1500.0, "dur": 1000.0},
                   {"ph": "X", "pid": 1, "tid": 7, "name": "c", "ts": 4500.0, "dur": 500.0},
                   {"ph": "X", "pid": 1, "tid": 8, "name": "d", "ts": 0.0, "dur": 500.0}]
  assert gpu_step.stream_gaps(events, n_steps=1) == {"kernels": 4, "busy_ms": 3.0,
                                                     "gap_ms": 2.5}
  assert gpu_step.stream_gaps(meta[:0] + events[1:], n_steps=1) is None  # no device streams


@pytest.mark.fast
def test_the_estimate_is_shown_as_a_share_of_the_measured_step():
  """The H100's numbers: an 81.4 ms estimate beside a 141.9 ms step is 57% of it."""
  r = {"config": "x", "device": "NVIDIA H100 80GB HBM3", "devices": 1, "backend": "gpu",
       "jax": "0.11.2", "params": 1, "attention": "flash_gpu", "compiled": [],
       "to_first_step_s": 39.1, "step_s": 0.1419, "step_s_all": [0.1419], "schedule_step_s": None,
       "tokens_per_s": 1.0, "mfu": 0.3, "peak_flops": 989e12, "peak_bytes": 2**30, "kernels": [],
       "traced": False, "gaps": None, "estimate": {"estimate_s": 0.0814, "launches": 1164}}
  assert "81.4 ms, 1164 launches (57% of the measured step)" in gpu_step.table(r)


@pytest.mark.fast
def test_own_kernels_are_taken_only_opted_in():
  """nanotext's own Pallas GEMMs and flash_gpu's QK-norm inside apply to a GPU program they tile
  only under --own_kernels (the A/B gpu_lease.sh's record_own step measures); a wrong name is a
  UserError naming the choices."""
  import jax.numpy as jnp
  from nanotext.errors import UserError
  from nanotext.model.kernels import fp8_head, per_device, relu2_mlp
  x = jnp.zeros((1, 1024, 768), jnp.bfloat16)
  with per_device.building_for("gpu"):
    assert not fp8_head.applies(4096, 768, 50304) and not relu2_mlp.applies(x, 3072)
    with per_device.opting_in(*gpu_step.own_kernels("all")):
      assert fp8_head.applies(4096, 768, 50304) and relu2_mlp.applies(x, 3072)
      assert per_device.opted_in("flash_gpu_qkv")
    with per_device.opting_in(*gpu_step.own_kernels("fp8_head")):
      assert fp8_head.applies(4096, 768, 50304) and not relu2_mlp.applies(x, 3072)
    assert not fp8_head.applies(4096, 768, 50304)  # the context put it back
  with pytest.raises(UserError, match="choose from flash_gpu_qkv, fp8_head, relu2_mlp, "
                     "flash_gpu_one_backward or all"):
    gpu_step.own_kernels("fp8_head,nope")
