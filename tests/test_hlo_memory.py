"""nanotext.hlo_memory: what a scheduled HLO program holds at once (nanotext.compile --peak)."""

import pytest

from nanotext import hlo_memory

pytestmark = pytest.mark.fast

KB4 = 4096  # bytes of one f32[1024]

PROGRAM = """HloModule m, is_scheduled=true

%fused (p0: f32[1024], p1: f32[8], p2: s32[]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  %p1 = f32[8]{0} parameter(1)
  %p2 = s32[] parameter(2)
  ROOT %u = f32[1024]{0} dynamic-update-slice(%p0, %p1, %p2)
}

%two (q0: f32[1024]) -> (f32[1024], f32[8]) {
  %q0 = f32[1024]{0} parameter(0)
  %e = f32[1024]{0} exponential(%q0)
  %n = f32[8]{0} slice(%q0), slice={[0:8]}
  ROOT %r = (f32[1024]{0}, f32[8]{0}) tuple(%e, %n)
}

%body (s: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %s = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %v = f32[1024]{0} get-tuple-element(%s), index=1
  %big = f32[4096]{0} broadcast(%v), dimensions={}
  %w = f32[1024]{0} slice(%big), slice={[0:1024]}
  ROOT %t = (s32[], f32[1024]{0}) tuple(%i, %w)
}

%cond (s: (s32[], f32[1024])) -> pred[] {
  %s = (s32[], f32[1024]{0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[1024], k: s32[]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %k = s32[] parameter(1)
  %x = f32[1024]{0} exponential(%a), metadata={op_name="jit(f)/exp"}
  %pair = (f32[1024]{0}, f32[8]{0}) fusion(%x), kind=kLoop, calls=%two
  %y = f32[1024]{0} get-tuple-element(%pair), index=0
  %small = f32[8]{0} slice(%y), slice={[0:8]}
  %u = f32[1024]{0} fusion(%y, %small, %k), kind=kLoop, calls=%fused
  %z = f32[1024]{0} add(%x, %u), metadata={op_name="jit(f)/add"}
  %init = (s32[], f32[1024]{0}) tuple(%k, %z)
  %loop = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[1024]{0} get-tuple-element(%loop), index=1
}
"""


def test_the_peak_counts_what_is_alive_together_and_nothing_else():
  """The loop's body makes 16 KB and 4 KB from its state while z (4 KB) is alive: the peak. Before
  it, x, y and z are alive together where z is made (see the next test)."""
  top, alive = hlo_memory.peak(PROGRAM)
  body = 4 * KB4 + KB4  # the broadcast and the slice made from it
  assert top == KB4 + body > 3 * KB4  # the loop's, above the point where z is made
  assert [b.bytes for b in alive] == [body, KB4]  # the body's peak, z alive across the loop
  assert alive[1].op_name == "jit(f)/add" and alive[1].opcode == "add"
  assert (alive[0].opcode, alive[0].op_name) == ("while", "peak inside body (loop)")


def test_the_rows_add_up_to_the_peak_a_workspace_and_a_loop_body_among_them():
  """A cuBLAS call's workspace (nothing reads it) and a loop body's own peak are in the total:
  --peak lists them as rows (it listed z alone, 4 KB of 24), the values beyond ROWS as one line."""
  gemm = ('  %g = (f32[1024]{0}, s8[65536]{0}) custom-call(%z), custom_call_target='
          '"__cublas$gemm", metadata={op_name="jit(f)/dot_general"}\n'
          '  %gz = f32[1024]{0} get-tuple-element(%g), index=0\n'
          '  %init = (s32[], f32[1024]{0}) tuple(%k, %gz)\n')
  text = PROGRAM.replace("  %init = (s32[], f32[1024]{0}) tuple(%k, %z)\n", gemm)
  top, alive = hlo_memory.peak(text)
  assert top == 65536 + 2 * KB4 == sum(b.bytes for b in alive)  # at the GEMM: z, its product
  assert alive[0].bytes == 65536 and alive[0].op_name == "workspace of jit(f)/dot_general " \
      "(never read)" and alive[0].opcode == "custom-call"
  top, rows = hlo_memory.record(PROGRAM)
  assert sum(r[0] for r in rows) == top and rows[0][2] == "peak inside body (loop)"
  lines = hlo_memory.lines(top, rows, lambda b: f"{b} B")
  assert lines[1].split()[:3] == ["20480", "B", "while"]
  many = "".join(f'  %m{i} = f32[1024]{{0}} negate(%a)\n' for i in range(12))
  many += "  ROOT %s = (" + ", ".join(["f32[1024]{0}"] * 12) + ") tuple(" + \
      ", ".join(f"%m{i}" for i in range(12)) + ")\n}\n"
  text = "HloModule m, is_scheduled=true\n\nENTRY %main (a: f32[1024]) -> f32[1024] {\n" \
      "  %a = f32[1024]{0} parameter(0)\n" + many
  top, rows = hlo_memory.record(text)
  assert top == 12 * KB4 and len(rows) == hlo_memory.ROWS
  assert hlo_memory.lines(top, rows, str)[-1].split() == [str(4 * KB4), "(the", "other", "values",
                                                          "alive)"]


def test_values_alive_together_before_the_loop():
  """Without the loop the peak is where z is made: x, y (updated in place by the
  dynamic-update-slice fusion: no new buffer) and z; the multi-output fusion's second output
  is never read (scratch: alive only while the fusion runs)."""
  text = PROGRAM.replace("  %loop = (s32[], f32[1024]{0}) while(%init), condition=%cond, "
                         "body=%body\n", "").replace("get-tuple-element(%loop)",
                                                     "get-tuple-element(%init)")
  top, alive = hlo_memory.peak(text)
  assert top == 3 * KB4  # the slice died into the update before z
  assert sorted(b.op_name for b in alive if b.bytes == KB4) == ["", "jit(f)/add", "jit(f)/exp"]


def test_an_async_start_counts_its_result_once():
  text = """HloModule m, is_scheduled=true

ENTRY %main (a: f32[1024]) -> f32[4096] {
  %a = f32[1024]{0} parameter(0)
  %s = (f32[1024]{0}, f32[4096]{0}) all-gather-start(%a), dimensions={0}
  %d = f32[4096]{0} all-gather-done(%s)
  ROOT %e = f32[4096]{0} exponential(%d)
}
"""
  top, _ = hlo_memory.peak(text)
  assert top == 2 * 4 * KB4  # the gathered result and the output, not the operand again


def test_what_a_tpu_keeps_on_chip_is_not_counted():
  """A layout in memory space 1 (`S(1)`, a TPU's VMEM) is not device memory: the compiler's HBM
  temporaries leave it out (the tiny configs' v6e-8 programs keep most of their values there)."""
  text = """HloModule m, is_scheduled=true

ENTRY %main (a: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %v = f32[1024]{0:T(256)S(1)} exponential(%a)
  %h = f32[1024]{0:T(256)} negate(%v)
  ROOT %e = f32[1024]{0} add(%h, %v)
}
"""
  top, alive = hlo_memory.peak(text)
  assert top == 2 * KB4 and [b.opcode for b in alive] == ["negate", "add"]


def test_a_tpu_value_counts_as_its_layouts_tiles_pad_it():
  """A TPU pads an array's minor dimension to its tile's lanes and the next to its sublanes: a
  per-head f32[64,2,32] with head_dim minor is 4x its size, one laid out with 64 minor is not (a
  d_model 64 model's v5e eval walked to 2.39 GiB unpadded, 5.21 padded, compiled 5.50)."""
  text = """HloModule m, is_scheduled=true

ENTRY %main (a: f32[64,2,32]) -> f32[64,2,32] {
  %a = f32[64,2,32]{2,1,0:T(8,128)} parameter(0)
  %q = f32[64,2,32]{2,1,0:T(8,128)} exponential(%a)
  %s = f32[64,2,32]{0,2,1:T(8,128)} negate(%q)
  %v = f32[40]{0:T(128)} slice(%s), slice={[0:40]}
  ROOT %e = f32[64,2,32]{2,1,0:T(8,128)} add(%q, %s)
}
"""
  top, alive = hlo_memory.peak(text)
  by = {b.opcode: b.bytes for b in alive}
  assert by["exponential"] == 64 * 8 * 128 * 4  # 2 heads to 8 sublanes, 32 to 128 lanes
  assert by["negate"] == 128 * 32 * 2 * 4  # 64 minor: to 128 lanes; 32 next: whole sublanes
  assert top == sum(by.values())
