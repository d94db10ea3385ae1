"""The training loop end to end: outputs, learning, golden loss, no recompiles, generation."""

import json
import os
import re
import shutil

import numpy as np
import pytest
import yaml

from conftest import BASE, SPEEDRUN, TINY, run_cli
from nanotext import config
from nanotext.errors import UserError
from nanotext.train import run

# A tiny GPT on the embedded corpus: learns visibly in a few dozen steps.
CORPUS = [o for o in TINY if not o.startswith(("data.", "model.vocab_size"))] + [
    "data.source=shakespeare", "data.tokenizer=shakespeare", "model.vocab_size=8192"]
# Loss after 4 steps of configs/base.yml with CORPUS, seed 0, 8 CPU devices (FSDP=8).
GOLDEN_LOSS_4 = 8.905299186706543


def metrics_of(out):
  with open(os.path.join(out, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def quiet_run(path, overrides):
  lines = []
  return run(path, overrides, log=lines.append), lines


@pytest.fixture(scope="module")
def corpus_run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("corpus_run"))
  result, lines = quiet_run(BASE, CORPUS + [f"output_dir={out}", "train.steps=60",
                                            "train.batch_size=16", "train.seq_len=64",
                                            "train.log_every=1", "train.eval_every=30",
                                            "checkpoint.every=30", "metrics.tensorboard=true",
                                            "optim.lr=0.01", "optim.warmup_steps=5",
                                            "sample.max_new_tokens=8",
                                            "train.target_val_loss=8.0"])
  return out, result, lines


def test_run_writes_config_metrics_tensorboard_and_checkpoints(corpus_run):
  out, _, _ = corpus_run
  saved = config.load(os.path.join(out, "config.yml"))  # the resolved config loads again
  assert saved.model.head_dim == 32 and saved.mesh.fsdp == 8 and saved.train.steps == 60
  rows = metrics_of(out)
  train_rows = [r for r in rows if "loss" in r]
  assert [r["step"] for r in train_rows] == list(range(1, 61))
  for key in ("loss", "lr", "tokens_per_sec", "mfu"):
    assert all(np.isfinite(r[key]) for r in train_rows), key
  # MFU is tokens/s times the FLOPs of a token over the devices' peak: one ratio for every row
  # (the rates themselves are the machine's load, not asserted).
  assert all(r["tokens_per_sec"] > 0 and r["mfu"] > 0 for r in train_rows)
  per_token = [r["mfu"] / r["tokens_per_sec"] for r in train_rows]
  assert per_token == pytest.approx([per_token[0]] * len(per_token))
  assert [r["step"] for r in rows if "val_loss" in r] == [30, 60]
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(out, "tb")))
  assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["30", "60"]


def test_evals_report_bits_per_byte_and_the_log_an_eta(corpus_run):
  out, result, lines = corpus_run
  evals = [r for r in metrics_of(out) if "val_loss" in r]
  # bits per byte = nats/token / ln 2 / bytes per token; Shakespeare BPE tokens are 3-4 bytes.
  ratios = [r["val_loss"] / r["val_bpb"] for r in evals]
  assert all(np.log(2) * 3 < x < np.log(2) * 4 for x in ratios), ratios
  assert max(ratios) - min(ratios) < 1e-9  # one bytes-per-token for the fixed validation set
  assert any(l.startswith("step     60 | val_loss ") and "| val_bpb " in l for l in lines)
  train_rows = [r for r in metrics_of(out) if "loss" in r]
  assert train_rows[-1]["eta_sec"] == 0 and all(r["eta_sec"] >= 0 for r in train_rows)
  assert train_rows[0]["eta_sec"] > 0
  step_lines = [l for l in lines if l.startswith("step ") and "/60 |" in l]
  assert all(" | eta " in l for l in step_lines) and step_lines[-1].endswith("| eta 0s")


def test_loss_decreases_on_the_embedded_corpus(corpus_run):
  out, result, _ = corpus_run
  rows = [r for r in metrics_of(out) if "loss" in r]
  first, last = np.mean([r["loss"] for r in rows[:3]]), np.mean([r["loss"] for r in rows[-3:]])
  assert first > 8.5  # about ln(8192) = 9.01 at initialisation
  assert last < first - 2.0
  assert result.val_loss < 7.0  # from ln(8192) = 9.01 at initialisation


def test_zero_compilations_after_the_first_step(corpus_run):
  out, result, lines = corpus_run
  assert result.compiles_in_loop == 0
  assert all(r["compiles"] == 0 for r in metrics_of(out) if "compiles" in r)
  assert "compilations inside the training loop: 0" in lines


def test_sample_is_printed_at_the_end(corpus_run):
  _, _, lines = corpus_run
  sample = [l for l in lines if l.startswith("sample: ROMEO:")]
  assert sample and len(sample[0]) > len("sample: ROMEO:")


def test_generate_cli_samples_from_the_checkpoint(corpus_run):
  out, _, _ = corpus_run
  proc = run_cli("nanotext.generate", f"output_dir={out}", "prompt=KING:", "max_new_tokens=12",
                 "temperature=0.8", "top_k=20", "seed=3")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith("[step 60] KING:")
  assert len(proc.stdout.strip()) > len("[step 60] KING:")
  again = run_cli("nanotext.generate", f"output_dir={out}", "prompt=KING:", "max_new_tokens=12",
                  "temperature=0.8", "top_k=20", "seed=3", "num_samples=2")
  assert again.returncode == 0, again.stderr
  # a seed makes sampling reproducible (the first of two samples is the command's above), and
  # sample i draws with seed + i
  first, second = again.stdout.split("[step 60, sample 2 of 2, seed 4] KING:")
  assert first == proc.stdout.replace("[step 60]", "[step 60, sample 1 of 2, seed 3]")
  # printed piece by piece as it is drawn, the text is the sample decoded at once
  from nanotext import generate, wiring
  from nanotext.data.tokenizer import get_tokenizer
  cfg = wiring.load(os.path.join(out, "config.yml"), ["sample.max_new_tokens=12",
                    "sample.temperature=0.8", "sample.top_k=20", "sample.seed=3"])
  step, graphdef, params = generate.restore(out, cfg, checked=True)
  tokenizer = get_tokenizer(cfg.data.tokenizer)
  text = generate.sample_text(graphdef, params, cfg, tokenizer, "KING:")
  assert proc.stdout == f"[step {step}] KING:{text}\n"
  ids = generate.sample_ids(graphdef, params, cfg, tokenizer, "KING:", seed=4)
  assert second == tokenizer.decode(list(ids)) + "\n" and second != text + "\n"


def test_golden_loss_after_four_steps(tmp_path):
  result, _ = quiet_run(BASE, CORPUS + [f"output_dir={tmp_path}", "sample.max_new_tokens=0"])
  rows = [r for r in metrics_of(str(tmp_path)) if "loss" in r]
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  if GOLDEN_LOSS_4 is None:
    pytest.fail(f"set GOLDEN_LOSS_4 = {rows[-1]['loss']!r}")
  np.testing.assert_allclose(rows[-1]["loss"], GOLDEN_LOSS_4, rtol=2e-4)


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
  losses = {}
  for accum in (1, 2):
    out = tmp_path / f"accum{accum}"
    quiet_run(BASE, TINY + [f"output_dir={out}", f"train.grad_accum={accum}",
                            "mesh.fsdp=4", "mesh.data=1", "mesh.tensor=2",
                            "sample.max_new_tokens=0"])
    losses[accum] = [r["loss"] for r in metrics_of(str(out)) if "loss" in r]
  np.testing.assert_allclose(losses[1], losses[2], rtol=1e-5)


def test_resume_continues_from_the_latest_checkpoint(tmp_path):
  common = TINY + [f"output_dir={tmp_path}", "checkpoint.every=2", "sample.max_new_tokens=0"]
  quiet_run(BASE, common + ["train.steps=4"])
  result, lines = quiet_run(BASE, common + ["train.steps=6"])
  assert any("resumed from the checkpoint of step 4" in l for l in lines)
  steps = [r["step"] for r in metrics_of(str(tmp_path)) if "loss" in r]
  assert steps == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("rule", [
    ["model.zero_init_head=true"],  # with the tied table: it only draws a fresh head's values
    ["optim.name=muon", "optim.weight_decay=0.1"],  # muon never read it: identical losses
])
def test_a_run_saved_before_a_fresh_start_rule_still_reads_and_resumes(tmp_path, monkeypatch,
                                                                       rule):
  """A rule of a fresh start only, added after a run was saved, locked it out: evaluate, generate,
  convert and a resume exited 2 naming the rule, and no override got past it (a model key is
  the run's own). A new run is still refused."""
  from nanotext import evaluate, generate, wiring
  from nanotext.convert import common
  out = str(tmp_path / "run")
  args = TINY + rule + ["data.source=synthetic", "data.tokenizer=shakespeare",
                        "model.vocab_size=8192", "train.eval_every=0", "sample.max_new_tokens=0"]
  with monkeypatch.context() as m:  # the run as nanotext saved it before the rule
    m.setattr(wiring, "check", lambda cfg, *args, **kwargs: cfg)
    quiet_run(BASE, args + ["train.steps=2", f"output_dir={out}"])
  assert [r["step"] for r in evaluate.evaluate(out, log=lambda line: None)] == [2]
  generate.main([f"output_dir={out}", "max_new_tokens=1"])
  assert common.load_run(out)[1] == 2  # convert's reader
  _, lines = quiet_run(os.path.join(out, "config.yml"), ["train.steps=3", f"output_dir={out}"])
  assert any("resumed from the checkpoint of step 2" in l for l in lines), lines
  with pytest.raises(UserError, match=re.escape(rule[-1])):
    run(BASE, args + ["train.steps=2", f"output_dir={tmp_path / 'new'}"], log=None)
  assert not os.path.exists(tmp_path / "new")


@pytest.mark.fast
def test_a_resume_on_a_mesh_the_model_does_not_divide_advises_the_mesh(tiny_run, tmp_path):
  """A resume can change only the mesh, yet the line said 'change model.num_heads or the mesh'
  (evaluate words it right); a new run in another output_dir may change the model."""
  mesh = ["mesh.fsdp=1", "mesh.tensor=8", "train.steps=8"]
  with pytest.raises(UserError, match=r"^model.num_heads=2 is not divisible by mesh.tensor=8 .*; "
                                      r"the run in output_dir resumes with the model it was "
                                      r"trained as: change the mesh \(mesh.\*\) or the number "
                                      r"of devices$"):
    run(BASE, TINY + mesh + [f"output_dir={tiny_run[0]}"], log=None)
  with pytest.raises(UserError, match=r"; change model.num_heads or the mesh$"):
    run(BASE, TINY + mesh + [f"output_dir={tmp_path / 'new'}"], log=None)
  assert not os.path.exists(tmp_path / "new")


def test_a_finished_run_started_again_changes_nothing(tiny_run, tmp_path):
  """Started again with resume-ok keys changed, a finished run rewrote config.yml with values
  it never trained with, and TensorBoard's folder appeared; it evaluates and says so only."""
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  before = {n: open(os.path.join(out, n), "rb").read() for n in ("config.yml", "metrics.jsonl")}
  _, lines = quiet_run(BASE, TINY + ["train.steps=2", "train.eval_every=0", f"output_dir={out}",
                                     "sample.max_new_tokens=0", "train.eval_batches=1",
                                     "train.log_every=5", "metrics.tensorboard=true"])
  assert any("(final; the run was complete: evaluated again, not recorded)" in l for l in lines)
  assert {n: open(os.path.join(out, n), "rb").read() for n in before} == before
  assert not os.path.exists(os.path.join(out, "tb"))


def test_a_killed_run_ended_at_its_checkpoint_drops_the_rows_past_it(tmp_path):
  """Killed after step 4 with its newest checkpoint at 2, then ended there (train.steps=2): it
  said "the run was complete" and kept the rows of steps 3-4 (which plot drew) and config.yml's
  train.steps; it is recorded as ending at 2 now. Every later start appended another val row
  of step 2 (and a TensorBoard file with it): it evaluates again, not recorded, as any finished
  run; the val row the killed run wrote at 2 is the one row of it."""
  out = str(tmp_path)
  common = TINY + [f"output_dir={out}", "checkpoint.every=2", "sample.max_new_tokens=0",
                   "metrics.tensorboard=true"]
  quiet_run(BASE, common + ["train.steps=4"])
  shutil.rmtree(os.path.join(out, "checkpoints", "4"))  # as if killed before step 4's save
  _, lines = quiet_run(BASE, common + ["train.steps=2"])
  assert not any("not recorded" in l for l in lines), lines
  rows = metrics_of(out)
  assert [(r["step"], "val_loss" in r) for r in rows] == [(1, False), (2, False), (2, True)]
  assert config.load(os.path.join(out, "config.yml")).train.steps == 2
  tb = sorted(os.listdir(os.path.join(out, "tb")))
  _, lines = quiet_run(BASE, common + ["train.steps=2"])
  assert any("(final; the run was complete: evaluated again, not recorded)" in l for l in lines)
  assert metrics_of(out) == rows and sorted(os.listdir(os.path.join(out, "tb"))) == tb


def test_a_finished_run_whose_extension_died_ends_at_its_checkpoint_again(tmp_path):
  """A finished 2-step run extended to 4 and killed before step 4's save, then started again
  with train.steps=2: its step 2 was saved as a final step, so it counted as finished and kept
  the dead extension's rows of steps 3-4 and its config.yml (train.steps=4)."""
  out = str(tmp_path)
  common = TINY + [f"output_dir={out}", "checkpoint.every=0", "sample.max_new_tokens=0"]
  quiet_run(BASE, common + ["train.steps=2"])
  quiet_run(BASE, common + ["train.steps=4"])
  shutil.rmtree(os.path.join(out, "checkpoints", "4"))  # as if killed before step 4's save
  _, lines = quiet_run(BASE, common + ["train.steps=2"])
  assert not any("not recorded" in l for l in lines), lines
  assert [(r["step"], "val_loss" in r) for r in metrics_of(out)] == [(1, False), (2, False),
                                                                     (2, True)]
  assert config.load(os.path.join(out, "config.yml")).train.steps == 2
  _, lines = quiet_run(BASE, common + ["train.steps=2"])
  assert any("(final; the run was complete: evaluated again, not recorded)" in l for l in lines)


def test_an_overwrite_plans_afresh_and_replaces_a_run_past_its_steps(tiny_run, tmp_path):
  """overwrite=true kept the replaced run's memory-plan choices (remat, loss chunks), and a
  run of the same identity past train.steps was refused whatever overwrite said."""
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  path = os.path.join(out, "config.yml")
  with open(path) as f:
    old = yaml.safe_load(f)
  assert old["model"]["remat"] == "none"  # what the plan chooses for TINY here
  old["model"]["remat"], old["seed"] = "full", 5  # another run, that chose full
  with open(path, "w") as f:
    yaml.safe_dump(old, f)
  common = TINY + [f"output_dir={out}", "train.eval_every=0", "sample.max_new_tokens=0",
                   "overwrite=true", "checkpoint.every=1"]
  quiet_run(BASE, common + ["train.steps=2"])
  with open(path) as f:
    assert yaml.safe_load(f)["model"]["remat"] == "none"
  quiet_run(BASE, common + ["train.steps=1"])  # step 2 on disk, past 1
  assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["1"]


def test_validation_capped_by_its_data_says_so(tmp_path):
  """train.eval_batches beyond the validation data was capped without a word (evaluate says)."""
  from nanotext.data import binfile
  binfile.write_shard(str(tmp_path / "train.bin"), np.arange(2000) % 512)
  binfile.write_shard(str(tmp_path / "val.bin"), np.arange(300) % 512)  # 9 rows: 1 batch of 8
  _, lines = quiet_run(BASE, TINY + [f"output_dir={tmp_path / 'run'}", "train.steps=1",
                                     "data.source=bin", f"data.train_files={tmp_path}/train.bin",
                                     f"data.val_files={tmp_path}/val.bin",
                                     "sample.max_new_tokens=0"])
  assert "validation: 1 batch, all the validation data holds (train.eval_batches=2)" in lines
  assert not [line for line in lines if line.startswith("training data:")]  # 8 of 62 rows


def test_startup_warnings_go_to_the_runs_log(tmp_path, caplog):
  """Misaligned matmul dims and a validation glob matching a training shard went to absl's log,
  not the `log=` of train.run: a library caller never saw them, the CLI an absl-formatted line."""
  from nanotext.data import binfile
  for name in ("train.bin", "val.bin"):
    binfile.write_shard(str(tmp_path / name), np.arange(2000) % 512)
  _, lines = quiet_run(BASE, TINY + [f"output_dir={tmp_path / 'run'}", "train.steps=1",
                                     "model.align=128", "data.source=bin",
                                     f"data.train_files={tmp_path}/*.bin",
                                     f"data.val_files={tmp_path}/val.bin",
                                     "sample.max_new_tokens=0"])
  warnings = [line for line in lines if line.startswith("warning: ")]
  assert warnings == [
      "warning: matmul dims not multiples of model.align=128: model.d_model=64, "
      "model.num_heads*model.head_dim=64",
      f"warning: data.train_files and data.val_files both match '{tmp_path}/val.bin': the "
      "validation loss is of text the run trains on (text_shards writes train_*.bin and "
      "val_*.bin)"]
  assert "not multiples" not in caplog.text and "both match" not in caplog.text


def test_nanotexts_own_calls_raise_no_deprecation_warning(tmp_path):
  """PYTHONWARNINGS=error: train, evaluate and generate died on a DeprecationWarning raised in
  nanotext's own calls (flax's State.to_pure_dict() and Variable.value, optax.global_norm)."""
  import warnings
  from nanotext import checkpoint, evaluate, generate, wiring
  out = str(tmp_path / "run")
  args = TINY + ["train.steps=2", f"output_dir={out}"]
  with warnings.catch_warnings():
    warnings.simplefilter("error", DeprecationWarning)
    run(BASE, args, log=lambda line: None)  # the memory plan, init, train and eval steps
    evaluate.evaluate(out, log=lambda line: None)
    _, params = checkpoint.latest_params(out)
    tokens = generate.sample(wiring.prepare(BASE, args).graphdef, params, [5, 17], seed=0,
                             max_len=32, max_new_tokens=2, temperature=0.0, top_k=0)
  assert len(tokens) == 2


def test_steps_past_the_training_data_say_the_epochs(tmp_path):
  """16 rows read of 9 sequences: each read again, said in one start-up line (was no word)."""
  from nanotext.data import binfile
  binfile.write_shard(str(tmp_path / "train.bin"), np.arange(300) % 512)  # 9 rows of 33
  binfile.write_shard(str(tmp_path / "val.bin"), np.arange(300) % 512)
  _, lines = quiet_run(BASE, TINY + [f"output_dir={tmp_path / 'run'}", "train.steps=2",
                                     "train.eval_every=0", "data.source=bin",
                                     f"data.train_files={tmp_path}/train.bin",
                                     f"data.val_files={tmp_path}/val.bin",
                                     "sample.max_new_tokens=0"])
  assert [line for line in lines if line.startswith("training data:")] == [
      "training data: 9 sequences of 33 tokens, 1.8 epochs in train.steps=2 of 8 rows"]


def test_speedrun_family_trains_with_muon(tmp_path):
  result, _ = quiet_run(SPEEDRUN, CORPUS + [f"output_dir={tmp_path}", "model.mlp_dim=0",
                                            "train.steps=6", "sample.max_new_tokens=0"])
  rows = [r for r in metrics_of(str(tmp_path)) if "loss" in r]
  np.testing.assert_allclose(rows[0]["loss"], np.log(8192), rtol=1e-3)  # zero-initialised head
  assert rows[-1]["loss"] < rows[0]["loss"]
  with open(os.path.join(tmp_path, "config.yml")) as f:
    assert yaml.safe_load(f)["optim"]["name"] == "muon"


@pytest.mark.fast
def test_no_sample_where_the_prompt_is_past_the_models_rows(tmp_path):
  """Synthetic ids fit any vocab_size, a prompt's ids under the shipped tokenizer need not fit
  512 rows: the end-of-run sample looked them up clamped and printed garbage."""
  from nanotext import train
  cfg = config.load(BASE, TINY + ["data.source=synthetic", "data.tokenizer=shakespeare",
                                  "sample.max_new_tokens=4", "sample.prompt=Thou art a villain",
                                  f"output_dir={tmp_path}"])
  lines = []
  train.report(None, cfg, None, lines.append)
  assert len(lines) == 1 and re.fullmatch(r"no sample: the prompt's token id \d+ \(tokenizer "
                                          r"'shakespeare'\) is past the model's 512 token rows",
                                          lines[0]), lines


@pytest.mark.fast
def test_no_sample_where_the_tokenizer_cannot_load_is_a_log_line(monkeypatch):
  """It went to absl's stderr, where a library caller's `log` never saw it."""
  from nanotext import train
  from nanotext.data import tokenizer

  def missing(name):
    raise UserError(f"the '{name}' tokenizer needs tiktoken")
  monkeypatch.setattr(tokenizer, "get_tokenizer", missing)
  cfg = config.load(BASE, ["data.tokenizer=gpt2", "data.source=synthetic"])
  lines = []
  train.report(None, cfg, None, lines.append)
  assert lines == ["no sample: the 'gpt2' tokenizer needs tiktoken"]


@pytest.mark.fast
def test_no_sample_without_a_tokenizer_is_a_log_line():
  """data.tokenizer=none skipped the closing sample without the line other reasons give;
  sample.max_new_tokens=0 asks for none, and gets no line."""
  from nanotext import train
  lines = []
  train.report(None, config.load(BASE, TINY), None, lines.append)
  assert lines == ["no sample: data.tokenizer=none has no text to decode ids into (set "
                   "data.tokenizer to the data's, or sample.max_new_tokens=0 for no sample)"]
  lines.clear()
  train.report(None, config.load(BASE, TINY + ["sample.max_new_tokens=0"]), None, lines.append)
  assert lines == []


def test_target_val_loss_is_reported(corpus_run):
  _, result, lines = corpus_run
  assert f"target val_loss <= 8.0: reached (final val_loss {result.val_loss:.4f})" in lines


@pytest.mark.fast
def test_a_tokenizer_that_cannot_load_is_said_before_training(monkeypatch):
  """data.tokenizer=gpt2 without tiktoken: the run trained to its end with no val_bpb and said
  why only there ("no sample: ... needs tiktoken")."""
  from nanotext import train as train_module
  from nanotext.data import tokenizer
  from nanotext.errors import UserError

  def missing(name):
    raise UserError(f"the '{name}' tokenizer needs tiktoken")
  monkeypatch.setattr(tokenizer, "get_tokenizer", missing)
  lines = []
  cfg = config.load(BASE, ["data.tokenizer=gpt2", "data.source=synthetic"])
  train_module.check_sample(cfg, lines.append)
  assert lines == ["warning: the 'gpt2' tokenizer needs tiktoken; this run trains without "
                   "val_bpb and its closing sample"]
