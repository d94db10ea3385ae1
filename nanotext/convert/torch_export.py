"""Speedrun-architecture checkpoint -> a safetensors state dict named as modded-nanogpt's `GPT`.

Names follow KellerJordan/modded-nanogpt train_gpt.py as of the 2025-02 records (merged qkv_w
era). torch.nn.Linear stores weight [out, in]; nanotext kernels are [in, out], hence transposes.

  nanotext (shape)                            torch (shape)
  embed.embedding [V, D]                      embed.weight [V, D]
  value_embeds.{j}.embedding [V, D]           value_embeds.{j}.weight [V, D]
  blocks.{i}.attn.qkv.kernel [3, D, H*K]      blocks.{i}.attn.qkv_w [3, H*K, D] (each .T)
    or blocks.{i}.attn.q|k|v.kernel [D, H*K]    (model.merged_qkv=false: stack of .T)
  blocks.{i}.attn.v_lambdas [2]               blocks.{i}.attn.lambdas [2]
  blocks.{i}.attn.o.kernel [H*K, D]           blocks.{i}.attn.c_proj.weight [D, H*K]
  blocks.{i}.mlp.fc.kernel [D, F]             blocks.{i}.mlp.c_fc.weight [F, D]
  blocks.{i}.mlp.proj.kernel [F, D]           blocks.{i}.mlp.c_proj.weight [D, F]
  blocks.{i}.lambdas [2]                      blocks.{i}.lambdas [2]
  skip_weights [L // 2]                       skip_weights [L // 2]
  head.kernel [D, V]                          lm_head.weight [V, D]

The record's head is lm_head.weight = sqrt(d_model) * head.kernel^T: its logits
30 * sigmoid(z / (7.5 sqrt(d))) equal nanotext's 15 * tanh(z' / 15) plus 15 everywhere.
Blocks in model.no_attention_layers have no attn.* entries (the record's blocks.7). A run the
record's module cannot express (its head_dim 128, 12 layers, 3 value tables, ... are hard-coded)
is refused, naming the first key that differs.
"""

import json
import os

import numpy as np

from nanotext.convert.common import load_run, per_layer, require
from nanotext.outputs import check_out, staged_file
from nanotext.errors import UserError
from nanotext.trees import flatten

# What the record's `GPT` (train_gpt.py 587b45fb) hard-codes: another value would load into its
# module (or not) and compute a different function.
STRUCTURE = {"model.positions": "rope", "model.norm": "rmsnorm", "model.mlp_act": "relu2",
             "model.bias": False, "model.tie_embeddings": False, "model.x0_mix": True,
             "model.qk_norm": True, "model.rope_freqs": "linspace", "model.fused_qkv": False,
             "model.value_residual": False, "model.attn_scale_learned": False}
RECORD = {"model.head_dim": 128, "model.num_layers": 12, "model.rope_base": 1024.0,
          "model.rope_truncate": True, "model.attn_scale": 0.12, "model.logit_softcap": 15.0,
          "model.value_embeds": 3, "model.unet_skips": True, "model.no_attention_layers": [7],
          # F.rms_norm with eps=None: finfo(float32).eps on its bf16 activations (the torch the
          # record's code was timed on, and every one since; configs/speedrun.yml)
          "model.norm_eps": 2.0 ** -23}


def check_expressible(cfg, tool: str = "export-torch") -> None:
  """Refuse (UserError, one line, naming `tool`) a run the record's module cannot compute."""
  why = f"{tool} needs what the speedrun record's GPT computes"
  require(cfg, STRUCTURE, why)
  require(cfg, RECORD, why)
  m = cfg.model
  if m.mlp_dim != 4 * m.d_model:
    raise UserError(f"{why}: model.mlp_dim={m.mlp_dim} is not supported (needs 4 * "
                    f"model.d_model = {4 * m.d_model})")
  rows = m.embed_rows if m.embed_rows > 0 else m.vocab_size
  head = -(-rows // 128) * 128  # the record: next_multiple_of_n(vocab_size, n=128)
  if m.vocab_size != head:
    raise UserError(f"{why}: model.vocab_size={m.vocab_size} is not supported (its lm_head has "
                    f"{head} rows for {rows} embedding rows)")


def torch_state_dict(cfg, params) -> dict:
  """{torch name: numpy array} for a params tree of a run the record's module expresses."""
  check_expressible(cfg)
  flat = per_layer(cfg, flatten(params))
  t = lambda name: np.asarray(flat.pop(name)).T
  head = np.asarray(flat.pop("head.kernel"), np.float32).T  # the record's lm_head is float32
  out = {"embed.weight": np.asarray(flat.pop("embed.embedding")),
         "lm_head.weight": head * np.float32(np.sqrt(cfg.model.d_model))}
  for i in range(cfg.model.num_layers):
    b = f"blocks.{i}"
    if f"{b}.attn.o.kernel" in flat:  # absent in MLP-only blocks (model.no_attention_layers)
      if f"{b}.attn.qkv.kernel" in flat:
        out[f"{b}.attn.qkv_w"] = np.swapaxes(np.asarray(flat.pop(f"{b}.attn.qkv.kernel")), 1, 2)
      else:
        out[f"{b}.attn.qkv_w"] = np.stack([t(f"{b}.attn.{n}.kernel") for n in "qkv"])
      out[f"{b}.attn.c_proj.weight"] = t(f"{b}.attn.o.kernel")
      if f"{b}.attn.v_lambdas" in flat:
        out[f"{b}.attn.lambdas"] = np.asarray(flat.pop(f"{b}.attn.v_lambdas"))
    out[f"{b}.mlp.c_fc.weight"] = t(f"{b}.mlp.fc.kernel")
    out[f"{b}.mlp.c_proj.weight"] = t(f"{b}.mlp.proj.kernel")
    out[f"{b}.lambdas"] = np.asarray(flat.pop(f"{b}.lambdas"))
  for j in range(cfg.model.value_embeds):
    if f"value_embeds.{j}.embedding" in flat:
      out[f"value_embeds.{j}.weight"] = np.asarray(flat.pop(f"value_embeds.{j}.embedding"))
  if "skip_weights" in flat:
    out["skip_weights"] = np.asarray(flat.pop("skip_weights"))
  if flat:  # a feature added to nanotext after this mapping was written
    raise UserError(f"parameters with no modded-nanogpt counterpart in this mapping: "
                    f"{', '.join(sorted(flat)[:5])}")
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


def export_torch(run: str, out: str, *, step: int = -1, force: bool = False, log=print) -> str:
  """Write the params of `run`'s checkpoint as a modded-nanogpt safetensors state dict."""
  from safetensors.numpy import save_file
  if out.endswith(("/", os.sep)):
    raise UserError(f"--out '{out}' names a folder; export-torch writes one file: give a path "
                    "such as model.safetensors")
  if out.lower().endswith((".pt", ".pth", ".bin", ".ckpt")):
    raise UserError(f"--out '{out}': export-torch writes safetensors, which torch.load cannot "
                    "read; name it .safetensors (safetensors.torch.load_file reads it)")
  check_out(os.path.abspath(out), force=force, protect=(run,), folder=False,
            own=("*.safetensors",))
  cfg, step, params = load_run(run, step)
  tensors = torch_state_dict(cfg, params)
  out_abs = os.path.abspath(out)
  with staged_file(out_abs, force=force, protect=(run,), own=("*.safetensors",)) as tmp:
    save_file(tensors, tmp, metadata={"format": "pt", "source": os.path.abspath(run),
                                      "step": str(step)})
    sort_metadata(tmp)
  log(f"wrote {out_abs} ({len(tensors)} tensors, step {step} of {run})")
  return out_abs


def read_header(f) -> tuple:
  """(raw bytes, parsed JSON) of the header of an open safetensors file: a little-endian 8-byte
  length, then that much JSON (none past safetensors' own 128 MiB bound: (b"", {}))."""
  size = int.from_bytes(f.read(8), "little")
  if size >= 1 << 27:
    return b"", {}
  raw = f.read(size)
  return raw, json.loads(raw)


def sort_metadata(path: str) -> None:
  """Rewrite a safetensors header's metadata in sorted order: safetensors writes it in an order
  of its own per process, so two exports of one step differed in their bytes."""
  with open(path, "r+b") as f:
    raw, header = read_header(f)
    header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
    new = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    if len(new) == len(raw.rstrip(b" ")):  # the same text reordered: the data stays in place
      f.seek(8)
      f.write(new.ljust(len(raw), b" "))
