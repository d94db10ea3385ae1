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

Blocks in model.no_attention_layers have no attn.* entries (the record's blocks.7). Features
switched off in the run are not written: load with strict=False and set attn.lambdas=[1, 0]
(no value embeddings) and skip_weights=0 (no U-net) to make them no-ops in the record's module.
"""

import os

import numpy as np

from nanotext.convert.common import flatten, load_run, require, staged_file
from nanotext.errors import UserError

# Config values without which the record's module has different parameters.
STRUCTURE = {"model.positions": "rope", "model.norm": "rmsnorm", "model.mlp_act": "relu2",
             "model.bias": False, "model.tie_embeddings": False, "model.x0_mix": True,
             "model.qk_norm": True}
# Constants the record's module hard-codes: other values export, but compute another function.
RECORD = {"model.rope_base": 1024.0, "model.rope_truncate": True, "model.attn_scale": 0.12,
          "model.logit_softcap": 15.0, "attention.window": 0, "model.value_embeds": 3,
          "model.unet_skips": True, "model.no_attention_layers": [7]}


def torch_state_dict(cfg, params) -> dict:
  """{torch name: numpy array} for a speedrun-architecture params tree."""
  require(cfg, STRUCTURE, "export-torch needs the speedrun architecture (configs/speedrun.yml)")
  flat = flatten(params)
  t = lambda name: np.asarray(flat.pop(name)).T
  out = {"embed.weight": np.asarray(flat.pop("embed.embedding")),
         "lm_head.weight": t("head.kernel")}
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
  from nanotext import config
  from safetensors.numpy import save_file
  cfg, step, params = load_run(run, step)
  tensors = torch_state_dict(cfg, params)
  for key, want in RECORD.items():
    if config.get(cfg, key) != want:
      log(f"warning: {key}={config.get(cfg, key)!r} but the modded-nanogpt record hard-codes "
          f"{want!r}; its module will compute a different function with these weights")
  out_abs = os.path.abspath(out)
  with staged_file(out_abs, force=force, protect=(run,)) as tmp:
    save_file(tensors, tmp, metadata={"format": "pt", "source": os.path.abspath(run),
                                      "step": str(step)})
  log(f"wrote {out_abs} ({len(tensors)} tensors, step {step} of {run})")
  return out_abs
