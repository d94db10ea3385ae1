"""Trip counts of while loops whose backend config does not state them (nanotext.hlo_loops).

Hand-written HLO in the form libtpu prints after optimization: the micro-batch loop of
train.grad_accum with no known_trip_count, its counter set and stepped through copies.
"""

import pytest

from nanotext import compile_report, hlo, hlo_loops, roofline

pytestmark = pytest.mark.fast

LOOP = """HloModule jit_step, is_scheduled=true

%mm (a: bf16[256,512], b: bf16[512,512]) -> bf16[256,512] {
  %a = bf16[256,512]{1,0:T(8,128)(2,1)} parameter(0)
  %b = bf16[512,512]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %d = bf16[256,512]{1,0:T(8,128)(2,1)} convolution(%a, %b), dim_labels=bf_io->bf
}

%body (arg: (s32[], bf16[256,512], bf16[512,512])) -> (s32[], bf16[256,512], bf16[512,512]) {
  %arg = (s32[]{:T(128)}, bf16[256,512]{1,0}, bf16[512,512]{1,0}) parameter(0)
  %i = s32[]{:T(128)} get-tuple-element(%arg), index=0
  %x = bf16[256,512]{1,0} get-tuple-element(%arg), index=1
  %w = bf16[512,512]{1,0} get-tuple-element(%arg), index=2
  %y = bf16[256,512]{1,0} fusion(%x, %w), kind=kOutput, calls=%mm
  %i.copy = s32[]{:T(128)} copy(%i)
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%i.copy, %one)
  ROOT %t = (s32[]{:T(128)}, bf16[256,512]{1,0}, bf16[512,512]{1,0}) tuple(%next, %y, %w)
}

%cond (arg.1: (s32[], bf16[256,512], bf16[512,512])) -> pred[] {
  %n = s32[]{:T(128)} constant(LIMIT)
  %arg.1 = (s32[]{:T(128)}, bf16[256,512]{1,0}, bf16[512,512]{1,0}) parameter(0)
  %i.1 = s32[]{:T(128)} get-tuple-element(%arg.1), index=0
  ROOT %lt = pred[]{:T(512)} compare(COMPARE), direction=DIRECTION
}

ENTRY %main (h: bf16[256,512], w: bf16[512,512], s: s32[]) -> bf16[256,512] {
  %h = bf16[256,512]{1,0} parameter(0)
  %w.0 = bf16[512,512]{1,0} parameter(1)
  %s = s32[]{:T(128)} parameter(2)
  %zero = s32[]{:T(128)} constant(0)
  %start = s32[]{:T(128)} copy(%START)
  %init = (s32[]{:T(128)}, bf16[256,512]{1,0}, bf16[512,512]{1,0}) tuple(%start, %h, %w.0)
  %loop = (s32[]{:T(128)}, bf16[256,512]{1,0}, bf16[512,512]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %r = bf16[256,512]{1,0} get-tuple-element(%loop), index=1
}
"""
GEMM = 2.0 * 256 * 512 * 512
PEAKS = roofline.Peaks(bf16=1e15, bandwidth=1e12)


def program(limit=4, compare="%i.1, %n", direction="LT", start="%zero"):
  return LOOP.replace("LIMIT", str(limit)).replace("COMPARE", compare) \
      .replace("DIRECTION", direction).replace("START", start)


@pytest.mark.parametrize("limit, compare, direction, trips", [
    (4, "%i.1, %n", "LT", 4), (2, "%i.1, %n", "LT", 2), (4, "%i.1, %n", "LE", 5),
    (4, "%n, %i.1", "GT", 4), (4, "%i.1, %n", "NE", 4), (0, "%i.1, %n", "LT", 0)])
def test_a_counted_loop_without_a_stated_count_runs_its_body_that_often(limit, compare,
                                                                         direction, trips):
  """The micro-batch loop of grad_accum=4 is four GEMMs, not one (libtpu states no count)."""
  text = program(limit, compare, direction)
  assert hlo_loops.loops(hlo.parse(text)[0]) == [("loop", trips, False)]
  gemm = [k for k in hlo.kernels(text) if k.kind == "gemm"]
  assert [k.count for k in gemm] == [max(trips, 1)]  # 0: unknown and known alike count once
  inv = roofline.inventory(text, PEAKS)
  assert inv["gemm_flops"] == max(trips, 1) * GEMM and inv["gemm_calls"]["bf16"] == max(trips, 1)


def test_a_collective_in_a_loop_counts_as_often_as_the_loop_goes_round():
  """The collectives line counted each instruction of the text once: FSDP's weight gathers of a
  grad_accum=4 step read as one micro-batch's (52 all-gathers at 2 and at 4 micro-batches)."""
  text = program().replace(
      "  %i.copy =", "  %g = bf16[512,512]{1,0} all-gather(%w), dimensions={0}\n  %i.copy =") \
      .replace("  %zero =", "  %sum = bf16[256,512]{1,0} all-reduce(%h), to_apply=%mm\n  %zero =")
  c = hlo.collectives(text)
  assert c["all-gather"] == {"count": 4, "bytes": 4 * 512 * 512 * 2}
  assert c["all-reduce"] == {"count": 1, "bytes": 256 * 512 * 2}
  assert hlo.collectives(program(start="%s").replace(  # a count nothing says: once
      "  %i.copy =", "  %g = bf16[512,512]{1,0} all-gather(%w), dimensions={0}\n  %i.copy ="))[
          "all-gather"]["count"] == 1


def test_a_loop_whose_count_nothing_says_is_counted_once_and_reported():
  """A counter that starts at a runtime value: the step estimate and FLOPs line say so."""
  text = program(start="%s")
  assert hlo_loops.loops(hlo.parse(text)[0]) == [("loop", 0, False)]
  inv = roofline.inventory(text, PEAKS)
  assert inv["unknown_loops"] == 1 and inv["gemm_calls"]["bf16"] == 1
  rec = record(inv, xla=GEMM)
  out = compile_report.describe(rec)
  assert "(no ratio: 1 loop(s) of unknown trip count, counted once)" in out
  assert "(short: 1 loop(s) of unknown trip count counted once)" in out
  assert "x)" not in out.split("FLOPs per device")[1].splitlines()[0]


def test_the_flops_line_counts_the_hlo_s_gemms_where_xla_counts_a_body_once():
  """XLA's cost analysis of libtpu's grad_accum=4 step counts one micro-batch: the ratio to the
  analytic FLOPs comes from the HLO's GEMMs instead, 1.00x, not 0.25x."""
  inv = roofline.inventory(program(), PEAKS)
  assert inv["unstated_loops"] == 1 and inv["unknown_loops"] == 0
  line = flops_line(record(inv, xla=GEMM))
  assert "GEMMs in the HLO 5.37e+08 (1.00x)" in line
  stated = program().replace("body=%body", 'body=%body, backend_config={"known_trip_count":'
                             '{"n":"4"}}')
  inv = roofline.inventory(stated, PEAKS)  # stated (GPU): XLA's own count is right
  assert inv["unstated_loops"] == 0 and "XLA 5.37e+08 (1.00x)" in flops_line(record(inv, 4 * GEMM))


def flops_line(rec) -> str:
  return next(l for l in compile_report.describe(rec).splitlines() if "FLOPs per device" in l)


def record(inv, xla) -> dict:
  return {"name": "train", "compile_s": 1.0, "argument": 0, "output": 0, "alias": 0, "temp": 0,
          "generated_code": 0, "total_bytes_per_chip": 0, "hbm_bytes_per_chip": 2**30,
          "headroom": 1.0, "fits": True, "flops_xla_per_chip": xla,
          "bytes_accessed_per_chip": float("nan"), "collectives": {},
          "flops_analytic_per_chip": 4 * GEMM, "kernels": inv, "platform": "tpu"}
