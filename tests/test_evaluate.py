"""`python -m nanotext.evaluate`: a run's validation loss read back from its checkpoints equals the
run's own, for a run or a params-only folder, on any device count; nothing in the run is
written; bad arguments are one line."""

import json
import os
import re
import shutil
import socket

import numpy as np
import pytest

from conftest import BASE, TINY, one_line_error, run_cli
from nanotext import evaluate, memory_plan, params_from, rundir, wiring
from nanotext.convert import params
from nanotext import errors
from nanotext.errors import UserError


def snapshot(folder: str) -> dict:
  """Every file under `folder`: (size, mtime in ns)."""
  out = {}
  for d, _, files in os.walk(folder):
    for f in files:
      st = os.stat(os.path.join(d, f))
      out[os.path.relpath(os.path.join(d, f), folder)] = (st.st_size, st.st_mtime_ns)
  return out


@pytest.mark.fast
def test_the_newest_step_evaluates_to_the_runs_own_loss_and_nothing_is_written(tiny_run):
  out, result = tiny_run
  before = snapshot(out)
  lines = []
  rows = evaluate.evaluate(out, log=lines.append)
  assert np.isfinite(result.val_loss)
  assert [r["step"] for r in rows] == [2]
  np.testing.assert_allclose(rows[0]["val_loss"], result.val_loss, rtol=1e-6)
  assert rows[0]["tokens"] == 2 * 8 * 32  # TINY: 2 eval batches of 8 rows of 32
  assert lines[-1].split()[:4] == ["step", "2", "|", "val_loss"]
  assert snapshot(out) == before


@pytest.mark.fast
def test_the_eval_steps_memory_choices_are_chosen_again(tiny_run):
  """config.yml's resolved eval_accum read as set: one that no longer fit (less memory, another
  mesh) was refused, the advice walking one pass count at a time. Now auto, the run's own value
  preferred where it fits (memory_plan.saved_choice); one given is kept."""
  out, _ = tiny_run
  assert memory_plan.saved_choice(out)["train.eval_accum"] == 1  # as config.yml holds it
  cfg = evaluate.load_config(out, [], checked=False)
  assert (cfg.train.eval_accum, cfg.train.eval_loss_chunk) == (-1, -1)
  assert evaluate.load_config(out, ["train.eval_accum=2"], checked=False).train.eval_accum == 2


@pytest.mark.fast
def test_a_params_only_folder_and_every_step_agree(tiny_run, tmp_path):
  out, result = tiny_run
  folder = str(tmp_path / "p")
  params.params_only(out, folder, log=lambda line: None)
  rows = evaluate.evaluate(folder, log=lambda line: None)
  assert [r["step"] for r in rows] == [2]  # from its convert.json
  np.testing.assert_allclose(rows[0]["val_loss"], result.val_loss, rtol=1e-6)
  lines = []
  every = evaluate.evaluate(out, "all", ["train.eval_batches=1"], log=lines.append)
  assert any("parameters | 1 batch of 8x32 tokens" in line for line in lines), lines
  assert [r["step"] for r in every] == [2] and every[0]["tokens"] == 8 * 32


@pytest.mark.fast
def test_a_damaged_convert_json_is_named_not_read_as_no_step(tiny_run, tmp_path):
  folder = str(tmp_path / "p")
  params.params_only(tiny_run[0], folder, log=lambda line: None)
  with open(os.path.join(folder, "convert.json"), "w") as f:
    f.write('{"step": ')  # cut short
  with pytest.raises(UserError, match="convert.json' is damaged"):
    evaluate.evaluate(folder, log=lambda line: None)
  for step in ("-5", "true", "2.5", "1" + "0" * 30):  # hand-edited: -5 was shown as the step
    with open(os.path.join(folder, "convert.json"), "w") as f:
      f.write('{"step": %s}' % step)
    with pytest.raises(UserError, match="convert.json' is damaged"):
      evaluate.evaluate(folder, log=lambda line: None)
  os.remove(os.path.join(folder, "convert.json"))  # none at all: the step is not known
  lines = []
  assert [r["step"] for r in evaluate.evaluate(folder, log=lines.append)] == [-1]
  assert lines[-1].startswith("step      ? | val_loss")  # it printed step -1


@pytest.mark.fast
def test_validation_shards_alone_evaluate_a_run_and_train_none(tiny_run, tmp_path, monkeypatch):
  """data.source=bin with data.val_files only: evaluate reads them (a Hugging Face import on
  one's own validation shard); training refuses, naming data.train_files, and writes nothing."""
  from nanotext.data import binfile
  from nanotext.train import run
  from conftest import BASE, TINY
  shard = str(tmp_path / "val_000.bin")
  binfile.write_shard(shard, np.random.default_rng(0).integers(0, 512, 4096, dtype=np.uint16))
  data = ["data.source=bin", f"data.val_files={shard}"]
  rows = evaluate.evaluate(tiny_run[0], overrides=data, log=lambda line: None)
  assert [r["step"] for r in rows] == [2] and np.isfinite(rows[0]["val_loss"])
  # a tokenizer that cannot load (tiktoken offline): no val_bpb, said as train says it
  from nanotext.data import pipeline
  monkeypatch.setattr(pipeline, "tokenizer_problem", lambda d: "data.tokenizer=gpt2 needs tiktoken")
  lines = []
  rows = evaluate.evaluate(tiny_run[0], overrides=data, log=lines.append)
  assert "val_bpb" not in rows[0]
  assert "warning: data.tokenizer=gpt2 needs tiktoken; no val_bpb without it" in lines
  monkeypatch.undo()
  out = str(tmp_path / "never")
  with pytest.raises(UserError, match="data.train_files is empty"):
    run(BASE, TINY + data + [f"output_dir={out}"], log=lambda line: None)
  assert not os.path.exists(out)


@pytest.mark.fast
@pytest.mark.parametrize("when", ["before", "during"])
def test_a_step_removed_while_it_is_read_is_left_out(tiny_run, tmp_path, monkeypatch, when):
  """Removed before its read, or in the middle of finding its state/ (was a FileNotFoundError
  traceback: a run with checkpoint.keep rotating it away, state/ first)."""
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  shutil.copytree(os.path.join(out, "checkpoints", "2"), os.path.join(out, "checkpoints", "1"))
  load, isdir = params_from.load, os.path.isdir
  one = os.path.join(out, "checkpoints", "1")

  def rotated_away(path, abstract, what, **kw):  # as a run training removes its oldest step
    if path.endswith(os.sep + "1"):
      shutil.rmtree(path)
    return load(path, abstract, what, **kw)

  def removed_meanwhile(path):
    if str(path) == os.path.join(one, "state") and isdir(one):
      shutil.rmtree(one)
    return isdir(path)
  if when == "before":
    monkeypatch.setattr(params_from, "load", rotated_away)
  else:
    monkeypatch.setattr(params_from.os.path, "isdir", removed_meanwhile)
  lines = []
  rows = evaluate.evaluate(out, "all", log=lines.append)
  assert [r["step"] for r in rows] == [2]
  assert any(line.split()[:3] == ["step", "1", "|"] and "removed" in line for line in lines)
  shutil.copytree(os.path.join(out, "checkpoints", "2"), os.path.join(out, "checkpoints", "1"))
  with pytest.raises(UserError, match="step 1 was removed"):
    evaluate.evaluate(out, 1, log=lambda line: None)


@pytest.mark.fast
def test_a_step_of_a_run_set_aside_while_it_is_read_says_so(tiny_run, tmp_path, monkeypatch):
  """step=N of a run an overwrite=true start set aside while it was read: 'removed while it was
  read (a run training into it keeps checkpoint.keep steps)'; now where it went, exit 2 as for
  the newest step. step=all leaves it out, saying why."""
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  load = params_from._load_params

  def set_aside_meanwhile(item, whole_state, abstract):
    if not os.path.isdir(os.path.join(out, rundir.ASIDE)):
      rundir.set_aside(out)
      os.makedirs(os.path.join(out, "checkpoints"))  # the new run's
    return load(item, whole_state, abstract)
  monkeypatch.setattr(params_from, "_load_params", set_aside_meanwhile)
  with pytest.raises(UserError) as e:
    evaluate.evaluate(out, 2, log=lambda line: None)
  assert "step 2 was set aside with the run while it was read, by an overwrite=true" in \
      str(e.value) and "keep" not in str(e.value)
  shutil.rmtree(out)
  shutil.copytree(tiny_run[0], out)
  lines = []
  assert evaluate.evaluate(out, "all", log=lines.append) == []
  assert lines[-1].startswith("step      2 | set aside with the run while it was read"), lines


def rotate_on_read(out: str, monkeypatch, times: int) -> list:
  """The first `times` step reads in `out` each save a newer step (3, 4, ...) and remove the one
  read, as a run training into it does; the steps removed, in order."""
  load, newer, removed = params_from._load_params, iter(range(3, 100)), []

  def rotated_away(item, whole_state, abstract):
    if len(removed) < times:
      where = os.path.dirname(item)
      removed.append(int(os.path.basename(where)))
      shutil.copytree(where, os.path.join(out, "checkpoints", str(next(newer))))
      shutil.rmtree(where)
    return load(item, whole_state, abstract)
  monkeypatch.setattr(params_from, "_load_params", rotated_away)
  return removed


@pytest.mark.fast
def test_beside_a_live_run_the_newest_step_is_read_again_longer(tiny_run, tmp_path, monkeypatch):
  """checkpoint.keep=1 with a save every step: evaluate gave up (exit 2, the step 'damaged')
  after three newest steps rotated away; while the run holding the lock is alive it reads the
  newest again, up to rundir.LIVE_READS times, then says why it gave up in one line."""
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  with open(os.path.join(out, ".lock"), "w") as f:  # a run training into it: this process
    json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
  rotations = rotate_on_read(out, monkeypatch, 5)
  rows = evaluate.evaluate(out, log=lambda line: None)
  assert [r["step"] for r in rows] == [7] and rotations == [2, 3, 4, 5, 6]
  rotations.clear()
  monkeypatch.setattr(rundir, "LIVE_READS", 4)
  with pytest.raises(UserError, match=r"removed each newest step before it could be read "
                                      r"\(steps 7, 8, 9, 10\)"):
    evaluate.evaluate(out, log=lambda line: None)


@pytest.mark.parametrize("rotations", [1, 99])
def test_step_all_beside_a_run_that_rotates_every_step_listed_reads_the_newer_ones(
    tiny_run, tmp_path, monkeypatch, rotations):
  """step=all beside a run saving faster than it reads: each step listed was removed while
  read, no val_loss, exit 0. The steps saved meanwhile are listed and read; where those go
  too, 3 listings in all, one line (exit 2)."""
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)  # step 2
  rotate_on_read(out, monkeypatch, rotations)
  if rotations == 1:
    assert [r["step"] for r in evaluate.evaluate(out, "all", log=lambda line: None)] == [3]
    return
  with pytest.raises(UserError, match=r"removed every step listed before it could be read "
                                      r"\(steps 2, 3, 4\)"):
    evaluate.evaluate(out, "all", log=lambda line: None)


@pytest.mark.fast
def test_a_step_a_live_run_is_removing_is_left_out_not_called_damaged(tiny_run, tmp_path):
  """A run with checkpoint.keep=2 removes its oldest step state/ first: caught between the two,
  the step was 'incomplete or damaged' and evaluate exited 2. With no run training there, the
  run was killed inside that removal: left out as well (it was read, and called damaged), said
  so; a step the keep does not rotate out is damaged."""
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  root = os.path.join(out, "checkpoints")
  for n in ("1", "3"):
    shutil.copytree(os.path.join(root, "2"), os.path.join(root, n))
  shutil.rmtree(os.path.join(root, "1", "state"))  # keep=2: steps 2 and 3 stay
  lines = []
  assert [r["step"] for r in evaluate.evaluate(out, "all", log=lines.append)] == [2, 3]
  assert "step      1 | left out: it was being deleted when the run stopped" in "\n".join(lines)
  with pytest.raises(UserError, match="step 1 was being deleted when the run stopped"):
    evaluate.evaluate(out, 1, log=lambda line: None)
  shutil.rmtree(os.path.join(root, "3"))  # step 1 among the newest two: damaged
  with pytest.raises(UserError, match=r"step\(s\) 1 of .* could not be read"):
    evaluate.evaluate(out, "all", log=lambda line: None)
  shutil.copytree(os.path.join(root, "2"), os.path.join(root, "3"))
  with open(os.path.join(out, ".lock"), "w") as f:  # a run training into it: this process
    json.dump({"pid": os.getpid(), "host": socket.gethostname()}, f)
  lines = []
  rows = evaluate.evaluate(out, "all", log=lines.append)
  assert [r["step"] for r in rows] == [2, 3]
  assert any(line.split()[:3] == ["step", "1", "|"] and "removed" in line for line in lines)


@pytest.mark.fast
def test_a_step_this_user_may_not_read_is_named_not_left_out_as_damaged(tiny_run, tmp_path,
                                                                       monkeypatch):
  """step=all left a step of another user's run (umask 077) out as 'holds no state/ folder
  (incomplete or damaged)'; it is one line naming the folder and EACCES instead."""
  from test_run_tools import deny
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  step = os.path.join(out, "checkpoints", "2")
  deny(monkeypatch, step)
  lines = []
  with pytest.raises(errors.Unreadable, match=rf"'{re.escape(step)}': Permission denied"):
    evaluate.evaluate(out, "all", log=lines.append)
  assert not any("left out" in line for line in lines), lines


@pytest.mark.fast
def test_a_damaged_step_is_named_and_the_others_evaluated(tiny_run, tmp_path):
  """step=all reads every intact step, names each one it cannot read, and exits 2 at the end;
  a file named like a step is no step; one damaged step asked for is its own error."""
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  os.mkdir(os.path.join(out, "checkpoints", "5"))  # a step folder with nothing in it
  with open(os.path.join(out, "checkpoints", "7"), "w") as f:
    f.write("x")
  lines = []
  with pytest.raises(UserError, match=r"step\(s\) 5 of .* could not be read .*nanotext.verify"):
    evaluate.evaluate(out, "all", log=lines.append)
  assert [line.split()[1] for line in lines if line.startswith("step")] == ["2", "5"]
  assert "holds no state/ folder" in lines[-1]
  with pytest.raises(UserError, match="step 5 holds no state/ folder"):
    evaluate.evaluate(out, 5, log=lambda line: None)
  # The newest step asked for (no step=): refused naming the older one, as generate and convert
  # refuse it; it read step 2 and printed its loss as the run's.
  with pytest.raises(UserError, match=r"/5' holds no state/ folder .*older step\(s\) \[2\]: "
                                      r"read one with step=2$"):
    evaluate.evaluate(out, log=lambda line: None)
  abstract = wiring.prepare(BASE, TINY).abstract_state()["params"]
  with pytest.raises(UserError, match=r"older step\(s\) \[2\]: read one with "
                                      r"checkpoint.load_params_from=\S+/checkpoints/2$"):
    params_from.load(out, abstract)
  for name in ("manifest.ocdbt", "_METADATA"):  # named alone, the first was called the second
    os.remove(os.path.join(out, "checkpoints", "2", "state", name))
    with pytest.raises(UserError, match=r"the metadata of its state/ \(_METADATA, "
                                        r"manifest.ocdbt\) is missing or damaged"):
      evaluate.evaluate(out, 2, log=lambda line: None)


@pytest.mark.fast
@pytest.mark.parametrize("argv, message", [
    ([], "output_dir is required"),
    (["output_dir={run}", "step=-2"], "step=-2 is not a checkpoint step"),
    (["output_dir={run}", "step=last"], "step='last' is not a checkpoint step"),
    (["output_dir={run}", "step=+-3"], "step='+-3' is not a checkpoint step"),
    (["output_dir={run}", "step=9"], "has no checkpoint for step 9; it has [2]"),
    (["output_dir={run}/checkpoints"], "holds no config.yml"),
    (["output_dir={run}", "no.such_key=1"], "no.such_key"),
    (["output_dir={run}", "train.eval_batches=0"], "train.eval_batches"),
    # the loss of another model, reported as the run's (exit 0)
    (["output_dir={run}", "model.qk_norm=true"], "model.qk_norm changes the model the checkpoint"),
    (["output_dir={run}", "attention.window=16"], "attention.window changes the model"),
    (["output_dir={run}", "output_dir={run}"], "output_dir= is given twice"),
    (["output_dir={run}", "step=all", "step=2"], "step= is given twice"),
])
def test_bad_arguments_are_refused_before_anything_runs(tiny_run, argv, message):
  argv = [a.format(run=tiny_run[0]) for a in argv]
  with pytest.raises(UserError) as e:
    out, step, overrides = evaluate.parse(argv)
    evaluate.precheck(argv)
    evaluate.sources(out, step)
  assert message in str(e.value)


@pytest.mark.fast
@pytest.mark.parametrize("step,overrides,message", [
    (-1, ["model.qk_norm=true"], "model.qk_norm changes the model the checkpoint"),
    ("2", [], "step='2' is no step: give an int"),
])
def test_the_python_api_refuses_as_the_command_line_does(tiny_run, step, overrides, message):
  """evaluate.evaluate(out, overrides=['model...']) said config.yml had been edited (nobody
  had); a string step said 'no checkpoint for step 2; it has [2]'."""
  with pytest.raises(UserError, match=re.escape(message)):
    evaluate.evaluate(tiny_run[0], step, overrides, log=pytest.fail)


@pytest.mark.fast
def test_a_saved_mesh_of_other_devices_becomes_fsdp_over_these(tiny_run):
  out = tiny_run[0]
  cfg = evaluate.load_config(out, ["mesh.fsdp=2"])  # as if trained on 2 devices
  lines = []
  moved = evaluate.fit_mesh(cfg, out, [], 8, lines.append)
  assert (moved.mesh.data, moved.mesh.fsdp, moved.mesh.tensor) == (1, -1, 1) and len(lines) == 1
  assert evaluate.fit_mesh(cfg, out, ["mesh.fsdp=2"], 8, lines.append) is cfg  # asked for
  assert evaluate.fit_mesh(cfg, out, [], 2, lines.append) is cfg  # it spans them


@pytest.mark.fast
def test_a_model_fsdp_does_not_divide_is_evaluated_data_parallel(tiny_run):
  """d_model=64 on 3 devices: the fallback took mesh.fsdp=-1 and was refused ('model.d_model=64
  is not divisible by mesh.fsdp=3'), though mesh.data=3 evaluates it."""
  import jax
  out = tiny_run[0]
  cfg = evaluate.load_config(out, ["mesh.fsdp=2", "train.batch_size=6"])
  lines = []
  moved = evaluate.fit_mesh(cfg, out, ["train.batch_size=6"], jax.devices()[:3], lines.append)
  assert (moved.mesh.data, moved.mesh.fsdp, moved.mesh.tensor) == (-1, 1, 1)
  assert lines == ["the run's mesh (data=1 fsdp=2 tensor=1) does not span this machine's 3 "
                   "devices: evaluating with mesh.data=-1 mesh.fsdp=1 mesh.tensor=1 (set mesh.* "
                   "to choose)"]
  assert wiring.from_config(moved, devices=jax.devices()[:3], checked=True).mesh.shape["data"] == 3
  # Neither divides (8 rows over 3 devices): fsdp's, whose refusal names d_model as before.
  moved = evaluate.fit_mesh(cfg, out, [], jax.devices()[:3], lines.append)
  assert (moved.mesh.data, moved.mesh.fsdp) == (1, -1)


def test_the_cli_prints_each_steps_loss_and_refuses_a_params_only_step(tiny_run, tmp_path):
  proc = run_cli("nanotext.evaluate", f"output_dir={tiny_run[0]}", "step=all",
                 "train.eval_batches=1")
  assert proc.returncode == 0, proc.stderr
  last = proc.stdout.splitlines()[-1].split()
  assert last[:4] == ["step", "2", "|", "val_loss"] and np.isfinite(float(last[4]))
  assert "Traceback" not in proc.stderr and "Metadata file" not in proc.stderr
  folder = str(tmp_path / "p")
  params.params_only(tiny_run[0], folder, log=lambda line: None)
  one_line_error(run_cli("nanotext.evaluate", f"output_dir={folder}", "step=2"),
                 "params-only folder")


def test_every_step_evaluates_to_the_runs_own_losses_at_its_windows(tmp_path):
  """train.eval_windows=step under a window schedule: each checkpoint's loss at that step's
  windows, as the run's own evaluations in metrics.jsonl."""
  import json
  from conftest import BASE, TINY
  from nanotext.train import run
  out = str(tmp_path / "run")
  run(BASE, TINY + ["attention.window=24", "attention.window_schedule=true",
                    "attention.window_block=8", "attention.window_start=8",
                    "train.eval_windows=step", "train.steps=4", "train.eval_every=2",
                    "checkpoint.every=2", "checkpoint.keep=4", "sample.max_new_tokens=0",
                    f"output_dir={out}"], log=lambda line: None)
  with open(os.path.join(out, "metrics.jsonl")) as f:
    own = {r["step"]: r["val_loss"] for r in map(json.loads, f) if "val_loss" in r}
  rows = evaluate.evaluate(out, "all", log=lambda line: None)
  assert sorted(own) == [r["step"] for r in rows] == [2, 4]
  for r in rows:
    np.testing.assert_allclose(r["val_loss"], own[r["step"]], rtol=1e-6)
  final = evaluate.evaluate(out, 2, ["train.eval_windows=final"], log=lambda line: None)
  assert abs(final[0]["val_loss"] - own[2]) > 1e-5  # step 2's windows are not the last ones


@pytest.mark.fast
def test_the_distributed_keys_of_the_run_are_not_joined_again(tiny_run, tmp_path):
  """A 2-process run's config.yml holds its coordinator, count and index: evaluate in one
  process waited init_timeout (300 s) to join a coordinator long gone, then exit 2."""
  import shutil
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  path = os.path.join(out, "config.yml")
  with open(path) as f:
    text = f.read()
  text = text.replace("coordinator_address: ''", "coordinator_address: 10.0.0.1:1234")
  with open(path, "w") as f:
    f.write(text.replace("num_processes: 0", "num_processes: 2").replace("process_id: -1",
                                                                       "process_id: 1"))
  d = evaluate.load_config(out, [], checked=False).distributed
  assert (d.coordinator_address, d.num_processes, d.process_id) == ("", 0, -1)
  d = evaluate.load_config(out, ["distributed.num_processes=4"], checked=False).distributed
  assert d.num_processes == 4


def test_many_eval_batches_on_8_cpu_devices_do_not_deadlock(tiny_run):
  # 64 eval programs dispatched at once outnumbered XLA:CPU's threads: a collective's rendezvous
  # waited for devices that never came and aborted the process (SIGABRT, exit 134). The timeout
  # bounds a deadlock; the fixed run takes seconds.
  proc = run_cli("nanotext.evaluate", f"output_dir={tiny_run[0]}", "train.eval_batches=64",
                 timeout=150)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "64 batches" in proc.stdout and np.isfinite(float(proc.stdout.split()[-1]))


@pytest.mark.fast
def test_another_eot_id_on_a_doc_mask_run_is_refused(tiny_run, tmp_path):
  """data.eot_id=1817 on a run trained with attention.doc_mask=true printed another loss as the
  run's (the id chooses the document mask the model computes); the run's own id still passes."""
  from conftest import saved_run
  out = str(tmp_path / "doc")
  saved_run(BASE, TINY + ["attention.doc_mask=true"], out)
  evaluate.precheck([f"output_dir={out}", "data.eot_id=0"])
  said = (r"^data.eot_id changes the model the checkpoint was trained as: .* end-of-text id 0, "
          r"the overrides give 7; .*\(leave data.eot_id out, or set data.eot_id=0\)$")
  for given in ("data.eot_id=7", "data.eot_id =7"):  # the key as config.load reads it
    with pytest.raises(UserError, match=said):
      evaluate.precheck([f"output_dir={out}", given])
  with pytest.raises(UserError, match=said):
    evaluate.evaluate(out, overrides=["data.eot_id=7"], log=pytest.fail)
  evaluate.precheck([f"output_dir={tiny_run[0]}", "data.eot_id=7"])  # no doc mask: other data


@pytest.mark.fast
def test_refusals_advise_only_keys_evaluate_takes(tiny_run, tmp_path):
  """evaluate takes no model.* key, yet a mesh that does not divide the model said to change
  model.num_heads (or d_model), and model.scan_layers=true over blocks that differ to turn
  model.unet_skips off; a train.* key's advice stands."""
  quiet = lambda line: None
  with pytest.raises(UserError, match=r"^model.num_heads=2 is not divisible by mesh.tensor=8 "
                                      r".*: change the mesh \(mesh.\*\) or the number of devices$"):
    evaluate.evaluate(tiny_run[0], overrides=["mesh.tensor=8", "mesh.fsdp=1"], log=quiet)
  with pytest.raises(UserError, match="train.batch_size=4 is not divisible by mesh.data.*; "
                                      "change train.batch_size or the mesh$"):
    evaluate.evaluate(tiny_run[0], overrides=["mesh.data=8", "mesh.fsdp=1",
                                              "train.batch_size=4"], log=quiet)
  from conftest import saved_run
  out = str(tmp_path / "unet")
  saved_run(BASE, TINY + ["model.unet_skips=true"], out)
  for given in ("model.scan_layers=true", "model.scan_layers =true"):
    with pytest.raises(UserError, match=r"needs identical blocks; .*model.unet_skips=true "
                                        r"\(.*leave model.scan_layers as the run has it\)$"):
      evaluate.evaluate(out, overrides=[given], log=quiet)


@pytest.mark.fast
def test_a_run_without_checkpoints_is_refused_before_its_data_and_model(tiny_run, tmp_path):
  """It built the data and the model (its `model:` line, an absl warning) before saying
  'holds no complete checkpoint'; now the steps on disk are looked at first, before jax too."""
  out = tmp_path / "run"
  out.mkdir()
  shutil.copy(os.path.join(tiny_run[0], "config.yml"), out)
  for empty in (False, True):  # no checkpoints/ folder, then an empty one
    if empty:
      (out / "checkpoints").mkdir()
    said = r"holds no checkpoints" + (r" \(its checkpoints/ folder is empty\)$" if empty else "$")
    for step in (-1, "all"):
      lines = []
      with pytest.raises(UserError, match=r"output_dir '.*' " + said):
        evaluate.evaluate(str(out), step, log=lines.append)
      assert lines == []
    with pytest.raises(UserError, match=said):
      evaluate.precheck([f"output_dir={out}"])
