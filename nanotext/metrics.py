"""FLOP and MFU accounting, and the metric writers (stdout, metrics.jsonl, TensorBoard)."""

import importlib
import importlib.util
import json
import math
import os
import socket
import struct
import sys
import time
import types

from nanotext.fileio import append_whole, atomic_write
from nanotext.errors import os_error

# Dense bf16 peak FLOP/s per device, from vendor spec sheets; MFU is quoted against these.
_PEAK_BY_KIND = (
    ("h200", 989e12), ("h100", 989e12), ("a100", 312e12), ("l4", 121e12),
    ("v6", 918e12), ("v5p", 459e12), ("v5", 197e12), ("v4", 275e12),
)
# Measured on the 2-core development machine: jitted f32 matmuls reach about 250 GFLOP/s in total.
CPU_PEAK_FLOPS = 250e9


def default_peak_flops(devices) -> float:
  """Per-device peak FLOP/s for MFU when metrics.peak_flops is 0, for the run's `devices`."""
  first = devices[0]
  if first.platform == "cpu":
    # Fake CPU devices share the same cores, so each gets its share of the machine's peak.
    local = [d for d in devices if d.process_index == first.process_index]
    return CPU_PEAK_FLOPS / max(1, len(local))
  kind = first.device_kind.lower()
  for name, peak in _PEAK_BY_KIND:
    if name in kind:
      return peak
  return 100e12


def peak_flops(metrics_cfg, devices) -> float:
  """Per-device peak FLOP/s for MFU on `devices` (the run's): metrics.peak_flops, or where it
  is 0 the default for them, found at each start (a resume on other devices has its own)."""
  return metrics_cfg.peak_flops or default_peak_flops(devices)


def flops_per_token(model_cfg, seq_len: int, window=0) -> float:
  """Training FLOPs per token: 6 * matmul params plus causal attention (forward + backward).

  Matmul params are the blocks' linear weights and the lm head (embedding lookups are free).
  `window` is one window for every layer or a sequence of per-layer windows (0 = causal).
  """
  m = model_cfg
  hk = m.num_heads * m.head_dim
  # MLP-only blocks (model.no_attention_layers) have neither attention weights nor scores.
  no_attn = {i for i in m.no_attention_layers if i < m.num_layers}
  matmul_params = ((m.num_layers - len(no_attn)) * 4 * m.d_model * hk
                   + m.num_layers * 2 * m.d_model * m.mlp_dim + m.d_model * m.vocab_size)
  return 6 * matmul_params + 3 * attention_flops_per_token(m, seq_len, window)


def attention_flops_per_token(model_cfg, seq_len: int, window=0) -> float:
  """Forward attention FLOPs per token over all layers: scores and the weighted sum cost
  2 * 2 * ctx * H * K, where ctx is the average number of keys a query sees (about T / 2 when
  causal, at most the window)."""
  m = model_cfg
  hk = m.num_heads * m.head_dim
  no_attn = {i for i in m.no_attention_layers if i < m.num_layers}
  t = seq_len
  def ctx(w):
    return (t + 1) / 2 if not w or w >= t else w - (w - 1) * w / (2 * t)
  windows = list(window) if isinstance(window, (list, tuple)) else [window] * m.num_layers
  return sum(4 * ctx(w) * hk for i, w in enumerate(windows) if i not in no_attn)


def val_row(val_loss: float, bytes_per_token: float | None) -> dict:
  """An eval's metrics: val_loss (nats/token) and, given the text's bytes per token, val_bpb."""
  row = {"val_loss": val_loss}
  if bytes_per_token:
    row["val_bpb"] = val_loss / math.log(2) / bytes_per_token
  return row


def val_text(row: dict) -> str:
  """'val_loss 5.2835 | val_bpb 2.3190' for a val_row."""
  bpb = f" | val_bpb {row['val_bpb']:.4f}" if "val_bpb" in row else ""
  return f"val_loss {row['val_loss']:.4f}{bpb}"


def duration(seconds: float) -> str:
  """'45s', '3m05s', '2h01m': short enough for a log line."""
  s = max(0, int(round(seconds)))
  if s < 60:
    return f"{s}s"
  if s < 3600:
    return f"{s // 60}m{s % 60:02d}s"
  return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Writer:
  """Writes metrics to metrics.jsonl and TensorBoard (process 0 only) and prints log lines.

  Each row is appended whole or not at all (fileio.append_whole), in the caller's thread: a
  disk that fills up or a file-size limit mid-run is one line (exit 1), no half line left, and
  the checkpoints intact."""

  def __init__(self, output_dir: str, *, tensorboard: bool, enabled: bool = True,
               resumed_at: int | None = None):
    """`resumed_at`: the step the run starts from; `begin` (or the first write) drops the rows
    of steps after it (a killed run's steps past its newest checkpoint, trained again now)."""
    self.enabled = enabled
    self._jsonl = self._tb = None
    self._resumed_at = resumed_at
    self._kept = set()  # (step, metric) of the rows kept at resumed_at: not written again
    if not enabled:
      return
    os.makedirs(output_dir, exist_ok=True)
    self._jsonl = _Appender(os.path.join(output_dir, "metrics.jsonl"))
    if tensorboard:
      self._tb = Events(os.path.join(output_dir, "tb"))

  def begin(self) -> None:
    """The run trains from here: the rows past resumed_at go now, not at its first row (a run
    stopped before writing one left the dead run's rows past its checkpoint, which plot drew).
    Called once training began: a stop before it must leave metrics.jsonl as it was."""
    if not self.enabled or self._resumed_at is None:
      return
    at, self._resumed_at = self._resumed_at, None
    self._kept = {(at, k) for k in self._drop_rows_after(at)}
    if self._tb is not None:  # TensorBoard drops the earlier files' events from here on
      self._tb.restart(at + 1 if at else 0)

  def write(self, step: int, values: dict) -> None:
    if not self.enabled:
      return
    self.begin()
    if any((int(step), k) in self._kept for k in values):  # each step has its rows once
      return
    row = {"step": int(step), **{k: _plain(v) for k, v in values.items()}}
    # strict JSON (jq, JavaScript and pandas' strict readers reject NaN): non-finite is null
    strict = {k: None if isinstance(v, float) and not math.isfinite(v) else v
              for k, v in row.items()}
    self._jsonl.append((json.dumps(strict, allow_nan=False) + "\n").encode())
    if self._tb is not None:
      self._tb.scalars(int(step), {k: v for k, v in row.items()
                                   if k != "step" and isinstance(v, (int, float))})

  def _drop_rows_after(self, step: int) -> set:
    """Rewrite metrics.jsonl (atomically) without rows of steps after `step`; from step 0,
    without any (the run writes them all again). Returns the metrics of the rows kept at `step`
    (a run ended at its checkpoint evaluates that step again: its val row is there already)."""
    path = self._jsonl.path
    try:
      with open(path, "rb") as f:
        lines = f.readlines()
      keep = [line for line in lines if not _after(line, step)]
      if keep and not keep[-1].endswith(b"\n"):  # a crash mid-append: the next row joined it
        keep[-1:] = [keep[-1] + b"\n"] if _row(keep[-1]) is not None else []  # whole, or gone
      if keep != lines:
        atomic_write(path, keep)
        self._jsonl.close()
        self._jsonl = _Appender(path)
    except OSError as e:
      raise os_error(e, f"cannot rewrite '{path}'") from None
    at = [json.loads(line) for line in keep if step and _row(line) == step]
    return {k for row in at for k in row if k != "step"}

  def sync(self) -> None:
    """The rows written so far on disk: called before a checkpoint of their step is saved, so a
    power cut cannot keep the checkpoint and lose rows before it (a resume writes none of them
    again)."""
    for f in (self._jsonl, self._tb):
      if f is not None:
        f.sync()

  def close(self) -> None:
    for f in (self._jsonl, self._tb):
      if f is not None:
        f.close()


def _row(line: bytes):
  """The step of a metrics.jsonl row, or None for a line that is not one."""
  try:
    at = json.loads(line)["step"]
  except (ValueError, KeyError, TypeError):
    return None
  return at if isinstance(at, (int, float)) else None


def _after(line: bytes, step: int) -> bool:
  """Whether a metrics.jsonl row is of a step after `step` (any step, from 0); a line that is
  not a row is kept."""
  at = _row(line)
  return at is not None and (at > step or step == 0)


class _Appender:
  """A file opened for appending whole records; a failed one is one line (errors.os_error)."""

  def __init__(self, path: str):
    self.path = path
    try:
      self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    except OSError as e:
      raise os_error(e, f"cannot write '{path}'") from None

  def append(self, data: bytes) -> None:
    try:
      append_whole(self._fd, data)
    except OSError as e:
      raise os_error(e, f"cannot write '{self.path}'") from None

  def sync(self) -> None:
    """What was appended, on disk (fsync)."""
    try:
      os.fsync(self._fd)
    except OSError as e:
      raise os_error(e, f"cannot write '{self.path}'") from None

  def close(self) -> None:
    os.close(self._fd)


class Events(_Appender):
  """A TensorBoard event file written in the caller's thread. tensorboardX's SummaryWriter
  writes from a thread of its own: when a write failed there, that thread died with a
  traceback, its queue filled, and the next scalar blocked the run for ever."""

  def __init__(self, folder: str):
    self._event, self._session_log, self._summary, self._crc = _tensorboardx()
    try:
      os.makedirs(folder, exist_ok=True)
    except OSError as e:
      raise os_error(e, f"cannot write the TensorBoard folder '{folder}'") from None
    super().__init__(os.path.join(
        folder, f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"))
    self.append(self._record(self._event(wall_time=time.time(), file_version="brain.Event:2")))

  def restart(self, step: int) -> None:
    """A session start at `step`: TensorBoard purges what earlier event files hold of it and
    later steps (a killed run's steps past its checkpoint, trained again: shown twice)."""
    start = self._session_log(status=self._session_log.START)
    self.append(self._record(self._event(wall_time=time.time(), step=step, session_log=start)))

  def scalars(self, step: int, values: dict) -> None:
    """One event holding every scalar of a metrics row."""
    summary = self._summary(value=[self._summary.Value(tag=k, simple_value=v)
                                   for k, v in values.items()])
    self.append(self._record(self._event(wall_time=time.time(), step=step, summary=summary)))

  def _record(self, event) -> bytes:
    """TFRecord framing: length, its masked CRC, the bytes, their masked CRC."""
    data = event.SerializeToString()
    head = struct.pack("<Q", len(data))
    return (head + struct.pack("<I", self._crc(head)) + data + struct.pack("<I", self._crc(data)))


def _tensorboardx() -> tuple:
  """(Event, SessionLog, Summary, masked_crc32c) from tensorboardX's modules, without its package's
  __init__: that imports its SummaryWriter, which imports PyTorch where it is installed (1.4 s
  of each run's start, a third of its imports). The package is stood in for by a bare module of
  the same path while they load; a later `import tensorboardX` runs the real one."""
  names = ("tensorboardX.proto.event_pb2", "tensorboardX.proto.summary_pb2",
           "tensorboardX.record_writer")
  spec = None if "tensorboardX" in sys.modules else importlib.util.find_spec("tensorboardX")
  if spec is not None:  # None: imported already, or not installed (the imports below say so)
    bare = types.ModuleType("tensorboardX")
    bare.__path__, bare.__spec__ = list(spec.submodule_search_locations), spec
    sys.modules["tensorboardX"] = bare
    try:
      for name in names:
        importlib.import_module(name)
    finally:
      if sys.modules.get("tensorboardX") is bare:
        del sys.modules["tensorboardX"]
  event, summary, record = (importlib.import_module(n) for n in names)
  return event.Event, event.SessionLog, summary.Summary, record.masked_crc32c


def _plain(v):
  try:
    return float(v)
  except (TypeError, ValueError):
    return v
