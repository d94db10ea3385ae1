"""Metric writers (metrics.jsonl, TensorBoard) and the FLOP count behind MFU."""

import glob
import json
import os
import struct
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from tensorboardX.proto import event_pb2

from conftest import BASE, PROCESS_TIMEOUT_S, TINY
from nanotext import config, metrics, wiring
from nanotext.model import gpt

pytestmark = pytest.mark.fast


def read_jsonl(path):
  with open(os.path.join(path, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def read_events(path):
  """Scalar (tag, step, value) triples of every TensorBoard event file under `path`."""
  out = []
  for name in sorted(glob.glob(os.path.join(path, "events.out.tfevents.*"))):
    with open(name, "rb") as f:
      data = f.read()
    i = 0
    while i < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
      (n,) = struct.unpack("<Q", data[i:i + 8])
      event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
  return out


def test_writer_one_json_line_per_call_step_first_values_float(tmp_path):
  """Each write is one line, `step` first as an int, array and int values as floats."""
  w = metrics.Writer(str(tmp_path), tensorboard=False)
  w.write(np.int64(3), {"loss": np.float32(2.5), "compiles": 0, "lr": jax.numpy.float32(1e-3)})
  w.write(4, {"val_loss": 1.25, "note": "text"})
  w.close()
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 2
  first, second = (json.loads(line) for line in lines)
  assert list(first) == ["step", "loss", "compiles", "lr"]
  assert first["step"] == 3 and type(first["step"]) is int
  assert first["loss"] == 2.5 and type(first["compiles"]) is float
  assert first["lr"] == pytest.approx(1e-3)
  assert second == {"step": 4, "val_loss": 1.25, "note": "text"}  # non-numbers stay as they are
  assert not os.path.exists(tmp_path / "tb")


def test_writer_appends_across_instances(tmp_path):
  """A resumed run's writer appends to the metrics.jsonl of the run before it."""
  for step in (1, 2):
    w = metrics.Writer(str(tmp_path), tensorboard=False)
    w.write(step, {"loss": float(step)})
    w.close()
  assert read_jsonl(tmp_path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]


def test_a_resumed_writer_drops_the_rows_past_its_step(tmp_path):
  """A run killed past its newest checkpoint wrote rows it trains again on resume: they were
  kept, so steps came twice (and a resume with a lower train.steps left rows past it)."""
  w = metrics.Writer(str(tmp_path), tensorboard=False)
  for step in (1, 2, 3, 4, 4, 5):
    w.write(step, {"loss": float(step)})
  w.close()
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write("not a row\n")  # kept: only rows of later steps go
  w = metrics.Writer(str(tmp_path), tensorboard=False, resumed_at=3)
  assert len(read_lines(tmp_path)) == 7  # nothing changes before the run writes
  w.write(4, {"loss": 40.0})
  w.write(5, {"loss": 50.0})
  w.close()
  assert read_lines(tmp_path) == ['{"step": 1, "loss": 1.0}', '{"step": 2, "loss": 2.0}',
                                  '{"step": 3, "loss": 3.0}', "not a row",
                                  '{"step": 4, "loss": 40.0}', '{"step": 5, "loss": 50.0}']
  w = metrics.Writer(str(tmp_path), tensorboard=False, resumed_at=0)  # a start from scratch
  w.write(0, {"val_loss": 9.0})
  w.close()
  assert read_lines(tmp_path) == ["not a row", '{"step": 0, "val_loss": 9.0}']


def test_a_resumed_writer_drops_the_rows_past_its_step_when_training_begins(tmp_path):
  """A resumed run stopped before its first row (a signal in its first step, a non-finite
  abort) left the killed run's rows past its checkpoint; they go when training begins."""
  (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n'
                                                  for s in (1, 2, 3)))
  w = metrics.Writer(str(tmp_path), tensorboard=False, resumed_at=2)
  assert len(read_lines(tmp_path)) == 3  # nothing changes before training begins
  w.begin()
  w.close()
  assert read_lines(tmp_path) == ['{"step": 1, "loss": 1.0}', '{"step": 2, "loss": 1.0}']


def test_a_row_of_the_resumed_step_already_recorded_is_not_written_again(tmp_path):
  """A run ended at its checkpoint evaluates that step again: its val row was there already
  and another was appended (each start, one more). A metric of the step is recorded once."""
  (tmp_path / "metrics.jsonl").write_text('{"step": 2, "loss": 2.0}\n'
                                          '{"step": 2, "val_loss": 5.0}\n')
  w = metrics.Writer(str(tmp_path), tensorboard=True, resumed_at=2)
  w.write(2, {"val_loss": 5.0})
  w.write(2, {"other": 1.0})  # a metric the step has no row of is written
  w.close()
  assert read_lines(tmp_path) == ['{"step": 2, "loss": 2.0}', '{"step": 2, "val_loss": 5.0}',
                                  '{"step": 2, "other": 1.0}']
  assert read_events(str(tmp_path / "tb")) == [("other", 2, 1.0)]


def test_a_row_cut_short_by_a_crash_is_no_glue_for_the_next(tmp_path):
  """metrics.jsonl ending inside a row (a crash mid-append): the resumed run's first row was
  appended to it, one broken line. A part row goes; a whole row without its newline gets one."""
  whole = '{"step": 2, "loss": 2.5}'
  for tail, kept in (('{"step": 3, "lo', []), (whole, [whole])):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n' + tail)
    w = metrics.Writer(str(tmp_path), tensorboard=False, resumed_at=2)
    w.write(3, {"loss": 3.0})
    w.close()
    assert read_lines(tmp_path) == ['{"step": 1, "loss": 1.0}', *kept, '{"step": 3, "loss": 3.0}']


def read_lines(folder) -> list:
  return (folder / "metrics.jsonl").read_text().splitlines()


def test_sync_puts_the_rows_and_events_on_disk(tmp_path, monkeypatch):
  synced, fsync = [], os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}"))
                      or fsync(fd))
  w = metrics.Writer(str(tmp_path), tensorboard=True)
  w.write(1, {"loss": 2.0})
  w.sync()
  [events] = glob.glob(os.path.join(tmp_path, "tb", "events.out.tfevents.*"))
  assert sorted(synced) == sorted([str(tmp_path / "metrics.jsonl"), events])


def test_disabled_writer_writes_nothing(tmp_path):
  """A writer on a process other than 0 creates no directory and no file."""
  out = tmp_path / "run"
  w = metrics.Writer(str(out), tensorboard=True, enabled=False)
  w.write(1, {"loss": 1.0})
  w.close()
  assert not out.exists()


def test_writer_tensorboard_scalars(tmp_path):
  """With tensorboard on, each numeric value becomes a scalar at its step; text is skipped."""
  w = metrics.Writer(str(tmp_path), tensorboard=True)
  w.write(1, {"loss": 3.0, "note": "x"})
  w.write(2, {"loss": 2.0, "mfu": np.float32(0.25)})
  w.close()
  assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
  assert sorted(read_events(str(tmp_path / "tb"))) == [("loss", 1, 3.0), ("loss", 2, 2.0),
                                                       ("mfu", 2, 0.25)]
  assert len(read_jsonl(tmp_path)) == 2


def test_a_resumed_run_tells_tensorboard_to_drop_the_steps_it_trains_again(tmp_path):
  """A killed run's rows past its checkpoint go from metrics.jsonl on resume; TensorBoard kept
  them in the old event file (those steps shown twice). The new file starts with a session
  START at the first step trained again, which TensorBoard purges earlier files from."""
  w = metrics.Writer(str(tmp_path), tensorboard=True)
  for step in (1, 2, 3):
    w.write(step, {"loss": float(step)})
  w.close()
  w = metrics.Writer(str(tmp_path), tensorboard=True, resumed_at=2)
  w.write(3, {"loss": 30.0})
  w.close()
  events = []
  for name in sorted(glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))):
    with open(name, "rb") as f:
      data = f.read()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      events.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
      i += 12 + n + 4
  start, row = events[-2:]  # after the three rows of the first session
  assert start.session_log.status == event_pb2.SessionLog.START and start.step == 3
  assert [(v.tag, row.step, v.simple_value) for v in row.summary.value] == [("loss", 3, 30.0)]


def test_tensorboard_events_do_not_import_pytorch(tmp_path):
  """The event writer loads tensorboardX's protos without its package's __init__ (whose writer
  imports PyTorch where installed: 1.4 s of every run's start); tensorboardX imports whole
  afterwards, and its parser reads the file."""
  script = (
      "import sys\n"
      "from nanotext import metrics\n"
      f"events = metrics.Events({str(tmp_path)!r})\n"
      "events.scalars(3, {'loss': 2.5})\n"
      "events.close()\n"
      "assert 'torch' not in sys.modules, 'torch imported'\n"
      "import tensorboardX\n"
      "assert hasattr(tensorboardX, 'SummaryWriter')\n")
  out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=PROCESS_TIMEOUT_S)
  assert out.returncode == 0, out.stderr
  assert read_events(str(tmp_path)) == [("loss", 3, 2.5)]


def model_cfg(*overrides):
  """TINY's model (2 layers, d 64, 2 heads of 32, mlp 256, vocab 512) with derived values."""
  return wiring.finalize(config.load(BASE, TINY + list(overrides)), jax.devices()[:1]).model


# Hand count for TINY: per attention layer q, k, v, o are 64x64, per layer fc + proj 64x256 each,
# the lm head 64x512.
QKVO, MLP, HEAD = 4 * 64 * 64, 2 * 64 * 256, 64 * 512
T = 32


def causal_keys(t, window=0):
  """Average number of keys a query sees, counted position by position."""
  return sum(min(i + 1, window or t) for i in range(t)) / t


def attn_flops(keys):
  """Forward scores + weighted sum (2 matmuls, 2 FLOPs per MAC) over 2 heads x 32, times 3."""
  return 3 * 4 * keys * 64


def test_flops_per_token_hand_count():
  """6 * matmul params plus the causal attention term, for 2 layers of full causal attention."""
  m = model_cfg()
  want = 6 * (2 * QKVO + 2 * MLP + HEAD) + 2 * attn_flops(causal_keys(T))
  assert causal_keys(T) == 16.5
  assert metrics.flops_per_token(m, T) == pytest.approx(want)
  assert want == 6 * 131072 + 2 * 3 * 4 * 16.5 * 64


def test_flops_per_token_matches_the_model_weights():
  """The matmul count equals the 2-D linear weights of the real (untied) model."""
  cfg = wiring.finalize(config.load(BASE, TINY + ["model.tie_embeddings=false"]),
                        jax.devices()[:1])
  _, abstract, _ = gpt.abstract_model(cfg, "cpu")
  flat = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(abstract))
  matmul = sum(int(np.prod(v.shape)) for path, v in flat
               if "kernel" in jax.tree_util.keystr(path))
  assert matmul == 2 * QKVO + 2 * MLP + HEAD
  attn = metrics.flops_per_token(cfg.model, T) - 6 * matmul
  assert attn == pytest.approx(2 * attn_flops(causal_keys(T)))


def test_windows_reduce_attention_flops():
  """A window caps the keys per query; per-layer windows count each layer's own."""
  m = model_cfg()
  matmul = 6 * (2 * QKVO + 2 * MLP + HEAD)
  assert causal_keys(T, 8) == 7.125
  assert metrics.flops_per_token(m, T, 8) == pytest.approx(matmul + 2 * attn_flops(7.125))
  assert metrics.flops_per_token(m, T, (8, 0)) == pytest.approx(
      matmul + attn_flops(7.125) + attn_flops(16.5))
  assert metrics.flops_per_token(m, T, [8, 16]) == pytest.approx(
      matmul + attn_flops(7.125) + attn_flops(causal_keys(T, 16)))
  # A window as long as the sequence is plain causal.
  assert metrics.flops_per_token(m, T, T) == metrics.flops_per_token(m, T, 0)
  assert metrics.flops_per_token(m, T, 8) < metrics.flops_per_token(m, T)


def test_mlp_only_layers_drop_attention_flops():
  """An MLP-only block has neither q/k/v/o weights nor scores; indices past the end are ignored."""
  full = model_cfg()
  m = model_cfg("model.no_attention_layers=[1]")
  want = 6 * (QKVO + 2 * MLP + HEAD) + attn_flops(16.5)
  assert metrics.flops_per_token(m, T) == pytest.approx(want)
  # Layer 1's window is ignored along with its attention.
  assert metrics.flops_per_token(m, T, (8, 4)) == pytest.approx(
      6 * (QKVO + 2 * MLP + HEAD) + attn_flops(7.125))
  past = model_cfg("model.no_attention_layers=[5]")
  assert metrics.flops_per_token(past, T) == metrics.flops_per_token(full, T)
