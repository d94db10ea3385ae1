"""export-torch against a PyTorch model written from the record's `GPT`; from-torch back.

`record_torch.RecordGPT` (benchmarks/record_torch.py) re-derives modded-nanogpt train_gpt.py
(587b45fb) from reading it: parameter names and shapes as its state dict, rotary with half the
frequencies zero, QK-norm, value-embedding mixing, x0 lambdas, U-net skips, ReLU^2, 30 * sigmoid
logits, and its block mask (long window W blocks, short W // 2, document-causal inside).
"""

import os
import re
import sys

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from conftest import REPO, TINY, extra, forward, one_line_error, run_cli, saved_run
from nanotext.convert import from_torch, torch_import
from nanotext.convert.common import load_run
from nanotext.convert.torch_export import export_torch
from nanotext.errors import UserError
from nanotext.model import GPT
from nanotext.trees import flatten
from nanotext.window_schedule import layer_windows

torch = extra("torch")
pytestmark = pytest.mark.torch
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from record_torch import RecordGPT  # noqa: E402

RECORD_CFG = f"{REPO}/configs/speedrun_record.yml"
# The record's module fixes 12 layers and 128-wide heads; everything else small.
DIMS = ["model.num_layers=12", "model.d_model=128", "model.num_heads=1", "model.head_dim=128",
        "model.mlp_dim=512", "model.vocab_size=512", "model.embed_rows=0", "model.dtype=float32",
        "train.seq_len=256", "train.steps=2", "train.eval_every=0", "train.eval_batches=1",
        "sample.max_new_tokens=0"]

@pytest.fixture(scope="module")
def record_run(tmp_path_factory):
  """A record-config run directory whose every parameter is off its init (the zero head and
  projections, the shared lambdas), as training leaves one, without compiling a train step."""
  out = str(tmp_path_factory.mktemp("record") / "run")
  saved_run(RECORD_CFG, TINY + DIMS, out, noise=0.02)
  return out


def test_exported_logits_match_the_records_module(record_run, tmp_path):
  from safetensors.torch import load_file
  out = str(tmp_path / "gpt.safetensors")
  export_torch(record_run, out, log=lambda s: None)
  cfg, _, params = load_run(record_run)
  m = cfg.model
  ref = RecordGPT(m.vocab_size, m.d_model, num_layers=m.num_layers)  # eps: the record's (None)
  ref.load_state_dict({k: v.float() for k, v in load_file(out).items()}, strict=True)
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, m.vocab_size, 512)
  tokens[[0, 100, 300, 301]] = 0  # documents, one starting on a block boundary (eot id 0)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: GPT(m, cfg.attention, rngs=nnx.Rngs(0))))
  nnx.replace_by_pure_dict(state, params)  # by name: a restored tree's "10" sorts before "2"
  seg = np.cumsum(tokens == 0)[None].astype(np.int32)
  for W in (1, 3):  # the record's window in blocks: short layers W // 2 = 0 and 1
    windows = layer_windows(cfg.attention, m.num_layers, 128 * W)
    ours = forward(graphdef, state, tokens[None], seg, windows, train=False)[0]
    with torch.no_grad():
      theirs = ref(torch.as_tensor(tokens), W, 0).numpy()
    # The record's logits are ours plus 15 (30 sigmoid(z / 7.5) = 15 tanh(z / 15) + 15).
    print(f"W={W}: max abs logit difference {np.abs(theirs - 15 - ours).max():.2e}")
    np.testing.assert_allclose(theirs - 15, ours, atol=2e-4)
    assert np.abs(ours).max() > 1e-3  # a head off its zero init


# ---------------------------------------------------------------------------------------------
# from-torch: the state dict back into a nanotext run

quiet = lambda line: None


@pytest.fixture(scope="module")
def exported(record_run, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("export") / "gpt.safetensors")
  export_torch(record_run, out, log=quiet)
  return out


@pytest.fixture(scope="module")
def imported(exported, tmp_path_factory):
  out = str(tmp_path_factory.mktemp("import") / "run")
  from_torch(exported, out, TINY + DIMS, log=quiet)  # --config: speedrun_record.yml, the source's
  return out


def params_of(run: str) -> dict:
  return {k: np.asarray(v) for k, v in flatten(load_run(run)[2]).items()}


def same_bits(a, b) -> bool:
  return a.dtype == b.dtype and a.shape == b.shape and \
      np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def test_from_torch_gives_back_the_exported_params(record_run, imported):
  cfg, step, _ = load_run(imported)
  assert step == 0 and cfg.model.to_dict() == load_run(record_run)[0].model.to_dict()
  want, got = params_of(record_run), params_of(imported)
  assert got.keys() == want.keys()
  assert got["embed.embedding"].dtype == ml_dtypes.bfloat16  # the record's tables, read as bf16
  for name in want:
    if name == "head.kernel":  # * sqrt(128) on export, / sqrt(128) back, in float32
      assert got[name].dtype == want[name].dtype
      np.testing.assert_array_max_ulp(got[name], want[name], maxulp=1)
    else:
      assert same_bits(got[name], want[name]), name


def test_a_modded_nanogpt_checkpoint_loads_to_the_same_params(exported, imported, tmp_path):
  """train_gpt.py saves dict(step, code, model=model.state_dict(), optimizers) of its compiled
  model (names under _orig_mod.), its tables bf16; q, k, v go to split kernels as well."""
  from safetensors.torch import load_file
  state = {f"_orig_mod.{k}": v for k, v in load_file(exported).items()}
  assert state["_orig_mod.embed.weight"].dtype == torch.bfloat16
  pt = tmp_path / "state_step000002.pt"
  adam = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], betas=(0.8, 0.95), fused=True)
  buffer = torch.zeros(4)
  muon = {"state": {}, "param_groups": [{"lr": 0.05, "params": [0, 1], "update_buffer": buffer,
                                         "update_buffer_views": [buffer[:2], buffer[2:]]}]}
  torch.save(dict(step=2, code="# train_gpt.py", model=state,
                  optimizers=[adam.state_dict(), muon]), pt)
  out = str(tmp_path / "run")
  from_torch(str(pt), out, TINY + DIMS + ["model.merged_qkv=false"], log=quiet)
  want, got = params_of(imported), params_of(out)
  for i in range(12):
    if i != 7:  # MLP-only
      qkv = want.pop(f"blocks.{i}.attn.qkv.kernel")
      for j, n in enumerate("qkv"):
        assert same_bits(got.pop(f"blocks.{i}.attn.{n}.kernel"), qkv[j]), (i, n)
  assert got.keys() == want.keys()
  assert all(same_bits(got[k], want[k]) for k in want)


def test_the_imported_run_evaluates_to_the_sources_loss(record_run, imported):
  from nanotext import evaluate
  final = ["train.eval_windows=final"]  # the source's step 3 and the import's step 0 alike
  want = evaluate.evaluate(record_run, overrides=final, log=quiet)[0]
  got = evaluate.evaluate(imported, overrides=final, log=quiet)[0]
  assert (want["step"], got["step"]) == (3, 0)
  np.testing.assert_allclose(got["val_loss"], want["val_loss"], rtol=1e-6)


def edited(tensors: dict, edit: str) -> dict:
  """`tensors` with one mistake a state dict of another model would carry, or values the model
  cannot hold."""
  t = dict(tensors)
  if edit == "missing":
    del t["blocks.3.mlp.c_fc.weight"]
  elif edit == "shape":
    t["skip_weights"] = np.ones(5, np.float32)
  elif edit == "too_big":  # past bfloat16's largest (3.39e38), the dtype of the model's table
    t["embed.weight"] = np.full(t["embed.weight"].shape, 3.3999e38, np.float32)
  elif edit == "extra":
    t["blocks.0.attn.rotary.inv_freq"] = np.ones(32, np.float32)
  else:  # a head of other rows
    t["lm_head.weight"] = np.ones((640, 128), np.float32)
  return t


@pytest.mark.parametrize("edit,message", [
    ("missing", "has no 'blocks.3.mlp.c_fc.weight' (512, 128)"),
    ("shape", "'skip_weights' has shape (5,), the config's model needs (6,)"),
    ("extra", "has 'blocks.0.attn.rotary.inv_freq', which the config's model has no place"),
    ("too_big", "'embed.embedding' holds values beyond bfloat16's range"),
    ("head", "lm_head.weight has 640 rows, the config's model.vocab_size=512; pass "
             "model.vocab_size=640")])
def test_from_torch_refuses_a_state_dict_of_another_model(exported, tmp_path, edit, message):
  from safetensors.numpy import load_file, save_file
  src = str(tmp_path / "in.safetensors")
  save_file(edited(load_file(exported), edit), src)
  with pytest.raises(UserError, match=re.escape(message)):
    from_torch(src, str(tmp_path / "out" / "run"), TINY + DIMS, log=quiet)
  assert os.listdir(tmp_path) == ["in.safetensors"]


@pytest.mark.fast
@pytest.mark.parametrize("name,overrides,message", [
    ("gpt.safetensors", ["model.head_dim=64", "model.num_heads=2"],
     "from-torch needs what the speedrun record's GPT computes: model.head_dim=64"),
    ("gpt.safetensors", ["model.mlp_dim=256"], "model.mlp_dim=256 is not supported"),
    ("gpt.bin", [], "is neither .safetensors nor a torch.save file"),
    ("missing.pt", [], "does not exist"),
    ("pipe.safetensors", [], "is not a regular file (a pipe or device)")])
def test_from_torch_refuses_a_config_or_file_before_reading_it(tmp_path, name, overrides,
                                                               message):
  """A pipe (--torch=<(cat F)) was said not to exist."""
  if name == "pipe.safetensors":
    os.mkfifo(tmp_path / name)  # never opened: nothing blocks
  elif name != "missing.pt":
    (tmp_path / name).write_bytes(b"")  # never read
  with pytest.raises(UserError, match=re.escape(message)):
    from_torch(str(tmp_path / name), str(tmp_path / "run"), TINY + DIMS + overrides, log=quiet)
  assert not os.path.exists(tmp_path / "run")


@pytest.mark.fast
def test_a_bare_torch_state_dict_reads_and_other_pickles_are_one_line(tmp_path, monkeypatch):
  pt = str(tmp_path / "sd.pt")
  torch.save({"_orig_mod.embed.weight": torch.ones(2, 3, dtype=torch.bfloat16) / 3,
              "skip_weights": torch.arange(3.0)}, pt)
  got = torch_import.read_state_dict(pt)
  assert sorted(got) == ["embed.weight", "skip_weights"]
  np.testing.assert_array_equal(got["embed.weight"],
                                np.full((2, 3), 1 / 3, np.float32).astype(ml_dtypes.bfloat16))
  torch.save([torch.ones(2)], pt)
  with pytest.raises(UserError, match="holds no state dict"):
    torch_import.read_state_dict(pt)
  torch.save(torch.nn.Linear(2, 2), pt)  # the module itself, not its state_dict()
  with pytest.raises(UserError, match=r"weights_only=True\), which takes tensors .*Linear"):
    torch_import.read_state_dict(pt)
  torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), pt)  # torch said: weights_only=False
  with pytest.raises(UserError, match=r"is a TorchScript archive \(torch.jit.save\); give the "
                                      r"module's state_dict\(\) saved with torch.save$"):
    torch_import.read_state_dict(pt)
  from safetensors.torch import save_file
  save_file({"skip_weights": torch.ones(2)}, pt)  # "damaged, or another format"
  with pytest.raises(UserError, match=r"is a safetensors file: name it .safetensors$"):
    torch_import.read_state_dict(pt)
  for text in (b"hello\n", b"", b"\x80\x02"):  # torch's own words were "101" (a KeyError's)
    with open(pt, "wb") as f:
      f.write(text)
    with pytest.raises(UserError, match="is not a torch.save file"):
      torch_import.read_state_dict(pt)
  monkeypatch.setitem(sys.modules, "torch", None)  # as where PyTorch is not installed
  with pytest.raises(UserError, match="needs PyTorch: pip install torch"):
    torch_import.read_state_dict(pt)


@pytest.mark.fast
def test_a_file_torch_save_did_not_write_is_said_so_in_one_line(tmp_path):
  """A pickle, .npy, .npz or gzip file named .pt got torch's unpickler's words ("Unsupported
  operand 149") and its UserWarning lines; both formats torch.save writes still read, with
  torch's warnings (of a pickle protocol past 2) kept off stderr."""
  import gzip
  import pickle
  import warnings
  pt, sd = str(tmp_path / "sd.pt"), {"skip_weights": torch.arange(64.0)}
  eocd = float(np.frombuffer(b"PK\x05\x06", np.float32)[0])  # a zip's end record, in a tensor
  for legacy, protocol, value in [(False, 2, 3.), (True, 2, 3.), (False, 3, 3.), (True, 2, eocd)]:
    sd["skip_weights"][-16] = value  # a legacy file with it there was "not a torch.save file"
    torch.save(sd, pt, _use_new_zipfile_serialization=not legacy, pickle_protocol=protocol)
    with warnings.catch_warnings(record=True) as said:
      warnings.simplefilter("always")
      got = torch_import.read_state_dict(pt)["skip_weights"]
    np.testing.assert_array_equal(got, sd["skip_weights"].numpy())
    assert not said
  with open(pt, "rb") as f:
    zipped = gzip.compress(f.read())
  np.savez(tmp_path / "a.npz", w=np.zeros(2))
  np.save(tmp_path / "a.npy", np.zeros(2))
  for data in (pickle.dumps(sd, protocol=4), (tmp_path / "a.npy").read_bytes(),
               (tmp_path / "a.npz").read_bytes(), zipped):
    with open(pt, "wb") as f:
      f.write(data)
    with warnings.catch_warnings(record=True) as said, \
        pytest.raises(UserError, match="is not a torch.save file"):
      warnings.simplefilter("always")
      torch_import.read_state_dict(pt)
    assert not said


@pytest.mark.fast
@pytest.mark.parametrize("protocol", [0, 4, 5])
def test_a_torch_save_file_of_a_protocol_the_safe_loader_cannot_read_says_so(tmp_path, protocol):
  """torch.save(..., pickle_protocol=4) was told it held more than tensors ("Unsupported operand
  149"): the protocol is what to change."""
  pt = str(tmp_path / "sd.pt")
  torch.save({"skip_weights": torch.arange(3.0)}, pt, pickle_protocol=protocol)
  with pytest.raises(UserError, match=r"was pickled in a protocol torch.load\(weights_only=True\) "
                                      r"does not read \(Unsupported operand \d+\): save it again"):
    torch_import.read_state_dict(pt)


@pytest.mark.fast
@pytest.mark.parametrize("tensors,message", [
    ({"skip_weights": torch.tensor([1 + 2j, 3j])}, "'skip_weights' is complex64, not a float"),
    ({"skip_weights": torch.tensor([True, False])}, "'skip_weights' is bool, not a float"),
    ({"skip_weights": torch.arange(3)}, "'skip_weights' is int64, not a float"),
    ({"embed.weight": torch.tensor([1.0, float("nan")])}, "'embed.weight' holds NaN or inf"),
    ({"skip_weights": torch.ones(2, dtype=torch.bfloat16) * float("inf")},
     "'skip_weights' holds NaN or inf"),
    ({"skip_weights": torch.tensor([1.0, 1e300], dtype=torch.float64)},
     "'skip_weights' holds values beyond float32's range"),
    ({"skip_weights": torch.ones(2), "_orig_mod.skip_weights": torch.zeros(2)},
     "holds both 'skip_weights' and '_orig_mod.skip_weights'")])
def test_a_state_dict_that_would_change_on_reading_is_refused(tmp_path, tensors, message):
  """Complex, bool and integer tensors were cast (the imaginary part dropped, True read as 1.0),
  NaN read in as weights (evaluate then said val_loss nan), as were float64 values float32
  cannot hold (cast to inf), and of a name given with and without torch.compile's prefix the
  last kept: each refused, naming the tensor."""
  pt = str(tmp_path / "sd.pt")
  torch.save(tensors, pt)
  with pytest.raises(UserError, match=re.escape(message)):
    torch_import.read_state_dict(pt)


@pytest.mark.fast
def test_export_metadata_is_written_in_one_order(tmp_path):
  """safetensors writes metadata in a per-process order: two exports of a step differed."""
  import json
  from safetensors import safe_open
  from nanotext.convert.torch_export import sort_metadata
  path = str(tmp_path / "m.safetensors")
  meta = {"step": "3", "source": "/r\u00e9\n", "format": "pt"}
  header = json.dumps({"__metadata__": meta, "a": {"dtype": "F32", "shape": [2], "data_offsets": [
      0, 8]}}, separators=(",", ":"), ensure_ascii=False).encode()  # as safetensors may order it
  header = header.ljust(-(-len(header) // 8) * 8, b" ")
  with open(path, "wb") as f:
    f.write(len(header).to_bytes(8, "little") + header + np.arange(2.0, dtype=np.float32).tobytes())
  size = os.path.getsize(path)
  sort_metadata(path)
  with open(path, "rb") as f:
    header = f.read(8 + int.from_bytes(f.read(8), "little"))[8:]
  assert header.index(b'"format"') < header.index(b'"source"') < header.index(b'"step"')
  with safe_open(path, "np") as f:
    assert f.metadata() == meta and (f.get_tensor("a") == np.arange(2.0)).all()
  assert os.path.getsize(path) == size


@pytest.mark.fast
def test_one_reader_of_a_safetensors_header(tmp_path):
  """The dtype check of from-torch and export's metadata sort read a header by one function:
  the JSON text as stored (padding kept), parsed; none past safetensors' own 128 MiB bound."""
  from nanotext.convert.torch_export import read_header
  path = tmp_path / "h.safetensors"
  path.write_bytes((9).to_bytes(8, "little") + b'{"a":1}  ' + b"data")
  with open(path, "rb") as f:
    assert read_header(f) == (b'{"a":1}  ', {"a": 1})
  path.write_bytes((1 << 27).to_bytes(8, "little") + b"{}")
  with open(path, "rb") as f:
    assert read_header(f) == (b"", {})


@pytest.mark.fast
def test_a_float8_or_float4_safetensors_file_is_refused_naming_the_tensor(tmp_path):
  """safetensors' numpy reader said "module 'numpy' has no attribute 'float8_e4m3fn'" (of F4,
  'float4_e2m1fn_x2') as if the file could not be read; the tensor and its dtype are named."""
  import json
  from safetensors.torch import save_file
  path = str(tmp_path / "sd.safetensors")
  save_file({"skip_weights": torch.ones(2), "embed.weight": torch.ones(2, 2).to(
      torch.float8_e4m3fn)}, path)
  with pytest.raises(UserError, match=re.escape("'embed.weight' is F8_E4M3")):
    torch_import.read_state_dict(path)
  save_file({"skip_weights": torch.ones(2), "position_ids": torch.arange(2)}, path)
  with pytest.raises(UserError, match=re.escape("'position_ids' is I64, not a floating-point "
                                                "tensor; give a state dict of the model's")):
    torch_import.read_state_dict(path)  # not "cast the state dict": it is no parameter
  header = json.dumps({"__metadata__": {"format": "pt"}, "skip_weights": {
      "dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode().ljust(96)  # two per byte
  with open(path, "wb") as f:
    f.write(len(header).to_bytes(8, "little") + header + b"\x00")
  with pytest.raises(UserError, match=re.escape("'skip_weights' is F4, not a float32")):
    torch_import.read_state_dict(path)
  deep = b"[" * 200_000 + b"]" * 200_000  # past Python's recursion limit
  for name, data in [("bad", b"\xff" * 20), ("deep", len(deep).to_bytes(8, "little") + deep)]:
    (tmp_path / f"{name}.safetensors").write_bytes(data)  # damaged: load_file's own line
    with pytest.raises(UserError, match="cannot read"):
      torch_import.read_state_dict(str(tmp_path / f"{name}.safetensors"))


@pytest.mark.parametrize("file,overrides,env,message", [
    ("gpt.safetensors", ["model.head_dim=64"], {}, "model.head_dim=64 is not supported"),
    ("gpt.pt", [], {"PYTHONPATH": "FAKE"}, "needs PyTorch: pip install torch")])
def test_cli_from_torch_refusals_are_one_line(tmp_path, file, overrides, env, message):
  fake = tmp_path / "fake" / "torch"
  fake.mkdir(parents=True)
  (fake / "__init__.py").write_text("raise ImportError('No module named torch')\n")
  (tmp_path / file).write_bytes(b"")
  env = {k: v.replace("FAKE", str(fake.parent)) for k, v in env.items()}
  proc = run_cli("nanotext.convert", "from-torch", f"--torch={tmp_path / file}",
                 f"--out={tmp_path / 'run'}", *TINY, *DIMS, *overrides, env=env, timeout=120)
  one_line_error(proc, message)
  assert not os.path.exists(tmp_path / "run")
