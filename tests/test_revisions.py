"""Arithmetic revisions: each checkpoint records the one that wrote it, and a resume names the
changes since then that touch its config."""

import json
import os
import shutil

import pytest

from conftest import BASE, TINY
from nanotext import config, revisions
from nanotext.train import run

FUSED_MUON = ["optim.name=muon", "model.fused_qkv=true", "model.bias=false",
              "optim.muon_scale=fan_out"]


def cfg_of(*overrides):
  return config.load(BASE, [*TINY, *overrides])


@pytest.mark.fast
def test_a_change_is_named_only_for_the_configs_it_touches():
  old = {"checksums": {}}  # a step saved before revisions were recorded
  note = revisions.resume_note(old, cfg_of(*FUSED_MUON), 7)
  assert "step 7" in note and "356920f" in note and "a818eac" not in note
  assert "a818eac" in revisions.resume_note(old, cfg_of("model.param_dtype=bfloat16"), 7)
  assert revisions.resume_note(old, cfg_of(), 7) == ""  # adamw in float32: nothing changed
  assert revisions.resume_note(old, cfg_of(*FUSED_MUON, "optim.muon_scale=rows"), 7) == ""


@pytest.mark.fast
def test_only_changes_after_the_saved_revision_are_named():
  cfg = cfg_of(*FUSED_MUON, "train.loss_reduction=row_sum")
  assert "356920f" in revisions.resume_note({"revision": 0}, cfg, 1)
  after_first = revisions.resume_note({"revision": 1}, cfg, 1)
  assert "8065c25" in after_first and "356920f" not in after_first
  assert revisions.resume_note({"revision": revisions.CURRENT}, cfg, 1) == ""
  newer = revisions.resume_note({"revision": revisions.CURRENT + 1}, cfg_of(), 1)
  assert "newer nanotext" in newer


@pytest.mark.fast
def test_a_resume_under_other_xla_flags_says_its_steps_may_round_otherwise(monkeypatch):
  """Any XLA_FLAGS left out nanotext's CPU flags: a resume under a flag that changes nothing
  else went on in other last bits than the run that saved it, unsaid."""
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
  note = revisions.resume_note({"revision": revisions.CURRENT, "xla_flags": ""}, cfg_of(), 4)
  assert note.startswith("note: the checkpoint of step 4 was saved under XLA_FLAGS=''")
  assert "'--xla_force_host_platform_device_count=1'" in note and "\n" not in note
  assert revisions.resume_note(revisions.stamp(), cfg_of(), 4) == ""
  assert revisions.resume_note({"revision": revisions.CURRENT}, cfg_of(), 4) == ""  # unrecorded
  both = revisions.resume_note({"xla_flags": "--x"}, cfg_of("model.param_dtype=bfloat16"), 4)
  assert [l[:40] for l in both.split("\n")] == [
      "note: the checkpoint of step 4 was saved", "note: the checkpoint of step 4 was saved"]


@pytest.mark.fast
def test_a_resume_under_another_jax_or_device_kind_says_its_steps_may_round_otherwise():
  """A run carried between jax 0.11.2 and 0.10.2 resumed in other last bits (probe R: 7.8e-5 in
  the record's loss three steps on), unsaid: the checkpoint did not record what compiled it."""
  now = revisions.compiler()
  assert now.startswith("jax ") and ", jaxlib " in now and now.endswith(", cpu")
  saved = {**revisions.stamp(), "compiler": "jax 0.11.2, jaxlib 0.11.2, NVIDIA H100 80GB HBM3"}
  note = revisions.resume_note(saved, cfg_of(), 4)
  assert note == ("note: the checkpoint of step 4 was saved by jax 0.11.2, jaxlib 0.11.2, NVIDIA "
                  f"H100 80GB HBM3; this process runs {now}: XLA may round the steps from here "
                  "otherwise than an uninterrupted run")
  assert revisions.resume_note({**saved, "compiler": now}, cfg_of(), 4) == ""
  for unrecorded in (None, 3, ["jax"]):  # an older checkpoint's, or junk: nothing said
    assert revisions.resume_note({**saved, "compiler": unrecorded}, cfg_of(), 4) == ""
  # from-torch's step 0 (converted on a CPU, trained on a GPU): no step was taken to round
  assert revisions.resume_note({**saved, "xla_flags": "--x"}, cfg_of(), 0) == ""


@pytest.mark.fast
def test_a_revision_that_is_not_a_whole_number_reads_as_unrecorded():
  for junk in (True, "3", 2.0, None, -1):
    assert revisions.saved_revision({"revision": junk}) == 0
  assert revisions.saved_revision(None) == 0


def test_a_checkpoint_records_its_revision_and_a_resume_names_later_changes(tiny_run, tmp_path,
                                                                             monkeypatch):
  out = str(tmp_path / "run")
  shutil.copytree(tiny_run[0], out)
  assert saved_revision(out, 2) == revisions.CURRENT
  assert saved_integrity(out, 2)["xla_flags"] == os.environ.get("XLA_FLAGS", "")
  assert saved_integrity(out, 2)["compiler"] == revisions.compiler()
  later = revisions.Change(revisions.CURRENT + 1, "abc1234", lambda cfg: True, "a change")
  monkeypatch.setattr(revisions, "CHANGES", (*revisions.CHANGES, later))
  monkeypatch.setattr(revisions, "CURRENT", later.revision)
  lines = []
  run(BASE, TINY + ["train.steps=3", "train.eval_every=0", "sample.max_new_tokens=0",
                    f"output_dir={out}"], log=lines.append)
  notes = [l for l in lines if l.startswith("note:")]
  assert len(notes) == 1 and "step 2" in notes[0] and "a change (abc1234)" in notes[0], lines
  assert saved_revision(out, 3) == later.revision
  monkeypatch.setattr(revisions, "CURRENT", later.revision + 1)  # no step left: nothing to say
  monkeypatch.setattr(revisions, "CHANGES", (*revisions.CHANGES, later._replace(
      revision=later.revision + 1)))
  lines.clear()
  run(BASE, TINY + ["train.steps=3", "train.eval_every=0", "sample.max_new_tokens=0",
                    f"output_dir={out}"], log=lines.append)
  assert not [l for l in lines if l.startswith("note:")], lines


def saved_integrity(out: str, step: int) -> dict:
  with open(os.path.join(out, "checkpoints", str(step), "integrity", "metadata")) as f:
    return json.load(f)  # orbax's JsonSave file


def saved_revision(out: str, step: int):
  return saved_integrity(out, step)["revision"]
