"""Compiling for a TPU slice on a CPU machine (nanotext.compile): tiny models, a few seconds each.

Tests that compile need libtpu (`pip install -e '.[tpu]'`, as CI does) and are skipped without
it. libtpu compiles run one after another in this process and its subprocesses.
"""

import json
import os
import sys
import types

import jax
import pytest

from conftest import BASE, SPEEDRUN, run_cli
from test_lean_step import head_weight_gathers
from nanotext import compile as nt_compile
from nanotext import compile_report, program_names, topology
from nanotext.errors import UserError

# Splash needs seq_len a multiple of 128; one layer keeps each TPU compile to seconds.
SMALL = ["model.num_layers=1", "model.d_model=128", "model.num_heads=2", "model.head_dim=64",
         "model.vocab_size=512", "train.batch_size=16", "train.seq_len=128", "train.steps=4",
         "data.source=synthetic", "data.tokenizer=none", "data.eot_id=0"]


def test_topology_names():
  assert topology.parse("v6e-8").libtpu_name == "v6e:2x4"
  assert topology.parse("v5p-16").libtpu_name == "v5:2x2x2"  # 16 cores = 8 megacore chips
  assert topology.parse("v4-8").num_chips == 4
  assert topology.parse("V5E-16").shape == (4, 4)
  for bad in ("v6e-7", "v7-8", "tpu", "v5p-3"):
    with pytest.raises(UserError, match="unknown topology.*known: v4-8, "):
      topology.parse(bad)


@pytest.mark.fast
def test_programs_follow_the_window_schedule():
  from nanotext import config
  cfg = config.load(SPEEDRUN, ["train.steps=1770"])
  progs = program_names.programs(cfg)
  assert [p[0] for p in progs][:2] == ["train@128", "train@256"]
  assert progs[13][0] == "train@1792" and progs[-1][0] == "eval@1792"
  # 14 window stages, and as many evals (eval_windows=step), as the trainer compiles them
  assert len(progs) == 28 and progs[14][0] == "eval@128"
  assert [p[0] for p in program_names.select(progs, "first,last,eval")] == \
      ["train@128", "train@1792", "eval@1792"]
  with pytest.raises(UserError, match="unknown program"):
    program_names.select(progs, "train@999")


# 1024-token rows: the long window (LS layers) reaches the row length at step 918, so its layers
# turn plain causal while the short window grows on through 512..896, the long window's earlier
# sizes.
REACHES = ["model.num_layers=2", "train.seq_len=1024", "train.eval_seq_len=0"]


@pytest.mark.fast
def test_each_stage_has_its_own_name_once_the_long_window_reaches_the_row():
  from nanotext import config
  progs = nt_compile.programs(config.load(SPEEDRUN, REACHES))
  names = [p[0] for p in progs]
  assert len(set(names)) == len(names) == 22, names  # 11 window stages, train and eval
  assert names[6:8] == ["train@896", "train@causal+512"] and names[10] == "train@causal+896"
  assert names[11] == "eval@128" and names[-1] == "eval@causal+896"
  assert progs[6][1].windows == (896, 384) and progs[7][1].windows == (0, 512)
  assert [(p[0], p[2]) for p in nt_compile.select(progs, "last")] == \
      [("train@causal+896", (1705, 1769))]
  assert [p[2] for p in nt_compile.select(progs, "train@512")] == [(394, 524)]
  assert [p[0] for p in nt_compile.select(progs, "first,last,eval")] == \
      ["train@128", "train@causal+896", "eval@causal+896"]
  runtime = nt_compile.programs(config.load(SPEEDRUN, [*REACHES, "train.seq_len_start=512"]),
                                "xla")
  assert [p[0] for p in runtime] == ["train@128..causal+384x512", "train@896..causal+896x1024",
                                     "eval"]
  assert runtime[0][1].describe() == "windows 128..causal+384, runtime"


@pytest.mark.fast
@pytest.mark.parametrize("spec, why", [
    ("", "--programs='' is empty: give all, or a comma list of first, last, eval"),
    (",", "--programs=',' has an empty item"), ("eval,,last", "has an empty item"),
    ("all,bogus", "unknown program.s. bogus; choose from all, first, last, eval, train@128, "),
    ("eval,train@999", "unknown program.s. train@999; choose from .*train@causal.896, eval@128, ")])
def test_bad_program_lists_are_refused(spec, why):
  from nanotext import config
  cfg = config.load(SPEEDRUN, REACHES)
  with pytest.raises(UserError, match=why):
    nt_compile.select(nt_compile.programs(cfg), spec)
  with pytest.raises(UserError, match=why):  # before jax loads, either kind of kernel
    nt_compile.check_programs(cfg, spec)


@pytest.mark.fast
@pytest.mark.parametrize("impl, spec, why", [
    ("blocked", "train@128", r"train@128; choose from all, first, last, train, eval$"),
    ("xla", "eval,train@causal+896", r"train@causal\+896; choose from all, first, last, train, "),
    ("splash", "train", r"^--programs names unknown program\(s\) train; choose from all, first, "
                        r"last, eval, train@128, .*train@causal\+896, eval@128, .*"
                        r"eval@causal\+896$")],
    ids=["blocked", "xla", "splash"])
def test_the_precheck_takes_only_the_programs_of_the_kernel_named(impl, spec, why):
  """attention.impl=blocked (windows at run time: one `train` program) took train@128, a name of
  the static-window kernels, and splash took `train`, until jax loaded and the target's kernel
  was resolved. A kernel named is every target's: its names alone pass; auto takes either."""
  from nanotext import config
  cfg = config.load(SPEEDRUN, REACHES + [f"attention.impl={impl}"])
  with pytest.raises(UserError, match=why):
    nt_compile.check_programs(cfg, spec)
  nt_compile.check_programs(cfg, "train@128" if impl == "splash" else "train,eval")
  auto = config.load(SPEEDRUN, REACHES)
  nt_compile.check_programs(auto, spec)


def test_a_program_of_the_other_kernel_family_is_refused_before_the_build():
  """train@128 names a static-window program; attention.impl=blocked takes the windows at run
  time (one `train` program). The precheck cannot tell the kernel before jax loads, so it took
  the name, and the run was planned and built (the header and plan printed) before the refusal."""
  lines = []
  overrides = REACHES + ["attention.impl=blocked", "data.source=synthetic", "data.tokenizer=none",
                         "data.eot_id=0"]
  with pytest.raises(UserError, match=r"^--programs names unknown program\(s\) train@128; "
                                      r"choose from all, first, last, train, eval$"):
    nt_compile.run_compile(SPEEDRUN, overrides, "v6e-8", "train@128", log=lines.append)
  assert lines == []


def test_an_unknown_program_exits_2_before_jax_loads():
  proc = run_cli("nanotext.compile", BASE, *SMALL, "--topology=v6e-8", "--programs=eval,bogus")
  assert proc.returncode == 2 and proc.stdout == "", proc.stderr
  assert proc.stderr.startswith("nanotext: error: --programs names unknown program(s) bogus; "
                                "choose from all, first, last, train, eval")
  assert len(proc.stderr.splitlines()) == 1


def test_each_eval_program_of_a_window_schedule_compiles_as_an_eval_step():
  """With train.eval_windows=step validation runs at each window stage's windows, one program per
  stage (eval@128, ...) where the kernel takes static windows; compile listed and compiled the
  final one alone. An eval@ program compiles as the eval step: the parameters in, nothing
  donated."""
  from nanotext import wiring
  small = ["model.num_layers=2", "model.d_model=64", "model.num_heads=2", "model.head_dim=32",
           "model.vocab_size=512", "model.align=0", "train.batch_size=8", "train.seq_len=256",
           "train.eval_seq_len=0", "train.steps=4", "train.eval_every=2", "attention.window=256",
           "attention.window_start=64", "attention.window_block=64", "data.source=synthetic",
           "data.tokenizer=none", "data.eot_id=0"]
  run = wiring.prepare(SPEEDRUN, small, devices=jax.devices()[:1])
  progs = nt_compile.programs(run.cfg)  # static windows: the programs of splash or cudnn
  evals = [(name, program) for name, program, _ in progs if name.startswith("eval")]
  assert [name for name, _ in evals] == ["eval@64", "eval@128", "eval@causal+128"], progs
  assert [p[0] for p in nt_compile.select(progs, "eval")] == ["eval@causal+128"]  # the final
  rec = nt_compile.compile_program(run, *evals[0], 2**40)
  assert "error" not in rec and rec["alias"] == 0, rec


def test_a_warmup_stages_logits_are_its_own_rows():
  """A train.seq_len_start stage cuts each row into shorter ones, run as that many more
  micro-batches: its head works on rows of its own length. compile sized them at train.seq_len
  and found no kernel over the logits (`0.0 passes over the logits by 0 kernels`)."""
  from nanotext import wiring
  run = wiring.prepare(BASE, ["model.num_layers=1", "model.d_model=64", "model.num_heads=2",
                              "model.head_dim=32", "model.vocab_size=512", "model.align=0",
                              "train.batch_size=8", "train.seq_len=32", "train.seq_len_start=8",
                              "data.source=synthetic", "data.tokenizer=none", "data.eot_id=0"],
                       devices=jax.devices()[:1])
  (_, short, _), (_, full, _), (_, evaluation, _) = nt_compile.programs(run.cfg, run.impl)
  assert (short.seq_len, full.seq_len) == (8, 32)
  whole = 8 * 32 * 512 * 2  # every token's bf16 logits, whatever the rows
  assert nt_compile.logits_size(run, short, True) == (8 * 8 * 512, whole, 512)
  assert nt_compile.logits_size(run, full, True) == (8 * 32 * 512, whole, 512)
  assert nt_compile.logits_size(run, evaluation, False) == (8 * 32 * 512, whole, 512)


@pytest.mark.fast
def test_small_estimates_are_printed_in_microseconds_and_counts_in_words():
  """A tiny program's step estimate read '0.0 ms (gemm 0.0 + other 0.0 ms)', and '1 kernels,
  besides 1 GEMMs'."""
  calls = {"bf16": 1, "f32": 0, "fp8": 0}
  inv = {"gemm_calls": calls, "own_gemm_calls": dict(calls, bf16=0), "launches": 9, "custom_kernels": 0,
         "cudnn_calls": 0, "fusions": 8, "scatters": 0, "collective_launches": 0, "copies": 0,
         "logits_passes": 2.0, "logits_kernels": 1, "logits_gemms": 1, "estimate_s": 23e-6,
         "estimate_parts_s": {"gemm": 11e-6, "other": 12e-6}, "passes_s": 12e-6,
         "slowest_ops": [("loss/log", 4e-6, 1, 2**20)]}
  _, logits, estimate, _ = compile_report.kernel_lines(inv, "gpu")
  assert logits.endswith("2.0 passes over the logits by 1 kernel, besides 1 GEMM")
  assert "step estimate      23.0 us, a roofline lower bound" in estimate
  assert "(gemm 11.0 + other 12.0 us)" in estimate and "loss/log 4.00 us (1 launch)" in estimate
  head, row = compile_report.pass_lines(inv, 1)
  assert "launches' 12.0 us, by jax op" in head and row.split()[:2] == ["4.00", "us"]
  slow = dict(inv, estimate_s=0.0711, estimate_parts_s={"gemm": 0.034, "other": 0.0371})
  assert "71.1 ms, a roofline" in compile_report.kernel_lines(slow, "gpu")[2]


@pytest.mark.fast
def test_verdict_names_the_largest_program_or_those_that_failed():
  rec = lambda name, gib, fits: {"name": name, "total_bytes_per_chip": gib * 2**30,
                                 "hbm_bytes_per_chip": 16 * 2**30, "fits": fits}
  ok, line = compile_report.verdict([rec("train", 9.6, True), rec("eval", 1.0, True)], "v6e-8",
                                    0.1)
  assert ok and line == ("verdict: fits v6e-8: 2 program(s), largest train at 9.60 GiB of "
                         "16.00 GiB per device (40.0% headroom, >= 10% asked)")
  ok, line = compile_report.verdict([rec("train", 15.0, False), rec("eval", 1.0, True)], "h100",
                                    0.1)
  assert not ok and line.startswith("train: needs up to 15.00 GiB per device but h100 has")
  ok, line = compile_report.verdict([rec("train", 15.0, False)], "h100", 0.995)
  assert line.endswith("and 99.5% is kept free")  # was '100%'
  ok, line = compile_report.verdict([{**rec("eval", 1.0, True), "error": "x"}], "h100", 0.1)
  assert not ok and line.startswith("eval failed to compile for h100")
  assert compile_report.gib(3 * 2**20) == "3.0 MiB" and compile_report.gib(2**30) == "1.00 GiB"
  # rounded down: 9.96% against 10% asked read "10.0% headroom: does NOT fit"
  assert compile_report.headroom(0.0996) == "9.9% headroom"


def test_lockfile_message_is_one_clear_line():
  msg = topology.libtpu_problem('ABORTED: Internal error when accessing libtpu multi-process '
                                'lockfile. Run "$ sudo rm /tmp/libtpu_lockfile".')
  assert "another process" in msg and "/tmp/libtpu_lockfile" in msg and "\n" not in msg


def test_without_libtpu_says_how_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "libtpu", None)  # `import libtpu` now raises ImportError
  with pytest.raises(UserError, match=r"pip install -e '\.\[tpu\]'"):
    topology.devices(topology.parse("v6e-8"))


@pytest.mark.fast
@pytest.mark.parametrize("on_tpu", [False, True])
def test_the_accelerator_type_is_the_targets_off_a_tpu_host(monkeypatch, on_tpu):
  """A type left in the environment (an earlier compile in this process, or in the one that
  started it) does not describe another target; on a TPU host the host's own type stays."""
  from jax.experimental import topologies
  seen = []
  monkeypatch.setattr(topology, "host_has_tpu", lambda: on_tpu)
  monkeypatch.setitem(sys.modules, "libtpu", types.ModuleType("libtpu"))  # not needed installed
  monkeypatch.setattr(topologies, "get_topology_desc", lambda **kw: seen.append(
      (kw["topology_name"], os.environ["TPU_ACCELERATOR_TYPE"])) or
      type("Desc", (), {"devices": []})())
  for key in ("TPU_SKIP_MDS_QUERY", "TPU_WORKER_HOSTNAMES", "ALLOW_MULTIPLE_LIBTPU_LOAD"):
    monkeypatch.delenv(key, raising=False)
  monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-16")
  for name in ("v6e-8", "v4-8"):
    topology.devices(topology.parse(name))
  assert seen == ([("v6e:2x4", "v5p-16"), ("v4:2x2x1", "v5p-16")] if on_tpu else
                  [("v6e:2x4", "v6e-8"), ("v4:2x2x1", "v4-8")])


def test_unknown_topology_exits_2():
  proc = run_cli("nanotext.compile", BASE, *SMALL, "--topology=v6e-9")
  assert proc.returncode == 2, proc.stderr
  assert "nanotext: error: unknown topology 'v6e-9'; known:" in proc.stderr
  assert "Traceback" not in proc.stderr


@pytest.mark.tpu
def test_fsdp_shards_parameters_an_eighth_of_dp():
  """Per-chip argument bytes of the eval program (params + batch) for DP=8 and FSDP=8."""
  def args_bytes(mesh):
    _, sl, recs = nt_compile.run_compile(BASE, SMALL + mesh, "v6e-8", "eval", log=lambda s: None)
    batch = 2 * 16 * 128 * 4 // 8  # inputs + targets, int32, split over 8 chips either way
    return recs[0]["argument"] - batch
  dp = args_bytes(["mesh.data=8", "mesh.fsdp=1"])
  fsdp = args_bytes(["mesh.data=1", "mesh.fsdp=8"])
  assert 0.11 < fsdp / dp < 0.14, (fsdp, dp)  # 1/8, plus the few replicated gains and biases


@pytest.mark.tpu
def test_a_mesh_axis_that_shards_nothing_is_named_on_the_header_line():
  """mesh.tensor=2 under rules that never name tensor: train's start-up line says every array is
  replicated over it, compile's said only 'mesh data=1 fsdp=4 tensor=2'."""
  lines = []
  nt_compile.run_compile(BASE, SMALL + ["mesh.tensor=2", "mesh.fsdp=4", "mesh.rules=[[batch, "
                                        "[data, fsdp]], [embed, fsdp]]"], "v6e-8", "eval",
                         log=lines.append)
  (header,) = [line for line in lines if line.startswith("compiling ")]
  assert ("mesh data=1 fsdp=4 tensor=2 (tensor=2 shards no array of this model under mesh.rules: "
          "everything is replicated over it), attention") in header


@pytest.mark.tpu
def test_a_kernel_that_repeats_is_generated_once_on_a_tpu(monkeypatch):
  """programs.TPU_OPTIONS: four layers' identical kernels make less program code than without
  the options; a libtpu that does not know an option compiles without it."""
  from nanotext import programs

  def code_bytes():
    _, _, recs = nt_compile.run_compile(BASE, SMALL + ["model.num_layers=4"], "v6e-8", "eval",
                                        log=lambda s: None)
    return recs[0]["generated_code"]
  deduplicated = code_bytes()
  monkeypatch.setattr(programs, "TPU_OPTIONS", {"xla_tpu_no_such_option": True})
  plain = code_bytes()
  assert deduplicated < 0.8 * plain, (deduplicated, plain)


@pytest.mark.tpu
def test_tpu_compile_uses_mosaic_kernels_and_reports(tmp_path):
  out, hlo = tmp_path / "fit.jsonl", tmp_path / "hlo"
  proc = run_cli("nanotext.compile", BASE, *SMALL, "--topology=v5p-16",
                 f"--json={out}", f"--hlo_dir={hlo}")
  assert proc.returncode == 0, proc.stderr
  assert "verdict: fits v5p-16" in proc.stdout
  # The optimized HLO, and libtpu's own buffer assignment and memory report of each program.
  for name in ("train", "eval"):
    assert "ENTRY" in (hlo / f"{name}.hlo").read_text()
    (report,) = (hlo / name).glob("*memory-usage-report.txt")
    assert "Total bytes" in report.read_text()
  recs = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["name"] for r in recs] == ["train", "eval"]
  for r in recs:
    assert r["fits"] and 0 < r["total_bytes_per_chip"] < r["hbm_bytes_per_chip"]
    assert r["tpu_custom_calls"] > 0  # splash as Mosaic, not the interpreter's HLO loops
  assert recs[0]["collectives"]["all-gather"]["count"] > 0  # FSDP gathers parameters
  assert 0.5 < recs[0]["flops_xla_per_chip"] / recs[0]["flops_analytic_per_chip"] < 2


@pytest.mark.tpu
def test_a_chunked_validation_loss_gathers_the_head_weight_once(tmp_path):
  """libtpu left the FSDP gather of the head weight in the eval step's chunk loop: the record's
  eval (train.eval_loss_chunk=256) on v6e-8 gathered it 1,024 times, 83 GiB a step."""
  chunked = SMALL + ["model.vocab_size=640", "mesh.fsdp=8", "train.eval_loss_chunk=32"]
  nt_compile.run_compile(BASE, chunked, "v6e-8", "eval", log=lambda s: None, hlo_dir=tmp_path)
  assert head_weight_gathers((tmp_path / "eval.hlo").read_text(), 640, 128) == 1


@pytest.mark.tpu
def test_too_big_for_the_chip_exits_2():
  # Whole-row validation logits (a 4 GiB head slice per chip) that the memory plan lets through,
  # against 90% asked free: compiled, and the compiler's figure is the verdict.
  big = SMALL + ["train.batch_size=4096", "model.vocab_size=32768", "train.eval_loss_chunk=0"]
  proc = run_cli("nanotext.compile", BASE, *big, "--topology=v5e-4", "--programs=eval",
                 "--min_headroom=0.9")
  assert proc.returncode == 2, proc.stdout + proc.stderr
  last = proc.stderr.strip().splitlines()[-1]
  assert last.startswith("nanotext: error: eval: needs up to ") and "v5e-4 has 15.75 GiB" in last
  assert "90% is kept free" in last
  # Only what lowers a forward pass: no remat or micro-batches for the eval step.
  assert "train.eval_loss_chunk=64" in last and "train.batch_size" in last
  assert "model.remat" not in last and "train.grad_accum" not in last


@pytest.mark.tpu
def test_a_config_that_cannot_fit_is_refused_before_compiling():
  """speedrun.yml at 4,096 rows for v6e-8 compiled 19 minutes without a verdict: the memory
  estimate refuses it before anything compiles, naming the micro-batching that would fit."""
  proc = run_cli("nanotext.compile", SPEEDRUN, "train.batch_size=4096", "--topology=v6e-8",
                 timeout=600)
  lines = [l for l in proc.stderr.splitlines() if l.startswith("nanotext: error:")]
  assert proc.returncode == 2 and len(lines) == 1, proc.stderr
  assert "the train step ~" in lines[0] and "TPU v6 lite HBM" in lines[0], lines[0]
  assert "train.grad_accum=" in lines[0] and "compiled in" not in proc.stdout  # nothing compiled


@pytest.mark.fast
@pytest.mark.tpu
def test_a_mesh_of_the_names_number_says_it_counts_tensorcores():
  """--topology=v4-8 with mesh.fsdp=8: '8 but there are 4 devices', and nothing said why."""
  with pytest.raises(UserError, match=r"= 8 but there are 4 devices.*\(v4-8 names 8 "
                                      r"TensorCores: 4 chips of 2, each chip one device\)"):
    nt_compile.run_compile(BASE, SMALL + ["mesh.fsdp=8"], "v4-8", "eval", log=lambda s: None)
  with pytest.raises(UserError, match=r"4 devices cannot be split.*\(v4-8 names 8 TensorCores"):
    nt_compile.run_compile(BASE, SMALL + ["mesh.tensor=8"], "v4-8", "eval", log=lambda s: None)


@pytest.mark.fast
@pytest.mark.tpu
def test_a_mesh_that_splits_a_torus_axis():
  """fsdp 8 x tensor 2 on a 4x4 v6e-16: no physical axis is 8 long, so mesh axes split them."""
  from nanotext import sharding
  from nanotext.config import load
  devices = topology.devices(topology.parse("v6e-16"))
  cfg = load(BASE, ["mesh.data=1", "mesh.fsdp=8", "mesh.tensor=2"])
  mesh = sharding.make_mesh(cfg.mesh, devices)
  assert {a: n for a, n in mesh.shape.items() if n > 1} == {"fsdp": 8, "tensor": 2}
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)


@pytest.mark.tpu
@pytest.mark.slow
def test_a_tpu_eval_plan_counts_each_skip_twice():
  """speedrun.yml's eval on v6e-8 keeps each U-net skip twice (the value and a layout copy,
  `nanotext.compile --peak`); the plan counted it once: 0.72 of the compiler at this shape (and
  at the shipped one), 0.80 with the copies (0.88 at the shipped shape)."""
  small = ["model.num_layers=6", "model.d_model=256", "model.num_heads=2", "model.head_dim=128",
           "model.mlp_dim=1024", "model.vocab_size=1024", "model.embed_rows=1000",
           "model.align=0", "train.batch_size=8", "train.seq_len=2048",
           "train.eval_seq_len=65536", "train.steps=20", "data.source=synthetic",
           "data.tokenizer=none", "data.eot_id=0"]
  # As a run compiles it: conftest's float32 matmul precision is no splash kernel's (Mosaic
  # refuses its bfloat16 operands at "highest").
  with jax.default_matmul_precision("default"):
    _, _, (rec,) = nt_compile.run_compile(SPEEDRUN, small, "v6e-8", "eval", log=lambda s: None)
  assert 0.78 <= rec["estimate_bytes_per_chip"] / rec["total_bytes_per_chip"] <= 1.15, rec


@pytest.mark.fast
def test_a_saved_runs_config_compiles_past_a_fresh_start_rule(tmp_path, monkeypatch):
  """A run saved before a fresh start's own rule (muon with weight_decay, since 10ea11b) resumes,
  so its config.yml compiles; a new config with the rule is still refused."""
  from nanotext import config, wiring
  run_dir = tmp_path / "run"
  os.makedirs(run_dir / "checkpoints" / "4")
  saved = str(run_dir / "config.yml")
  config.save(config.load(BASE, SMALL + ["optim.name=muon", "optim.weight_decay=0.1"]), saved)

  def built(*args, **kwargs):
    raise RuntimeError("built")  # the config passed every check: stop before compiling

  monkeypatch.setattr(wiring, "from_config", built)
  monkeypatch.setattr(topology, "devices", lambda target: jax.devices())  # no libtpu needed
  with pytest.raises(RuntimeError, match="built"):
    nt_compile.run_compile(saved, [], "v6e-8", "eval", log=lambda s: None)
  os.rename(run_dir / "checkpoints", run_dir / "elsewhere")  # a config file, no run beside it
  with pytest.raises(UserError, match="weight_decay"):
    nt_compile.run_compile(saved, [], "v6e-8", "eval", log=lambda s: None)
