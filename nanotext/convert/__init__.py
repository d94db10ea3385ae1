"""Checkpoint conversion: `python -m nanotext.convert SUBCOMMAND --flag=value ... [key=value ...]`.

  from-hf      --hf=HF_DIR --out=RUN_DIR [--config=BASE.yml] [--force] [key=value ...]
               HF GPT2LMHeadModel (config.json + model.safetensors) -> nanotext run directory
               (config.yml + checkpoint of step 0 with a fresh optimizer state); train on with
               `python -m nanotext.train RUN_DIR/config.yml output_dir=RUN_DIR`.
  to-hf        --run=RUN_DIR [--step=N] --out=HF_DIR [--force]
               nanotext classic GPT-2 checkpoint -> GPT2LMHeadModel.from_pretrained directory.
  params-only  --run=RUN_DIR [--step=N] --out=DIR [--dtype=bfloat16|float32] [--force]
               train state -> DIR/config.yml + DIR/params/ (orbax StandardCheckpointer, the params
               tree only) + DIR/convert.json; `nanotext.convert.load_params(DIR)` reads it.
  export-torch --run=RUN_DIR [--step=N] --out=FILE.safetensors [--force]
               speedrun-architecture checkpoint -> modded-nanogpt `GPT` state dict (torch names).
  from-torch   --torch=FILE --out=RUN_DIR [--config=BASE.yml] [--force] [key=value ...]
               modded-nanogpt `GPT` state dict (export-torch's .safetensors, or a torch.save
               .pt/.pth: its checkpoint dict or a bare state dict) -> run directory of --config
               (default configs/speedrun_record.yml) with a step-0 checkpoint, as from-hf.

--step defaults to the newest checkpoint; --run may also be a params-only folder (no --step).
An existing non-empty --out is refused unless --force; outputs are written next to --out and
renamed into place, so a failure leaves --out untouched.

nanotext <-> HF GPT-2 (HF names without 'transformer.'; both sides store matrices as [in, out]):
  embed.embedding [V, D]            wte.weight [V, D] (lm_head.weight is tied to it)
  pos [P, D]                        wpe.weight [P, D] (P = model.max_seq_len = n_positions)
  blocks.{i}.ln1|ln2.scale|bias     h.{i}.ln_1|ln_2.weight|bias [D]
  blocks.{i}.attn.q|k|v.kernel      h.{i}.attn.c_attn.weight [D, 3D] columns [q | k | v]
  blocks.{i}.attn.q|k|v.bias        h.{i}.attn.c_attn.bias [3D], same split
  blocks.{i}.attn.qkv.kernel|bias   the same, model.merged_qkv's [3, D, D] | [3, D] stacks
  blocks.{i}.attn.o.kernel|bias     h.{i}.attn.c_proj.weight [D, D] | bias
  blocks.{i}.mlp.fc.kernel|bias     h.{i}.mlp.c_fc.weight [D, F] | bias
  blocks.{i}.mlp.proj.kernel|bias   h.{i}.mlp.c_proj.weight [F, D] | bias
  ln_f.scale|bias                   ln_f.weight|bias
A model.scan_layers run stores blocks.* stacked ([num_layers, ...] under one name): to-hf and
export-torch unstack it into the names above, from-hf stacks them when model.scan_layers=true,
and params-only copies the tree as it is (with the run's config).
HF's gelu_new (tanh form) is jax.nn.gelu's default (approximate=True); LayerNorm eps is 1e-5 on
both sides. The speedrun mapping is in nanotext.convert.torch_export (torch_import reads it
backwards) and docs/convert.md.
"""

from nanotext.convert.hf import merged, read_hf, to_hf
from nanotext.convert.common import load_params, write_run
from nanotext.convert.params import params_only
from nanotext.convert.torch_export import export_torch
from nanotext.convert import torch_import



def from_hf(hf: str, out: str, overrides=(), *, config_path: str = "", force: bool = False,
            log=print) -> str:
  """Convert a HF GPT-2 directory into a nanotext run directory holding a step-0 checkpoint.

  Here rather than in `convert.hf`: building the run needs `wiring`, a layer above the format
  mapping, and only this front module (like train and generate) reaches up to it.
  """
  from nanotext import wiring
  from nanotext.errors import UserError
  cfg, flat = read_hf(hf, out, overrides, config_path=config_path, force=force)
  try:  # a run that train, evaluate and generate would refuse
    wiring.check_vocab(cfg)
  except UserError:
    raise UserError(
        f"the Hugging Face checkpoint's vocab_size={cfg.model.vocab_size} is smaller than the "
        f"vocabulary of data.tokenizer '{cfg.data.tokenizer}' "
        f"({wiring.tokenizer_vocab(cfg.data)}); pass data.tokenizer=NAME, the tokenizer its "
        "ids are of") from None
  run = built_here(cfg)
  return write_run(run, merged(cfg, flat), hf, out, what="the Hugging Face checkpoint",
                   given=cfg, force=force, log=log)


def from_torch(path: str, out: str, overrides=(), *, config_path: str = "",
               force: bool = False, log=print) -> str:
  """Convert a modded-nanogpt state dict (export-torch's safetensors or a torch.save checkpoint)
  into a nanotext run directory of --config (default configs/speedrun_record.yml) holding a
  step-0 checkpoint."""
  from nanotext import wiring
  cfg = torch_import.read_config(path, out, overrides, config_path=config_path, force=force)
  wiring.check_vocab(cfg)  # a run that train, evaluate and generate would refuse
  run = built_here(cfg)
  want = torch_import.layer_shapes(cfg, run.abstract_state()["params"])
  flat = torch_import.params_from_torch(cfg, torch_import.read_state_dict(path), want, path)
  return write_run(run, flat, path, out, what=f"the state dict '{path}'", given=cfg,
                   force=force, log=log)


def built_here(cfg):
  """wiring's Run of `cfg` on this machine's devices; a mesh for another machine is kept in
  config.yml as given (write_run), the step written from this machine's devices, every one on
  fsdp (a checkpoint restores onto any mesh)."""
  from nanotext import sharding, wiring
  try:
    return wiring.from_config(cfg)
  except sharding.MeshSizeError:
    local = cfg.copy_and_resolve_references()
    for key, value in (a.split("=") for a in sharding.ALL_ON_FSDP):
      local.mesh[key.split(".")[1]] = int(value)
    return wiring.from_config(local)


__all__ = ["from_hf", "from_torch", "to_hf", "params_only", "load_params", "export_torch"]
