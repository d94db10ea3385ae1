"""model.scan_layers: the stacked, scanned block stack computes what the unrolled one does."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import BASE, SPEEDRUN, TINY, forward, one_line_error, run_cli, saved_run
from nanotext import params_from, trainer, wiring
from nanotext.errors import UserError

# float32 everywhere: what is compared is the scan, not bf16 or FP8 rounding.
EXACT = ["model.dtype=float32", "model.embed_dtype=float32", "model.fp8_head=false",
         "optim.muon_bf16=false", "model.num_layers=3"]
# The speedrun block (x0 lambdas, merged QKV [L, 3, D, HK], RoPE, QK-norm, Muon) without the
# features that make its blocks differ; a nonzero head and projections so steps move the loss.
SPEEDRUN_SCANNABLE = ["model.value_embeds=0", "model.unet_skips=false",
                      "model.no_attention_layers=[]", "attention.window_pattern=",
                      "model.zero_init_head=false", "model.zero_init_proj=false",
                      "model.mlp_dim=0"]
PORT = os.path.join(os.path.dirname(BASE), "modded_nanogpt_jax.yml")
# The port's block: fused QKV [L, 3*H*K, D] (L Muon matrices), a learned scale per layer.
PORT_SCANNABLE = ["model.value_residual=false", "model.unet_skips=false",
                  "model.zero_init_head=false", "model.zero_init_proj=false", "model.mlp_dim=0",
                  "train.grad_accum=1", "model.param_dtype=float32", "train.seq_len_start=0"]
CONFIGS = {"base": (BASE, []), "speedrun": (SPEEDRUN, SPEEDRUN_SCANNABLE),
           "port": (PORT, PORT_SCANNABLE)}
# Scan and unrolled blocks run the same float32 ops; XLA may fuse and order them differently.
RTOL = 1e-5


def prepare(name, scan, extra=(), n_devices=1):
  path, more = CONFIGS[name]
  overrides = TINY + EXACT + more + list(extra) + [f"model.scan_layers={str(scan).lower()}"]
  return wiring.prepare(path, overrides, devices=jax.devices()[:n_devices])


def stack_blocks(params):
  """An unrolled params tree with its blocks {0: ..., 1: ...} stacked into one [L, ...] tree."""
  blocks = params["blocks"]
  layers = [blocks[i] for i in sorted(blocks)]
  return dict(params, blocks=jax.tree.map(lambda *xs: np.stack(xs), *layers))


def train_losses(run, params, steps=3):
  """Losses of `steps` train steps from `params` (fresh optimizer state), same batches each run."""
  state = run.state_from_params(params)
  step, it = trainer.make_train_step(run), run.train_iter()
  out = []
  for _ in range(steps):
    state, m = step(state, trainer.global_batch(run, next(it)))
    out.append(float(m["loss"]))
  return np.array(out), state


@pytest.mark.parametrize("name", CONFIGS)
def test_scanned_logits_and_losses_match_unrolled(name):
  unrolled, scanned = prepare(name, False), prepare(name, True)
  params = jax.device_get(nnx.to_pure_dict(nnx.state(unrolled.create_model())))
  tokens = np.asarray(next(unrolled.train_iter())["inputs"])
  want = forward(unrolled.graphdef, params, tokens)
  got = forward(scanned.graphdef, stack_blocks(params), tokens)
  np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-6)
  ref, _ = train_losses(unrolled, params)
  loss, state = train_losses(scanned, stack_blocks(params))
  assert np.all(np.diff(ref) != 0)
  np.testing.assert_allclose(loss, ref, rtol=RTOL)
  assert state["params"]["blocks"]["mlp"]["fc"]["kernel"].shape[0] == 3


def test_remat_applies_to_the_scanned_body():
  plain, remat = prepare("base", True), prepare("base", True, ["model.remat=full"])
  params = jax.device_get(nnx.to_pure_dict(nnx.state(plain.create_model())))
  tokens = np.asarray(next(plain.train_iter())["inputs"])
  grads = {}
  for run in (plain, remat):
    fn = jax.value_and_grad(lambda p: trainer.loss_fn(run.graphdef, p, tokens, tokens))
    grads[run.cfg.model.remat] = jax.jit(fn)(params)
    has_remat = "remat" in str(jax.make_jaxpr(fn)(params))  # jax.checkpoint's primitive
    assert has_remat == (run is remat)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=RTOL, atol=1e-7),
               grads["full"], grads["none"])


def test_sharded_layout_matches_one_device():
  params = jax.device_get(nnx.to_pure_dict(nnx.state(prepare("speedrun", True).create_model())))
  ref, _ = train_losses(prepare("speedrun", True), params)
  run = prepare("speedrun", True, ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"], n_devices=8)
  got, state = train_losses(run, params)
  np.testing.assert_allclose(got, ref, rtol=2e-5)  # as tests/test_parallel.py: summation order
  qkv = state["params"]["blocks"]["attn"]["qkv"]["kernel"]  # [layers, 3, embed, heads]
  assert qkv.sharding.spec == jax.sharding.PartitionSpec(None, None, "fsdp", "tensor")


@pytest.mark.fast
def test_layers_axis_is_replicated_and_named_in_divisibility_errors():
  run = prepare("base", True, ["mesh.rules=[[layers, fsdp], [embed, fsdp]]",
                               "model.num_layers=8"], n_devices=8)
  assert run.state_shardings["params"]["blocks"]["mlp"]["fc"]["kernel"].spec[0] == "fsdp"
  with pytest.raises(UserError, match="model.num_layers=3 is not divisible by mesh.fsdp=8"):
    prepare("base", True, ["mesh.rules=[[layers, fsdp]]"], n_devices=8)


@pytest.mark.fast
def test_refuses_blocks_that_differ():
  with pytest.raises(UserError) as e:
    wiring.load(SPEEDRUN, ["model.scan_layers=true"])
  for key in ("model.unet_skips", "model.value_embeds=3", "model.no_attention_layers=[7]",
              "attention.window_pattern='LSSSLSSLSSSL'", "model.scan_layers=false"):
    assert key in str(e.value)
  with pytest.raises(UserError, match="model.unet_skips=true, model.value_residual=true"):
    wiring.load(PORT, ["model.scan_layers=true"])
  with pytest.raises(UserError, match="attention.window_pattern='LS'"):
    prepare("base", True, ["attention.window=16", "attention.window_pattern=LS"])
  prepare("base", True, ["attention.window=16", "attention.window_pattern=LL",
                         "model.no_attention_layers=[5]"])  # same window everywhere; no layer 5


@pytest.mark.fast
def test_windows_covering_every_row_scan_as_one():
  """A long (128) and short (64) window that both cover every row the run takes (train's 32,
  eval's and sampling's 64) are plain causal on each layer: scanned, computing what the unrolled
  layers do; rows past the short window (model.max_seq_len=128: sampling's) are refused."""
  extra = ["attention.window=128", "attention.window_block=16", "attention.window_pattern=LS",
           "train.eval_seq_len=64", "model.max_seq_len=64"]
  unrolled, scanned = prepare("base", False, extra), prepare("base", True, extra)
  params = jax.device_get(nnx.to_pure_dict(nnx.state(unrolled.create_model())))
  tokens = np.asarray(next(unrolled.train_iter())["inputs"])
  np.testing.assert_allclose(forward(scanned.graphdef, stack_blocks(params), tokens),
                             forward(unrolled.graphdef, params, tokens), rtol=RTOL, atol=1e-6)
  with pytest.raises(UserError, match="attention.window_pattern='LS'"):
    prepare("base", True, extra + ["model.max_seq_len=128"])
  with pytest.raises(UserError, match="attention.window_pattern='LS'"):  # 128+64 at the start
    prepare("base", True, ["attention.window=256", "attention.window_block=16",
                           "attention.window_pattern=LS", "train.seq_len=128",
                           "attention.window_schedule=true", "attention.window_start=128"])
  prepare("base", True, ["attention.window=256", "attention.window_block=16",
                         "attention.window_pattern=LS", "train.seq_len=128"])  # 256+128: causal


def test_cli_refusal_is_one_line(tmp_path):
  proc = run_cli("nanotext.train", SPEEDRUN, "model.scan_layers=true",
                 f"output_dir={tmp_path / 'run'}")
  one_line_error(proc, "model.scan_layers=true", "model.unet_skips")


@pytest.mark.torch
@pytest.mark.transformers
def test_hf_round_trip_through_a_scanned_run(tmp_path):
  import torch
  import transformers
  from safetensors.numpy import load_file
  from nanotext.convert import from_hf, to_hf
  from nanotext.convert.common import load_run
  torch.manual_seed(0)
  c = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
  hf = str(tmp_path / "hf")
  transformers.GPT2LMHeadModel(c).save_pretrained(hf)
  keys = [a for a in TINY if not a.startswith("model.")] + ["model.align=0",
                                                            "model.scan_layers=true"]
  run = from_hf(hf, str(tmp_path / "run"), keys, log=lambda *a: None)
  assert load_run(run)[2]["blocks"]["attn"]["q"]["kernel"].shape == (2, 64, 64)
  out = to_hf(run, str(tmp_path / "back"), log=lambda *a: None)
  a, b = load_file(os.path.join(hf, "model.safetensors")), \
      load_file(os.path.join(out, "model.safetensors"))
  a = {k: v for k, v in a.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
  assert sorted(a) == sorted(b)
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_load_params_from_converts_between_unrolled_and_scanned(tmp_path):
  """checkpoint.load_params_from stacks an unrolled run's blocks for a scanned model and
  unstacks a scanned one's (here from a params-only folder), placed on the target's mesh."""
  from nanotext import checkpoint
  from nanotext.convert import params_only
  common = TINY + EXACT  # checkpoints as runs leave them (saved_run: no train step compiled)
  flat = lambda tree: {"/".join(str(getattr(k, "key", k)) for k in p): np.asarray(v)
                       for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}
  unrolled_run = str(tmp_path / "unrolled")
  saved_run(BASE, common, unrolled_run, noise=0.02)
  saved = jax.device_get(checkpoint.latest_params(unrolled_run)[1])
  scanned = prepare("base", True, n_devices=8)
  _, got = params_from.load(unrolled_run, scanned.abstract_state()["params"])
  want = flat(stack_blocks(saved))
  assert sorted(flat(got)) == sorted(want)
  for k, v in flat(jax.device_get(got)).items():
    np.testing.assert_array_equal(v, want[k], err_msg=k)
  kernel = got["blocks"]["mlp"]["fc"]["kernel"]
  assert kernel.shape[0] == 3 and kernel.sharding == \
      scanned.abstract_state()["params"]["blocks"]["mlp"]["fc"]["kernel"].sharding

  scanned_run = str(tmp_path / "scanned")
  saved_run(BASE, common + ["model.scan_layers=true"], scanned_run, noise=0.02)
  folder = params_only(scanned_run, str(tmp_path / "params"), log=lambda s: None)
  stacked_saved = jax.device_get(checkpoint.latest_params(scanned_run)[1])
  unrolled = prepare("base", False)
  _, back = params_from.load(folder, unrolled.abstract_state()["params"])
  assert flat(stack_blocks(jax.device_get(back))).keys() == flat(stacked_saved).keys()
  for k, v in flat(stack_blocks(jax.device_get(back))).items():
    np.testing.assert_array_equal(v, flat(stacked_saved)[k], err_msg=k)


@pytest.mark.parametrize("scan", [True, False])
def test_a_config_yml_edited_in_scan_layers_reads_the_same_weights(tmp_path, scan):
  """config.yml edited in model.scan_layers (how the model computes, not what: evaluate read
  the folder): generate and every converter said it 'has no value for nanotext parameter
  blocks.0...'. The layout is converted, as checkpoint.load_params_from converts it."""
  from nanotext import config, generate, trees
  from nanotext.convert.common import load_run
  run = str(tmp_path / "run")
  _, saved = saved_run(BASE, TINY + EXACT + [f"model.scan_layers={str(scan).lower()}"], run,
                       noise=0.02)
  path = os.path.join(run, "config.yml")
  text = open(path).read()
  assert f"scan_layers: {str(scan).lower()}" in text
  with open(path, "w") as f:
    f.write(text.replace(f"scan_layers: {str(scan).lower()}",
                         f"scan_layers: {str(not scan).lower()}"))
  flip = trees.unstack_blocks if scan else trees.stack_blocks
  want = flip(trees.flatten(saved))
  for params in (load_run(run)[2], generate.restore(run, config.load(path))[2]):
    got = trees.flatten(jax.device_get(params))
    assert sorted(got) == sorted(want)
    for k, v in got.items():
      np.testing.assert_array_equal(v, want[k], err_msg=k)


def test_load_params_from_the_other_layout_names_the_key_that_differs(tmp_path):
  """A scanned merged_qkv run loaded into an unrolled three-parameter model said only 'has no
  value for nanotext parameter blocks.0.attn.k.bias' (the same layout names model.merged_qkv)."""
  source = str(tmp_path / "src")
  saved_run(BASE, TINY + EXACT + ["model.scan_layers=true", "model.merged_qkv=true"], source)
  unrolled = prepare("base", False)
  with pytest.raises(UserError, match="does not fit this model: parameter .* set "
                                      "model.merged_qkv or model.fused_qkv as the source run"):
    params_from.load(source, unrolled.abstract_state()["params"])
