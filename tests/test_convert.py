"""Checkpoint conversion: HF GPT-2 both ways (logits match), params-only, speedrun torch export,
and refusals; all on tiny models built here (no downloads)."""

import json
import re
import os

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import REPO, SPEEDRUN, TINY, extra, forward, run_cli, saved_run
from nanotext import config, train, verify
from nanotext.trees import flatten
from nanotext.model import gpt
from nanotext.convert import from_hf, hf, load_params, params_only, to_hf
from nanotext.convert.common import load_run
from nanotext.errors import UserError

torch = extra("torch")  # the whole file: skipped, with the reason, without torch or transformers
transformers = extra("transformers")
pytestmark = [pytest.mark.torch, pytest.mark.transformers]

# Both sides compute in float32 with different matmul blocking and reduction orders; over two
# blocks that moves logits of magnitude ~1-5 by ~1e-6..1e-5. 1e-4 is well above that noise and
# far below any mapping error (a swapped q/k, a missing bias or the erf GELU move logits >1e-3).
ATOL = 1e-4
# Keys from TINY that describe data and training (the model keys come from the HF config).
TRAIN_KEYS = [a for a in TINY if not a.startswith("model.")] + ["model.align=0"]
FAST = ["train.steps=2", "train.eval_every=0", "train.eval_batches=1"]
quiet = lambda *a, **k: None


def nanotext_logits(run_dir, params, tokens):
  cfg = config.load(os.path.join(run_dir, "config.yml"))
  graphdef = gpt.abstract_model(cfg, "cpu")[0]
  return forward(graphdef, params, tokens)


def hf_logits(model, tokens):
  model.eval()
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A random tiny GPT2LMHeadModel saved as safetensors, biases and LayerNorms perturbed too."""
  torch.manual_seed(0)
  cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64,
                                bos_token_id=0, eos_token_id=0)
  model = transformers.GPT2LMHeadModel(cfg)
  with torch.no_grad():  # HF inits biases to 0 and LN to 1, which would hide mapping mistakes
    for name, p in model.named_parameters():
      if p.ndim == 1:
        p.add_(0.1 * torch.randn_like(p))
  path = tmp_path_factory.mktemp("hf") / "gpt2-tiny"
  model.save_pretrained(path)
  return str(path), model


@pytest.fixture(scope="module")
def converted(hf_dir, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("conv") / "run")
  from_hf(hf_dir[0], out, TRAIN_KEYS, log=quiet)
  return out


@pytest.fixture
def base_run(tiny_run):
  """2 steps of TINY (conftest's run, shared: read only)."""
  return tiny_run[0]


@pytest.fixture(scope="module")
def speedrun_run(tmp_path_factory):
  """A speedrun run directory (not trained: what is refused is its config)."""
  out = str(tmp_path_factory.mktemp("speedrun") / "run")
  saved_run(SPEEDRUN, TINY + FAST + ["model.mlp_dim=256"], out)
  return out


def assert_same_tensors(hf_a, hf_b):
  """Two HF folders' model.safetensors hold the same tensors, bit for bit."""
  before = load_file(os.path.join(hf_a, "model.safetensors"))
  after = load_file(os.path.join(hf_b, "model.safetensors"))
  assert sorted(before) == sorted(after)
  for k in before:
    np.testing.assert_array_equal(before[k], after[k], err_msg=k)


def test_from_hf_logits_match(hf_dir, converted):
  cfg, step, params = load_run(converted)
  assert step == 0 and cfg.model.max_seq_len == 64 and cfg.train.seq_len == 32
  tokens = np.random.default_rng(0).integers(0, 512, (2, 64), dtype=np.int32)
  ours, theirs = nanotext_logits(converted, params, tokens), hf_logits(hf_dir[1], tokens)
  print(f"from-hf max |logit diff| = {np.abs(ours - theirs).max():.2e}")
  np.testing.assert_allclose(ours, theirs, atol=ATOL, rtol=0)


def test_from_hf_then_to_hf_is_lossless(hf_dir, converted, tmp_path):
  """The tensors, and under data.tokenizer=none the eos id as data.eot_id (both were lost)."""
  no_eot = [a for a in TRAIN_KEYS if not a.startswith("data.eot_id")]
  assert hf.read_hf(hf_dir[0], str(tmp_path / "x"), no_eot)[0].data.eot_id == 0
  to_hf(converted, str(tmp_path / "back"), step=0, log=quiet)
  for name in ("config.json", "generation_config.json"):
    c = json.load(open(tmp_path / "back" / name))
    assert c["bos_token_id"] == c["eos_token_id"] == c["pad_token_id"] == 0, name
  assert_same_tensors(hf_dir[0], tmp_path / "back")


def test_from_hf_onto_speedrun_then_to_hf_is_lossless(hf_dir, tmp_path):
  """--config=speedrun.yml: fp8_head is switched off with the other speedrun features (it was
  refused: 'needs an untied head'), and the table is stored float32, not speedrun's bfloat16
  embed_dtype (to-hf gave back a rounded wte)."""
  out = str(tmp_path / "run")
  from_hf(hf_dir[0], out, TRAIN_KEYS, config_path=SPEEDRUN, log=quiet)
  cfg = config.load(os.path.join(out, "config.yml"))
  assert not cfg.model.fp8_head and cfg.model.param_dtype == "float32"
  assert cfg.model.embed_dtype in ("", "float32")
  to_hf(out, str(tmp_path / "back"), log=quiet)
  assert_same_tensors(hf_dir[0], tmp_path / "back")
  with pytest.raises(UserError, match="model.embed_dtype='bfloat16' conflicts"):
    from_hf(hf_dir[0], str(tmp_path / "bf"), TRAIN_KEYS + ["model.embed_dtype=bfloat16"],
            config_path=SPEEDRUN, log=quiet)


def test_merged_qkv_converts_both_ways(hf_dir, tmp_path):
  """model.merged_qkv=true (one [3, D, D] kernel per block, the same function) was refused both
  ways; now c_attn splits into it and back, scanned layers too."""
  out = str(tmp_path / "run")
  from_hf(hf_dir[0], out, TRAIN_KEYS + ["model.merged_qkv=true", "model.scan_layers=true"],
          log=quiet)
  cfg, _, params = load_run(out)
  assert cfg.model.merged_qkv and flatten(params)["blocks.attn.qkv.kernel"].shape == (2, 3, 64, 64)
  tokens = np.random.default_rng(2).integers(0, 512, (2, 64), dtype=np.int32)
  np.testing.assert_allclose(nanotext_logits(out, params, tokens), hf_logits(hf_dir[1], tokens),
                             atol=ATOL, rtol=0)
  to_hf(out, str(tmp_path / "back"), log=quiet)
  assert_same_tensors(hf_dir[0], tmp_path / "back")


def test_to_hf_logits_match(base_run, tmp_path):
  out = str(tmp_path / "hf")
  to_hf(base_run, out, log=quiet)
  model = transformers.GPT2LMHeadModel.from_pretrained(out)
  _, _, params = load_run(base_run)
  tokens = np.random.default_rng(1).integers(0, 512, (2, 32), dtype=np.int32)
  ours, theirs = nanotext_logits(base_run, params, tokens), hf_logits(model, tokens)
  print(f"to-hf max |logit diff| = {np.abs(ours - theirs).max():.2e}")
  np.testing.assert_allclose(theirs, ours, atol=ATOL, rtol=0)


def test_a_layer_norm_epsilon_of_another_size_converts_both_ways(hf_dir, tmp_path):
  """HF's layer_norm_epsilon is model.norm_eps (it was refused unless 1e-5, and to-hf wrote 1e-5
  whatever the run's norm_eps: another function, silently)."""
  src = tmp_path / "hf"
  src.mkdir()
  c = json.loads(open(os.path.join(hf_dir[0], "config.json")).read())
  c["layer_norm_epsilon"] = 0.5  # large enough to move the logits well past ATOL
  (src / "config.json").write_text(json.dumps(c))
  os.symlink(os.path.join(hf_dir[0], "model.safetensors"), src / "model.safetensors")
  run = str(tmp_path / "run")
  from_hf(str(src), run, TRAIN_KEYS, log=quiet)
  cfg, _, params = load_run(run)
  assert cfg.model.norm_eps == 0.5
  tokens = np.random.default_rng(2).integers(0, 512, (2, 64), dtype=np.int32)
  theirs = hf_logits(transformers.GPT2LMHeadModel.from_pretrained(str(src)), tokens)
  np.testing.assert_allclose(nanotext_logits(run, params, tokens), theirs, atol=ATOL, rtol=0)
  assert np.abs(theirs - hf_logits(hf_dir[1], tokens)).max() > 100 * ATOL  # the epsilon matters
  to_hf(run, str(tmp_path / "back"), step=0, log=quiet)
  back = json.loads((tmp_path / "back" / "config.json").read_text())
  assert back["layer_norm_epsilon"] == 0.5
  with pytest.raises(UserError, match="model.norm_eps=0.01 conflicts"):
    from_hf(str(src), str(tmp_path / "other"), TRAIN_KEYS + ["model.norm_eps=0.01"], log=quiet)


def test_converted_run_trains_on(converted):
  lines = []
  result = train.run(os.path.join(converted, "config.yml"),
                     [f"output_dir={converted}", "train.steps=3"], log=lines.append)
  assert any("resumed from the checkpoint of step 0" in l for l in lines), lines
  assert np.isfinite(result.last_loss)
  assert int(result.state["step"]) == 3


def test_from_hf_keeps_the_mesh_as_given(hf_dir, tmp_path):
  """config.yml held the converting machine's device count (mesh.fsdp: 8 here), and the printed
  train command then failed on any other count: it holds the mesh as given, one for more
  devices than this machine has included (it was refused: the step is written from these)."""
  import yaml
  for extra_keys, want in [([], (1, -1, 1)), (["mesh.fsdp=4", "mesh.data=2"], (2, 4, 1)),
                           (["mesh.data=16"], (16, -1, 1))]:
    out = str(tmp_path / f"run{len(extra_keys)}")
    from_hf(hf_dir[0], out, TRAIN_KEYS + extra_keys, log=quiet)
    saved = yaml.safe_load(open(os.path.join(out, "config.yml")))["mesh"]
    assert (saved["data"], saved["fsdp"], saved["tensor"]) == want


@pytest.mark.fast
def test_a_truncated_params_only_array_is_one_readable_line(tmp_path):
  """The line ended in tensorstore's 'See full TensorStore details: <bound method pybind11_...'
  (verify, generate and every converter read the folder so)."""
  import orbax.checkpoint as ocp
  ckptr = ocp.Checkpointer(ocp.StandardCheckpointHandler())
  ckptr.save(str(tmp_path / "po" / "params"),
             ocp.args.StandardSave({"w": np.arange(512 * 64, dtype=np.float32).reshape(512, 64)}))
  ckptr.close()
  files = [os.path.join(d, n) for d, _, names in os.walk(tmp_path / "po" / "params") for n in names
           if os.sep + "d" + os.sep in os.path.join(d, n)]
  biggest = max(files, key=os.path.getsize)
  os.truncate(biggest, os.path.getsize(biggest) // 2)
  with pytest.raises(UserError) as e:
    load_params(str(tmp_path / "po"))
  assert str(e.value).startswith(f"cannot read the params-only checkpoint '{tmp_path / 'po'}': ")
  assert "TensorStore details" not in str(e.value) and "<bound" not in str(e.value)


@pytest.mark.parametrize("dtype", ["", "bfloat16"])
def test_params_only(base_run, tmp_path, dtype):
  out = str(tmp_path / "p")
  params_only(base_run, out, dtype=dtype, log=quiet)
  assert os.path.isfile(os.path.join(out, "config.yml"))
  step, got = load_params(out)
  _, want_step, want = load_run(base_run)
  assert step == want_step == 2
  # the model's own tree, as load_run gives it: layers keyed by ints in order (they were the
  # saved strings '0', '1', ..., a tree nnx.merge does not take for the model's)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  assert list(got["blocks"]) == list(range(len(want["blocks"])))
  got, want = flatten(got), flatten(want)
  assert sorted(got) == sorted(want)
  for name, w in want.items():
    assert got[name].dtype == (dtype or w.dtype)
    np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(w).astype(got[name].dtype))


def test_a_params_only_folder_converts_on(base_run, tmp_path, monkeypatch):
  """What params-only wrote reads as a --run of its own: to HF GPT-2 (the run's weights) and to
  another params-only folder (cast back); --step is refused there (it has one step), and verify
  reads its one step. Named by a relative path (orbax refused it: 'damaged' in every tool)."""
  monkeypatch.chdir(tmp_path)
  folder = "p"
  params_only(base_run, folder, log=quiet)
  to_hf(folder, str(tmp_path / "hf_a"), log=quiet)
  to_hf(base_run, str(tmp_path / "hf_b"), log=quiet)
  assert_same_tensors(tmp_path / "hf_a", tmp_path / "hf_b")
  params_only(folder, str(tmp_path / "q"), dtype="bfloat16", log=quiet)
  assert load_params(str(tmp_path / "q"))[0] == 2
  with pytest.raises(UserError, match="params-only folder .*leave --step out"):
    to_hf(folder, str(tmp_path / "hf_c"), step=2, log=quiet)
  assert not os.path.exists(tmp_path / "hf_c")
  from nanotext import verify
  lines = []
  assert verify.report(folder, lines.append) == 0
  assert lines[1].split()[:3] == ["step", "2", "intact"], lines


def test_a_params_only_folder_refuses_an_edited_model_key(base_run, tmp_path):
  """An edited model.* key in a params-only folder's config.yml is refused as in a run folder
  (evaluate, generate and to-hf computed another model, unwarned); another key and a
  convert.json written before the record (no "config") read as before."""
  from nanotext import evaluate
  folder = str(tmp_path / "p")
  params_only(base_run, folder, log=quiet)
  yml = os.path.join(folder, "config.yml")
  text = open(yml).read()
  assert "attn_scale: 0.0" in text and "eval_batches: 2" in text
  open(yml, "w").write(text.replace("eval_batches: 2", "eval_batches: 3"))
  assert load_run(folder)[1] == 2
  open(yml, "w").write(text.replace("attn_scale: 0.0", "attn_scale: 3.0"))
  words = "differs from the config its checkpoint of step 2 was saved with (model.attn_scale: 0.0"
  for read in (lambda: load_run(folder), lambda: evaluate.load_config(folder, [], checked=False)):
    with pytest.raises(UserError, match=re.escape(words)):
      read()
  lines = []  # verify: the weights are intact, the folder unreadable
  assert verify.report(folder, lines.append) == 1 and words in lines[-1], lines
  record = json.load(open(os.path.join(folder, "convert.json")))
  del record["config"]
  json.dump(record, open(os.path.join(folder, "convert.json"), "w"))
  assert load_run(folder)[0].model.attn_scale == 3.0


def test_export_torch_refuses_what_the_record_cannot_express(speedrun_run, tmp_path):
  """The tiny speedrun run has 32-wide heads and 2 layers; the record's module fixes 128 and 12.
  Names, shapes and logits of an expressible run: tests/test_export_record.py."""
  out = tmp_path / "gpt.safetensors"
  one_line_error(run_cli("nanotext.convert", "export-torch", f"--run={speedrun_run}",
                         f"--out={out}"), "model.head_dim=32", "128")
  assert os.listdir(tmp_path) == []


# Refusals.

@pytest.mark.fast
@pytest.mark.parametrize("override", ["model.rope_freqs=arange", "model.value_residual=true",
                                      "model.attn_scale_learned=true"])
def test_export_torch_refuses_what_changes_the_records_function(override):
  """Keys the record's module has no way to compute: it loaded the weights and gave other
  logits (rope_freqs=arange: 0.016 off)."""
  from nanotext.convert import torch_export
  record = os.path.join(REPO, "configs", "speedrun_record.yml")
  torch_export.check_expressible(config.load(record))  # the record itself
  with pytest.raises(UserError, match=override.split("=")[0]):
    torch_export.check_expressible(config.load(record, [override]))


@pytest.mark.fast
def test_to_hf_takes_mlp_only_indices_past_the_last_layer():
  """model.no_attention_layers=[5] on 2 layers builds every attention (base.yml: indices past
  the last layer are ignored), yet to-hf refused it as unsupported."""
  base = os.path.join(REPO, "configs", "base.yml")
  hf.check_classic(config.load(base, ["model.num_layers=2", "model.no_attention_layers=[5]"]))
  with pytest.raises(UserError, match=r"model.no_attention_layers=\[1, 5\] is not supported"):
    hf.check_classic(config.load(base, ["model.num_layers=2", "model.no_attention_layers=[1,5]"]))


@pytest.mark.fast
def test_to_hf_and_from_hf_refuse_document_masks_and_other_table_rows(hf_dir, tmp_path):
  """GPT-2 has no document masks: a doc_mask run exported, or a GPT-2 imported into one, gave
  other logits after every <|endoftext|> (up to 1.2)."""
  base = os.path.join(REPO, "configs", "base.yml")
  with pytest.raises(UserError, match="attention.doc_mask=True is not supported"):
    hf.check_classic(config.load(base, ["attention.doc_mask=true"]))
  # a table of other rows than the head's: the export's config.json said vocab_size 8320 beside
  # a wte of 8192 rows, which transformers cannot load
  with pytest.raises(UserError, match="model.embed_rows=8192 differs from model.vocab_size=8320"):
    hf.check_classic(config.load(base, ["model.embed_rows=8192", "model.vocab_size=8320"]))
  hf.check_classic(config.load(base, ["model.embed_rows=8192"]))
  with pytest.raises(UserError, match="attention.doc_mask=True conflicts"):
    from_hf(hf_dir[0], str(tmp_path / "run"), TRAIN_KEYS + ["attention.doc_mask=true"],
            log=quiet)

def one_line_error(result, *needles):
  assert result.returncode == 2, result.stderr
  assert "Traceback" not in result.stderr
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("nanotext: error:"), result.stderr
  for n in needles:
    assert n in lines[0], lines[0]


def test_cli_to_hf_refuses_speedrun(speedrun_run, tmp_path):
  out = tmp_path / "hf"
  one_line_error(run_cli("nanotext.convert", "to-hf", f"--run={speedrun_run}", f"--out={out}"),
                 "model.positions")
  assert not out.exists() and os.listdir(tmp_path) == []


def test_cli_export_torch_refuses_base(base_run, tmp_path):
  out = tmp_path / "x.safetensors"
  one_line_error(run_cli("nanotext.convert", "export-torch", f"--run={base_run}",
                         f"--out={out}"), "speedrun", "model.positions")
  assert os.listdir(tmp_path) == []


@pytest.mark.fast
def test_cli_missing_run_dir(tmp_path):
  one_line_error(run_cli("nanotext.convert", "params-only", f"--run={tmp_path / 'nope'}",
                         f"--out={tmp_path / 'p'}"), "does not exist")


@pytest.mark.parametrize("option,value", [("scale_attn_by_inverse_layer_idx", True),
                                          ("activation_function", "gelu"),
                                          ("add_cross_attention", True)])
def test_from_hf_refuses_unsupported_option(hf_dir, tmp_path, option, value):
  src = tmp_path / "hf"
  src.mkdir()
  c = json.loads(open(os.path.join(hf_dir[0], "config.json")).read())
  c[option] = value
  (src / "config.json").write_text(json.dumps(c))
  os.symlink(os.path.join(hf_dir[0], "model.safetensors"), src / "model.safetensors")
  with pytest.raises(UserError, match=option):
    from_hf(str(src), str(tmp_path / "run"), TRAIN_KEYS, log=quiet)
  assert not (tmp_path / "run").exists()


@pytest.mark.fast
def test_from_hf_refuses_conflicting_override(hf_dir, tmp_path):
  with pytest.raises(UserError, match="model.vocab_size=1024 conflicts"):
    from_hf(hf_dir[0], str(tmp_path / "run"), TRAIN_KEYS + ["model.vocab_size=1024"], log=quiet)
  # rows longer than the checkpoint's positions: named as its config.json names them
  with pytest.raises(UserError, match=r"model.max_seq_len=64\).* \(model.max_seq_len is the "
                                      r"Hugging Face checkpoint's n_positions=64\)"):
    from_hf(hf_dir[0], str(tmp_path / "run"), TRAIN_KEYS + ["train.seq_len=128"], log=quiet)


def test_existing_out_refused_then_forced(base_run, tmp_path):
  out = tmp_path / "p"
  out.mkdir()
  (out / "keep.txt").write_text("mine")
  # what --force would refuse is said at once (it said 'pass --force', which then refused)
  with pytest.raises(UserError, match="holds 'keep.txt', which this tool does not write"):
    params_only(base_run, str(out), log=quiet)
  assert os.listdir(out) == ["keep.txt"]
  # --force replaces an earlier output of the tool, never a folder holding anything else (a
  # git checkout given as --out was replaced whole)
  with pytest.raises(UserError, match="holds 'keep.txt', which this tool does not write"):
    params_only(base_run, str(out), force=True, log=quiet)
  os.remove(out / "keep.txt")
  params_only(base_run, str(out), log=quiet)
  params_only(base_run, str(out), force=True, log=quiet)
  assert sorted(os.listdir(out)) == ["config.yml", "convert.json", "params"]
  assert sorted(os.listdir(tmp_path)) == ["p"]  # no staging folders left behind


def test_refuses_out_that_is_the_run(base_run):
  with pytest.raises(UserError, match="would replace the input"):
    params_only(base_run, base_run, force=True, log=quiet)


@pytest.mark.fast
def test_refuses_out_that_holds_the_run_through_a_link(base_run, tmp_path):
  """--run named through a link, --out the folder the run really lies in: with --force the
  folder, the run in it, was replaced by the parameters."""
  import shutil
  runs = tmp_path / "runs"
  runs.mkdir()
  shutil.copytree(os.path.join(base_run, "checkpoints"), runs / "a" / "checkpoints")
  shutil.copy(os.path.join(base_run, "config.yml"), runs / "a" / "config.yml")
  (tmp_path / "link").symlink_to(runs / "a")
  with pytest.raises(UserError, match="would replace the input .*link' \\(a link to"):
    params_only(str(tmp_path / "link"), str(runs), force=True, log=quiet)
  assert os.listdir(runs) == ["a"] and sorted(os.listdir(runs / "a")) == ["checkpoints",
                                                                          "config.yml"]


@pytest.mark.fast
@pytest.mark.parametrize("edit,message", [
    (lambda c: [1, 2, 3], "holds a JSON list"),
    (lambda c: {**c, "n_layer": "2"}, "n_layer='2'"),
    (lambda c: {k: v for k, v in c.items() if k != "n_embd"}, "n_embd=None"),
    (lambda c: {**c, "n_embd": 64.5}, "n_embd=64.5"),
    (lambda c: {**c, "n_layer": -1}, "n_layer=-1"),
    (lambda c: {**c, "n_inner": "abc"}, "n_inner='abc'"),  # was named model.mlp_dim
    (lambda c: {**c, "n_inner": -5}, "n_inner=-5"),
])
def test_from_hf_names_a_size_that_is_not_a_positive_integer(hf_dir, tmp_path, edit, message):
  src = tmp_path / "hf"
  src.mkdir()
  c = json.loads(open(os.path.join(hf_dir[0], "config.json")).read())
  (src / "config.json").write_text(json.dumps(edit(c)))
  os.symlink(os.path.join(hf_dir[0], "model.safetensors"), src / "model.safetensors")
  with pytest.raises(UserError, match=re.escape(message)):
    from_hf(str(src), str(tmp_path / "run"), TRAIN_KEYS, log=quiet)
  assert not (tmp_path / "run").exists()


def test_an_explicit_norm_eps_of_gpt2s_own_value_is_no_conflict(hf_dir, tmp_path):
  """model.norm_eps=1e-5 on a 1e-5 checkpoint is LayerNorm's default (0) spelt out: the same."""
  cfg, _ = hf.read_hf(hf_dir[0], str(tmp_path / "run"), TRAIN_KEYS + ["model.norm_eps=1e-5"])
  assert cfg.model.norm_eps == 1e-5
  assert not os.path.exists(tmp_path / "run")  # read_hf only reads


def test_from_hf_onto_a_speedrun_config_turns_its_features_off(hf_dir, tmp_path):
  """--config=configs/shakespeare.yml: its windows, value tables and U-net are not GPT-2's, so
  the run takes GPT-2's (once: 'window_pattern needs window > 0'); merged QKV is a layout of the
  same function, kept."""
  out = str(tmp_path / "run")
  from_hf(hf_dir[0], out, TRAIN_KEYS, config_path=os.path.join(REPO, "configs", "shakespeare.yml"),
          log=quiet)
  cfg = config.load(os.path.join(out, "config.yml"))
  hf.check_classic(cfg)  # exported back as it came
  assert cfg.model.norm_eps == 0  # LayerNorm's 1e-5, GPT-2's: not the config's 2**-7
  assert cfg.attention.window_pattern == "" and cfg.model.merged_qkv


@pytest.mark.fast
def test_from_hf_refuses_a_vocabulary_smaller_than_the_tokenizers(hf_dir, tmp_path):
  """The HF checkpoint's 512 ids under the shipped 8,192-token tokenizer: the run was written,
  then train and evaluate refused it and generate sampled from clamped lookups, exit 0."""
  text = [a for a in TRAIN_KEYS if not a.startswith("data.")] + [
      "data.source=shakespeare", "data.tokenizer=shakespeare"]
  with pytest.raises(UserError, match=r"vocab_size=512 is smaller than the vocabulary of "
                                      r"data.tokenizer 'shakespeare' \(8192\); pass "
                                      r"data.tokenizer="):
    from_hf(hf_dir[0], str(tmp_path / "run"), text, log=quiet)
  assert not (tmp_path / "run").exists()


@pytest.mark.fast
def test_from_hf_reads_shards_and_names_a_damaged_index(hf_dir, tmp_path):
  """A sharded save (model.safetensors.index.json) reads as the single file does; an index that
  is not JSON, has no weight_map or names a path outside its folder was a traceback."""
  sharded = tmp_path / "sharded"
  hf_dir[1].save_pretrained(sharded, max_shard_size="100KB")
  assert not (sharded / "model.safetensors").exists()
  _, want = hf.read_hf(hf_dir[0], str(tmp_path / "a"), TRAIN_KEYS)
  _, got = hf.read_hf(str(sharded), str(tmp_path / "b"), TRAIN_KEYS)
  assert sorted(got) == sorted(want)
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  index = sharded / "model.safetensors.index.json"
  for text in ("{not json", '{"metadata": {}}', "[1, 2]", '{"weight_map": {"a": "../x"}}',
               '{"weight_map": {}}'):
    index.write_text(text)
    with pytest.raises(UserError, match="model.safetensors.index.json' is not a safetensors "
                                        "index"):
      hf.read_hf(str(sharded), str(tmp_path / "c"), TRAIN_KEYS)


@pytest.mark.fast
def test_from_hf_refuses_weights_that_are_not_finite(hf_dir, tmp_path):
  from safetensors.numpy import save_file
  src = tmp_path / "hf"
  src.mkdir()
  os.symlink(os.path.join(hf_dir[0], "config.json"), src / "config.json")
  tensors = load_file(os.path.join(hf_dir[0], "model.safetensors"))
  name = next(k for k in tensors if k.endswith("h.1.mlp.c_fc.weight"))
  tensors[name] = tensors[name].copy()
  tensors[name][0, 3] = np.nan
  save_file(tensors, str(src / "model.safetensors"))
  with pytest.raises(UserError, match=r"NaN or infinite values in blocks\.1\.mlp\.fc\.kernel"):
    from_hf(str(src), str(tmp_path / "run"), TRAIN_KEYS, log=quiet)
  assert not (tmp_path / "run").exists()


@pytest.mark.fast
@pytest.mark.parametrize("name,message", [("sd/", "names a folder"),
                                          ("model.pt", "torch.load cannot read")])
def test_export_torch_refuses_an_out_it_would_write_wrong(tmp_path, name, message):
  """--out=DIR/ wrote a file named DIR; --out=model.pt a safetensors file torch.load rejects."""
  from nanotext.convert.torch_export import export_torch
  with pytest.raises(UserError, match=message):
    export_torch(str(tmp_path / "run"), str(tmp_path) + "/" + name, log=lambda s: None)
  assert os.listdir(tmp_path) == []


@pytest.mark.fast
def test_from_hf_takes_the_checkpoints_widths_without_an_alignment_warning(hf_dir, tmp_path):
  """base.yml's model.align=256 warned on every import (GPT-2's 50,257 rows), a second line on
  stderr before any refusal; an override still sets it."""
  keys = [a for a in TRAIN_KEYS if a != "model.align=0"]
  assert hf.read_hf(hf_dir[0], str(tmp_path / "run"), keys)[0].model.align == 0
  assert hf.read_hf(hf_dir[0], str(tmp_path / "run"), keys + ["model.align=64"])[0].model.align \
      == 64


@pytest.mark.fast
def test_a_cast_is_refused_only_where_it_rounds_a_finite_value_to_infinity():
  """The largest finite value was the bound: 3.39e38 rounds to bfloat16's 3.3895e38, finite,
  and was refused as "read as infinite"; numpy arrays and sharded jax arrays alike."""
  import ml_dtypes
  from nanotext.trees import beyond_range, cast_checked
  for make in (np.asarray, jax.numpy.asarray):
    assert not beyond_range(make(np.float32([1, 3.39e38, -3.39e38])), ml_dtypes.bfloat16)
    assert beyond_range(make(np.float32([1, -3.4e38])), ml_dtypes.bfloat16)
    assert not beyond_range(make(np.float32([np.inf])), ml_dtypes.bfloat16)  # not the cast's
    assert not beyond_range(make(np.float32([3.4e38])), np.float32)  # no narrowing
  assert beyond_range(np.float64([3.4029e38]), np.float32)
  assert not beyond_range(np.float64([3.40282350e38]), np.float32)  # rounds to float32's max
  with pytest.raises(UserError, match=r"^w: 'b' holds values beyond float16's range"):
    cast_checked(np.float32([7e4]), np.float16, "b", "w")
  assert cast_checked(np.float32([6.5e4]), np.float16, "b", "w").dtype == np.float16


def test_a_cast_of_one_width_into_a_smaller_range_is_checked_and_a_widening_one_not_made(
    monkeypatch):
  """bfloat16 or int32 into float16 keeps or grows nothing in width yet overflows at 65,504: it
  went unchecked; and a widening or same-dtype check cast every tensor first (from-torch: each
  float32 weight copied and thrown away)."""
  import ml_dtypes
  from nanotext import trees
  with pytest.raises(UserError, match=r"^w: 'b' holds values beyond float16's range"):
    trees.cast_checked(np.float32([7e4]).astype(ml_dtypes.bfloat16), np.float16, "b", "w")
  assert trees.beyond_range(np.int32([2**20]), np.float16)
  assert not trees.beyond_range(np.int32([2**20]), np.float32)
  assert not trees.beyond_range(np.int64([2**62]), np.float32)
  monkeypatch.setattr(trees, "_cast", lambda *_: pytest.fail("cast made for nothing"))
  for dtype in (np.float32, ml_dtypes.bfloat16):
    assert not trees.beyond_range(np.zeros(3, dtype), np.float32)
