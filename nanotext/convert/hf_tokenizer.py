"""The tokenizer half of a Hugging Face export: files and special-token ids for `to-hf`.

With these, `AutoTokenizer.from_pretrained(DIR)` and `pipeline("text-generation", model=DIR)`
work offline. GPT-2-style models have one special token, `<|endoftext|>`: it is the bos, eos
and (for batched generation) the pad token, as in HF's own GPT-2 files.
"""

import json
import os
import shutil

from nanotext.data.tokenizer import EOT, get_tokenizer, GPT2_EOT, shipped_path


def special_ids(tokenizer: str, eot_id: int = -1) -> dict:
  """bos/eos/pad token ids: data.eot_id where set (>= 0), else data.tokenizer `tokenizer`'s
  end-of-text (None for 'none')."""
  if eot_id >= 0:
    eot = int(eot_id)
  elif tokenizer == "gpt2":
    eot = GPT2_EOT
  elif tokenizer == "shakespeare":
    eot = get_tokenizer("shakespeare").eot_id
  else:
    eot = None
  return {"bos_token_id": eot, "eos_token_id": eot, "pad_token_id": eot}


def generation_config(ids: dict) -> dict:
  """generation_config.json: the ids generate() falls back to (else it warns and guesses)."""
  return {**ids, "_from_model_config": True}


def write_tokenizer(tokenizer: str, out_dir: str, max_len: int) -> str:
  """Write tokenizer files for data.tokenizer `tokenizer` into out_dir; returns what was done.

  shakespeare: the shipped tokenizer.json (a byte-level BPE) as a PreTrainedTokenizerFast.
  gpt2: no files, since the tiktoken encoding cannot be written offline; GPT-2's own tokenizer
  (`AutoTokenizer.from_pretrained("gpt2")`) has the same ids.
  """
  if tokenizer != "shakespeare":
    return ("no tokenizer files (data.tokenizer=gpt2: use AutoTokenizer.from_pretrained('gpt2'), "
            "same ids)" if tokenizer == "gpt2" else
            "no tokenizer files (data.tokenizer=none)")
  shutil.copyfile(shipped_path(), os.path.join(out_dir, "tokenizer.json"))
  special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "pad_token": EOT}
  config = {
      "tokenizer_class": "PreTrainedTokenizerFast", **special,
      "model_max_length": int(max_len),
      # Byte-level BPE decodes exactly; HF's clean-up would drop spaces before punctuation.
      "clean_up_tokenization_spaces": False,
      "add_bos_token": False, "add_eos_token": False,
  }
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
    json.dump(special, f, indent=2)
  return "tokenizer.json (the shipped Shakespeare BPE)"
