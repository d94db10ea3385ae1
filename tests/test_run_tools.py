"""One tiny run (conftest's tiny_run, trained once in-process), read by the tools as a user reads it: verify, plot,
convert (params-only, the HF mapping, the CLI's argument handling) and the parameter trees. The
fast tier's end-to-end file (tests/test_faults_tools.py: the same tools under damage and races)."""

import errno
import json
import os
import re
import shutil
import threading

import jax
import numpy as np
import pytest

from conftest import BASE, TINY, one_line_error, record_syncs, run_cli, synced_around_rename
from nanotext import checkpoint, config, integrity, loop, programs, plot, trees, verify, wiring
from nanotext.convert import __main__ as convert_cli
from nanotext.convert import common, hf, hf_tokenizer, params, torch_export
from nanotext import fileio, params_from, train
from nanotext import errors
from nanotext.errors import ResourceError, UserError

pytestmark = pytest.mark.fast

ARGS = TINY + ["train.steps=2", "train.eval_every=0", "sample.max_new_tokens=0"]  # tiny_run's


def test_the_loop_trains_and_saves_its_last_step(tiny_run):
  out, result = tiny_run
  assert isinstance(result, loop.LoopResult) and int(result.state["step"]) == 2
  assert np.isfinite(result.last_loss)
  step, saved = checkpoint.latest_params(out)
  assert step == 2
  assert integrity.checksums(saved) == integrity.checksums(jax.device_get(result.state["params"]))
  plan = programs.train_plan(wiring.prepare(BASE, ARGS), range(2))
  assert len(set(plan.values())) == 1  # no window schedule: one train program for every step


def test_verify_reads_every_step_and_names_damage(tiny_run, tmp_path):
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  lines = []
  assert verify.report(out, lines.append) == 0
  assert lines[1].split()[:3] == ["step", "2", "intact"]
  data = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(out, "checkpoints", "2", "state"))
          for f in fs if os.path.basename(d) == "d"]
  for f in data:
    os.truncate(f, os.path.getsize(f) // 2)
  lines.clear()
  assert verify.report(out, lines.append) == 1
  assert lines[1].split()[:3] == ["step", "2", "damaged"]
  shutil.rmtree(os.path.join(out, "checkpoints", "2"))
  open(os.path.join(out, "checkpoints", "2"), "w").close()  # a file where the step was
  lines.clear()
  assert verify.report(out, lines.append) == 1  # it was left out: "0 checkpoint(s)", exit 0
  assert lines[1].split()[:3] == ["step", "2", "damaged"] and "is not a folder" in lines[1]
  os.remove(os.path.join(out, "checkpoints", "2"))
  lines.clear()
  assert verify.report(out, lines.append) == 0  # nothing damaged; it said "0 checkpoint(s)"
  assert lines[0].endswith("checkpoints yet: nothing to verify")


@pytest.mark.parametrize("damage", ["truncated", "removed"])
def test_verify_reads_the_saved_config_a_resume_restores(tiny_run, tmp_path, damage):
  """A step whose config item cannot be read: a resume set it aside as damaged, verify called
  it intact."""
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  item = os.path.join(out, "checkpoints", "2", "config")
  if damage == "truncated":
    os.truncate(os.path.join(item, "metadata"), 10)
  else:
    shutil.rmtree(item)
  lines = []
  assert verify.report(out, lines.append) == 1
  assert lines[1].split()[:3] == ["step", "2", "damaged"] and "config saved in" in lines[1]
  with pytest.raises(checkpoint.Damaged):  # what the resume reads, refused the same way
    checkpoint.restore_step(checkpoint.reader(out), 2,
                            wiring.prepare(BASE, ARGS + [f"output_dir={out}"]).abstract_state())


def test_verify_of_checkpoints_copied_without_config_yml_names_the_cp(tiny_run, tmp_path):
  """checkpoints/ copied alone: verify said only that config.yml 'does not exist', where
  generate, evaluate and convert name the cp that puts the step's saved config back."""
  out = str(tmp_path / "copy")
  shutil.copytree(os.path.join(tiny_run[0], "checkpoints"), os.path.join(out, "checkpoints"))
  lines = []
  assert verify.report(out, lines.append) == 1
  saved, path = os.path.join(out, "checkpoints", "2", "config", "metadata"), \
      os.path.join(out, "config.yml")
  assert lines[1].split()[:3] == ["step", "2", "intact"]
  assert lines[-1] == (f"config.yml: output_dir '{out}' holds no config.yml, which its checkpoint "
                       f"of step 2 was saved with: put it back (cp '{saved}' '{path}': JSON is "
                       "YAML)"), lines
  shutil.copyfile(saved, path)  # as the line says
  lines.clear()
  assert verify.report(out, lines.append) == 0, lines


def deny(monkeypatch, path: str) -> None:
  """Reads of `path` (listing a folder, opening a file) refused with EACCES, as for a user who
  may not read another's run written with umask 077: permission bits do not stop root (CI)."""
  def refusing(real):
    def call(p, *args, **kwargs):
      if isinstance(p, (str, os.PathLike)) and os.path.abspath(p) == path:
        raise PermissionError(errno.EACCES, "Permission denied", os.fspath(p))
      return real(p, *args, **kwargs)
    return call
  for name in ("listdir", "scandir", "open"):
    monkeypatch.setattr(os, name, refusing(getattr(os, name)))


@pytest.mark.parametrize("denied", ["checkpoints", "step", "array file"])
def test_checkpoints_this_user_may_not_read_are_named_never_called_damaged(tiny_run, tmp_path,
                                                                         monkeypatch, denied):
  """A run another user wrote with umask 077: verify and evaluate printed 'unexpected
  PermissionError (a bug)' for checkpoints/, and called an unreadable step damaged ('holds no
  state/ folder', 'error while reading array index'). Now one line names the path and EACCES."""
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  step = os.path.join(out, "checkpoints", "2")
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step, "state")) for f in fs
           if os.path.basename(d) == "d"]
  path = {"checkpoints": os.path.dirname(step), "step": step, "array file": files[0]}[denied]
  manager = checkpoint.reader(out)
  abstract = wiring.prepare(BASE, ARGS + [f"output_dir={out}"]).abstract_state()
  deny(monkeypatch, path)
  named = rf"cannot read '{re.escape(path)}': Permission denied \(EACCES\)"
  with pytest.raises(UserError, match=named) as e:
    verify.report(out, lambda line: None)
  assert isinstance(e.value, errors.Unreadable)  # not integrity.Damaged: nothing is set aside
  reads = [lambda: checkpoint.latest_params(out),  # generate, convert
           lambda: params_from.load(out, abstract["params"])]  # evaluate, load_params_from
  if denied != "checkpoints":  # a resume lists checkpoints/ first (the reader above)
    reads.append(lambda: checkpoint.restore_step(manager, 2, abstract))
  for read in reads:
    with pytest.raises(errors.Unreadable, match=named):
      read()


@pytest.mark.parametrize("edit", [{"num_layers": 3}, {"mlp_dim": 512}, {"vocab_size": 640},
                                  {"num_heads": 4, "head_dim": 16}, {"logit_softcap": 5.0}])
def test_a_config_yml_edited_after_training_is_refused_by_every_read_tool(tiny_run, tmp_path,
                                                                         edit):
  """config.yml edited after training: to-hf raised a KeyError (a traceback) for a layer more,
  and for a wider MLP or vocabulary wrote a config.json that contradicted its weights; an edit
  that keeps every shape (heads regrouped, a softcap) was read by generate, evaluate and to-hf
  as another model, exit 0 (an HF export 0.25 off in its logits)."""
  import yaml
  from nanotext import evaluate, generate
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  with open(os.path.join(out, "config.yml")) as f:
    saved = yaml.safe_load(f)
  saved["model"].update(edit)
  with open(os.path.join(out, "config.yml"), "w") as f:
    yaml.safe_dump(saved, f)
  edited = r"config\.yml' differs from the config its checkpoint of step 2 .*edited after"
  with pytest.raises(UserError, match=edited):
    common.load_run(out)
  with pytest.raises(UserError, match=edited):
    evaluate.precheck([f"output_dir={out}"])
  with pytest.raises(UserError, match=edited):
    generate.main([f"output_dir={out}", "max_new_tokens=1"])
  lines = []  # verify: every checksum matches, yet no read tool takes the folder
  assert verify.report(out, lines.append) == 1
  assert lines[1].split()[:3] == ["step", "2", "intact"] and re.search(edited, lines[-1]), lines
  if "num_layers" in edit:  # the CLI: one line, exit 2, nothing written
    one_line_error(run_cli("nanotext.convert", "to-hf", f"--run={out}",
                           f"--out={tmp_path / 'hf'}"), "edited after", "model.num_layers: 2 -> 3")
    assert not os.path.exists(tmp_path / "hf")


def test_a_finished_run_started_again_writes_no_second_row(tiny_run, tmp_path):
  """The same command after the last step trains nothing: it says the final validation loss
  again, and metrics.jsonl keeps the one row it has of it (a rerun appended another)."""
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  with open(os.path.join(out, "metrics.jsonl")) as f:
    before = f.read()
  assert '"val_loss"' in before
  lines = []
  train.run(BASE, ARGS + [f"output_dir={out}"], log=lines.append)
  with open(os.path.join(out, "metrics.jsonl")) as f:
    assert f.read() == before
  assert any("(final; the run was complete: evaluated again, not recorded)" in line
             for line in lines), lines
  # the plurals right: "compiled 0 train step program(s)", "compile 1.2 s (1 programs)"
  assert any(l.startswith("compiled no train step program (no step left to train) and the eval "
                          "step (1 in all)") for l in lines), lines
  assert any(l.startswith("start-up:") and " s (1 program);" in l for l in lines), lines
  # log=None: no lines (a library caller's None was a TypeError at the first line)
  assert train.run(BASE, ARGS + [f"output_dir={out}"], log=None).val_loss > 0


def test_plot_reads_the_runs_metrics(tiny_run):
  got = plot.read_run(tiny_run[0])
  assert [s for s, _ in got["train"]] == [1, 2] and got["tokens_per_step"] == 8 * 32
  assert got["skipped"] == [] and got["name"] == "run"


def test_params_only_holds_the_runs_parameters(tiny_run, tmp_path):
  out = str(tmp_path / "p")
  params.params_only(tiny_run[0], out, log=lambda line: None)
  step, got = common.load_params(out)
  _, want = checkpoint.latest_params(tiny_run[0])
  assert step == 2 and integrity.checksums(got) == integrity.checksums(want)
  flat = trees.flatten(jax.device_get(got))  # one layer per name: scan_layers off
  stacked = trees.stack_blocks(flat)
  assert trees.is_stacked(stacked) and not trees.is_stacked(flat)
  back = trees.unstack_blocks(stacked)
  assert back.keys() == flat.keys() and all(np.array_equal(back[k], flat[k]) for k in flat)


def test_the_hf_mapping_of_the_tiny_model(tiny_run):
  cfg = config.load(os.path.join(tiny_run[0], "config.yml"))
  hf.check_classic(cfg)
  c = hf.hf_config(cfg)
  assert (c["n_layer"], c["n_embd"], c["n_head"], c["vocab_size"]) == (2, 64, 2, 512)
  assert c["eos_token_id"] == 0  # data.tokenizer=none: TINY's data.eot_id
  assert hf_tokenizer.special_ids("none")["eos_token_id"] is None
  eot = hf_tokenizer.special_ids("shakespeare")["eos_token_id"]
  assert isinstance(eot, int) and 0 <= eot < 8192
  with pytest.raises(UserError, match="cannot express"):
    hf.check_classic(config.load(os.path.join(os.path.dirname(BASE), "speedrun.yml")))


def test_export_torch_takes_only_what_the_record_computes(tiny_run):
  with pytest.raises(UserError, match="export-torch needs .*model.positions"):
    torch_export.check_expressible(config.load(os.path.join(tiny_run[0], "config.yml")))
  record = os.path.join(os.path.dirname(BASE), "speedrun_record.yml")
  torch_export.check_expressible(config.load(record))
  # The record's norms take float32's epsilon (torch's eps=None): another one is another function.
  with pytest.raises(UserError,
                     match=r"model.norm_eps=1e-05 is not supported .*1\.1920928955078125e-07"):
    torch_export.check_expressible(config.load(record, ["model.norm_eps=1e-5"]))


@pytest.mark.parametrize("command", sorted(convert_cli.ACCEPTS))
def test_convert_subcommand_help_names_its_flags(command):
  proc = run_cli("nanotext.convert", command, "--help")
  assert proc.returncode == 0, proc.stderr
  assert all(f"--{name}:" in proc.stdout for name in convert_cli.ACCEPTS[command] + ("force",))


@pytest.mark.parametrize("argv,message", [
    (["nope"], "unknown subcommand 'nope'"),
    (["--run=r", "--out=o"], "name a subcommand first"),  # was the help and exit 0
    ([], "name a subcommand first"),
    (["to-hf", "--hf=x", "--run=r", "--out=o"], "to-hf does not take --hf"),
    (["params-only", "--run=r"], "params-only needs --out")])
def test_convert_cli_arguments(argv, message):
  """A wrong subcommand or flag is one line, exit 2 (the real CLI: its flags are defined only
  when it runs as a program)."""
  one_line_error(run_cli("nanotext.convert", *argv), message)


def test_an_atomic_write_leaves_the_old_file_or_the_new_one(tmp_path):
  path = str(tmp_path / "f")
  fileio.atomic_write(path, [b"old"])

  def failing():
    yield b"half"
    raise OSError("disk full")
  with pytest.raises(OSError):
    fileio.atomic_write(path, failing())
  assert open(path, "rb").read() == b"old" and os.listdir(tmp_path) == ["f"]


def test_an_atomic_write_fsyncs_the_file_before_the_rename(tmp_path, monkeypatch):
  """A rename of a file not yet on disk can leave it empty after a power cut (ext4's delayed
  allocation): the temp file is fsynced before os.replace, the folder after it."""
  events = record_syncs(monkeypatch)
  path = str(tmp_path / "f")
  fileio.atomic_write(path, [b"new"])
  assert open(path, "rb").read() == b"new"
  synced_around_rename(events, [path], path)


def test_a_staged_output_is_on_disk_before_its_rename(tmp_path, monkeypatch):
  """staged_file and staged_dir fsync what was written (every file and folder) before the
  rename onto --out, and its folder after, as atomic_write does."""
  from nanotext.outputs import staged_dir, staged_file
  events = record_syncs(monkeypatch)
  out = str(tmp_path / "model.safetensors")
  with staged_file(out, force=False) as tmp:
    open(tmp, "wb").write(b"weights")
  synced_around_rename(events, [out], out)
  out = str(tmp_path / "hf")
  with staged_dir(out, force=False) as tmp:
    os.makedirs(os.path.join(tmp, "sub"))
    open(os.path.join(tmp, "sub", "a"), "wb").write(b"a")
    open(os.path.join(tmp, "b"), "wb").write(b"b")
  synced_around_rename(events, [out, f"{out}/sub", f"{out}/sub/a", f"{out}/b"], out)


def test_a_failed_conversion_outlasts_a_writer_still_finishing_in_it(tmp_path):
  """A failed orbax save returns while tensorstore still writes its other files (CI once found
  a '.out.tmp-*' left): staged_dir waits for them and leaves the folder of --out empty."""
  from nanotext.outputs import staged_dir
  started, raised = threading.Event(), threading.Event()

  def late_writer(tmp):
    with open(os.path.join(tmp, "first"), "wb"):  # held open while the save fails
      started.set()
      raised.wait(30)
      os.makedirs(os.path.join(tmp, "d"), exist_ok=True)
      with open(os.path.join(tmp, "d", "late"), "wb") as f:
        f.write(b"x")

  with pytest.raises(ResourceError, match="No space left"):
    with staged_dir(str(tmp_path / "out"), force=False) as tmp:
      writer = threading.Thread(target=late_writer, args=(tmp,))
      writer.start()
      started.wait(30)
      raised.set()
      raise OSError(28, "No space left on device")
  writer.join()
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fails", [False, True])
def test_replacing_an_output_is_whole_under_a_signal_or_a_failed_rename(tmp_path, monkeypatch,
                                                                        fails):
  """--force onto an existing folder sets the old one aside, then renames the new one in. A
  Ctrl-C between the two renames left neither: the old aside under a hidden name, the new one
  deleted. Now the signal takes effect after the swap, and a failed second rename puts the old
  one back."""
  import signal
  from nanotext import outputs
  out = tmp_path / "out"
  out.mkdir()
  (out / "OLD").write_text("the previous export")
  real = os.replace

  def replace(a, b):
    if fails and os.path.basename(a).startswith(".out.tmp-"):
      raise OSError(5, "Input/output error")
    real(a, b)
    if a == str(out) and not fails:  # the old output just set aside
      signal.raise_signal(signal.SIGINT)

  monkeypatch.setattr(outputs.os, "replace", replace)
  # Ctrl-C as a tool meets it (a test before this one in the worker may have set another)
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    with pytest.raises(OSError if fails else KeyboardInterrupt):
      with outputs.staged_dir(str(out), force=True) as tmp:
        with open(os.path.join(tmp, "NEW"), "w") as f:
          f.write("the new export")
  finally:
    signal.signal(signal.SIGINT, previous)
  assert os.listdir(out) == ["OLD" if fails else "NEW"]
  assert sorted(os.listdir(tmp_path)) == ["out"]  # nothing aside, nothing staged left


def test_out_a_link_to_an_empty_folder_is_treated_as_a_link(tiny_run, tmp_path):
  """--out a link to an empty folder passed as an empty folder, then the rename onto the link
  crashed (NotADirectoryError, a traceback). A link is replaced, not written through, as a link
  to a folder that holds files: refused while the link is not its own, with --force or without
  (which said 'pass --force', then --force said 'is a link')."""
  (tmp_path / "empty").mkdir()
  (tmp_path / "link").symlink_to(tmp_path / "empty")
  for force in (False, True):
    with pytest.raises(UserError, match="is a link .* give the path it links to"):
      params.params_only(tiny_run[0], str(tmp_path / "link"), force=force, log=pytest.fail)
  assert os.path.islink(tmp_path / "link") and os.listdir(tmp_path / "empty") == []
  assert sorted(os.listdir(tmp_path)) == ["empty", "link"]


def test_out_a_mount_point_is_refused_before_the_work(tiny_run, tmp_path, monkeypatch):
  """--out an empty mount point (a docker volume): every convert subcommand did its whole work,
  then crashed renaming onto it (EBUSY) with a traceback. Refused before reading the run; a
  rename refused all the same is one line, nothing left beside --out."""
  import errno
  from nanotext import outputs
  out = tmp_path / "mnt"
  out.mkdir()
  real_ismount, real_replace = os.path.ismount, os.replace
  monkeypatch.setattr(outputs.os.path, "ismount",
                      lambda p: os.path.abspath(p) == str(out) or real_ismount(p))
  with pytest.raises(UserError, match=r"is a mount point, which the output cannot replace .* "
                                      r"give a new folder inside it, such as '.*/mnt/out'"):
    params.params_only(tiny_run[0], str(out), log=pytest.fail)  # refused before it reads
  monkeypatch.setattr(outputs.os.path, "ismount", real_ismount)

  def replace(a, b):
    if os.path.basename(b) in ("mnt", "mnt.safetensors"):  # a file can be a mount point too
      raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))
    real_replace(a, b)
  monkeypatch.setattr(outputs.os, "replace", replace)
  for staged, name in ((outputs.staged_dir, "mnt"), (outputs.staged_file, "mnt.safetensors")):
    with pytest.raises(UserError, match=f"'.*/{name}' cannot be replaced \\(Device or resource "
                                        "busy"):
      with staged(str(tmp_path / name), force=True):
        pass
    assert os.listdir(tmp_path) == ["mnt"]


def test_force_onto_an_output_that_cannot_be_moved_is_one_line(tmp_path, monkeypatch):
  """--force onto an earlier export that is immutable (or read-only, which a move to another
  folder needs): a traceback after the whole conversion, an empty '.out.old-*' left each time;
  the same for an immutable empty --out. Now refused before the work (os.access), and a rename
  refused all the same leaves --out and its folder as they were."""
  import errno
  from nanotext import outputs
  out = tmp_path / "out"
  out.mkdir()
  for force in (False, True):  # empty, then an earlier output
    real_access = os.access
    monkeypatch.setattr(outputs.os, "access",
                        lambda p, m: p != str(out) and real_access(p, m))
    with pytest.raises(UserError, match=r"'.*/out' is read-only or immutable, so it cannot be "
                                        r"replaced; make it writable"):
      outputs.check_out(str(out), force=force)
    monkeypatch.setattr(outputs.os, "access", real_access)
    real_replace = os.replace

    def replace(a, b):
      if str(out) in (a, b):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))
      real_replace(a, b)
    monkeypatch.setattr(outputs.os, "replace", replace)
    with pytest.raises(UserError, match=r"'.*/out' cannot be replaced \(Operation not permitted"):
      with outputs.staged_dir(str(out), force=force) as tmp:
        with open(os.path.join(tmp, "NEW"), "w") as f:
          f.write("the new export")
    monkeypatch.setattr(outputs.os, "replace", real_replace)
    assert os.listdir(tmp_path) == ["out"]  # no '.out.old-*', no '.out.tmp-*'
    assert os.listdir(out) == ([] if not force else ["OLD"])
    (out / "OLD").write_text("the previous export")


def test_a_failed_write_removes_the_folders_made_for_its_out(tmp_path):
  """--out=a/b/c onto a full disk left the empty a/b it had made."""
  from nanotext.outputs import staged_dir, staged_file
  (tmp_path / "kept").mkdir()
  for staged, out in ((staged_dir, tmp_path / "a" / "b" / "c"),
                      (staged_file, tmp_path / "kept" / "d" / "e.safetensors")):
    with pytest.raises(ResourceError, match="No space left"):
      with staged(str(out), force=False):
        raise OSError(28, "No space left on device")
    assert sorted(os.listdir(tmp_path)) == ["kept"] and os.listdir(tmp_path / "kept") == []


def test_a_signal_after_the_body_removes_the_staged_output(tmp_path, monkeypatch):
  """Ctrl-C or SIGTERM after the body wrote the whole output, in the chmod walk before the
  rename: text_shards exited 130 and left '.out.tmp-*' holding every shard. Now the staged
  folder and the folders made for --out go, as for a signal in the body."""
  from nanotext import outputs

  def interrupted(path):
    raise KeyboardInterrupt()
  monkeypatch.setattr(outputs, "_shared", interrupted)
  with pytest.raises(KeyboardInterrupt):
    with outputs.staged_dir(str(tmp_path / "a" / "b" / "out"), force=False) as tmp:
      with open(os.path.join(tmp, "meta.json"), "w") as f:
        f.write("{}")
  assert os.listdir(tmp_path) == []


def test_the_tools_name_what_was_given(tiny_run, tmp_path):
  """convert named --step as step=; verify called a missing path or a file a folder without
  checkpoints/, and a params-only folder without convert.json 'step -1' (generate: unknown)."""
  with pytest.raises(UserError, match=r"^--step=-5 is not a checkpoint step"):
    params.params_only(tiny_run[0], str(tmp_path / "p"), step=-5, log=lambda line: None)
  params.params_only(tiny_run[0], str(tmp_path / "po"), log=lambda line: None)
  for step in (-5, 2):  # -5 was taken for the newest; a params-only folder has one step
    with pytest.raises(UserError, match=r"--run '.*/po' is a params-only folder \(one step\): "
                                        r"leave --step out$") as e:
      params.params_only(str(tmp_path / "po"), str(tmp_path / "p"), step=step, log=pytest.fail)
    assert str(e.value).startswith("--step=-5 is not a checkpoint step: " if step < 0 else "--run")
  (tmp_path / "file").write_text("x")
  for path, what in ((tmp_path / "nope", "does not exist"), (tmp_path / "file",
                                                             "is not a directory")):
    with pytest.raises(UserError, match=f"'{re.escape(str(path))}' {what}"):
      verify.report(str(path), lambda line: None)
  params.params_only(tiny_run[0], str(tmp_path / "p"), log=lambda line: None)
  os.remove(tmp_path / "p" / "convert.json")
  lines = []
  assert verify.report(str(tmp_path / "p"), lines.append) == 0
  assert lines[1].split()[:4] == ["step", "unknown", "(no", "convert.json)"], lines


def test_converted_files_are_readable_as_the_umask_allows(tmp_path):
  """safetensors writes its file 0600 (as mkstemp makes one): to-hf's model.safetensors and
  every export-torch file were unreadable to anyone else, the other outputs 0644."""
  from nanotext.outputs import staged_dir, staged_file
  old = os.umask(0o022)
  try:
    with staged_file(str(tmp_path / "model.safetensors"), force=False) as tmp:
      with open(tmp, "wb") as f:
        f.write(b"x")
      os.chmod(tmp, 0o600)
    with staged_dir(str(tmp_path / "hf"), force=False) as tmp:
      os.makedirs(os.path.join(tmp, "sub"))
      for name in ("model.safetensors", os.path.join("sub", "a.json")):
        with open(os.path.join(tmp, name), "wb") as f:
          f.write(b"x")
        os.chmod(os.path.join(tmp, name), 0o600)
  finally:
    os.umask(old)
  for path in ("model.safetensors", "hf/model.safetensors", "hf/sub/a.json"):
    assert os.stat(tmp_path / path).st_mode & 0o777 == 0o644, path


def test_a_damaged_newest_step_names_the_step_to_read_instead(tiny_run, tmp_path):
  """'read an older one' named neither the steps there nor how to pick one."""
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  os.makedirs(os.path.join(out, "checkpoints", "7"))  # newer than step 2, and empty
  with pytest.raises(UserError, match=r"holds no state/.*older step\(s\) \[2\]: read one with "
                                      r"--step=2$"):
    common.load_run(out)
  one_line_error(run_cli("nanotext.convert", "params-only", f"--run={out}",
                         f"--out={tmp_path / 'p'}"), "read one with --step=2")
  assert common.load_run(out, 2)[1] == 2


def _swap_weights(folder: str, params) -> None:
  """`folder`'s params/ written again holding `params` with one weight changed: bytes that
  still read, as a garbled compressed chunk can, but are not the ones written."""
  import orbax.checkpoint as ocp
  flat = jax.tree.leaves(params)
  flat[0] = np.asarray(flat[0]) + 1
  where = os.path.join(folder, "params")
  shutil.rmtree(where)
  ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())
  ckptr.save(where, ocp.args.StandardSave(jax.tree.unflatten(jax.tree.structure(params), flat)))
  ckptr.close()


def test_a_params_only_folder_is_checked_against_its_checksums(tiny_run, tmp_path):
  """Garbled weights in a params-only folder gave generate's text and evaluate's val_loss (nan,
  inf) with exit 0, where a full checkpoint damaged the same way is refused; a folder written
  before the checksums existed is read as before."""
  out = str(tmp_path / "p")
  params.params_only(tiny_run[0], out, log=lambda line: None)
  good = common.load_params(out)[1]
  abstract = wiring.prepare(BASE, ARGS).abstract_state()["params"]
  old = str(tmp_path / "old")
  shutil.copytree(out, old)
  with open(os.path.join(old, "convert.json")) as f:
    record = json.load(f)
  assert len(record.pop("checksums")) == len(jax.tree.leaves(good))
  with open(os.path.join(old, "convert.json"), "w") as f:
    json.dump(record, f)
  assert integrity.checksums(common.load_params(old)[1]) == integrity.checksums(good)
  lines = []
  assert verify.report(old, lines.append) == 0 and lines[1].split()[2] == "unverified", lines
  # A record that lists none of the arrays (a name edited) checked nothing and said 'intact'.
  record["checksums"] = {"params/embed/embeddings": "0" * 16}
  with open(os.path.join(old, "convert.json"), "w") as f:
    json.dump(record, f)
  lines.clear()
  assert verify.report(old, lines.append) == 1 and "has no checksum saved with it" in lines[1]
  for emptied in ({}, []):  # read unchecked, 'unverified', exit 0; only a missing key is so
    record["checksums"] = emptied
    with open(os.path.join(old, "convert.json"), "w") as f:
      json.dump(record, f)
    with pytest.raises(integrity.Damaged, match="its integrity record lists no checksums"):
      common.load_params(old)
  _swap_weights(out, good)
  with pytest.raises(integrity.Damaged, match=r"is damaged: array params/\S+ .*does not match"):
    common.load_params(out)
  with pytest.raises(integrity.Damaged, match=r"is damaged: array params/\S+ .*does not match"):
    params_from.load(out, abstract)
  lines.clear()
  assert verify.report(out, lines.append) == 1 and lines[1].split()[1:3] == ["2", "damaged"], lines
  one_line_error(run_cli("nanotext.evaluate", f"output_dir={out}"),
                 "does not match")


@pytest.mark.parametrize("name", ["checkpoints", "tb"])
def test_force_never_replaces_a_folder_of_a_run(tiny_run, tmp_path, name):
  """--out=RUN/checkpoints --force replaced every step of the run with the conversion (the
  guard refused only paths inside checkpoints/)."""
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  os.makedirs(os.path.join(out, name), exist_ok=True)
  before = sorted(os.listdir(os.path.join(out, name)))
  with pytest.raises(UserError, match=f"is the {name} of the run"):
    params.params_only(tiny_run[0], os.path.join(out, name), force=True, log=lambda line: None)
  assert sorted(os.listdir(os.path.join(out, name))) == before


def verify_and_resume_say_damaged(run: str, why: str) -> None:
  """verify calls step 2 of `run` damaged, and a resume's restore of it raises Damaged (`why`)."""
  lines = []
  assert verify.report(run, lines.append) == 1 and lines[1].split()[1:3] == ["2", "damaged"], lines
  manager = checkpoint.reader(run)
  with pytest.raises(integrity.Damaged, match=why):
    checkpoint.restore_step(manager, 2, wiring.prepare(BASE, ARGS).abstract_state())
  checkpoint.close(manager)


def test_a_step_whose_integrity_record_is_emptied_is_damaged(tiny_run, tmp_path):
  """integrity/metadata emptied ({}), unreadable or not an object: the step read as written
  before checksums existed, its damaged arrays resumed from silently (or a traceback). Only a
  step without the folder is so."""
  run = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], run)
  abstract = wiring.prepare(BASE, ARGS).abstract_state()["params"]
  step = os.path.join(run, "checkpoints", "2")
  for text in ("{}", "{", "[1]"):
    with open(os.path.join(step, "integrity", "metadata"), "w") as f:
      f.write(text)
    with pytest.raises(integrity.Damaged, match="integrity record lists no checksums"):
      params_from.load(step, abstract)
  assert integrity.record_beside(os.path.join(step, "state")) == {}
  # valid JSON but not an object: a resume and verify said "'list' object has no attribute 'get'"
  verify_and_resume_say_damaged(run, "integrity record lists no checksums")
  shutil.rmtree(os.path.join(step, "integrity"))
  # the folder gone from a step saved with one (its orbax metadata lists it): damaged too, where
  # every tool read it as written before checksums ("unverified") and a resume restored it
  with pytest.raises(integrity.Damaged, match="integrity/ folder .* is gone"):
    params_from.load(step, abstract)
  verify_and_resume_say_damaged(run, "integrity/ folder .* is gone")
  meta = os.path.join(step, "_CHECKPOINT_METADATA")
  with open(meta) as f:
    written = json.load(f)
  del written["item_handlers"]["integrity"]  # a step from before records existed
  with open(meta, "w") as f:
    json.dump(written, f)
  assert integrity.record_beside(os.path.join(step, "state")) is None
  with pytest.raises(integrity.Damaged, match="integrity record lists no checksums"):
    integrity.verify_named({"a": np.zeros(2)}, {"checksums": {}}, step)
  integrity.verify_named({"a": np.zeros(2)}, None, step)


def test_a_step_of_another_optimizers_layout_says_so_not_damaged(tiny_run):
  """A run saved before nanotext changed its optimizer state's layout (135dfa7 moved a tied
  table to the head's group) was 'does not match this model or is damaged' while verify called
  every step intact; its parameters fit: the line says so and how to go on from them."""
  out = tiny_run[0]
  step = os.path.join(out, "checkpoints", "2")
  restore = lambda *o: checkpoint.restore_step(checkpoint.reader(out), 2, wiring.prepare(
      BASE, ARGS + [f"output_dir={out}", *o]).abstract_state())
  with pytest.raises(integrity.Damaged, match=re.escape(
      f"'{step}' holds this model's parameters with an optimizer state laid out for another "
      f"optimizer") + ".*" + re.escape(f"checkpoint.load_params_from={step}")):
    restore("optim.name=muon")
  with pytest.raises(integrity.Damaged, match="does not match this model or is damaged"):
    restore("model.d_model=128")  # another model: its parameters do not fit either
  assert restore()[0]["params"]  # the run's own optimizer: it restores
