"""A modded-nanogpt `GPT` state dict -> nanotext params: torch_export's mapping read backwards.

The input is what export-torch writes (safetensors, read without torch) or a torch.save file:
modded-nanogpt's checkpoint dict (its `model` entry) or a bare state dict, torch.compile's
`_orig_mod.` prefix stripped. The config (configs/speedrun_record.yml unless given) must be one
the record's module expresses, and the state dict must match its model tensor for tensor.
"""

import io
import os
import pickletools
import re
import warnings
import zipfile

import ml_dtypes
import numpy as np

from nanotext.convert.common import RUN_OWN, per_layer
from nanotext.convert.torch_export import check_expressible, read_header
from nanotext.errors import UserError, os_error
from nanotext.outputs import check_out
from nanotext.rundir import check_no_glob
from nanotext.trees import beyond_range, flatten

TORCH_SAVE = (".pt", ".pth")
FLOATS = ("F64", "F32", "F16", "BF16")  # the safetensors dtypes read: numpy's, ml_dtypes' bfloat16
TORCH_MAGIC = 0x1950a86a20f9469cfc6c  # the first thing a legacy (pickle) torch.save file holds
# (nanotext name, torch name, transposed): torch_state_dict's one-to-one tensors
RENAMES = [(r"embed\.embedding", r"embed.weight", False),
           (r"value_embeds\.(\d+)\.embedding", r"value_embeds.\1.weight", False),
           (r"blocks\.(\d+)\.attn\.v_lambdas", r"blocks.\1.attn.lambdas", False),
           (r"blocks\.(\d+)\.attn\.o\.kernel", r"blocks.\1.attn.c_proj.weight", True),
           (r"blocks\.(\d+)\.mlp\.fc\.kernel", r"blocks.\1.mlp.c_fc.weight", True),
           (r"blocks\.(\d+)\.mlp\.proj\.kernel", r"blocks.\1.mlp.c_proj.weight", True),
           (r"blocks\.(\d+)\.lambdas", r"blocks.\1.lambdas", False),
           (r"skip_weights", r"skip_weights", False)]


def read_config(path: str, out: str, overrides=(), *, config_path: str = "",
                force: bool = False):
  """The config of the run from-torch writes (--config, by default the record's, with the
  overrides), refused unless the record's module computes it; --torch and --out checked."""
  from nanotext import config
  check_no_glob(os.path.abspath(out), "--out")  # orbax writes its checkpoint there
  if not os.path.isfile(path):
    what = ("is a folder" if os.path.isdir(path) else "is not a regular file (a pipe or device)"
            if os.path.exists(path) else "does not exist")
    raise UserError(f"--torch '{path}' {what}; give a state dict file")
  if not path.lower().endswith((".safetensors",) + TORCH_SAVE):
    raise UserError(f"--torch '{path}' is neither .safetensors nor a torch.save file "
                    f"({', '.join(TORCH_SAVE)}); name it by its format")
  if path.lower().endswith(TORCH_SAVE):
    _torch(path)  # missing: said before the config and the model are built
  check_out(os.path.abspath(out), force=force, protect=(path,), own=RUN_OWN)
  base = config_path or str(config.SCHEMA_PATH.parent / "speedrun_record.yml")
  cfg = config.load(base, list(overrides) + [f"output_dir={os.path.abspath(out)}"])
  check_expressible(cfg, "from-torch")
  return cfg


def read_state_dict(path: str) -> dict:
  """{torch name: numpy array} of a .safetensors file or a torch.save file (bfloat16 kept as
  ml_dtypes' or widened to float32: both exact), `_orig_mod.` stripped."""
  if path.lower().endswith(TORCH_SAVE):
    tensors = _torch_load(path)
  else:
    from safetensors.numpy import load_file
    _refuse_dtypes(path)
    try:
      tensors = load_file(path)
    except Exception as e:  # safetensors raises its own error types for damaged files
      raise UserError(f"cannot read '{path}': {str(e).splitlines()[0][:200]}") from None
  out = {}
  for k, v in tensors.items():
    name = k.removeprefix("_orig_mod.")
    if name in out:  # one would silently win over the other
      raise UserError(f"'{path}' holds both '{name}' and '_orig_mod.{name}'; keep one of them")
    if v.dtype.kind != "f" and v.dtype != ml_dtypes.bfloat16:  # a cast would change its values
      raise UserError(f"'{path}': '{k}' is {v.dtype}, not a floating-point tensor; give a "
                      "state dict of the model's float32 or bfloat16 parameters")
    if not np.isfinite(v).all():
      raise UserError(f"'{path}': '{k}' holds NaN or infinite values; give a state dict of "
                      "finite parameters (an earlier step, before the run diverged)")
    if beyond_range(v, np.float32):
      raise UserError(f"'{path}': '{k}' holds values beyond float32's range, which would be "
                      "read as infinite; give a state dict of values float32 holds")
    out[name] = v
  return out


def _refuse_dtypes(path: str):
  """A tensor of a dtype other than the floats read (float8, float4, integers, ...) named from the
  header: safetensors' numpy reader said of some "module 'numpy' has no attribute"."""
  try:
    with open(path, "rb") as f:
      header = read_header(f)[1]
    names = [k for k, v in header.items() if k != "__metadata__" and v["dtype"] not in FLOATS]
  except Exception:  # a header it cannot read (nested past recursion, ...): load_file says so
    return
  if names and header[names[0]]["dtype"][0] in "FE":  # F8_E4M3, F4, E8M0, ...: a cast reads it
    raise UserError(f"'{path}': '{names[0]}' is {header[names[0]]['dtype']}, not a float32 or "
                    "bfloat16 tensor; cast the state dict to float32 or bfloat16")
  if names:  # an integer buffer (position ids, ...): not a parameter to cast
    raise UserError(f"'{path}': '{names[0]}' is {header[names[0]]['dtype']}, not a floating-point "
                    "tensor; give a state dict of the model's float32 or bfloat16 parameters")


def _torch(path: str):
  """The torch module, which a torch.save file needs; without it one line naming the install."""
  try:
    import torch
    return torch
  except ImportError:
    raise UserError(f"--torch '{path}' is a torch.save file, which needs PyTorch: pip install "
                    "torch (or give the state dict as .safetensors)") from None


def _saved_by_torch(path: str) -> bool:
  """Whether `path` has torch.save's format: a zip archive holding a data.pkl, or a pickle that
  starts with torch's magic number (the legacy format)."""
  try:
    with open(path, "rb") as f:
      if f.read(4) == b"PK\x03\x04":  # as torch tells them (a legacy file's tensor bytes may
        with zipfile.ZipFile(f) as z:  # hold a zip's end record, which is_zipfile looks for)
          return any(n.rpartition("/")[2] == "data.pkl" for n in z.namelist())
      f.seek(0)
      for op, arg, _ in pickletools.genops(io.BytesIO(f.read(64))):  # the magic is in 40 bytes
        if op.name not in ("PROTO", "FRAME"):
          return arg == TORCH_MAGIC
  except OSError as e:
    raise os_error(e, f"cannot read '{path}'") from None
  except Exception:  # a damaged archive, or not a pickle
    pass
  return False


def _safetensors(path: str) -> bool:
  """Whether `path`, whatever its name, starts as a safetensors file: a header of JSON tensors."""
  try:
    with open(path, "rb") as f:
      header = read_header(f)[1]
    return isinstance(header, dict) and bool(header) and all(
        isinstance(v, dict) and "dtype" in v for k, v in header.items() if k != "__metadata__")
  except Exception:  # not JSON there: another format
    return False


def _torchscript(path: str) -> bool:
  """Whether the torch.save-like zip `path` is torch.jit.save's (constants.pkl beside data.pkl)."""
  try:
    with zipfile.ZipFile(path) as z:
      return any(n.rpartition("/")[2] == "constants.pkl" for n in z.namelist())
  except Exception:  # a legacy torch.save file: no zip
    return False


def _torch_load(path: str) -> dict:
  torch = _torch(path)
  if not _saved_by_torch(path):  # torch's words would be of its unpickler ("operand 149")
    if _safetensors(path):
      raise UserError(f"'{path}' is a safetensors file: name it .safetensors")
    raise UserError(f"'{path}' is not a torch.save file (damaged, or another format); give a "
                    "state dict saved with torch.save")
  if _torchscript(path):  # torch would advise weights_only=False, which runs its code
    raise UserError(f"'{path}' is a TorchScript archive (torch.jit.save); give the module's "
                    "state_dict() saved with torch.save")
  try:
    with warnings.catch_warnings():  # of pickle protocols and the like: lines beside ours
      warnings.simplefilter("ignore")
      obj = torch.load(path, map_location="cpu", weights_only=True)
  except Exception as e:  # a damaged file, or pickled objects beyond tensors and containers
    why = " ".join(str(e).split("WeightsUnpickler error:")[-1].split())  # torch's advice left out
    why = re.split(r" (Please use|Check the documentation)", why)[0]
    if isinstance(e, (KeyError, IndexError, EOFError)) or len(why) < 8:  # pickle's internals
      raise UserError(f"'{path}' is not a torch.save file (damaged, or another format); give a "
                      "state dict saved with torch.save") from None
    if why.startswith("Unsupported operand"):  # the safe loader reads pickle protocols 2-3
      raise UserError(f"'{path}' was pickled in a protocol torch.load(weights_only=True) does "
                      f"not read ({why[:40]}): save it again with torch.save's default "
                      "pickle_protocol") from None
    raise UserError(f"cannot read '{path}' with torch.load(weights_only=True), which takes "
                    f"tensors and containers only (save a state dict): {why[:200]}") from None
  if isinstance(obj, dict) and isinstance(obj.get("model"), dict):  # modded-nanogpt's checkpoint
    obj = obj["model"]
  if not isinstance(obj, dict) or not obj or \
      not all(isinstance(v, torch.Tensor) for v in obj.values()):
    raise UserError(f"'{path}' holds no state dict: save model.state_dict(), or modded-nanogpt's "
                    "checkpoint dict with it under 'model'")
  try:
    return {k: (v.float() if v.dtype == torch.bfloat16 else v).detach().numpy()
            for k, v in obj.items()}
  except TypeError as e:  # a dtype numpy has no counterpart of (float8, ...)
    raise UserError(f"'{path}': {e}; cast the state dict to float32 or bfloat16") from None


def counterpart(name: str, shape: tuple, d_model: int):
  """(torch name, its shape, torch array -> nanotext array) of one layer's nanotext parameter."""
  if name == "head.kernel":  # the record's lm_head.weight is sqrt(d) * head.kernel^T
    scale = np.float32(np.sqrt(d_model))
    return "lm_head.weight", shape[::-1], lambda w: np.asarray(w, np.float32).T / scale
  if m := re.fullmatch(r"(blocks\.\d+\.attn)\.(qkv|q|k|v)\.kernel", name):
    theirs = f"{m[1]}.qkv_w"  # [3, H*K, D]: three [out, in] matrices
    if m[2] == "qkv":
      return theirs, (shape[0], shape[2], shape[1]), lambda w: np.swapaxes(w, 1, 2)
    j = "qkv".index(m[2])
    return theirs, (3, *shape[::-1]), lambda w: w[j].T
  for ours, theirs, transposed in RENAMES:
    if re.fullmatch(ours, name):
      return (re.sub(ours, theirs, name), shape[::-1] if transposed else shape,
              (lambda w: w.T) if transposed else np.asarray)
  raise UserError(f"nanotext parameter '{name}' has no modded-nanogpt counterpart in this "
                  "mapping")


def layer_shapes(cfg, abstract) -> dict:
  """{name: shape} of a params tree of ShapeDtypeStructs, one layer each (`per_layer` run on
  broadcast stand-ins, which hold no memory)."""
  stand_ins = {n: np.broadcast_to(np.int8(0), s.shape) for n, s in flatten(abstract).items()}
  return {n: v.shape for n, v in per_layer(cfg, stand_ins).items()}


def params_from_torch(cfg, tensors: dict, want: dict, path: str) -> dict:
  """{nanotext name: array} of the parameters `want` names ({name: shape}, one layer each) from
  the state dict `tensors`; a missing tensor, a shape or a name the model has no place for is
  refused, naming the first."""
  plan = {name: counterpart(name, tuple(shape), cfg.model.d_model)
          for name, shape in want.items()}
  needed = {theirs: shape for theirs, shape, _ in plan.values()}
  what = f"the state dict '{path}'"
  for theirs, shape in needed.items():
    if theirs not in tensors:
      raise UserError(f"{what} has no '{theirs}' {shape}, which the config's model needs")
  head, vocab = tensors["lm_head.weight"].shape, cfg.model.vocab_size
  if len(head) == 2 and head[0] != vocab:
    raise UserError(f"{what}: lm_head.weight has {head[0]} rows, the config's model.vocab_size="
                    f"{vocab}; pass model.vocab_size={head[0]}")
  for theirs, shape in needed.items():
    if tensors[theirs].shape != shape:
      raise UserError(f"{what}: '{theirs}' has shape {tuple(tensors[theirs].shape)}, the "
                      f"config's model needs {shape} (set its model.* keys to the checkpoint's)")
  extra = [k for k in tensors if k not in needed]
  if extra:
    raise UserError(f"{what} has '{extra[0]}'{f' and {len(extra) - 1} more' if extra[1:] else ''}"
                    ", which the config's model has no place for")
  return {name: np.ascontiguousarray(take(tensors[theirs]))
          for name, (theirs, _, take) in plan.items()}
