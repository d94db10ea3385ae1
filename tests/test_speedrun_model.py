"""The speedrun architecture switches: value embeddings, U-net skips, MLP-only layers, merged QKV
(with Muon per matrix), the FP8 head, Polar Express coefficients, and the configs that use them."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import REPO, SPEEDRUN, TINY
from nanotext import config, optim, sharding, wiring
from nanotext.errors import UserError
from nanotext.model import count_params
from nanotext.model.gpt import value_embed_layers
from nanotext.model.layers import fp8_head_scales, fp8_matmul, rms_norm, scaled_sum

SPEEDRUN_RECORD = os.path.join(REPO, "configs", "speedrun_record.yml")
SMALL = ["model.num_layers=4", "model.d_model=64", "model.num_heads=2", "model.head_dim=32",
         "model.mlp_dim=128", "model.vocab_size=256", "model.align=0", "train.seq_len=16",
         "train.batch_size=8", "model.dtype=float32", "model.zero_init_head=false",
         "model.zero_init_proj=false"]


def build(*overrides, path=SPEEDRUN, seed=0):
  run = wiring.prepare(path, SMALL + list(overrides))
  return run.cfg, run.create_model(seed)


def tokens(seed=0):
  return jax.random.randint(jax.random.key(seed), (2, 16), 0, 256)


def params_and_specs(model):
  state = nnx.state(model, nnx.Param)
  return nnx.to_pure_dict(state), nnx.to_pure_dict(sharding.param_specs(state))


@pytest.mark.fast
def test_speedrun_switches_are_on_in_speedrun_and_off_in_base():
  m = config.load(SPEEDRUN).model
  assert (m.value_embeds, m.unet_skips, m.no_attention_layers, m.merged_qkv, m.fp8_head) == \
      (3, True, [7], True, True)
  b = config.load(os.path.join(REPO, "configs", "base.yml"))
  assert (b.model.value_embeds, b.model.unet_skips, b.model.no_attention_layers,
          b.model.merged_qkv, b.model.fp8_head, b.optim.muon_ns_coeffs) == \
      (0, False, [], False, False, "jordan")


@pytest.mark.fast
def test_new_parameters_shapes_axes_and_groups():
  _, model = build("model.no_attention_layers=[2]")
  params, specs = params_and_specs(model)
  labels = optim.group_labels(nnx.state(model, nnx.Param))
  attn = params["blocks"][0]["attn"]
  assert attn["qkv"]["kernel"].shape == (3, 64, 64) and "q" not in attn
  assert tuple(specs["blocks"][0]["attn"]["qkv"]["kernel"]) == (None, "embed", "heads")
  assert labels["blocks"][0]["attn"]["qkv"]["kernel"] == "matrix"
  np.testing.assert_array_equal(attn["v_lambdas"], [0.5, 0.5])  # record init
  assert labels["blocks"][0]["attn"]["v_lambdas"] == "scalar"
  # L=4 keeps min(3, 4 // 2) = 2 value-embedding tables, embeddings for the optimizer.
  assert sorted(params["value_embeds"]) == [0, 1]
  assert params["value_embeds"][0]["embedding"].shape == (256, 64)
  assert tuple(specs["value_embeds"][0]["embedding"]) == ("vocab", "embed")
  assert labels["value_embeds"][1]["embedding"] == "embed"
  np.testing.assert_array_equal(params["skip_weights"], [1.0, 1.0])
  assert tuple(specs["skip_weights"]) == (None,) and labels["skip_weights"] == "scalar"


def test_value_embedding_layer_pattern():
  assert value_embed_layers(3, 12) == (0, 1, 2) + (None,) * 6 + (0, 1, 2)  # the record
  assert value_embed_layers(3, 8) == (0, 1, 2, None, None, 0, 1, 2)
  assert value_embed_layers(3, 4) == (0, 1, 0, 1)
  assert value_embed_layers(3, 2) == (0, 0)
  assert value_embed_layers(0, 4) == (None,) * 4
  _, model = build("model.num_layers=8")
  assert model.ve_layers == (0, 1, 2, None, None, 0, 1, 2) and len(model.value_embeds) == 3
  before = model(tokens())
  model.value_embeds[2].embedding.value = model.value_embeds[2].embedding.value * 2.0
  assert not np.allclose(before, model(tokens()), atol=1e-4)  # table 2 feeds layers 2 and 7


def test_unet_skip_weights_are_used():
  _, model = build()
  _, plain = build("model.unet_skips=false")
  out = model(tokens())
  assert np.isfinite(np.asarray(out)).all()
  assert not np.allclose(out, plain(tokens()), atol=1e-4)
  # The skip weights take no random numbers: with them at zero the two models are the same.
  model.skip_weights.value = jnp.zeros_like(model.skip_weights.value)
  np.testing.assert_allclose(model(tokens()), plain(tokens()), atol=1e-5)
  model.skip_weights.value = jnp.array([0.0, 2.0])
  assert not np.allclose(model(tokens()), plain(tokens()), atol=1e-4)


@pytest.mark.fast
@pytest.mark.parametrize("path", [SPEEDRUN, SPEEDRUN_RECORD,
                                  os.path.join(REPO, "configs", "shakespeare.yml")])
def test_one_layer_holds_no_empty_array(path):
  """One layer has no U-net skip (L // 2 = 0 weights): an empty array, which orbax refuses to
  save (a 1-layer shakespeare.yml run failed at its first checkpoint with a traceback)."""
  run = wiring.prepare(path, SMALL + ["model.num_layers=1", "model.no_attention_layers=[]"])
  leaves = jax.tree_util.tree_leaves_with_path(run.abstract_state())
  assert [jax.tree_util.keystr(p) for p, x in leaves if not x.size] == []


def test_no_attention_layer_has_no_attention_params():
  _, model = build("model.no_attention_layers=[2, 9]")  # 9 is past the last layer: ignored
  params, _ = params_and_specs(model)
  assert model.blocks[2].attn is None and "attn" not in params["blocks"][2]
  assert all("attn" in params["blocks"][i] for i in (0, 1, 3))
  assert np.isfinite(np.asarray(model(tokens()))).all()
  _, full = build("model.no_attention_layers=[]")
  assert count_params(nnx.state(full, nnx.Param)) - count_params(nnx.state(model, nnx.Param)) \
      == 3 * 64 * 64 + 64 * 64 + 2  # qkv, o, v_lambdas


@pytest.mark.fast
def test_merged_qkv_equals_separate_projections():
  _, merged = build()
  _, separate = build("model.merged_qkv=false")
  a = separate.blocks
  for i, block in enumerate(merged.blocks):
    block.attn.qkv.kernel.value = jnp.stack([a[i].attn.q.kernel.value, a[i].attn.k.kernel.value,
                                             a[i].attn.v.kernel.value])
    block.attn.o.kernel.value = a[i].attn.o.kernel.value
    block.mlp.fc.kernel.value, block.mlp.proj.kernel.value = (a[i].mlp.fc.kernel.value,
                                                              a[i].mlp.proj.kernel.value)
  merged.embed.embedding.value = separate.embed.embedding.value
  merged.head.kernel.value = separate.head.kernel.value
  for j, table in enumerate(merged.value_embeds):
    table.embedding.value = separate.value_embeds[j].embedding.value
  np.testing.assert_allclose(merged(tokens()), separate(tokens()), atol=1e-5, rtol=1e-5)


@pytest.mark.fast
def test_merged_qkv_with_bias_keeps_biases_out_of_muon():
  _, model = build("model.bias=true")
  labels = optim.group_labels(nnx.state(model, nnx.Param))
  assert model.blocks[0].attn.qkv.bias.value.shape == (3, 64)
  assert labels["blocks"][0]["attn"]["qkv"]["bias"] == "scalar"


@pytest.mark.parametrize("layout", ["sharded", "replicated", "distributed"])
def test_muon_on_a_merged_parameter_is_muon_per_matrix(layout):
  cfg = config.load(SPEEDRUN, ["optim.muon_bf16=false", f"optim.muon_layout={layout}"]).optim
  keys = jax.random.split(jax.random.key(0), 3)
  qkv = jax.random.normal(keys[0], (3, 32, 48))
  other = jax.random.normal(keys[1], (32, 48))  # same shape as each q/k/v: one distributed group
  tall = jax.random.normal(keys[2], (48, 32))
  tx = optim.scale_by_muon(cfg)
  merged = {"qkv": qkv, "other": other, "tall": tall}
  split = {"q": qkv[0], "k": qkv[1], "v": qkv[2], "other": other, "tall": tall}
  got, _ = jax.jit(tx.update)(merged, tx.init(merged))
  want, _ = jax.jit(tx.update)(split, tx.init(split))
  for j, name in enumerate("qkv"):
    np.testing.assert_allclose(got["qkv"][j], want[name], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got["other"], want["other"], rtol=1e-5, atol=1e-6)
  # Each matrix is scaled by its own sqrt(max(1, fan_out / fan_in)) = sqrt(1.5).
  s = np.linalg.svd(np.asarray(got["qkv"][1]) / np.sqrt(1.5), compute_uv=False)
  assert 0.4 < s.min() and s.max() < 1.6


@pytest.mark.fast
def test_polar_express_coefficients_are_selected():
  jordan = optim.ns_coefficients(config.load(SPEEDRUN).optim)
  np.testing.assert_allclose(jordan, optim.NS_COEFFS, rtol=1e-6)
  cfg = config.load(SPEEDRUN, ["optim.muon_ns_coeffs=polar_express", "optim.muon_bf16=false"])
  pe = np.asarray(optim.ns_coefficients(cfg.optim))
  table = np.asarray(optim.POLAR_EXPRESS_COEFFS)
  assert pe.shape == (5, 3)
  np.testing.assert_allclose(pe[1:], table[1:], rtol=1e-6)
  np.testing.assert_allclose(pe[0], table[0] / 1.02 ** np.array([1, 3, 5]), rtol=1e-6)
  # More steps repeat the last quintic.
  seven = optim.ns_coefficients(config.load(SPEEDRUN, ["optim.muon_ns_coeffs=polar_express",
                                                       "optim.muon_ns_steps=7"]).optim)
  np.testing.assert_allclose(np.asarray(seven)[5:], table[[4, 4]], rtol=1e-6)
  # Polar Express lands the singular values nearer to 1 than Jordan's coefficients do.
  g = {"w": jax.random.normal(jax.random.key(1), (64, 64))}
  def spread(c):
    tx = optim.scale_by_muon(c)
    s = np.linalg.svd(np.asarray(tx.update(g, tx.init(g))[0]["w"]), compute_uv=False)
    return np.abs(s - 1).max()
  assert spread(cfg.optim) < spread(config.load(SPEEDRUN, ["optim.muon_bf16=false"]).optim)
  with pytest.raises(UserError, match="optim.muon_ns_coeffs"):
    wiring.load(SPEEDRUN, ["optim.muon_ns_coeffs=cubic"])


@pytest.mark.fast
def test_scalar_mixing_rounds_once_from_float32():
  """x0/value/skip lambdas: float32 scalars times bf16 activations, summed in float32 and rounded
  once (the record's compiled PyTorch), not the lambdas rounded to bf16 first."""
  rng = np.random.default_rng(0)
  x, x0 = (jnp.asarray(rng.normal(size=(4, 256)), jnp.bfloat16) for _ in range(2))
  lam = jnp.asarray([1.0123457, -0.3141593], jnp.float32)  # not bf16 numbers
  got = scaled_sum((lam[0], lam[1]), (x, x0))
  f64 = lambda a: np.asarray(a, np.float64)
  want = (np.float32(lam[0]) * f64(x).astype(np.float32) +
          np.float32(lam[1]) * f64(x0).astype(np.float32)).astype(jnp.bfloat16)
  assert got.dtype == jnp.bfloat16 and np.array_equal(f64(got), f64(want))
  lam16 = lam.astype(jnp.bfloat16)  # the old way moves a share of the outputs by an ulp or more
  assert np.mean(f64(got) != f64(lam16[0] * x + lam16[1] * x0)) > 0.1


def test_fp8_matmul_is_close_to_the_exact_matmul():
  """FP8 e4m3 keeps 3 mantissa bits (relative rounding <= 1/16 per operand), e5m2 two."""
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  N, D, V = 64, 128, 256
  x = rms_norm(jax.random.normal(kx, (N, D))).astype(jnp.bfloat16)
  w = 0.02 * jax.random.normal(kw, (D, V))
  g = jax.random.normal(kg, (N, V)) / N  # the gradient of a mean over N tokens
  scales = fp8_head_scales(D, N)
  def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.linalg.norm(a - b) / np.linalg.norm(b)
  out, vjp = jax.vjp(lambda x, w: fp8_matmul(x, w, *scales), x, w)
  ref, ref_vjp = jax.vjp(lambda x, w: jnp.dot(x.astype(jnp.float32), w), x, w)
  assert out.dtype == jnp.bfloat16
  assert rel(out, ref) < 0.05
  (dx, dw), (rdx, rdw) = vjp(g.astype(out.dtype)), ref_vjp(g)
  assert dx.dtype == x.dtype and dw.dtype == w.dtype
  assert rel(dx, rdx) < 0.1 and rel(dw, rdw) < 0.1
  # Out-of-range values saturate instead of turning into NaN (e4m3fn has no infinity).
  big = fp8_matmul(x * 1000, w * 1000, *scales)
  assert np.isfinite(np.asarray(big, np.float32)).all()


def test_fp8_head_close_to_the_bf16_head():
  """Same params, FP8 vs bf16 head: logits within 0.1 (of a 15-capped range), loss within 1%."""
  overrides = ["model.dtype=bfloat16", "model.logit_softcap=15.0", "model.num_layers=2"]
  _, fp8 = build(*overrides)
  _, bf16 = build(*overrides, "model.fp8_head=false")
  t = tokens()
  targets = jnp.roll(t, -1, axis=1)
  @functools.partial(jax.jit, static_argnums=0)  # the graphdef holds the fp8_head switch
  def logits_loss_grad(graphdef, state):
    def loss(state):
      logits = nnx.merge(graphdef, state)(t)
      nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1).mean()
      return nll, logits
    return jax.value_and_grad(loss, has_aux=True)(state)
  (va, la), ga = logits_loss_grad(*nnx.split(fp8))
  (vb, lb), gb = logits_loss_grad(*nnx.split(bf16))
  assert 0 < np.abs(np.asarray(la) - np.asarray(lb)).max() < 0.1
  np.testing.assert_allclose(va, vb, rtol=1e-2)
  ha, hb = np.asarray(ga["head"]["kernel"]), np.asarray(gb["head"]["kernel"])
  assert np.linalg.norm(ha - hb) / np.linalg.norm(hb) < 0.15


@pytest.mark.fast
def test_config_errors_name_the_key():
  with pytest.raises(UserError, match="model.value_embeds"):
    wiring.load(SPEEDRUN, ["model.head_dim=64"])  # 4 heads x 64 != d_model 1024
  with pytest.raises(UserError, match="model.fp8_head"):
    wiring.load(SPEEDRUN, ["model.tie_embeddings=true"])
  with pytest.raises(UserError, match="model.no_attention_layers"):
    wiring.load(SPEEDRUN, ["model.no_attention_layers=[-1]"])
  with pytest.raises(UserError, match="model.value_embeds"):
    wiring.load(SPEEDRUN, ["model.value_embeds=-1"])


def test_speedrun_record_has_the_record_shape():
  run = wiring.prepare(SPEEDRUN_RECORD)
  m, cfg = run.cfg.model, run.cfg
  assert (m.d_model, m.num_heads, m.head_dim, m.mlp_dim, m.vocab_size, m.align) == \
      (768, 6, 128, 3072, 50304, 128)
  assert config.misaligned_dims(m) == []
  assert m.embed_rows == 50257  # the tokenizer's vocabulary; only the head is padded
  np.testing.assert_allclose(cfg.optim.head_lr, 0.22 / np.sqrt(768))
  abstract = nnx.eval_shape(run.create_model)
  params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
  assert params["blocks"][0]["attn"]["qkv"]["kernel"].shape == (3, 768, 768)
  assert "attn" not in params["blocks"][7] and len(params["value_embeds"]) == 3
  assert params["embed"]["embedding"].dtype == jnp.bfloat16
  assert params["value_embeds"][0]["embedding"].shape == (50257, 768)
  assert params["head"]["kernel"].shape == (768, 50304)
  # The record's module: 12 layers, 3 value tables, one attention-free layer, untied head.
  n = count_params(nnx.state(abstract, nnx.Param))
  per_attn, per_mlp = 4 * 768 * 768 + 2, 2 * 768 * 3072
  want = 4 * 50257 * 768 + 50304 * 768 + 11 * per_attn + 12 * (per_mlp + 2) + 6
  assert n == want


def test_uniform_init_has_the_records_bounds():
  run = wiring.prepare(SPEEDRUN_RECORD, ["model.num_layers=2", "model.zero_init_proj=false",
                                        "model.vocab_size=512", "model.embed_rows=0"])
  model = run.create_model()
  w = np.asarray(model.blocks[0].mlp.fc.kernel.value)  # [768, 3072]: fan_in 768
  bound = np.sqrt(3) * 0.5 / np.sqrt(768)
  assert np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound
  np.testing.assert_allclose(w.std(), 0.5 / np.sqrt(768), rtol=0.01)


def test_speedrun_config_trains_with_every_switch(tmp_path):
  from nanotext.train import run
  lines = []
  result = run(SPEEDRUN, TINY + [f"output_dir={tmp_path}", "model.num_layers=4",
                                 "model.no_attention_layers=[2]", "model.mlp_dim=0",
                                 "optim.muon_ns_coeffs=polar_express", "train.steps=3",
                                 "train.eval_every=0", "sample.max_new_tokens=0"],
               log=lines.append)
  assert np.isfinite(result.last_loss)
  assert int(result.state["step"]) == 3


@pytest.mark.fast
def test_flops_leave_out_attention_of_mlp_only_layers():
  from nanotext import metrics
  cfg, _ = build("model.no_attention_layers=[]")
  full = metrics.flops_per_token(cfg.model, 16)
  cfg, _ = build("model.no_attention_layers=[1]")
  d, hk = 64, 64
  attn_one = 6 * 4 * d * hk + 3 * 4 * (16 + 1) / 2 * hk  # weights + scores of one causal layer
  assert metrics.flops_per_token(cfg.model, 16) == pytest.approx(full - attn_one)
