"""configs/modded_nanogpt_jax.yml: the pure-JAX TPU port's recipe, and the switches it needs."""

import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import REPO, TINY, one_line_error, run_cli
from nanotext import config, optim, trainer, window_schedule, wiring
from nanotext.convert import mnjax
from nanotext.data import binfile
from nanotext.model.rope import rope_frequencies

MNJAX = os.path.join(REPO, "configs", "modded_nanogpt_jax.yml")
FIXTURE = os.path.join(REPO, "tests", "data", "port_parity.npz")


def parity_module():
  spec = importlib.util.spec_from_file_location(
      "port_parity", os.path.join(REPO, "benchmarks", "port_parity.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_recipe_follows_the_port_from_its_own_weights(tmp_path):
  # The port's side (its initial weights, the tokens, its per-step losses) was computed by its own
  # train.py at a9d3e04: `python benchmarks/port_parity.py --port=train.py --write=FIXTURE`.
  # Port: 4.852030 4.793086 4.698523 4.608765 4.509197 4.398999 4.317649 4.220574.
  # The first two steps agree to float32 rounding; later ones to ~5e-5: the port normalises and
  # combines Newton-Schulz terms in bfloat16 arithmetic, nanotext in float32, rounding once.
  f = np.load(FIXTURE)
  shard = str(tmp_path / "shard_000.bin")
  binfile.write_shard(shard, f["tokens"])
  params = {k[len("param."):]: f[k] for k in f.files if k.startswith("param.")}
  ours = parity_module().nanotext_losses(params, shard, [str(o) for o in f["overrides"]])
  np.testing.assert_allclose(ours[:2], f["losses"][:2], rtol=1e-6)
  np.testing.assert_allclose(ours, f["losses"], rtol=2e-4)
  assert ours[-1] < ours[0] - 0.5  # and it learns


@pytest.mark.fast
def test_recipe_is_the_ports_full_size_run():
  cfg = wiring.load(MNJAX)
  m, t, o = cfg.model, cfg.train, cfg.optim
  assert (m.num_layers, m.d_model, m.num_heads, m.head_dim, m.vocab_size) == (12, 1024, 4, 256,
                                                                              50304)
  assert t.batch_size * t.seq_len == 524288 and t.steps == 1675
  assert [window_schedule.seq_len_at(t, s) for s in (0, 837, 838, 1674)] == [1024] * 2 + [2048] * 2
  assert (o.muon_lr, o.muon_momentum_warmup, o.head_lr, o.embed_lr, o.scalar_lr) == \
      (0.04, 500, 0.008, 0.6, 0.04)


def port_shape(step, n, lo, hi, inc, rows_at_lo, micro):
  """modded-nanogpt-jax's `_get_shape_for_step` in words: (row length, rows, micro-batches)."""
  lens = list(range(lo, hi + 1, inc))
  lens += [hi] if hi not in lens else []
  t = lens[int(step / n * len(lens))]
  rows = max(micro, rows_at_lo * lo // t // micro * micro)
  return t, rows, rows // micro


@pytest.mark.fast
@pytest.mark.parametrize("lo,hi,inc,steps", [(1024, 2048, 1024, 1675), (256, 1024, 256, 97),
                                             (128, 1024, 384, 50)])
def test_seq_len_warmup_matches_the_port(lo, hi, inc, steps):
  t = config.load(MNJAX, [f"train.seq_len_start={lo}", f"train.seq_len={hi}",
                          f"train.seq_len_step={inc}", f"train.steps={steps}"]).train
  micro = t.batch_size // t.grad_accum
  if any(hi % n for n in window_schedule.seq_lens(t)):
    return  # refused by check_config (test below); the port would round rows down
  for step in range(steps):
    want_t, want_rows, _ = port_shape(step, steps, lo, hi, inc, t.batch_size * hi // lo, micro)
    got = window_schedule.seq_len_at(t, step)
    assert got == want_t and t.batch_size * hi // got == want_rows, step


def test_seq_len_warmup_that_does_not_divide_is_one_line():
  proc = run_cli("nanotext.train", MNJAX, *TINY, "train.seq_len=32", "train.seq_len_start=12",
                 "train.grad_accum=1", "model.vocab_size=512")
  one_line_error(proc, "train.seq_len_start")


def tiny_port_run(*extra):
  ov = [str(o) for o in np.load(FIXTURE)["overrides"]] + ["data.source=synthetic", *extra]
  return wiring.prepare(MNJAX, ov, devices=jax.devices()[:1])


def test_a_short_stage_is_the_same_tokens_in_shorter_rows():
  run = tiny_port_run()
  state = run.init_state()
  batch = trainer.global_batch(run, next(run.train_iter()))  # 4 rows of 64
  params = state["params"]
  _, m_short = trainer.make_train_step(run, None, 32)(jax.tree.map(jnp.copy, state), batch)
  cut = {k: v.reshape(8, 32) for k, v in batch.items()}
  loss = jax.jit(lambda p, x, y: trainer.loss_fn(run.graphdef, p, x, y, train=True))
  want = loss(params, cut["inputs"], cut["targets"])  # one program, not one per op
  # The mean of four micro-batch means against one mean: float32 summation order only.
  np.testing.assert_allclose(float(m_short["loss"]), float(want), rtol=1e-5)


def test_value_residual_and_learned_scale():
  tokens = jnp.asarray(np.arange(64).reshape(1, 64) % 128)
  def opened(model):  # non-zero output projections, so every attention layer shows
    for blk in model.blocks:
      blk.attn.o.kernel.value = 0.1 * jnp.ones_like(blk.attn.o.kernel.value)
    return model
  hidden = nnx.jit(lambda m: m.hidden(tokens))  # one program, not one per op
  model = opened(tiny_port_run().create_model())
  h0 = np.asarray(hidden(model))
  # The first layer's own v is v1: its lambda changes nothing; a later layer's does.
  model.blocks[0].attn.v_residual.value = jnp.array([0.9])
  np.testing.assert_allclose(hidden(model), h0, rtol=1e-6, atol=1e-6)
  model.blocks[2].attn.v_residual.value = jnp.array([0.9])
  assert not np.allclose(hidden(model), h0, rtol=1e-4, atol=1e-4)
  # The learned scale starts at attn_scale: the same function as the fixed scale.
  a = opened(tiny_port_run().create_model(seed=3))
  b = opened(tiny_port_run("model.attn_scale_learned=false").create_model(seed=3))
  np.testing.assert_allclose(hidden(a), hidden(b), rtol=1e-5, atol=1e-6)
  a.blocks[1].attn.scale_param.value = jnp.array([0.5])
  assert not np.allclose(hidden(a), hidden(b), rtol=1e-4, atol=1e-4)


def test_rope_arange_spacing_is_the_ports():
  f = rope_frequencies(16, 1024.0, truncate=True, spacing="arange")
  np.testing.assert_allclose(f[:4], 1.0 / 1024.0 ** (np.arange(4) / 4))
  assert not f[4:].any()
  assert rope_frequencies(16, 1024.0, True)[3] == pytest.approx(1 / 1024)  # linspace reaches 1/base


@pytest.mark.fast
def test_rope_sign_flip_is_the_same_function():
  # The port rotates by +theta, nanotext by -theta; flipping half of q and k maps one to the other.
  from nanotext.model.rope import apply_rope
  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.normal(size=(1, 8, 1, 16)), jnp.float32) for _ in range(2))
  freq = rope_frequencies(16, 1024.0, True, "arange")
  t = np.arange(8)[:, None] * freq[None]
  c, s = np.cos(t)[None, :, None], np.sin(t)[None, :, None]
  port = lambda x: np.concatenate([x[..., :8] * c - x[..., 8:] * s,
                                   x[..., :8] * s + x[..., 8:] * c], -1)
  flip = lambda x: np.concatenate([x[..., :8], -x[..., 8:]], -1)
  want = np.einsum("bthk,bshk->ts", port(np.asarray(q)), port(np.asarray(k)))
  got = np.einsum("bthk,bshk->ts", apply_rope(flip(q), freq), apply_rope(flip(k), freq))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  w = rng.normal(size=(3 * 2 * 16, 4))
  flipped = mnjax.flip_rope_halves(w, 2, 16).reshape(3, 2, 16, 4)
  np.testing.assert_array_equal(flipped[2], w.reshape(3, 2, 16, 4)[2])  # v untouched
  np.testing.assert_array_equal(flipped[:2, :, 8:], -w.reshape(3, 2, 16, 4)[:2, :, 8:])


def test_muon_scale_rules():
  assert optim.aspect_scale((64, 256), "fan_out") == 2.0  # MLP in: fan_out / fan_in = 4
  assert optim.aspect_scale((64, 256), "rows") == 1.0     # port: rows / cols of [in, out]
  assert optim.aspect_scale((256, 64), "rows") == 2.0     # port's MLP out
  assert optim.aspect_scale((192, 64), "rows") == pytest.approx(3 ** 0.5)  # port's c_qkv [out, in]


def test_muon_layer_decay_scales_each_block():
  def updates(decay):
    run = tiny_port_run(f"optim.muon_layer_decay={decay}")
    state = run.init_state()
    grads = jax.tree.map(jnp.ones_like, state["params"])
    up, _ = jax.jit(run.tx.update)(grads, state["opt_state"], state["params"])
    return up
  ref, dec = updates(1.0), updates(0.5)
  for i in range(4):
    np.testing.assert_allclose(dec["blocks"][i]["mlp"]["fc"]["kernel"],
                               ref["blocks"][i]["mlp"]["fc"]["kernel"] * 0.5 ** (3 - i), rtol=1e-6)
  np.testing.assert_allclose(dec["head"]["kernel"], ref["head"]["kernel"])  # Adam groups unchanged
  # the scalars of a block are Adam's too
  np.testing.assert_allclose(dec["blocks"][0]["lambdas"], ref["blocks"][0]["lambdas"])


@pytest.mark.fast
def test_fused_qkv_refuses_a_bias():
  with pytest.raises(Exception, match="model.fused_qkv"):
    wiring.load(MNJAX, ["model.bias=true"])


def test_train_cli_compiles_every_length_before_step_one(tmp_path):
  proc = run_cli("nanotext.train", MNJAX, *TINY, "train.seq_len=32", "train.seq_len_start=16",
                 "train.seq_len_step=16", "train.grad_accum=1", "model.vocab_size=512",
                 "train.loss_chunk=0", "model.remat=none", "model.dtype=float32",
                 "model.param_dtype=float32", f"output_dir={tmp_path / 'run'}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = proc.stdout + proc.stderr
  assert "compiled 2 train step programs" in out, out[-2000:]
  assert "compilations inside the training loop: 0" in out


def test_muon_layer_decay_on_scanned_layers():
  ov = TINY + ["model.scan_layers=true", "model.num_layers=3", "optim.name=muon"]
  def updates(decay):
    run = wiring.prepare(os.path.join(REPO, "configs", "base.yml"),
                         ov + [f"optim.muon_layer_decay={decay}"], devices=jax.devices()[:1])
    state = run.init_state()
    grads = jax.tree.map(jnp.ones_like, state["params"])
    return jax.jit(run.tx.update)(grads, state["opt_state"], state["params"])[0]
  ref, dec = updates(1.0), updates(0.5)
  want = ref["blocks"]["mlp"]["fc"]["kernel"] * np.array([0.25, 0.5, 1.0])[:, None, None]
  np.testing.assert_allclose(dec["blocks"]["mlp"]["fc"]["kernel"], want, rtol=1e-6)
