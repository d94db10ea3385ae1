"""benchmarks/overhead.py, reference_step.py, convergence.py and build_time.py on tiny shapes."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import BASE, PROCESS_TIMEOUT_S, REPO, SPEEDRUN, one_line_error

sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # overhead.py imports reference_step by name


def _load(name):
  spec = importlib.util.spec_from_file_location(
      f"{name}_bench", os.path.join(REPO, "benchmarks", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


overhead = _load("overhead")
convergence = _load("convergence")
reference = _load("reference_step")
build_time = _load("build_time")

# GPT-2 as configs/base.yml, only small; a short warmup so the timed steps cross the schedule.
SMALL = ["model.num_layers=2", "model.d_model=64", "model.num_heads=2", "model.head_dim=32",
         "model.vocab_size=512", "model.align=0", "train.batch_size=4", "train.seq_len=32",
         "train.steps=10", "optim.warmup_steps=2", "optim.weight_decay=0.1"]


@pytest.mark.filterwarnings("error::DeprecationWarning")  # the library's replacements
def test_reference_step_is_the_same_math_as_nanotext():
  r = overhead.measure(BASE, SMALL, rounds=2, steps=2, warmup=1)
  assert r["loss_rel_diff"] <= overhead.LOSS_RTOL
  # Five optimizer steps later (warmup, clipping, decay) the two still agree.
  assert r["nt_loss_end"] == pytest.approx(r["ref_loss_end"], rel=1e-5)
  assert r["nt_loss_end"] < r["nt_loss0"]
  assert "same math: yes" in overhead.table(r, "small")


@pytest.mark.fast
def test_reference_schedule_matches_nanotext():
  from nanotext import config, optim, wiring
  cfg = config.load(BASE, ["train.steps=30", "optim.warmup_steps=5"])
  hp = overhead.hparams(wiring.finalize(cfg, jax.devices()[:1]))
  ref = reference.schedule(hp)
  nt = optim.lr_factor(cfg.optim, 30, xp=np)
  np.testing.assert_allclose([float(ref(s)) for s in range(31)],
                             [cfg.optim.lr * float(nt(s)) for s in range(31)], rtol=1e-6)


def test_overhead_refuses_other_architectures():
  proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "overhead.py"), SPEEDRUN],
                        capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.startswith("nanotext: error: ") and proc.stderr.count("\n") == 1, proc.stderr


def test_steps_to_reach_interpolates():
  curve = [(10, 5.0), (20, 4.0), (30, 3.0)]
  assert convergence.steps_to_reach(curve, 3.5) == pytest.approx(25.0)
  assert convergence.steps_to_reach(curve, 5.5) == 10.0  # already there at the first evaluation
  assert convergence.steps_to_reach(curve, 2.9) is None


def test_convergence_checks_both_recipes_before_training():
  """Both configs take the shared overrides (speedrun.yml's long eval_seq_len reset): checked
  before either trains, and the default output is not the committed report."""
  convergence.check_recipes(convergence.common_overrides(
      steps=4, batch_size=8, seq_len=32, eval_every=2, eval_batches=1))
  assert not os.path.dirname(convergence.DEFAULT_OUT)  # the current directory


@pytest.mark.plots
def test_convergence_report_and_plot(tmp_path):
  curves = {"baseline (AdamW GPT-2)": [(10, 6.0), (20, 5.0), (40, 4.0)],
            "speedrun recipe": [(10, 5.0), (20, 3.9), (40, 3.5)]}
  walls = {name: 1.0 for name in curves}
  settings = dict(steps=40, batch_size=4, seq_len=8, eval_every=10, eval_batches=1)
  md = convergence.report(curves, walls, settings, "python benchmarks/convergence.py")
  assert "| speedrun recipe | 3.5000 | 19.1 |" in md
  assert "ratio 0.48" in md and "target (<= 0.5) met" in md
  png = tmp_path / "c.png"
  convergence.plot(curves, 4.0, 19.1, str(png))
  assert png.read_bytes()[:4] == b"\x89PNG"


def test_attention_numerics_kernels_are_within_an_ulp_of_float64():
  """benchmarks/attention_numerics.py: its online-softmax kernel and the blocked kernel both land
  within a bf16 ulp (RMS) of the float64 answer, and do not agree with it bit for bit."""
  import jax.numpy as jnp
  num = _load("attention_numerics")
  from nanotext.model.kernels.blocked import blocked_attention
  q, k, v, seg = num.inputs(512, seed=0)
  m = num.mask(512, 256, seg)
  ref = num.exact(q, k, v, m)[None]
  onl = num.online(q, k, v, m)
  blk = blocked_attention(q, k, v, scale=num.SCALE, window=256, block_windows=True,
                          segment_ids_BT=jnp.asarray(seg), block=num.BLOCK)
  for out in (onl, blk):
    mx, rel = num.errors(out, ref, ref)
    assert 0 < rel < 2.0 ** -8 and mx < 0.05


def test_long_attention_points_and_the_dense_path_it_will_not_compile():
  long = _load("long_attention")
  r = long.point(512, "blocked", window=256, heads=2, repeats=1, max_gib=1.0)
  assert r["temp_gib"] > 0 and r["step_ms"] > 0
  skipped = long.point(49152, "xla", window=1792, heads=6, repeats=1, max_gib=4.0)
  assert skipped["skipped"] == "not compiled (about 162 GiB)"


def test_suite_compile_time_counts_the_programs_of_each_test(tmp_path):
  """benchmarks/suite_compile_time.py as a pytest plugin in a session of its own: a test that
  compiles two programs, one that compiles none, and one that starts processes (one compiles a
  program and ends with os._exit, as the CLI's errors do; one runs under a file-size limit, as
  the fault tests do, which its line must not disturb), then the table."""
  (tmp_path / "test_two.py").write_text(
      "import jax, numpy as np, subprocess, sys\n\n"
      "def plus_one(x):\n  return x + 1\n\n"
      "def test_compiles():\n"
      "  jax.jit(plus_one)(np.ones(3)).block_until_ready()\n"
      "  jax.jit(plus_one)(np.ones(4)).block_until_ready()\n\n"
      "def test_compiles_nothing():\n"
      "  pass\n\n"
      "def test_starts_processes():\n"
      "  code = 'import jax, os; jax.jit(lambda x: x + 2)(1.0).block_until_ready(); os._exit(2)'\n"
      "  assert subprocess.run([sys.executable, '-c', code]).returncode == 2\n"
      "  assert subprocess.run([sys.executable, '-c', 'pass']).returncode == 0\n"
      "  # under a file-size limit its line cannot be written: nothing on stderr, exit 0\n"
      "  code = 'import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (1, 1))'\n"
      "  r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True)\n"
      "  assert (r.returncode, r.stderr) == (0, '')\n")
  times = tmp_path / "times.jsonl"
  env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "benchmarks"),
             NANOTEXT_SUITE_TIMES=str(times))
  # Under pytest-xdist (as the suite runs): tests run in a worker, reports reach the controller.
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_compile_time",
                         "-n", "1", "-p", "no:cacheprovider", "test_two.py"],
                        cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=PROCESS_TIMEOUT_S)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  rows = [json.loads(line) for line in times.read_text().splitlines()]
  children = sorted((r for r in rows if "child" in r), key=lambda r: r.get("programs", 0))
  rows = [r for r in rows if "child" not in r]
  assert sorted(r["test"] for r in rows) == ["test_two.py::test_compiles",
                                             "test_two.py::test_compiles_nothing",
                                             "test_two.py::test_starts_processes"]
  assert all(0 < r["wall"] < 300 for r in rows), rows  # one row per test, measured where it ran
  # Each process the test started, the one that compiled and left by os._exit included.
  assert [r["test"] for r in children] == ["test_two.py::test_starts_processes"] * 2, children
  assert children[0].get("programs", 0) == 0 and children[1]["programs"] == 1, children
  assert children[1]["compile"] > 0 and children[1]["cpu"] > 0 and "-c" in children[1]["child"]
  rows = {r["test"]: r for r in rows}
  assert rows["test_two.py::test_compiles"]["programs"] == 2
  assert rows["test_two.py::test_compiles"]["compile"] > 0
  assert rows["test_two.py::test_compiles"]["named"]["jit_plus_one"]["count"] == 2
  assert rows["test_two.py::test_compiles_nothing"].get("programs", 0) == 0
  out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "suite_compile_time.py"),
                        str(times), "--tests", "1", "--programs", "3"], capture_output=True,
                       text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert lines[0] == ("| tests | wall | compile | trace | lower | programs | processes | "
                      "their CPU | their compile |")
  cells = [c.strip() for c in lines[2].split("|")[1:-1]]
  assert cells[0] == "test_two.py" and cells[5:7] == ["2", "2"], lines[2]  # programs, processes
  assert float(cells[7]) > 0  # the processes' CPU
  assert lines[3].startswith("| total |")
  assert any(line.startswith("| test_two.py::") for line in lines[5:])
  assert lines[-3] == "| program | compiled | seconds | test files |"
  assert lines[-1].startswith("| jit_plus_one | 2 | ") and lines[-1].endswith(" | 1 |")


@pytest.mark.filterwarnings("error::DeprecationWarning")  # the library's replacements
def test_build_time_times_each_phase_and_tabulates():
  got = build_time.times(BASE, "v6e-8", SMALL)
  assert set(got) == {"model", "init trace", "plan"} and all(t > 0 for t in got.values())
  text = build_time.table({(BASE, "a"): [got, got], (BASE, "b"): [got]}, ["a", "b"])
  assert text.splitlines()[0] == "| config | tree | model, s | init trace, s | plan, s |"
  assert text.count("| `base.yml` |") == 2


def _gpu_shims(tmp_path) -> dict:
  """PATH with stand-ins for nvidia-smi and python3: gpu_step.py fails unless it times cudnn."""
  shims = tmp_path / "shims"
  shims.mkdir()
  (shims / "nvidia-smi").write_text("#!/bin/bash\necho fake GPU\n")
  (shims / "python3").write_text(
      "#!/bin/bash\ncase \"$*\" in *gpu_step.py*attention.impl=cudnn*) exit 0;;\n"
      "  *gpu_step.py*) exit 1;; esac\nexit 0\n")
  for f in shims.iterdir():
    f.chmod(0o755)
  return dict(os.environ, PATH=f"{shims}:{os.environ['PATH']}")


@pytest.mark.fast
def test_gpu_lease_names_its_steps_and_runs_only_those_asked(tmp_path):
  """benchmarks/gpu_lease.sh: its usage lists every step it has (the record_cudnn fallback
  aside); a name it does not have (a misspelt step ran nothing and exited 0), no OUT_DIR, or no
  nvidia-smi is one line and exit 2, nothing written; `record` named and failing still times
  cudnn (the fallback had been filtered out)."""
  script = os.path.join(REPO, "benchmarks", "gpu_lease.sh")
  text = open(script).read()
  listed = text.split("all if none:\n# ", 1)[1].split(";", 1)[0].split()
  steps = [line.split()[1] for line in text.splitlines() if line.lstrip().startswith("step ")]
  assert listed == [s for s in steps if s != "record_cudnn"] and "learning" in listed
  env = _gpu_shims(tmp_path)
  out = tmp_path / "out"
  run = lambda *args, env=env: subprocess.run(["bash", script, *args], cwd=tmp_path, env=env,
                                              capture_output=True, text=True, timeout=120)
  one_line_error(run(str(out), "recrod"), "no step 'recrod'", " ".join(listed))
  one_line_error(run(), "no OUT_DIR")
  bare = dict(env, PATH="/usr/bin:/bin")  # bash's own folders: no nvidia-smi there
  if not os.path.exists("/usr/bin/nvidia-smi"):
    one_line_error(run(str(out), "record", env=bare), "no nvidia-smi")
  assert not out.exists()
  proc = run(str(out), "record")
  assert proc.returncode == 0, proc.stderr
  summary = [line.split(" after")[0] for line in (out / "summary.txt").read_text().splitlines()]
  assert summary == ["record: exit 1", "record_cudnn: exit 0"]


@pytest.mark.fast
def test_learning_check_reads_back_its_table_and_plots_it(tmp_path):
  """benchmarks/learning_check.py --from_table: the columns of a printed table come back as
  printed (a GPU run's log, re-summarised and drawn here), and --plot writes a PNG."""
  lc = _load("learning_check")
  columns = {"nanotext FP8": [9.0, 5.5, 4.0], "record (torch)": [9.0, 5.0, 4.4]}
  printed = lc.table(columns, "record (torch)", 1)
  assert "max |nanotext FP8 - record (torch)| / record (torch): 1.00e-01" in printed
  assert "mean 6.36e-02, signed mean +3.03e-03" in printed  # (0 + 0.1 -+ 0.0909) / 3
  log = tmp_path / "learning.log"
  log.write_text("a header line\n" + printed + "\n")
  assert lc.read_table(str(log)) == columns
  lc.plot(columns, "record (torch)", str(tmp_path / "curves.png"), "title")
  assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"


SPEEDRUN_TINY = ["model.num_layers=2", "model.d_model=64", "model.num_heads=2", "model.head_dim=32",
                 "model.mlp_dim=128", "model.align=0", "model.vocab_size=512",
                 "train.batch_size=8", "train.seq_len=64", "attention.window=32",
                 "attention.window_start=16", "attention.window_block=16"]


def _bench(name, *args, cwd=REPO, env=None):
  """benchmarks/NAME.py ARGS as a process; its CompletedProcess."""
  return subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", f"{name}.py"), *args],
                        cwd=cwd, env=dict(os.environ, **(env or {})), capture_output=True,
                        text=True, timeout=PROCESS_TIMEOUT_S)


def test_checkpoint_save_runs_a_doc_mask_config_and_removes_its_folder(tmp_path):
  """speedrun.yml (attention.doc_mask) on synthetic data, its temporary folder gone after; no
  CONFIG is one line."""
  proc = _bench("checkpoint_save", SPEEDRUN, *SPEEDRUN_TINY, "--repeats=1",
                env={"TMPDIR": str(tmp_path)})
  assert proc.returncode == 0, proc.stderr
  assert "| async: loop blocked per save (median) |" in proc.stdout
  assert not [p for p in os.listdir(tmp_path) if p.startswith("ckpt_bench_")]
  one_line_error(_bench("checkpoint_save"), "no CONFIG")


@pytest.mark.fast
def test_learning_check_decides_the_torch_column_before_training():
  """A shape export-torch cannot give (head_dim 64): --torch=auto leaves the column out with a
  note, --torch=on is a UserError; both before any training (they had trained both runs first)."""
  from nanotext import config
  from nanotext.errors import UserError
  lc = _load("learning_check")
  cfg = config.load(lc.CONFIG, ["model.head_dim=64"])
  notes = []
  assert lc.torch_choice("auto", cfg, log=notes.append) == "off"
  assert len(notes) == 1 and "left out" in notes[0], notes
  with pytest.raises(UserError, match="--torch=on"):
    lc.torch_choice("on", cfg)
  assert lc.torch_choice("off", cfg) == "off"


# Scripts with a command line of their own (the others are library modules).
SCRIPTS = sorted(os.path.basename(p)[:-3] for p in
                 __import__("glob").glob(os.path.join(REPO, "benchmarks", "*.py"))
                 if "__main__" in open(p).read() and not p.endswith("bench_cli.py"))


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_benchmark_explains_itself_and_refuses_an_unknown_flag(name):
  """--help: the usage on stdout, exit 0 (absl's had exit 1; flash_tiles.py ran its benchmark);
  an unknown flag: one line, exit 2."""
  proc = _bench(name, "--help")
  assert proc.returncode == 0 and proc.stdout.startswith("usage:"), (proc.stdout, proc.stderr)
  if name not in ("port_parity", "suite_compile_time"):  # argparse's own usage error, exit 2
    one_line_error(_bench(name, "--no_such_flag"), "no_such_flag")


@pytest.mark.parametrize("name, args, needle", [
    ("peak_flops", ["--repeats=0"], "--repeats=0"),
    ("attention_cpu", ["0"], "ROUNDS=0"),
    ("attention_numerics", ["--seeds=0"], "--seeds=0"),
    ("gpu_step", [BASE, "--steps=0"], "--steps=0"),
    ("gpu_step", [BASE, "--json=" + REPO], "is a folder"),
    ("sample_speed", [BASE, "--prompt=0"], "--prompt=0"),
    ("muon_layout", [BASE, "--rounds=0"], "--rounds=0"),
    ("build_time", [BASE, "--tree=/no/such/tree"], "not a nanotext checkout"),
    ("compile_matrix", ["--targets=h1000"], "unknown topology 'h1000'"),
    ("learning_check", ["--from_table=/no/such.log"], "--from_table"),
    ("scan_compile", ["/no/such.yml"], "/no/such.yml"),
    ("scan_compile", [BASE, "model.bogus=1"], "model.bogus"),
    ("long_attention", ["--lengths=128", "--repeats=0"], "--repeats"),
    ("convergence", ["--out=" + os.path.join(REPO, "no_such_dir", "c")], "does not exist"),
    ("flash_tiles", [], "--small"),  # the record's shape on the CPU: hours in interpret mode
    ("port_parity", ["--port=/no/such.py"], "--port"),
    ("cpu_vs_torch", ["--variants=torch-eagr"], "--variants=torch-eagr"),
    ("cpu_vs_torch", [BASE, "model.d_model=64", "model.num_heads=2"], "model.head_dim=64"),
    ("cpu_vs_torch", [SPEEDRUN], "model.positions"),
])
def test_a_benchmark_refuses_bad_arguments_in_one_line(name, args, needle):
  """Before anything is measured: one `nanotext: error:` line and exit 2, not a traceback."""
  one_line_error(_bench(name, *args, env={"JAX_PLATFORMS": "cpu"}), needle)


@pytest.mark.fast
def test_memory_estimate_selects_cases_by_their_comma_holding_names():
  """--only split names on commas, and every case name holds one: nothing could be chosen."""
  from nanotext.errors import UserError
  me = _load("memory_estimate")
  assert [c[0] for c in me.select("small", "base, dots/64; base, none/0")] == \
      ["base, none/0", "base, dots/64"]
  assert len(me.select("small", "")) == len(me.CASES["small"])
  with pytest.raises(UserError, match="--cases=tiny: choose one of small, mid, full"):
    me.select("tiny", "")
  with pytest.raises(UserError, match="no case 'base' in --cases=small"):
    me.select("small", "base")


def test_sample_speed_says_which_way_its_ratios_go():
  """The mode table's ratio is a time ratio (above 1: slower), the samples table's a speed-up;
  both had been labelled 'x ...'."""
  tiny = ["model.num_layers=1", "model.d_model=64", "model.num_heads=2", "model.head_dim=32",
          "model.vocab_size=512", "model.align=0", "train.seq_len=32"]
  proc = _bench("sample_speed", BASE, *tiny, "--tokens=2", "--repeats=1", "--modes=cache",
                "--samples=2", env={"PYTHONWARNINGS": "error::DeprecationWarning"})
  assert proc.returncode == 0, proc.stderr
  assert "| tokens/s after | time / cache's |" in proc.stdout
  assert "| tokens/s after | speed-up over one by one |" in proc.stdout


@pytest.mark.fast
def test_slurm_train_outside_slurm_is_one_line(tmp_path):
  """Outside a SLURM job: one line, exit 2 (was bash's 'unbound variable', exit 1)."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
  script = os.path.join(REPO, "scripts", "slurm_train.sh")
  run = lambda *args: subprocess.run(["bash", script, *args], cwd=tmp_path, env=env,
                                     capture_output=True, text=True, timeout=60)
  one_line_error(run(BASE), "not inside a SLURM job")
  one_line_error(run(), "no CONFIG")
  assert not os.listdir(tmp_path)


@pytest.mark.fast
def test_gpu_step_shortens_an_op_path_between_names():
  """The kernel rows' "from" column cut the op path at 80 characters, mid-name."""
  gpu_step = _load("gpu_step")
  path = "jit(step)/" + "/".join(f"transpose(jvp(block_{i}))" for i in range(6)) + "/dot_general"
  short = gpu_step.op_tail(path)
  assert short.startswith(".../transpose(jvp(block_") and short.endswith("/dot_general")
  assert path.endswith(short[4:]) and len(short) <= 84
  assert gpu_step.op_tail("jit(step)/dot_general") == "jit(step)/dot_general"
