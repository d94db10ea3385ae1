"""Compiling for an H100 on a CPU machine (nanotext.compile --topology=h100): what the GPU program
must be, checked where no GPU is (CI). Needs the gpu-compile extra (the jax CUDA plugin); its
tests are skipped without it. ../shared/GPU.md says how this was found to work.
"""

import json
import sys

import jax
import pytest

from conftest import BASE, REPO, SPEEDRUN, TINY, run_cli
from nanotext import compile as nt_compile
from nanotext import gpus, topology
from nanotext.errors import UserError
from nanotext.model.kernels import per_device

RECORD = f"{REPO}/configs/speedrun_record.yml"
# The record's features (document masks, block windows on a schedule, value embeddings, U-net
# skips, the FP8 head) at a size that compiles in seconds.
SMALL = ["model.num_layers=4", "model.d_model=256", "model.num_heads=2", "model.head_dim=128",
         "model.mlp_dim=512", "model.vocab_size=1024", "model.embed_rows=1000", "model.align=0",
         "train.batch_size=1", "train.seq_len=2048", "train.eval_seq_len=4096", "train.steps=20",
         "attention.window=512", "data.source=synthetic", "data.tokenizer=none", "data.eot_id=0"]


def compiled(path, overrides, which="last,eval", target="h100") -> dict:
  """{program name: record} of nanotext.compile for `target`."""
  _, _, recs = nt_compile.run_compile(path, overrides, target, which, log=lambda s: None)
  return {r["name"].split("@")[0]: r for r in recs}


def test_gpu_targets():
  h = topology.parse("h100-8")
  assert h.platform == "gpu" and h.num_chips == 8 and h.gpu.capability == (9, 0)
  assert topology.parse("H100").count == 1 and topology.parse("a100-80gb").gpu.sms == 108
  text = gpus.GPUS["h100"].target_config()
  for field in ("core_count: 132", "cuda_compute_capability { major: 9 minor: 0 }",
                'device_description_str: "NVIDIA H100 80GB HBM3"', "runtime_version"):
    assert field in text
  for bad in ("h100-3", "h100-16"):
    with pytest.raises(UserError, match="one host holds"):
      topology.parse(bad)
  with pytest.raises(UserError, match="unknown topology 'v100'.*h100-8"):
    topology.parse("v100")


def test_usable_memory_is_jaxs_pool(monkeypatch):
  total = gpus.GPUS["h100"].memory_bytes
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  assert topology.parse("h100").memory_bytes == int(0.75 * total)  # 59.4 GiB, as measured
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
  assert topology.parse("h100").memory_bytes == int(0.9 * total)
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "lots")
  with pytest.raises(UserError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
    topology.parse("h100").memory_bytes


@pytest.mark.parametrize("fraction, share", [(".75", "75%"), (".004", "0.4%"), (".0004", "<0.1%")])
def test_the_pool_line_names_a_small_share(monkeypatch, fraction, share):
  """XLA_PYTHON_CLIENT_MEM_FRACTION=.004 (0.3 GiB of an H100) was 'JAX's pool, 0% of 79.1 GiB'."""
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", fraction)
  assert topology.parse("h100").memory_what == f"JAX's pool, {share} of 79.1 GiB"


def test_without_the_plugin_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "jax_plugins.xla_cuda13", None)  # import now fails
  with pytest.raises(UserError, match=r"pip install -e '\.\[gpu-compile\]'"):
    topology.devices(topology.parse("h100"))


@pytest.mark.gpu_compile
@pytest.mark.parametrize("impl,fp8,own", [("flash_gpu", True, False), ("flash_gpu", True, True),
                                          ("blocked", False, False), ("xla", True, False)])
def test_every_kernel_path_compiles_for_an_h100(impl, fp8, own):
  """`own`: with nanotext's opt-in kernels taken (per_device.OWN_KERNELS), which must keep
  compiling for an H100 though a run takes them only opted in."""
  # 2 layers (one long window, one short): the kernels asserted do not depend on depth. At the
  # run's matmul precision (conftest's `highest` would make every FP8 GEMM an exact one).
  with jax.default_matmul_precision("default"), \
      per_device.opting_in(*(per_device.OWN_KERNELS if own else ())):
    recs = compiled(SPEEDRUN, SMALL + ["model.num_layers=2", f"attention.impl={impl}",
                                       f"model.fp8_head={fp8}".lower()])
  train, evaluation = recs["train"], recs["eval"]
  for r in (train, evaluation):
    assert "error" not in r and r["fits"], r
  inv = train["kernels"]
  assert inv["gemm_calls"]["fp8"] == (3 if fp8 else 0)  # the head's forward and two backward
  # The forward cuBLASLt's with fast accumulation (the record's use_fast_accum=True), or opted
  # in a Pallas GEMM with the loss's exp-sum inside (kernels/fp8_head.py); the two backward
  # cuBLASLt's without it (the record's use_fast_accum=False)
  assert inv["own_gemm_calls"]["fp8"] == (1 if fp8 and own else 0)
  assert inv["fp8_fast_accum"] == (1 if fp8 and not own else 0)
  # Opted in, each layer's squared ReLU inside two Pallas GEMMs (kernels/relu2_mlp.py): the
  # up-projection's and its input gradient's.
  assert inv["own_gemm_calls"]["bf16"] == (2 * 2 if own else 0)
  # The token and value tables' backward: one scatter (the blocked kernel gathers key strips,
  # and their gradient scatters too).
  assert inv["scatters"] == 1 if impl != "blocked" else inv["scatters"] > 1
  # Pallas as Triton, not XLA loops, a layer: the QK-norm and rotation's forward and backward
  # (kernels/qk_rope.py) and flash_gpu's forward, dq and dk/dv kernels; opted in, flash_gpu's
  # forward and one backward alone with the norm and rotation inside; XLA's attention or the
  # blocked kernel beside qk_rope's two
  assert inv["custom_kernels"] == 2 * (5 if impl == "flash_gpu" and not own else 2)
  assert evaluation["kernels"]["gemm_calls"]["fp8"] == 0  # evaluation: the bf16 head
  assert 0 < inv["estimate_s"] and train["runtime_windows"]  # one program for every stage


@pytest.mark.fast
@pytest.mark.gpu_compile
def test_cudnn_compiles_or_says_why_in_one_line():
  """cuDNN attention needs cuDNN's own wheel even to trace: without it, one line, no traceback."""
  try:
    recs = compiled(SPEEDRUN, SMALL + ["attention.impl=cudnn", "attention.block_windows=false",
                                       "attention.doc_mask=false"], "eval")
  except UserError as e:
    assert "cudnn" in str(e).lower() and "\n" not in str(e)
    assert "backend is cpu" not in str(e)  # the target is the H100, not this CPU host
  else:
    assert "error" not in recs["eval"], recs["eval"]


@pytest.mark.gpu_compile
def test_auto_says_when_it_takes_xla_for_want_of_cudnn_here(monkeypatch):
  """Where cuDNN's attention does not build on this host (no cuDNN wheel), auto compiles xla for
  the GPU; a GPU machine would run cudnn, another program: the output says so."""
  from nanotext.model.kernels import cudnn
  monkeypatch.setattr(cudnn, "problem", lambda *a: "RuntimeError: cuDNN not found.")
  lines = []
  tiny = ["model.num_layers=2", "model.d_model=128", "model.num_heads=1", "model.head_dim=128",
          "model.vocab_size=512", "train.seq_len=256", "train.batch_size=2"]
  nt_compile.run_compile(BASE, tiny, "h100", "eval", log=lines.append)
  note = [l for l in lines if l.startswith("note: attention auto took xla")]
  assert len(note) == 1 and "cuDNN not found" in note[0], lines
  lines.clear()
  nt_compile.run_compile(BASE, tiny + ["attention.impl=xla", "train.batch_size=4"], "h100",
                         "eval", log=lines.append)  # another program: no cache hit
  assert not [l for l in lines if l.startswith("note:")], lines  # xla as asked: no note


@pytest.mark.fast
def test_the_cudnn_kernel_asks_the_target_not_the_host():
  """Traced for a GPU on a CPU host (nanotext.compile --topology=h100), the cuDNN kernel is the
  GPU's: it asked the host's default backend, and where cuDNN's wheels were installed (the
  `auto` choice for a dense config then) compiling for an H100 failed with 'the backend is
  cpu'."""
  import functools
  import jax
  import jax.numpy as jnp
  from nanotext.model.kernels import cudnn, per_device
  x = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
  attend = functools.partial(cudnn.cudnn_attention, scale=0.125)
  with pytest.raises(UserError, match="the backend is cpu"):
    jax.eval_shape(attend, x, x, x)
  with per_device.building_for("gpu"):
    try:
      jax.eval_shape(attend, x, x, x)
    except UserError as e:
      pytest.fail(f"refused a GPU target: {e}")
    except Exception:  # noqa: BLE001 -- jax's own cuDNN checks, where cuDNN is not installed
      pass


@pytest.mark.gpu_compile
@pytest.mark.slow
def test_the_record_program_on_an_h100():
  """speedrun_record.yml at the record's per-GPU work (one 49,152-token row) for one H100: it
  compiles, fits with room, and its kernels are what the design says. The ceilings are today's
  program with a little room; a change that breaks one changed the GPU program: look at
  `python -m nanotext.compile configs/speedrun_record.yml train.batch_size=1 --topology=h100`."""
  recs = compiled(RECORD, ["train.batch_size=1"])
  train, evaluation = recs["train"], recs["eval"]
  for r in (train, evaluation):
    assert "error" not in r and r["headroom"] >= 0.10, r
    # The memory plan within 15% of what the compiler allocates (train 0.99, eval 0.95; the
    # eval 0.87 while the plan had the value embeddings flash_gpu reads looked up in each
    # reader, 1.20 while it traced flash_gpu as the blocked kernel with QK-norm and rotation
    # before it, 1.32 while it kept every GEMM output added to the residual stream since the
    # first; the train plan 1.14 while it held every head slice's output at the loss).
    assert 0.85 <= r["estimate_bytes_per_chip"] / r["total_bytes_per_chip"] <= 1.15, r
  inv = train["kernels"]
  slices = inv["gemm_calls"]["fp8"] // 3
  assert slices > 1 and inv["gemm_calls"]["fp8"] == 3 * slices  # the FP8 head, in slices
  # cuBLAS's GEMMs and XLA's fusions: nanotext's own Pallas GEMMs (the FP8 head's forward, the
  # MLP's squared ReLU) and flash_gpu with QK-norm, rotation and the value mix inside are
  # opt-in since an H200 ran the record's step at 186.6 ms with them, 113.3 ms without
  # (2026-12-04; their program: 912 launches, 54.5 ms estimated, 17.27 GiB).
  assert inv["own_gemm_calls"] == {"fp8": 0, "bf16": 0, "f32": 0}
  assert inv["fp8_fast_accum"] == slices  # the forward's, as the record's use_fast_accum=True
  assert inv["gemm_calls"]["f32"] == 0 and inv["scatters"] == 1
  # 1,027 launches and 71.1 ms: QK-norm and rotation one kernel each way (kernels/qk_rope.py)
  # beside flash_gpu's forward, dq and dk/dv kernels and the backward's row term (1,005 and
  # 70.6 ms with one backward kernel, 1.26x slower on an H200); each head slice's float32
  # logits read by XLA's fusions for the exp-sum and for z. Newton-Schulz's X X^T written as
  # bf16 by its GEMM, the head's weight gradient summed inside its FP8 GEMMs (C, beta 1),
  # rotary's backward fused (1,128 launches and 78.1 ms before those three).
  assert inv["launches"] <= 1040
  # the float32 logits read twice and z, dz written in two layouts (the FP8 GEMMs besides)
  assert inv["logits_passes"] <= 5.5
  assert inv["estimate_s"] <= 0.072
  assert evaluation["kernels"]["logits_passes"] <= 1.5


@pytest.mark.gpu_compile
def test_each_row_length_is_planned_at_its_own_length():
  """A train.seq_len_start warmup compiles a program per row length; the plan chooses remat and
  chunks for the widest but estimates each program at its own rows (modded_nanogpt_jax.yml's
  first stage was planned at the second's size, 2.61x what the H100 program allocates). At this
  small shape the plan runs high on both stages alike (measured 1.38x and 1.47x); planned at the
  widest, the first stage was 4.8x."""
  small = ["model.num_layers=2", "model.d_model=256", "model.num_heads=2", "model.head_dim=128",
           "model.vocab_size=1024", "model.mlp_dim=1024", "train.batch_size=16",
           "train.grad_accum=1", "train.seq_len=2048", "train.seq_len_start=1024",
           "train.seq_len_step=1024", "train.steps=8", "data.source=synthetic",
           "data.tokenizer=none", "data.eot_id=0",
           "attention.impl=xla"]  # what `auto` picks where cuDNN is not installed: dense
  _, _, recs = nt_compile.run_compile(f"{REPO}/configs/modded_nanogpt_jax.yml", small, "h100",
                                      "first,last", log=lambda s: None)
  first, last = (r["estimate_bytes_per_chip"] / r["total_bytes_per_chip"] for r in recs)
  assert [r["seq_len"] for r in recs] == [1024, 2048]
  assert recs[0]["estimate_bytes_per_chip"] < 0.5 * recs[1]["estimate_bytes_per_chip"]
  assert 1 / 1.15 <= first / last <= 1.15, (first, last)


@pytest.mark.gpu_compile
def test_a_looped_head_is_planned_with_every_slices_output_kept():
  """Past head_loss.UNROLL slices the head runs as a loop, which keeps every slice's output z
  for the backward; the plan took them as freed one by one, as the unrolled slices' are: 2.3 GiB
  planned against 14.9 compiled at this shape (128 rows of 1,024 tokens, 32 slices)."""
  from nanotext.model import head_loss
  rows = ["model.num_layers=2", "model.d_model=128", "model.num_heads=1", "model.head_dim=128",
          "model.mlp_dim=512", "model.align=0", "train.seq_len=1024", "train.batch_size=128",
          "train.eval_seq_len=1024", "data.source=synthetic", "data.tokenizer=none",
          "data.eot_id=0"]
  assert head_loss.slices(128, 1024, 50304, "gpu") > head_loss.UNROLL
  r = compiled(RECORD, rows, "first")["train"]
  assert 0.85 <= r["estimate_bytes_per_chip"] / r["total_bytes_per_chip"] <= 1.15, r


@pytest.mark.gpu_compile
def test_a_dense_attention_eval_is_planned_as_it_compiles():
  """modded_nanogpt_jax.yml's eval with dense `xla` attention: its fusions recompute a softmax's
  masked scores and exponentials from the float32 scores and store the probabilities once, as
  the bfloat16 the next GEMM reads; value embeddings are looked up inside each reader. The plan
  counted both float32 arrays and every lookup: 1.35x the compiler at this shape, 1.18x at the
  shipped one (fusion.FORWARD)."""
  small = ["model.num_layers=4", "model.d_model=256", "model.num_heads=4", "model.head_dim=64",
           "model.vocab_size=1024", "model.mlp_dim=1024", "train.batch_size=16",
           "train.seq_len=2048", "train.steps=8", "data.source=synthetic",
           "data.tokenizer=none", "data.eot_id=0",
           "attention.impl=xla"]  # what `auto` picks where cuDNN is not installed
  r = compiled(f"{REPO}/configs/modded_nanogpt_jax.yml", small, "eval")["eval"]
  assert 0.85 <= r["estimate_bytes_per_chip"] / r["total_bytes_per_chip"] <= 1.15, r


@pytest.mark.gpu_compile
def test_fsdp_programs_are_planned_with_each_layers_weights_gathered_at_its_use():
  """Under FSDP on one 8-GPU host a program gathers each layer's weights for its own GEMMs and
  frees them after (a train step gathers them again for its backward). The plan counted every
  parameter gathered at once: shakespeare.yml's eval 1.42x the compiler and its train step 1.24x
  (the speedrun configs' evals 1.17-1.18x); with each weight alive from its first reader to its
  last in the eval, and the head's and one block's weights at the train step's loss, 1.03x and
  0.96x."""
  # As a run compiles them: conftest's float32 matmul precision made shakespeare.yml's float32
  # GEMMs another program (and its compile 3x longer).
  with jax.default_matmul_precision("default"):
    progs = compiled(f"{REPO}/configs/shakespeare.yml", [], "last,eval", target="h100-8")
  for r in progs.values():
    assert r["collectives"]["all-gather"]["count"] > 0, r
    assert 0.85 <= r["estimate_bytes_per_chip"] / r["total_bytes_per_chip"] <= 1.15, r


@pytest.mark.gpu_compile
def test_a_step_without_remat_looks_its_rows_up_again_where_they_are_read():
  """Without remat no block boundary holds looked-up rows: XLA fuses a lookup into the readers
  of what is made from it (the scaled embedding rows, rotary rows), in the backward pass too.
  Counted as kept, shakespeare.yml's train step on one H100 planned 1.16x the compiler (the
  record's one-row step 20.6 GiB against 20.36)."""
  with jax.default_matmul_precision("default"):  # as a run compiles it (see above)
    r = compiled(f"{REPO}/configs/shakespeare.yml", [], "last")["train"]
  assert 0.85 <= r["estimate_bytes_per_chip"] / r["total_bytes_per_chip"] <= 1.15, r


@pytest.mark.gpu_compile
def test_cli_reports_kernels_and_writes_json(tmp_path):
  out = tmp_path / "h100.jsonl"
  proc = run_cli("nanotext.compile", SPEEDRUN, *SMALL, "--topology=h100", "--programs=eval",
                 f"--json={out}", "--peak", "--passes=12")
  assert proc.returncode == 0, proc.stderr
  assert "verdict: fits h100" in proc.stdout and "a roofline lower bound" in proc.stdout
  assert "not priced" in proc.stdout and "alive at the peak" in proc.stdout
  # JSON, strictly: no NaN (XLA gives no FLOPs or bytes for a GPU program: null)
  rec = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in --json"))
  assert rec["name"] == "eval" and rec["kernels"]["launches"] > 0 and rec["target"] == "h100"
  # --passes: the estimate's slowest non-GEMM passes by jax op, as many lines as asked for (or
  # as there are), slowest first; the record holds every pass.
  lines = proc.stdout.splitlines()
  at = next(i for i, l in enumerate(lines) if l.startswith("  slowest passes     "))
  rows = rec["kernels"]["slowest_ops"][:12]
  assert 3 < len(rows) <= 12, rows  # the 12 slowest, or every op where there are fewer
  shown = lines[at + 1:at + 1 + len(rows)]
  assert [l.split("MiB  ", 1)[1] for l in shown] == [op for op, _, _, _ in rows]
  ms = [float(l.split()[0]) for l in shown]
  assert ms == sorted(ms, reverse=True) and ms[0] > 0
  every = rec["kernels"]["slowest_ops"]
  assert sum(s for _, s, _, _ in every) == pytest.approx(rec["kernels"]["passes_s"])
  # --peak: the walk of the schedule against the compiler's temporaries (measured 0.96), the
  # largest value first, named by the jax op that made it.
  assert 0.7 <= rec["live_peak_bytes"] / rec["temp"] <= 1.1, rec
  sizes = [b for b, _, _ in rec["live_at_peak"]]
  assert sizes == sorted(sizes, reverse=True) and "eval_fn" in rec["live_at_peak"][0][2]


@pytest.mark.gpu_compile
def test_the_fp8_head_stays_fp8_gemms_under_fsdp_on_8_gpus():
  """On one 8-GPU host (mesh.fsdp=-1 as shipped: the head's [d_model, vocab] weight split along
  d_model) each of the head's GEMMs is a cuBLASLt FP8 GEMM: the weight's FP8 codes are gathered,
  not its dequantized float32 values. Gathered dequantized, the input gradient's GEMM was a
  float32 one over a float32 copy of the output gradient, every slice's alive at once (the
  record on h100-8: 27.40 GiB, 82.9 ms estimated; 20.96 GiB and 68.0 ms gathering codes)."""
  train = compiled(SPEEDRUN, SMALL + ["model.num_layers=2", "train.batch_size=8"], "last",
                   target="h100-8")["train"]
  assert "error" not in train and train["collectives"]["all-gather"]["count"] > 0, train
  gemms = train["kernels"]["gemm_calls"]
  assert gemms["f32"] == 0 and gemms["fp8"] == 3 * (gemms["fp8"] // 3) > 0, gemms


@pytest.mark.gpu_compile
def test_newton_schulz_writes_x_xt_as_bfloat16_on_an_h100():
  """Muon's Newton-Schulz rounds each X X^T to bf16 at once, so on a GPU that GEMM writes bf16
  itself: no float32 [n, n] output and convert kernel per iteration (the record's H100 step:
  1,042 -> 1,027 launches, 71.6 -> 71.1 ms estimated). A @ A and B @ X keep float32 outputs:
  they are combined in float32 before their one rounding."""
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from nanotext import hlo, optim
  from nanotext.model.kernels import per_device
  mesh = Mesh(np.array(gpus.devices(gpus.parse("h100"))[:1]), ("x",))
  g = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=NamedSharding(mesh, P()))
  with per_device.building_for("gpu"):
    lowered = jax.jit(lambda g: optim.newton_schulz(g, optim.NS_COEFFS, 5)).trace(g).lower(
        lowering_platforms=("cuda",))
  text = lowered.compile(compiler_options=gpus.COMPILER_OPTIONS).as_text()
  comps, _ = hlo.parse(text)
  # Each cuBLAS call's result (dtype, dims); its workspace comes after it.
  outputs = [hlo.shapes(ins.type)[0] for body in comps.values() for ins in body
             if hlo.custom_call_target(ins).startswith("__cublas")]
  assert len(outputs) == 15, outputs  # 3 GEMMs an iteration, unrolled
  square = [dtype for dtype, dims in outputs if dims == (256, 256)]  # X X^T and A @ A
  assert sorted(square) == ["bf16"] * 5 + ["f32"] * 5, outputs
  assert all(dtype == "f32" for dtype, dims in outputs if dims == (256, 512)), outputs  # B @ X


@pytest.mark.gpu_compile
def test_a_warmup_stage_counts_its_passes_over_the_logits():
  """A train.seq_len_start stage's head works on rows of its own length: compile sized its
  logits at train.seq_len and printed '0.0 passes over the logits by 0 kernels, besides 0
  GEMMs' for it (4.0 for the full-length stage)."""
  r = compiled(BASE, TINY + ["model.num_layers=1", "model.dtype=bfloat16",
                             "train.seq_len_start=8"], "first")["train"]
  assert r["seq_len"] == 8 and "error" not in r, r
  inv = r["kernels"]
  assert inv["logits_passes"] > 0 and inv["logits_kernels"] > 0 and inv["logits_gemms"] > 0


@pytest.mark.gpu_compile
def test_an_a100_program_is_planned_with_its_own_cublas_workspace():
  """XLA gives a cuBLAS call 4 MiB of workspace before Hopper: the plan added Hopper's 32 MiB
  on an A100 too (a tiny train step compiled to 8.3 MiB, planned 36.1)."""
  r = compiled(BASE, TINY + ["model.dtype=bfloat16"], "last", "a100-80gb")["train"]
  assert abs(r["estimate_bytes_per_chip"] - r["total_bytes_per_chip"]) < 2**20, r


@pytest.mark.gpu_compile
def test_a_chunked_fp8_head_gathers_its_codes_once_and_keeps_fp8_gemms_on_8_gpus(tmp_path):
  """Under train.loss_chunk on one 8-GPU host the head weight's e4m3 codes are gathered once a
  step, and each chunk's four head GEMMs (the forward's, the backward pass's recomputed one and
  its two) are FP8 ones. The chunks made the codes inside their loop: XLA gathered the float32
  weight (4x the bytes), the backward pass quantized it again in every chunk, and the forward's
  quantization, hoisted out of the loop, lost the GEMM its FP8 rewrite: float32 GEMMs on
  operands XLA then left unrounded, a loss the FP8 head does not compute."""
  chunks, D, V = 8, 256, 1024  # SMALL's d_model and vocab_size
  with jax.default_matmul_precision("default"):
    _, _, recs = nt_compile.run_compile(
        SPEEDRUN, SMALL + ["model.num_layers=2", "train.batch_size=8", "model.remat=none",
                           f"train.loss_chunk={2048 // chunks}"], "h100-8", "last",
        log=lambda s: None, hlo_dir=str(tmp_path))
  assert "error" not in recs[0], recs[0]
  gemms = recs[0]["kernels"]["gemm_calls"]
  assert gemms["f32"] == 0 and gemms["fp8"] == 4 * chunks, gemms
  from nanotext import hlo
  comps, _ = hlo.parse((tmp_path / "train.hlo").read_text())
  gathered = [dtype for body in comps.values() for ins in body
              if ins.opcode in ("all-gather", "all-gather-start")
              for dtype, dims in hlo.shapes(ins.type) if sorted(dims) == [D, V]]
  assert gathered == ["f8e4m3fn"], gathered
