"""Reading compiled programs (nanotext.hlo): parsing, kernel kinds, bytes, loops, the estimate.

Hand-written HLO in the form XLA prints after optimization, so these run without any compiler
plugin; test_gpu_compile.py checks the same on programs XLA's GPU compiler made.
"""

import pytest

from nanotext import compile_report, hlo, hlo_conv, hlo_memory, roofline

pytestmark = pytest.mark.fast

PROGRAM = """HloModule jit_step, is_scheduled=true

%fused_gather (param_0: f32[1024,4096], param_1: s32[1024]) -> f32[1024] {
  %param_0 = f32[1024,4096]{1,0} parameter(0)
  %param_1 = s32[1024]{0} parameter(1)
  %convert.1 = bf16[1024,4096]{1,0} convert(%param_0)
  %gather.1 = bf16[1024]{0} gather(%convert.1, %param_1), offset_dims={}
  ROOT %convert.2 = f32[1024]{0} convert(%gather.1)
}

%fused_exp (param_0.1: f32[1024,4096]) -> f32[1024,4096] {
  %param_0.1 = f32[1024,4096]{1,0} parameter(0)
  ROOT %exp.1 = f32[1024,4096]{1,0} exponential(%param_0.1)
}

%fused_scatter (p0: f32[4096,64], p1: s32[1024], p2: f32[1024,64]) -> f32[4096,64] {
  %p0 = f32[4096,64]{1,0} parameter(0)
  %p1 = s32[1024]{0} parameter(1)
  %p2 = f32[1024,64]{1,0} parameter(2)
  ROOT %scatter.1 = f32[4096,64]{1,0} scatter(%p0, %p1, %p2), to_apply=%add
}

%body (arg: (s32[], bf16[1024,64])) -> (s32[], bf16[1024,64]) {
  %arg = (s32[], bf16[1024,64]{1,0}) parameter(0)
  %gte = bf16[1024,64]{1,0} get-tuple-element(%arg), index=1
  %w = bf16[64,64]{1,0} constant({...})
  %cublas-gemm.9 = (bf16[1024,64]{1,0}, s8[4194304]{0}) custom-call(%gte, %w), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  ROOT %t = (s32[], bf16[1024,64]{1,0}) tuple(%gte, %gte)
}

%cond (arg.1: (s32[], bf16[1024,64])) -> pred[] {
  %arg.1 = (s32[], bf16[1024,64]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f8e4m3fn[1024,64], w: f8e4m3fn[4096,64], y: s32[1024], h: bf16[1024,64]) -> f32[] {
  %x = f8e4m3fn[1024,64]{1,0} parameter(0)
  %w = f8e4m3fn[4096,64]{1,0} parameter(1)
  %y = s32[1024]{0} parameter(2)
  %h = bf16[1024,64]{1,0} parameter(3)
  %cublas-gemm.3 = (f32[1024,4096]{1,0}, s8[33554432]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul$f8", backend_config={"operation_queue_id":"0","gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %gte.1 = f32[1024,4096]{1,0} get-tuple-element(%cublas-gemm.3), index=0
  %picked = f32[1024]{0} fusion(%gte.1, %y), kind=kLoop, calls=%fused_gather
  %exp = f32[1024,4096]{1,0} fusion(%gte.1), kind=kLoop, calls=%fused_exp
  %table = f32[4096,64]{1,0} constant({...})
  %g = f32[1024,64]{1,0} constant({...})
  %scat = f32[4096,64]{1,0} fusion(%table, %y, %g), kind=kInput, calls=%fused_scatter
  %flash = (bf16[1024,64]{1,0}) custom-call(%h, %h, %h), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jvp(block_0)/attention/attention_kernel/x" /*comment*/}
  %init = (s32[], bf16[1024,64]{1,0}) tuple(%y, %h)
  %loop = (s32[], bf16[1024,64]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"12"}}
  %ar = f32[4096,64]{1,0} all-reduce-start(%scat), to_apply=%add
  %ard = f32[4096,64]{1,0} all-reduce-done(%ar)
  ROOT %r = f32[] constant(0)
}
"""

PEAKS = roofline.Peaks(bf16=1e15, fp8=2e15, f32=5e14, bandwidth=1e12)


def by_name():
  return {k.name: k for k in hlo.kernels(PROGRAM)}


def test_parse_finds_computations_entry_and_operands():
  comps, entry = hlo.parse(PROGRAM)
  assert entry == "main" and {"fused_gather", "body", "cond", "main"} <= set(comps)
  gemm = next(i for i in comps["main"] if i.name == "cublas-gemm.3")
  assert gemm.opcode == "custom-call" and gemm.operands == ("x", "w")
  assert gemm.type.startswith("(f32[1024,4096]")
  assert next(i for i in comps["fused_gather"] if i.root).name == "convert.2"


def test_kernel_kinds_and_what_launches():
  k = by_name()
  assert set(k) == {"cublas-gemm.3", "picked", "exp", "scat", "flash", "cublas-gemm.9", "ar"}
  assert k["cublas-gemm.3"].kind == "gemm-fp8" and k["cublas-gemm.3"].math == "fp8"
  assert k["scat"].kind == "scatter" and k["flash"].kind == "custom"
  assert k["ar"].kind == "collective" and k["exp"].kind == "fusion"


def test_an_fp8_gemm_at_the_default_precision_accumulates_fast():
  """cuBLASLt's FP8 fast accumulation is XLA's choice at DEFAULT operand precision (the record
  asks for it forward only); HIGHEST turns it off; a bf16 GEMM has none."""
  assert by_name()["cublas-gemm.3"].fast_accum and not by_name()["cublas-gemm.9"].fast_accum
  exact = PROGRAM.replace('"rhs_batch_dimensions":[]}', '"rhs_batch_dimensions":[]},'
                          '"precision_config":{"operand_precision":["HIGHEST","HIGHEST"]}')
  assert exact != PROGRAM
  assert not {k.name: k for k in hlo.kernels(exact)}["cublas-gemm.3"].fast_accum
  inv = roofline.inventory(PROGRAM, PEAKS)
  assert inv["fp8_fast_accum"] == 1 and roofline.inventory(exact, PEAKS)["fp8_fast_accum"] == 0


def test_gemm_flops_and_bytes_leave_out_the_workspace():
  g = by_name()["cublas-gemm.3"]
  assert g.flops == 2 * 1024 * 4096 * 64
  assert g.bytes == 1024 * 64 + 4096 * 64 + 1024 * 4096 * 4  # FP8 operands, f32 result


def test_a_loop_body_counts_once_per_trip():
  assert by_name()["cublas-gemm.9"].count == 12


def test_a_gather_through_a_convert_reads_what_it_picks():
  k = by_name()
  # the gathered float32 (what memory holds, not the bfloat16 it becomes), indices, result
  assert k["picked"].bytes == 1024 * 4 + 1024 * 4 + 1024 * 4
  assert k["exp"].bytes == 2 * 1024 * 4096 * 4  # a whole read and a whole write


SLICES = """HloModule jit_step, is_scheduled=true

%fused_split (param_0: bf16[1024,3072]) -> (bf16[1024,1024], f32[1024]) {
  %param_0 = bf16[1024,3072]{1,0} parameter(0)
  %convert.1 = f32[1024,3072]{1,0} convert(%param_0)
  %q = f32[1024,1024]{1,0} slice(%convert.1), slice={[0:1024], [0:1024]}
  %k = f32[1024,1024]{1,0} slice(%convert.1), slice={[0:1024], [1024:2048]}
  %qb = bf16[1024,1024]{1,0} convert(%q)
  %c = f32[] constant(0)
  %sum = f32[1024]{0} reduce(%k, %c), dimensions={1}, to_apply=%add
  ROOT %t = (bf16[1024,1024]{1,0}, f32[1024]{0}) tuple(%qb, %sum)
}

ENTRY %main (x: bf16[1024,3072]) -> (bf16[1024,1024], f32[1024]) {
  %x = bf16[1024,3072]{1,0} parameter(0)
  ROOT %f = (bf16[1024,1024]{1,0}, f32[1024]{0}) fusion(%x), kind=kInput, calls=%fused_split
}
"""


def test_slices_of_a_widened_operand_read_it_at_its_own_width():
  # A bfloat16 operand widened to float32 inside the fusion, then split: the kernel reads two
  # thirds of the bfloat16 array from memory (it widens in registers), and writes its results.
  (k,) = hlo.kernels(SLICES)
  assert k.bytes == 2 * 1024 * 1024 * 2 + (1024 * 1024 * 2 + 1024 * 4)


# Muon's momentum step (libtpu): one layer's slice of the stacked momentum read, updated and
# written back in place, its bfloat16 copy a second output of the same fusion.
MOMENTUM = """HloModule jit_step, is_scheduled=true

%fused_momentum (p0: f32[16,1024,1024], p1: f32[1,1024,1024], p2: s32[]) -> (f32[16,1024,1024], bf16[1,1024,1024]) {
  %p0 = f32[16,1024,1024]{2,1,0} parameter(0)
  %p1 = f32[1,1024,1024]{2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %old = f32[1,1024,1024]{2,1,0} dynamic-slice(%p0, %p2, %z, %z), dynamic_slice_sizes={1,1024,1024}
  %new = f32[1,1024,1024]{2,1,0} add(%old, %p1)
  %u = f32[16,1024,1024]{2,1,0} dynamic-update-slice(%p0, %new, %p2, %z, %z)
  %b = bf16[1,1024,1024]{2,1,0} convert(%new)
  ROOT %t = (f32[16,1024,1024]{2,1,0}, bf16[1,1024,1024]{2,1,0}) tuple(%u, %b)
}

ENTRY %main (m: f32[16,1024,1024], g: f32[1,1024,1024], i: s32[]) -> (f32[16,1024,1024], bf16[1,1024,1024]) {
  %m = f32[16,1024,1024]{2,1,0} parameter(0)
  %g = f32[1,1024,1024]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  ROOT %f = (f32[16,1024,1024]{2,1,0}, bf16[1,1024,1024]{2,1,0}) fusion(%m, %g, %i), kind=kLoop, calls=%fused_momentum
}
"""


def test_a_tuple_element_updating_a_buffer_in_place_moves_its_update_not_the_buffer():
  """As a fusion whose root is the dynamic-update-slice: the gradient and index read, the
  momentum's slice read and written, its bfloat16 copy written; not the 64 MiB stack twice."""
  (k,) = hlo.kernels(MOMENTUM)
  update = 1024 * 1024 * 4
  assert k.bytes == update + 4 + 2 * update + update // 2
  assert k.largest == 1024 * 1024


# XLA 0.11 (jax 0.11.2) puts a cuBLAS call that reads a slice of a loop's stacked operand into a
# "dynamic-slice fusion" (the validation head's GEMM, one slice of tokens a trip).
SLICED_GEMM = """HloModule jit_eval_fn, is_scheduled=true

%dynamic-slice-fusion (p0: bf16[8,1,256,64], p1: s32[], p2: bf16[64,1024]) -> (bf16[256,1024], s8[1048576]) {
  %p0 = bf16[8,1,256,64]{3,2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %ds = bf16[1,1,256,64]{3,2,1,0} dynamic-slice(%p0, %p1, %c0, %c0, %c0), dynamic_slice_sizes={1,1,256,64}
  %bc = bf16[256,64]{1,0} bitcast(%ds)
  %p2 = bf16[64,1024]{1,0} parameter(2)
  ROOT %custom-call.59 = (bf16[256,1024]{1,0}, s8[1048576]{0}) custom-call(%bc, %p2), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
}

ENTRY %main (a: bf16[8,1,256,64], i: s32[], w: bf16[64,1024]) -> bf16[256,1024] {
  %a = bf16[8,1,256,64]{3,2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %w = bf16[64,1024]{1,0} parameter(2)
  %dsf = (bf16[256,1024]{1,0}, s8[1048576]{0}) fusion(%a, %i, %w), kind=kCustom, calls=%dynamic-slice-fusion, backend_config={"fusion_backend_config":{"kind":"__custom_fusion","custom_fusion_config":{"name":"dynamic_slice_fusion","kernel_index":0}}}
  ROOT %z = bf16[256,1024]{1,0} get-tuple-element(%dsf), index=0
}
"""


def test_a_cublas_call_fused_with_the_slice_it_reads_is_a_gemm():
  """Priced as the GEMM it is (its FLOPs), reading its slice, not the stacked operand, and writing
  its result, not the workspace: taken for an elementwise fusion it was 10 ms of 'logits passes'
  in the record's H100 eval under jax 0.11.2, and no GEMM."""
  (k,) = hlo.kernels(SLICED_GEMM)
  assert k.kind == "gemm" and k.math == "bf16"
  assert k.flops == 2 * 256 * 1024 * 64
  assert k.bytes == 256 * 64 * 2 + 4 + 64 * 1024 * 2 + 256 * 1024 * 2  # slice, index, w, z
  assert roofline.inventory(SLICED_GEMM, PEAKS)["gemm_calls"]["bf16"] == 1


LAYERS = """HloModule jit_step, is_scheduled=true

%sq (p: bf16[1024,256]) -> bf16[1024,256] {
  %p = bf16[1024,256]{1,0} parameter(0)
  ROOT %m = bf16[1024,256]{1,0} multiply(%p, %p)
}

%body (arg: (s32[], bf16[1024,256])) -> (s32[], bf16[1024,256]) {
  %arg = (s32[], bf16[1024,256]{1,0}) parameter(0)
  %gte = bf16[1024,256]{1,0} get-tuple-element(%arg), index=1
  %sq.2 = bf16[1024,256]{1,0} fusion(%gte), kind=kLoop, calls=%sq, metadata={op_name="jit(step_fn)/while/body/jvp(block_2)/mlp/square"}
  ROOT %t = (s32[], bf16[1024,256]{1,0}) tuple(%gte, %sq.2)
}

%cond (arg.1: (s32[], bf16[1024,256])) -> pred[] {
  %arg.1 = (s32[], bf16[1024,256]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (h: bf16[1024,256], w: bf16[256,256], i: s32[]) -> bf16[1024,256] {
  %h = bf16[1024,256]{1,0} parameter(0)
  %w = bf16[256,256]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %sq.0 = bf16[1024,256]{1,0} fusion(%h), kind=kLoop, calls=%sq, metadata={op_name="jit(step_fn)/jvp(block_0)/mlp/square"}
  %sq.1 = bf16[1024,256]{1,0} fusion(%sq.0), kind=kLoop, calls=%sq, metadata={op_name="jit(step_fn)/jvp(block_11)/mlp/square"}
  %dot.1 = bf16[1024,256]{1,0} dot(%sq.1, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step_fn)/jvp(block_0)/mlp/dot_general"}
  %other = bf16[1024,256]{1,0} fusion(%dot.1), kind=kLoop, calls=%sq
  %init = (s32[], bf16[1024,256]{1,0}) tuple(%i, %other)
  %loop = (s32[], bf16[1024,256]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = bf16[1024,256]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_passes_are_summed_by_the_jax_op_of_every_layer():
  """The estimate's slowest passes by jax op: every layer's (block_0, block_11, a loop's block_2
  three times) as one row, the jit's name dropped, GEMMs left out, an unnamed fusion on its own."""
  inv = roofline.inventory(LAYERS, PEAKS)
  moved = 2 * 1024 * 256 * 2  # a launch reads and writes a bf16 [1024, 256]
  one = moved / PEAKS.bandwidth
  rows = {op: (sec, n, b) for op, sec, n, b in inv["slowest_ops"]}
  assert set(rows) == {"jvp(block_N)/mlp/square", "while/body/jvp(block_N)/mlp/square",
                       "(no op name)"}
  assert rows["jvp(block_N)/mlp/square"] == (pytest.approx(2 * one), 2, moved)
  assert rows["while/body/jvp(block_N)/mlp/square"] == (pytest.approx(3 * one), 3, moved)
  assert rows["(no op name)"] == (pytest.approx(one), 1, moved)
  assert [row[0] for row in inv["slowest_ops"]][0] == "while/body/jvp(block_N)/mlp/square"
  assert inv["passes_s"] == pytest.approx(6 * one)  # every non-GEMM launch, listed or not
  assert [row[0] for row in roofline.inventory(LAYERS, PEAKS, top=1)["slowest_ops"]] == \
      ["while/body/jvp(block_N)/mlp/square"]


def test_the_step_estimate_line_counts_launches_in_words():
  """'(1 launch)', '(2 launches)'; a TPU's are ops ('(1 launches)' was printed)."""
  inv = roofline.inventory(LAYERS, PEAKS)
  line = compile_report.kernel_lines(inv, "gpu")[2]
  assert "(3 launches)" in line and "(2 launches)" in line and "(1 launch)" in line
  assert "(1 op)" in compile_report.kernel_lines(inv, "tpu")[2]


def test_op_names_are_unescaped():
  """An argument's op_name as the HLO text escapes it (batch[\\'inputs\\']) reads as jax
  wrote it, in the kernel inventory and in --peak's rows."""
  text = """HloModule m

ENTRY %main (a: f32[1024,256]) -> f32[1024,256] {
  %a = f32[1024,256]{1,0} parameter(0), metadata={op_name="batch[\\'inputs\\']"}
  ROOT %e = f32[1024,256]{1,0} exponential(%a), metadata={op_name="jit(f)/x[\\'y\\']/exp"}
}
"""
  comps, entry = hlo.parse(text)
  assert [hlo.op_name(i) for i in comps[entry]] == ["batch['inputs']", "x['y']/exp"]
  assert hlo_memory.record(text)[1][0][2] == "jit(f)/x['y']/exp"


def test_passes_lines_list_the_slowest_first_with_their_bytes():
  """nanotext.compile --passes=N: N lines under the estimate, slowest first, each its ms, launch
  count and MiB a launch moves; none without the flag."""
  inv = roofline.inventory(LAYERS, roofline.Peaks(bf16=1e15, bandwidth=1e9))  # 1 GB/s
  assert compile_report.pass_lines(inv, 0) == []
  head, *rows = compile_report.pass_lines(inv, 2)
  # six launches of 1 MiB (a bf16 [1024, 256] read and written) at 1 GB/s: 1.05 ms each
  assert head.startswith("  slowest passes     2 of the non-GEMM launches' 6.3 ms")
  assert len(rows) == 2 and rows[0].endswith("  while/body/jvp(block_N)/mlp/square")
  assert rows[0].split()[:5] == ["3.15", "ms", "3", "x", "1.0"]
  assert rows[1].split()[:5] == ["2.10", "ms", "2", "x", "1.0"]
  assert len(compile_report.pass_lines(inv, 50)) == 1 + 3  # as many as there are
  assert "non-GEMM ops' 6.3 ms" in compile_report.pass_lines(inv, 1, "tpu")[0]  # a TPU runs ops


def test_inventory_counts_and_prices():
  inv = roofline.inventory(PROGRAM, PEAKS, logits_elements=1024 * 4096, logits_bytes=1024 * 4096 * 2,
                      custom_flops=1e9)
  assert inv["launches"] == 6 + 12
  assert inv["gemm_calls"] == {"bf16": 12, "f32": 0, "fp8": 1}
  assert inv["scatters"] == 1 and inv["custom_kernels"] == 1 and inv["collective_launches"] == 1
  # exp reads and writes the logits; `picked` only gathers from them; the GEMM writes them.
  assert inv["logits_kernels"] == 1 and inv["logits_gemms"] == 1
  assert inv["logits_passes"] == 4  # f32 read and write: twice bf16's bytes each
  assert inv["estimate_parts_s"]["logits passes"] == pytest.approx(
      2 * 1024 * 4096 * 4 / PEAKS.bandwidth)
  # The custom kernel at its analytic FLOPs, which outweigh its bytes (2 bf16 [1024, 64] arrays:
  # the one it reads three times, and its output).
  assert 2 * 1024 * 64 * 2 / PEAKS.bandwidth < 1e9 / PEAKS.bf16
  assert inv["estimate_parts_s"]["custom"] == pytest.approx(1e9 / PEAKS.bf16)
  assert inv["estimate_s"] == pytest.approx(sum(inv["estimate_parts_s"].values()))


FUSED_HEAD = """HloModule jit_eval

%head_loss (p0: bf16[256,768], p1: bf16[768,4096]) -> f32[256] {
  %p0 = bf16[256,768]{1,0} parameter(0)
  %p1 = bf16[768,4096]{1,0} parameter(1)
  %dot.1 = f32[256,4096]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %exp.1 = f32[256,4096]{1,0} exponential(%dot.1)
  %zero = f32[] constant(0)
  ROOT %reduce.1 = f32[256]{0} reduce(%exp.1, %zero), dimensions={1}, to_apply=%add
}

ENTRY %main (h: bf16[256,768], w: bf16[96,4096]) -> f32[256] {
  %h = bf16[256,768]{1,0} parameter(0)
  %w = bf16[96,4096]{1,0} parameter(1)
  %all-gather.1 = bf16[768,4096]{1,0} all-gather(%w), dimensions={0}, metadata={op_name="jit(eval)/loss/dot_general"}
  ROOT %fusion.1 = f32[256]{0} fusion(%h, %all-gather.1), kind=kOutput, calls=%head_loss, metadata={op_name="jit(eval)/loss/dot_general"}
}
"""


def test_a_head_gemm_with_the_loss_fused_in_makes_no_pass_over_the_logits():
  """A TPU's chunked validation head: the exp-sum in the GEMM's fusion, the head weight gathered
  (FSDP) for each chunk. The gather, vocab-wide and larger than a chunk's logits, was counted as
  3.4 passes over the logits (the record's eval, eval_loss_chunk=256: 1024 gathers)."""
  inv = roofline.inventory(FUSED_HEAD, PEAKS, logits_elements=256 * 4096,
                           logits_bytes=256 * 4096 * 2, vocab=4096)
  assert inv["collective_launches"] == 1 and inv["gemm_calls"]["bf16"] == 1
  assert (inv["logits_kernels"], inv["logits_gemms"], inv["logits_passes"]) == (0, 1, 0.0)
  assert compile_report.logits_line(inv).split() == [
      "logits", "no", "pass", "over", "the", "logits", "besides", "1", "GEMM:", "the", "loss", "is",
      "fused", "into", "them"]
  few = dict(inv, logits_kernels=6, logits_passes=0.04)  # kernels there, if little of them
  assert compile_report.logits_line(few).endswith("0.0 passes over the logits by 6 kernels, "
                                                  "besides 1 GEMM")
  passes = dict(inv, logits_kernels=2, logits_passes=2.0)
  assert compile_report.logits_line(passes).endswith("2.0 passes over the logits by 2 kernels, "
                                                     "besides 1 GEMM")


def test_a_custom_kernel_outside_attention_is_priced_at_its_own_bytes():
  """An elementwise Pallas kernel (kernels/qk_rope.py) does not hide under the attention
  kernels' FLOPs: it costs its own bytes, its operand passed twice read once."""
  text = """HloModule m

ENTRY %main (a: bf16[1024,64], w: bf16[1024,3,64]) -> bf16[1024,64] {
  %a = bf16[1024,64]{1,0} parameter(0)
  %w = bf16[1024,3,64]{2,1,0} parameter(1)
  %flash = bf16[1024,64]{1,0} custom-call(%a, %a, %a), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/jvp(block_0)/attention/attention_kernel/flash_gpu_forward/pallas_call"}
  ROOT %norm = (bf16[1024,64]{1,0}, bf16[1024,64]{1,0}) custom-call(%w, %w), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/jvp(block_0)/attention/qk_norm_rope/pallas_call"}
}
"""
  inv = roofline.inventory(text, PEAKS, custom_flops=1e9)
  own = (1024 * 3 * 64 + 2 * 1024 * 64) * 2 / PEAKS.bandwidth
  assert inv["estimate_parts_s"]["custom"] == pytest.approx(1e9 / PEAKS.bf16 + own)


def test_a_pallas_kernel_named_gemm_is_priced_as_one():
  """kernels/fp8_head.py's GEMM (e4m3 [M, K] x [K, N]) with its epilogue's outputs: a GEMM of
  our own at the FP8 peak or its bytes, in the GEMM counts, not among the passes; a kernel not
  named *_gemm stays a custom kernel."""
  text = """HloModule m

ENTRY %main (a: f8e4m3fn[4096,768], b: f8e4m3fn[768,50304]) -> (bf16[4096,50304], f32[4096,393]) {
  %a = f8e4m3fn[4096,768]{1,0} parameter(0)
  %b = f8e4m3fn[768,50304]{1,0} parameter(1)
  ROOT %head = (bf16[4096,50304]{1,0}, f32[4096,393]{1,0}) custom-call(%a, %b), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/jvp(loss)/fp8_head_gemm/pallas_call"}, backend_config={grid_x = 32 : i32, ir = "", name = "fp8_head_gemm", num_warps = 8 : i32}
}
"""
  [k] = hlo.kernels(text)
  assert (k.kind, k.math, k.own, k.flops) == ("gemm-fp8", "fp8", True, 2.0 * 4096 * 768 * 50304)
  moved = 4096 * 768 + 768 * 50304 + 4096 * 50304 * 2 + 4096 * 393 * 4
  assert k.bytes == moved
  inv = roofline.inventory(text, PEAKS)
  assert inv["gemm_calls"]["fp8"] == inv["own_gemms"] == 1 and inv["custom_kernels"] == 0
  assert inv["estimate_parts_s"]["gemm"] == pytest.approx(
      max(k.flops / PEAKS.fp8, moved / PEAKS.bandwidth))
  assert not inv["slowest_ops"] and "1 Pallas" in compile_report.kernel_lines(inv, "gpu")[0]
  [other] = hlo.kernels(text.replace('name = "fp8_head_gemm"', 'name = "fp8_head_sums"'))
  assert (other.kind, other.own, other.flops) == ("custom", False, 0.0)


def test_collectives_count_an_async_pair_once():
  c = hlo.collectives(PROGRAM)
  assert c["all-reduce"] == {"count": 1, "bytes": 4096 * 64 * 4}


def test_an_instruction_may_span_lines():
  """TPU kernels carry configs with line breaks: the computation goes on after them."""
  text = """HloModule m

ENTRY %main (a: bf16[8,128]) -> bf16[8,128] {
  %a = bf16[8,128]{1,0} parameter(0)
  %k = bf16[8,128]{1,0} custom-call(%a), custom_call_target="tpu_custom_call", backend_config={"x":"{
}}, metadata={op_name="kernel"}
  ROOT %f = bf16[8,128]{1,0} fusion(%k), kind=kLoop, calls=%fused
}
"""
  comps, entry = hlo.parse(text)
  assert [i.name for i in comps[entry]] == ["a", "k", "f"]
  assert [k.kind for k in hlo.kernels(text)] == ["custom", "fusion"]


def test_a_pallas_gemm_may_read_its_second_operand_transposed():
  """kernels/relu2_mlp.py's gradient: dy [M, K] times w [N, K] transposed, h read in its
  epilogue; a bf16 GEMM of our own, counted as such in the report."""
  text = """HloModule m

ENTRY %main (dy: bf16[4096,768], w: bf16[3072,768], h: bf16[4096,3072]) -> bf16[4096,3072] {
  %dy = bf16[4096,768]{1,0} parameter(0)
  %w = bf16[3072,768]{1,0} parameter(1)
  %h = bf16[4096,3072]{1,0} parameter(2)
  ROOT %dh = bf16[4096,3072]{1,0} custom-call(%dy, %w, %h), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/transpose(jvp(block_0))/mlp/relu2_grad_gemm/pallas_call"}, backend_config={grid_x = 32 : i32, ir = "", name = "relu2_grad_gemm", num_warps = 8 : i32}
}
"""
  [k] = hlo.kernels(text)
  assert (k.kind, k.math, k.own, k.flops) == ("gemm", "bf16", True, 2.0 * 4096 * 768 * 3072)
  inv = roofline.inventory(text, PEAKS)
  assert inv["own_gemm_calls"] == {"bf16": 1, "f32": 0, "fp8": 0}
  assert "GEMMs 1 bf16 (1 Pallas), 0 f32, 0 FP8 |" in compile_report.kernel_lines(inv, "gpu")[0]
  # Operands that are no [M, K] x [K or N, ...] pair: not a GEMM to price.
  [odd] = hlo.kernels(text.replace("bf16[3072,768]", "bf16[3072,512]"))
  assert (odd.kind, odd.own) == ("custom", False)


def test_a_dot_written_as_a_convolution_counts_its_real_multiply_adds():
  """libtpu writes attention's batch and heads as a window over an input dilated by its size, and
  a small projection as a window padded on both sides: only the window positions that meet real
  input count, not every position of the kernel (batch x heads, or 64, times too many)."""
  text = """HloModule m

%fused_scores (p0: bf16[2,256,4,64], p1: bf16[2,256,4,64]) -> f32[2,4,256,256] {
  %p0 = bf16[2,256,4,64]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %p1 = bf16[2,256,4,64]{3,2,1,0:T(8,128)(2,1)} parameter(1)
  ROOT %convolution-base-dilated.46 = f32[2,4,256,256]{2,3,1,0:T(8,128)} convolution(%p0, %p1), window={size=2x4 stride=1x3 lhs_dilate=2x4}, dim_labels=0b1f_0o1i->01bf
}

ENTRY %main (q: bf16[2,256,4,64], x: bf16[64,8,32], w: bf16[64,32,16], y: bf16[2,256,768], z: bf16[2,256,256]) -> f32[2,4,256,256] {
  %q = bf16[2,256,4,64]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %x = bf16[64,8,32]{2,1,0:T(8,128)(2,1)} parameter(1)
  %w = bf16[64,32,16]{2,1,0:T(8,128)(2,1)} parameter(2)
  %y = bf16[2,256,768]{2,1,0:T(8,128)(2,1)} parameter(3)
  %z = bf16[2,256,256]{2,1,0:T(8,128)(2,1)} parameter(4)
  %padded = bf16[127,8,16]{2,1,0:T(8,128)(2,1)} convolution(%x, %w), window={size=64 pad=63_63}, dim_labels=0bf_0io->0bf
  %x1 = bf16[1,8,32]{2,1,0:T(8,128)(2,1)} slice(%x), slice={[0:1], [0:8], [0:32]}
  %taps = bf16[64,8,16]{2,1,0:T(8,128)(2,1)} convolution(%x1, %w), window={size=64 pad=63_63}, dim_labels=0bf_0io->0bf
  %wgrad = bf16[768,256,1]{1,0,2:T(8,128)(2,1)} convolution(%y, %z), window={size=2}, dim_labels=0fb_0io->bf0
  %proj = bf16[2,256,256]{2,1,0:T(8,128)(2,1)} convolution(%y, %wgrad), window={size=1}, dim_labels=0bf_io0->0bf
  ROOT %scores = f32[2,4,256,256]{2,3,1,0:T(8,128)} fusion(%q, %q), kind=kOutput, calls=%fused_scores
}
"""
  flops = {k.name: k.flops for k in hlo.kernels(text)}
  assert flops["scores"] == 2 * (2 * 4) * 256 * 256 * 64  # batch x heads x queries x keys x dim
  assert flops["padded"] == 2 * 8 * 16 * 32 * 64 * 64  # each of 64 inputs meets each of 64 taps
  assert flops["taps"] == 2 * 8 * 16 * 32 * 64  # its one input meets each tap once, not 64 times
  assert flops["wgrad"] == flops["proj"] == 2 * 512 * 768 * 256  # no holes, no padding: as before


def test_a_convolutions_window_positions_that_meet_input_are_counted_exactly():
  """hlo_conv's closed count against every (output, window) position tried one by one."""
  import itertools
  for n, size, stride, low, ld, rd in itertools.product((1, 3, 5), (1, 2, 4), (1, 2, 3),
                                                        (0, 1, 3), (1, 2, 3), (1, 2)):
    out = max(1, ((n - 1) * ld + 2 * low - (size - 1) * rd) // stride + 1)
    brute = sum(1 for o in range(out) for k in range(size)
                if (p := o * stride + k * rd - low) % ld == 0 and 0 <= p <= (n - 1) * ld)
    assert hlo_conv._pairs(n, size, out, stride, low, ld, rd) == brute, (n, size, stride, low)


def test_libtpus_own_custom_calls_are_no_kernels():
  """A scratch buffer and a note on gather indices launch nothing: neither counted as custom
  kernels nor a reason to price the attention FLOPs as one; a Mosaic kernel still counts."""
  text = """HloModule m

ENTRY %main (a: bf16[8,128], i: s32[2048]) -> bf16[8,128] {
  %a = bf16[8,128]{1,0:T(8,128)(2,1)} parameter(0)
  %i = s32[2048]{0:T(1024)} parameter(1)
  %custom-call.36 = f32[128]{0:T(128)S(1)} custom-call(), custom_call_target="AllocateBuffer", backend_config={"flag_configs":[]}
  %custom-call.43 = s32[2048]{0:T(1024)} custom-call(%i), custom_call_target="AssumeGatherIndicesInBound"
  ROOT %k = bf16[8,128]{1,0:T(8,128)(2,1)} custom-call(%a), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/jvp(block_0)/attention/attention_kernel/pallas_call"}
}
"""
  assert [k.name for k in hlo.kernels(text)] == ["k"]
  mosaic_free = text.replace('"tpu_custom_call"', '"GatherScatterIndicesBitpacked"')
  inv = roofline.inventory(mosaic_free, PEAKS, custom_flops=1e9)
  assert inv["custom_kernels"] == 0 and inv["estimate_parts_s"]["custom"] == 0


def test_a_matmul_in_a_fusion_nested_in_another_is_a_gemm():
  """libtpu nests attention's score matmul inside the fusion of its softmax: the outer fusion is
  a GEMM launch with the nested matmul's FLOPs, not a fusion without any."""
  text = """HloModule m

%fused_scores (p0: bf16[2,256,4,64], p1: bf16[2,256,4,64]) -> f32[2,4,256,256] {
  %p0 = bf16[2,256,4,64]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %p1 = bf16[2,256,4,64]{3,2,1,0:T(8,128)(2,1)} parameter(1)
  ROOT %convolution-base-dilated.46 = f32[2,4,256,256]{2,3,1,0:T(8,128)} convolution(%p0, %p1), window={size=2x4 stride=1x3 lhs_dilate=2x4}, dim_labels=0b1f_0o1i->01bf
}

%fused_softmax (q0: bf16[2,256,4,64], q1: bf16[2,256,4,64]) -> f32[2,4,256,256] {
  %q0 = bf16[2,256,4,64]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %q1 = bf16[2,256,4,64]{3,2,1,0:T(8,128)(2,1)} parameter(1)
  %fusion.19 = f32[2,4,256,256]{2,3,1,0:T(8,128)} fusion(%q0, %q1), kind=kOutput, calls=%fused_scores
  ROOT %exp.53 = f32[2,4,256,256]{2,3,1,0:T(8,128)} exponential(%fusion.19)
}

ENTRY %main (q: bf16[2,256,4,64]) -> f32[2,4,256,256] {
  %q = bf16[2,256,4,64]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  ROOT %softmax = f32[2,4,256,256]{2,3,1,0:T(8,128)} fusion(%q, %q), kind=kLoop, calls=%fused_softmax
}
"""
  [k] = hlo.kernels(text)
  assert (k.kind, k.math, k.flops) == ("gemm", "bf16", 2 * (2 * 4) * 256 * 256 * 64)
