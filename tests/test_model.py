"""Model family: logical axes on every parameter, config switches, causality, rotary embeddings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import BASE, SPEEDRUN, TINY
from nanotext import config, sharding, wiring
from nanotext.model import GPT, Keys, count_params
from nanotext.model import rope
from nanotext.model.kernels.per_device import building_for
from nanotext.model.rope import apply_rope, rope_frequencies

SMALL = ["model.num_layers=2", "model.d_model=64", "model.num_heads=2", "model.head_dim=32",
         "model.vocab_size=256", "model.align=0", "train.seq_len=16", "train.batch_size=8"]


def build(path=BASE, *overrides, seed=0):
  run = wiring.prepare(path, SMALL + list(overrides))
  return run.cfg, run.create_model(seed)


def tokens(seed=0, batch=2, length=16, vocab=256):
  return jax.random.randint(jax.random.key(seed), (batch, length), 0, vocab)


@pytest.mark.parametrize("path", [BASE, SPEEDRUN])
def test_every_parameter_has_known_logical_axes(path):
  cfg, model = build(path)
  specs = jax.tree.leaves(sharding.param_specs(nnx.state(model, nnx.Param)),
                          is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
  values = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert len(specs) == len(values) > 0
  for spec, value in zip(specs, values):
    assert len(spec) == value.ndim
    assert all(a is None or a in sharding.LOGICAL_AXES for a in spec), spec
  # Every matrix names what each of its dimensions is.
  assert all(None not in s for s, v in zip(specs, values) if v.ndim == 2)


@pytest.mark.parametrize("path", [BASE, SPEEDRUN])
def test_forward_shapes_and_dtype(path):
  cfg, model = build(path)
  logits = model(tokens())
  assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()


def test_causal_future_tokens_do_not_change_past_logits():
  for path in (BASE, SPEEDRUN):
    _, model = build(path, "model.zero_init_head=false", "model.zero_init_proj=false")
    a = tokens(0)
    b = a.at[:, 10:].set((a[:, 10:] + 1) % 256)
    la, lb = model(a), model(b)
    np.testing.assert_allclose(la[:, :10], lb[:, :10], atol=1e-5)
    assert not np.allclose(la[:, 10:], lb[:, 10:])


def test_speedrun_zero_head_gives_uniform_logits():
  _, model = build(SPEEDRUN, "model.dtype=float32")
  np.testing.assert_array_equal(np.asarray(model(tokens())), 0.0)


@pytest.mark.fast
def test_classic_gpt2_switches():
  cfg, model = build(BASE)
  assert cfg.model.tie_embeddings and model.head is None and model.pos is not None
  assert model.blocks[0].ln1.kind == "layernorm" and model.blocks[0].mlp.act == "gelu"
  assert model.blocks[0].attn.q.bias is not None
  _, untied = build(BASE, "model.tie_embeddings=false")
  assert count_params(nnx.state(untied, nnx.Param)) == \
      count_params(nnx.state(model, nnx.Param)) + 64 * 256


@pytest.mark.fast
def test_logit_softcap_bounds_logits():
  _, model = build(BASE, "model.logit_softcap=2.0", "model.embed_std=5.0")
  logits = np.asarray(model(tokens()))
  assert np.abs(logits).max() <= 2.0 and np.abs(logits).max() > 1.0


@pytest.mark.fast
def test_x0_mix_lambdas_start_as_identity_and_matter():
  cfg, model = build(BASE, "model.x0_mix=true")
  _, plain = build(BASE)
  np.testing.assert_allclose(model(tokens()), plain(tokens()), atol=1e-5)
  model.blocks[1].lambdas.value = jnp.array([1.0, 1.0])
  assert not np.allclose(model(tokens()), plain(tokens()), atol=1e-4)


def test_rope_frequencies_full_and_half_truncated():
  full = rope_frequencies(16, 10000.0, truncate=False)
  assert full.shape == (8,) and full[0] == 1.0 and np.all(np.diff(full) < 0)
  half = rope_frequencies(16, 1024.0, truncate=True)
  assert half.shape == (8,)
  # The record's float32 linspace: within float32 rounding of the exact points.
  np.testing.assert_allclose(half[:4], (1 / 1024) ** np.linspace(0, 1, 4), rtol=1e-6)
  np.testing.assert_array_equal(half[4:], 0.0)


def test_rope_is_relative_and_truncated_half_is_untouched():
  x = jax.random.normal(jax.random.key(0), (1, 8, 1, 16))
  freq = rope_frequencies(16, 1024.0, truncate=True)
  y = apply_rope(x, freq)
  np.testing.assert_allclose(y[0, 0], x[0, 0], atol=1e-6)  # position 0 is not rotated
  # Pairs (i, i + 8) with zero frequency are never rotated.
  np.testing.assert_allclose(y[..., 4:8], x[..., 4:8], atol=1e-6)
  np.testing.assert_allclose(y[..., 12:], x[..., 12:], atol=1e-6)
  # Rotation preserves the norm of each vector.
  np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
  # q.k depends only on the offset: same content at positions (1, 3) and (4, 6).
  q = jnp.broadcast_to(x[:, :1], x.shape)
  rq = apply_rope(q, freq)
  np.testing.assert_allclose(jnp.dot(rq[0, 1, 0], rq[0, 3, 0]), jnp.dot(rq[0, 4, 0], rq[0, 6, 0]),
                             rtol=1e-4)


@pytest.mark.fast
def test_rope_forms_are_the_same_rotation_bit_for_bit():
  """The GPU's reversed-halves rotation computes what the split-and-concatenate one does (the
  record's), to the bit eagerly (compiled, XLA may contract a product into an FMA), gradient too;
  apply_rope takes the split form here (CPU) and the reversed one when building for a GPU."""
  rng = np.random.default_rng(0)
  x, g = (jnp.asarray(rng.standard_normal((2, 40, 3, 32)), jnp.float32) for _ in range(2))
  for freq in (rope_frequencies(32, 1024.0, True), rope_frequencies(32, 10000.0, False)):
    theta = jnp.arange(40, dtype=jnp.float32)[:, None] * jnp.asarray(freq, jnp.float32)
    forms = (rope.rotate_reversed, rope.rotate_split)
    np.testing.assert_array_equal(*(f(x, theta) for f in forms))
    np.testing.assert_array_equal(*(jax.vjp(lambda x: f(x, theta), x)[1](g)[0] for f in forms))
  prims = lambda: {e.primitive.name for e in jax.make_jaxpr(lambda x: apply_rope(x, freq))(x).eqns}
  assert "rev" not in prims() and "concatenate" in prims()
  with building_for("gpu"):
    assert "rev" in prims() and "concatenate" not in prims()


@pytest.mark.fast
def test_sliding_window_limits_attention():
  _, model = build(BASE, "attention.window=4", "model.positions=rope")
  a = tokens(1)
  b = a.at[:, 0].set((a[:, 0] + 1) % 256)
  la, lb = model(a), model(b)
  # Two layers of window 4 see back at most 6 tokens: position 12 cannot see position 0.
  np.testing.assert_allclose(la[:, 12:], lb[:, 12:], atol=1e-5)
  assert not np.allclose(la[:, 1:4], lb[:, 1:4])


def test_kernel_resolution_on_cpu():
  from nanotext.errors import UserError
  from nanotext.model.kernels.dispatch import resolve_impl
  assert resolve_impl("auto", "cpu") == "cpu"
  assert resolve_impl("splash", "cpu") == "splash"  # interpret mode off TPU
  with pytest.raises(UserError, match="attention.impl"):
    resolve_impl("cudnn", "cpu")
  with pytest.raises(UserError, match="train.seq_len"):
    resolve_impl("splash", "cpu", seq_len=100)


def test_shared_lookup_is_one_float32_scatter():
  """Token and value tables read at the same ids: gradients equal to each table's own gather,
  summed in one scatter for all of them (3 tables: 1 scatter in the compiled program, not 3)."""
  import re
  from types import SimpleNamespace
  from nanotext.model.layers import lookup
  ids = jax.random.randint(jax.random.key(0), (2, 64), 0, 50)
  tables = [jax.random.normal(jax.random.key(i), (50, 8)) for i in range(3)]
  def ours(tables):
    embeds = [SimpleNamespace(embedding=SimpleNamespace(get_value=lambda t=t: t),
                              dtype=jnp.float32) for t in tables]
    return sum(((x * (i + 1)) ** 2).sum() for i, x in enumerate(lookup(embeds, ids)))
  def plain(tables):
    return sum(((jnp.take(t, ids, axis=0) * (i + 1)) ** 2).sum() for i, t in enumerate(tables))
  for a, b in zip(jax.grad(ours)(tables), jax.grad(plain)(tables)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  count = lambda f: len(re.findall(r" scatter\(", jax.jit(jax.grad(f)).lower(tables).compile()
                                   .as_text()))
  assert (count(ours), count(plain)) == (1, 3)


SCANNED = ["model.scan_layers=true", "model.tie_embeddings=false"]  # a head made after the blocks


@pytest.mark.parametrize("path,extra", [(BASE, []), (SPEEDRUN, ["model.num_layers=4"]),
                                        (BASE, SCANNED)])
def test_init_keys_are_nnx_rngs_sequence(path, extra):
  """Models are built with layers.Keys (a Python count: no traced count per parameter); their
  parameters are those nnx.Rngs(key) gives, in a jitted init with a traced seed (as
  Run.init_state), scanned layers (nnx.split_rngs, and what is made after them) included."""
  cfg = config.load(path, SMALL + extra)

  def params(rngs_of, seed):
    return nnx.state(GPT(cfg.model, cfg.attention, rngs=rngs_of(jax.random.key(seed))))
  by_keys = jax.jit(lambda s: params(Keys, s))
  by_rngs = jax.jit(lambda s: params(nnx.Rngs, s))
  for seed in (0, 3):
    got, want = by_keys(seed), by_rngs(seed)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, got, want)


@pytest.mark.fast
def test_a_bf16_weight_gradient_over_batch_and_time_is_summed_in_float32_on_cpu():
  """layers.matmul's weight gradient of a bf16 x [2, 2048, 768]: within bf16's rounding of the
  result of float64 (1.7e-3 measured). jax 0.11's CPU backend summed the plain x @ w's in bf16,
  2.1e-2 off (and 2.4% between one batch and two micro-batches at the record's rows)."""
  from nanotext.model.layers import matmul
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 2048, 768)), jnp.bfloat16)
  g = jnp.asarray(rng.standard_normal((2, 2048, 768)), jnp.bfloat16)
  w = jnp.zeros((768, 768), jnp.float32)
  loss = lambda w, x, g: jnp.sum(  # x and g as arguments: XLA would fold constants for minutes
      matmul(x, w.astype(jnp.bfloat16)).astype(jnp.float32) * g.astype(jnp.float32))
  grad = jax.jit(jax.grad(loss))(w, x, g)
  x64, g64 = (np.asarray(a, np.float64).reshape(-1, 768) for a in (x, g))
  want = x64.T @ g64
  assert np.linalg.norm(np.asarray(grad, np.float64) - want) / np.linalg.norm(want) < 3e-3


@pytest.mark.fast
def test_a_program_for_a_gpu_keeps_its_bf16_matmuls():
  """The float32 products are the CPU's alone: traced for a GPU, layers.matmul is x @ w."""
  from nanotext.model.layers import matmul
  x, w = jnp.ones((2, 8, 16), jnp.bfloat16), jnp.ones((16, 4), jnp.bfloat16)
  for target, wide in (("gpu", False), ("tpu", False), ("cpu", True)):
    with building_for(target):
      jaxpr = jax.make_jaxpr(lambda a, b: matmul(a, b))(x, w)  # a new trace per target
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1 and (dots[0].outvars[0].aval.dtype == jnp.float32) == wide, target


@pytest.mark.parametrize("truncate,head_dim,need", [(True, 30, "a multiple of 4 with "
                                                     "model.rope_truncate=true"),
                                                    (False, 31, "even")])
def test_rotary_head_dim_names_the_rule_it_breaks(truncate, head_dim, need):
  """30 is even: 'need an even head_dim' was said of it where rope_truncate asked for 4."""
  from nanotext.errors import UserError
  from nanotext.model import gpt
  cfg = config.load(BASE, [*TINY, "model.positions=rope", f"model.rope_truncate={truncate}",
                           f"model.head_dim={head_dim}"])
  with pytest.raises(UserError, match=f"need a head_dim {need}; got model.head_dim={head_dim}"):
    gpt.check_config(cfg.model)
