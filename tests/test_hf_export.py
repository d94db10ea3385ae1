"""A Hugging Face export a user can use: tokenizer files and ids, checked with transformers
itself (AutoTokenizer, pipeline), offline; convert CLI help and file-vs-directory messages."""

import json
import os

import pytest

from conftest import BASE, TINY, extra, one_line_error, run_cli, saved_run
from nanotext.convert import to_hf
from nanotext.data.tokenizer import get_tokenizer
from nanotext.errors import UserError

torch = extra("torch")  # the whole file: skipped, with the reason, without torch or transformers
transformers = extra("transformers")
pytestmark = [pytest.mark.torch, pytest.mark.transformers]

# A tiny classic GPT-2 on the embedded corpus with the shipped tokenizer (vocab 8192).
CORPUS = [o for o in TINY if not o.startswith(("data.", "model.vocab_size"))] + [
    "data.source=shakespeare", "data.tokenizer=shakespeare", "model.vocab_size=8192",
    "train.eval_every=0", "train.eval_batches=1", "sample.max_new_tokens=0"]
TEXT = "ROMEO: But soft, what light through yonder window breaks?\nJULIET: Ay me!"
quiet = lambda *a, **k: None


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory):
  run = str(tmp_path_factory.mktemp("run") / "run")
  saved_run(BASE, CORPUS, run, step=2, noise=0.02)  # a run directory, no train step compiled
  out = str(tmp_path_factory.mktemp("hf") / "hf")
  to_hf(run, out, log=quiet)
  return run, out


@pytest.fixture(autouse=True)
def offline(monkeypatch):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def test_export_holds_tokenizer_and_ids(hf_export):
  _, out = hf_export
  assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
          "tokenizer_config.json", "special_tokens_map.json"} <= set(os.listdir(out))
  eot = get_tokenizer("shakespeare").eot_id
  c = json.load(open(os.path.join(out, "config.json")))
  assert c["bos_token_id"] == c["eos_token_id"] == c["pad_token_id"] == eot
  g = json.load(open(os.path.join(out, "generation_config.json")))
  assert g["eos_token_id"] == g["pad_token_id"] == eot


def test_force_replaces_an_earlier_export_and_never_a_users_notes(hf_export, tmp_path):
  """to-hf --force deleted a my_notes.txt or README.md beside an earlier export (its own= took
  every *.txt, *.md, *.json): it replaces only a folder holding what to-hf writes."""
  import shutil
  from nanotext.convert.hf import HF_OWN
  run, out = hf_export
  assert sorted(os.listdir(out)) == sorted(HF_OWN)  # exactly what --force may replace
  again = str(tmp_path / "hf")
  shutil.copytree(out, again)
  to_hf(run, again, force=True, log=quiet)  # an earlier export alone: replaced
  for name in ("my_notes.txt", "README.md", "vocab.json", "pytorch_model.bin"):
    (tmp_path / "hf" / name).write_text("mine")
    with pytest.raises(UserError, match=f"holds '{name}', which this tool does not write"):
      to_hf(run, again, force=True, log=quiet)
    assert (tmp_path / "hf" / name).read_text() == "mine"
    (tmp_path / "hf" / name).unlink()


def test_auto_tokenizer_matches_nanotext(hf_export):
  _, out = hf_export
  tok = transformers.AutoTokenizer.from_pretrained(out)
  ours = get_tokenizer("shakespeare")
  ids = tok(TEXT)["input_ids"]
  assert ids == ours.encode(TEXT)  # no bos/eos added, same ids
  assert tok.decode(ids) == TEXT  # exact round trip (no clean-up of spaces)
  assert tok.eos_token == tok.bos_token == tok.pad_token == "<|endoftext|>"
  assert tok.eos_token_id == ours.eot_id
  assert tok.model_max_length == 32  # n_positions = train.seq_len of the run


def test_pipeline_generates_like_the_model(hf_export):
  _, out = hf_export
  pipe = transformers.pipeline("text-generation", model=out, device="cpu")
  result = pipe("ROMEO:", max_new_tokens=8, do_sample=False)[0]["generated_text"]
  assert result.startswith("ROMEO:") and len(result) > len("ROMEO:")
  # Greedy decoding by hand with the same model agrees with the pipeline's text.
  tok = transformers.AutoTokenizer.from_pretrained(out)
  model = transformers.AutoModelForCausalLM.from_pretrained(out)
  ids = tok("ROMEO:", return_tensors="pt")["input_ids"]
  with torch.no_grad():
    for _ in range(8):
      nxt = model(ids).logits[0, -1].argmax()
      ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
  assert tok.decode(ids[0]) == result


@pytest.mark.parametrize("command", ["from-hf", "to-hf", "params-only", "export-torch"])
def test_subcommand_help(command):
  proc = run_cli("nanotext.convert", command, "--help")
  assert proc.returncode == 0, proc.stderr
  assert proc.stdout.startswith(f"usage: python -m nanotext.convert {command} ")
  assert "--out" in proc.stdout and not proc.stderr.strip()


def test_file_where_a_directory_is_expected(hf_export, tmp_path):
  run, _ = hf_export
  f = tmp_path / "file.txt"
  f.write_text("not a directory")
  one_line_error(run_cli("nanotext.convert", "to-hf", f"--run={f}", f"--out={tmp_path / 'o'}"),
                 f"--run '{f}' is a file")
  one_line_error(run_cli("nanotext.convert", "from-hf", f"--hf={f}", f"--out={tmp_path / 'o'}"),
                 f"--hf '{f}' is a file")
  one_line_error(run_cli("nanotext.convert", "to-hf", f"--run={run}", f"--out={f}"),
                 f"--out '{f}' is a file")
  one_line_error(run_cli("nanotext.convert", "to-hf", f"--run={run}",
                         f"--out={f / 'hf'}"), "a file stands where its folder")
  assert f.read_text() == "not a directory"
  assert sorted(os.listdir(tmp_path)) == ["file.txt"]
