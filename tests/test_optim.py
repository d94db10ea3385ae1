"""Optimizer: groups from logical roles, schedules, Muon's update."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import pytest

from conftest import BASE, SPEEDRUN
from nanotext import config, optim, wiring
from nanotext.errors import UserError

pytestmark = pytest.mark.fast


def optim_cfg(path=SPEEDRUN, *overrides):
  return config.load(path, list(overrides)).optim


def test_groups_are_the_roles_given_where_parameters_are_made():
  from nanotext.model.layers import Linear, param
  # A 2-D bias stays in the scalar group whatever its axes: nothing is guessed from them.
  bias = param(jnp.zeros((3, 4)), ("layers", "embed"), "scalar")
  head = Linear(4, 8, ("embed", "vocab"), std=0.02, bias=True, param_dtype=jnp.float32,
                dtype=jnp.float32, rngs=nnx.Rngs(0), role="head")
  labels = optim.group_labels(nnx.state(nnx.Dict(bias=bias, head=head), nnx.Param))
  assert labels == {"bias": "scalar", "head": {"kernel": "head", "bias": "scalar"}}
  with pytest.raises(AssertionError):
    param(jnp.zeros((2,)), ("embed",), "adam")


def test_speedrun_model_groups():
  run = wiring.prepare(SPEEDRUN, ["model.num_layers=2", "model.d_model=64", "model.num_heads=2",
                                  "model.head_dim=32", "model.mlp_dim=128",
                                  "model.vocab_size=256", "model.align=0", "train.batch_size=8"])
  abstract = nnx.state(nnx.eval_shape(run.create_model))
  labels = optim.group_labels(abstract)
  assert labels["embed"]["embedding"] == "embed"
  assert labels["head"]["kernel"] == "head"
  assert labels["blocks"][0]["attn"]["qkv"]["kernel"] == "matrix"  # merged QKV: 3 matrices
  assert labels["blocks"][1]["mlp"]["proj"]["kernel"] == "matrix"
  assert labels["blocks"][0]["lambdas"] == "scalar"


def test_a_tied_table_is_the_head_group_at_head_lr():
  # Trained at embed_lr (0.6) as an embedding, a tied table (also the head) diverged: 9.0 -> 16.3.
  run = wiring.prepare(SPEEDRUN, ["model.num_layers=2", "model.d_model=64", "model.num_heads=2",
                                  "model.head_dim=32", "model.mlp_dim=128", "model.vocab_size=256",
                                  "model.align=0", "train.batch_size=8", "model.fp8_head=false",
                                  "model.tie_embeddings=true", "model.zero_init_head=false"])
  params = nnx.state(nnx.eval_shape(run.create_model))
  labels = optim.group_labels(params)
  assert labels["embed"]["embedding"] == "head" and labels["value_embeds"][0]["embedding"] == "embed"
  o = run.cfg.optim  # Adam's first update of a gradient of ones is the lr itself
  grads = {"embed": {"embedding": jnp.ones((4, 64))}}
  tx = optim.make_optimizer(o, {"embed": {"embedding": labels["embed"]["embedding"]}}, 100)
  update, _ = tx.update(grads, tx.init(grads), grads)
  peak = o.head_lr * float(optim.lr_factor(o, 100, xp=np)(0))
  np.testing.assert_allclose(update["embed"]["embedding"], -peak, rtol=1e-4)
  with pytest.raises(UserError, match="model.zero_init_head=true needs an untied head"):
    wiring.load(SPEEDRUN, ["model.tie_embeddings=true", "model.fp8_head=false"])


def test_schedule_warmup_constant_cooldown():
  cfg = optim_cfg(BASE, "optim.warmup_steps=10", "optim.cooldown_frac=0.5",
                  "optim.final_lr_frac=0.1")
  f = optim.lr_factor(cfg, 100, xp=np)
  np.testing.assert_allclose([f(0), f(4), f(9)], [0.1, 0.5, 1.0], rtol=1e-6)
  np.testing.assert_allclose([f(20), f(50)], [1.0, 1.0])
  np.testing.assert_allclose([f(75), f(100)], [0.55, 0.1], rtol=1e-6)
  # The jnp version used inside optax agrees with the host version.
  np.testing.assert_allclose(optim.lr_factor(cfg, 100)(75), f(75), rtol=1e-6)


def test_cooldown_is_the_records_fraction_of_progress():
  # train_gpt.py 587b45fb get_lr: x = step / N, 1 while x < 1 - 0.4, else w = (1 - x) / 0.4 and
  # w + (1 - w) * 0.1. At N = 12 the cooldown is 4.8 steps: no whole number of steps gives it.
  def get_lr(step, n):
    w = min(1.0, (1 - step / n) / 0.4)
    return w + (1 - w) * 0.1
  for n in (12, 13, 1770):
    f = optim.lr_factor(optim_cfg(SPEEDRUN), n, xp=np)
    np.testing.assert_allclose([f(s) for s in range(n + 1)], [get_lr(s, n) for s in range(n + 1)],
                               rtol=1e-6)



def test_cooldown_whole_steps_is_the_ports_schedule():
  # modded-nanogpt-jax train.py a9d3e04: W = int(N * 0.4) warmdown steps, lr (N - it) / W * 0.9
  # + 0.1 from it = N - W on (the port's config sets the key; the record's is a fraction).
  def get_lr(it, n):
    w = int(n * 0.4)
    return 1.0 if it < n - w else (n - it) / w * 0.9 + 0.1
  cfg = optim_cfg(BASE, "optim.warmup_steps=0", "optim.cooldown_frac=0.4",
                  "optim.final_lr_frac=0.1", "optim.cooldown_whole_steps=true")
  for n in (8, 12, 1770):
    f = optim.lr_factor(cfg, n, xp=np)
    np.testing.assert_allclose([f(s) for s in range(n)], [get_lr(s, n) for s in range(n)],
                               rtol=1e-6)
  assert optim.lr_factor(cfg, 12, xp=np)(8) != pytest.approx(0.85)  # the fraction's value

@pytest.mark.parametrize("overrides", [
    ["optim.warmup_steps=10", "optim.cooldown_frac=0.45"],  # a fractional cooldown (the record's)
    ["optim.cooldown_frac=0.4", "optim.cooldown_whole_steps=true"],  # whole steps (the port's)
    ["optim.cooldown_frac=0.37", "optim.final_lr_frac=0.1"],
    ["optim.cooldown_frac=0"]])  # no cooldown
def test_the_schedule_as_the_train_steps_argument_is_the_same_float32_numbers(overrides):
  """The train step takes [total, cooldown steps] as an argument (one program for every
  train.steps): its schedule equals, bit for bit, the one with them as constants (the host's,
  for the log, to float32 rounding)."""
  cfg = optim_cfg(BASE, *overrides)
  for n in (1, 12, 75, 1770):
    steps = jnp.arange(n + 1, dtype=jnp.int32)
    const = jax.jit(jax.vmap(optim.lr_factor(cfg, n)))(steps)
    arg = jax.jit(lambda s, sched: jax.vmap(optim.lr_factor(cfg, sched))(s))(
        steps, jnp.asarray(optim.schedule_values(cfg, n), jnp.float32))
    host = [optim.lr_factor(cfg, n, xp=np)(s) for s in range(n + 1)]
    np.testing.assert_array_equal(np.asarray(arg), np.asarray(const), err_msg=f"{overrides} {n}")
    np.testing.assert_allclose(np.asarray(arg), np.asarray(host, np.float32), rtol=1e-6)


def test_runs_that_differ_only_in_train_steps_share_one_train_program():
  from conftest import TINY
  from nanotext import trainer
  texts = []
  for steps in (4, 6, 1000):
    run = wiring.prepare(SPEEDRUN, TINY + ["model.mlp_dim=0", f"train.steps={steps}"])
    batch = {k: jax.ShapeDtypeStruct((8, 32), jnp.int32, sharding=run.batch_sharding)
             for k in ("inputs", "targets")}
    texts.append(trainer.make_train_step(run).lower(run.abstract_state(), batch).as_text())
    np.testing.assert_array_equal(run.schedule(), np.float32([steps, 0.4 * steps]))
  assert texts[0] == texts[1] == texts[2]


def test_muon_momentum_warmup():
  m = optim.muon_momentum(optim_cfg())
  np.testing.assert_allclose([m(0), m(150), m(300), m(1000)], [0.85, 0.90, 0.95, 0.95],
                             rtol=1e-6)


def test_muon_update_is_orthogonalised_and_scaled():
  cfg = optim_cfg(SPEEDRUN, "optim.muon_bf16=false")
  tx = optim.scale_by_muon(cfg)
  g = {"w": jax.random.normal(jax.random.key(0), (32, 64))}  # fan_in 32, fan_out 64
  state = tx.init(g)
  upd, state = tx.update(g, state)
  s = np.linalg.svd(np.asarray(upd["w"]) / np.sqrt(2.0), compute_uv=False)
  # Newton-Schulz with the speedrun's coefficients pushes singular values near 1 (0.5..1.5).
  assert 0.4 < s.min() and s.max() < 1.6
  # Momentum: first step's buffer is (1 - 0.85) * g.
  np.testing.assert_allclose(state["mu"]["w"], 0.15 * g["w"], rtol=1e-6)
  assert int(state["count"]) == 1


def test_muon_recipe_updates_every_group_and_adamw_baseline():
  params = {"embed": jnp.ones((16, 8)), "w": jnp.ones((8, 8)) + jnp.eye(8), "g": jnp.ones((8,))}
  labels = {"embed": "embed", "w": "matrix", "g": "scalar"}
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.1), params)
  for name in ("muon", "adamw"):
    cfg = optim_cfg(SPEEDRUN, f"optim.name={name}")
    tx = optim.make_optimizer(cfg, labels, total_steps=10)
    upd, _ = jax.jit(tx.update)(grads, tx.init(params), params)  # one program, not one per op
    for k in params:
      assert float(jnp.abs(upd[k]).max()) > 0, (name, k)
  # Adam groups use their own learning rates: embed_lr=0.6 vs scalar_lr=0.04 on a sign-like step.
  cfg = optim_cfg(SPEEDRUN)
  tx = optim.make_optimizer(cfg, labels, total_steps=10)
  upd, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  ratio = float(jnp.abs(upd["embed"]).mean() / jnp.abs(upd["g"]).mean())
  np.testing.assert_allclose(ratio, 0.6 / 0.04, rtol=1e-3)


def test_grad_clip_is_applied():
  params = {"w": jnp.zeros((4, 4))}
  big = {"w": jnp.full((4, 4), 100.0)}  # global norm 400
  def second_moment(clip):
    cfg = optim_cfg(BASE, f"optim.grad_clip={clip}", "optim.warmup_steps=0")
    tx = optim.make_optimizer(cfg, {"w": "matrix"}, total_steps=10)
    _, state = tx.update(big, tx.init(params), params)
    nus = [s.nu for s in jax.tree.leaves(state, is_leaf=lambda x: hasattr(x, "nu"))
           if hasattr(s, "nu")]
    return float(nus[0]["w"].max())
  # Adam's nu after one step is (1 - beta2) * g^2, with g clipped to norm 1 -> 0.25 per entry.
  np.testing.assert_allclose(second_moment(1.0), 0.05 * 0.25 ** 2, rtol=1e-4)
  np.testing.assert_allclose(second_moment(0.0), 0.05 * 100.0 ** 2, rtol=1e-4)


@pytest.mark.parametrize("layout", [["model.merged_qkv=false"], ["model.merged_qkv=true"],
                                    ["model.merged_qkv=false", "model.fused_qkv=true"],
                                    ["model.scan_layers=true"],
                                    ["model.scan_layers=true", "model.merged_qkv=false",
                                     "model.fused_qkv=true"]])
def test_muon_fan_out_scale_is_each_layouts_real_fan_out_over_fan_in(layout):
  # d_model 64, heads 2 x 64 (HK 128), mlp 256: the matrices' real fan_out / fan_in by name.
  scan = "model.scan_layers=true" in layout
  run = wiring.prepare(SPEEDRUN, ["model.num_layers=2", "model.d_model=64", "model.num_heads=2",
                                  "model.head_dim=64", "model.mlp_dim=256", "model.vocab_size=256",
                                  "model.align=0", "train.batch_size=8", "model.value_embeds=0",
                                  "model.no_attention_layers=[]"] + layout +
                       (["model.unet_skips=false", "attention.window_pattern="] if scan else []))
  abstract = nnx.state(nnx.eval_shape(run.create_model))
  want = {"qkv": 3 * 128 / 64 if "model.fused_qkv=true" in layout else 2.0, "q": 2.0, "k": 2.0,
          "v": 2.0, "o": 1.0, "fc": 4.0, "proj": 1.0}
  leaves = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(abstract))[0]
  seen = set()
  for (path, x), role in zip(leaves, jax.tree.leaves(optim.group_labels(abstract))):
    if role != "matrix":
      continue
    name = next(k.key for k in reversed(path) if k.key != "kernel")
    got = optim.aspect_scale(x.shape, "fan_out", optim.stored_out_in(path))
    assert got == pytest.approx(want[name] ** 0.5), (jax.tree_util.keystr(path), x.shape)
    seen.add(name)
  assert seen >= {"o", "fc", "proj"} and seen & {"qkv", "q"}


def test_muon_scales_fused_qkv_as_its_transpose_stored_in_out():
  # The same [in, out] = [64, 192] update stored as a Linear kernel and as fused QKV's [out, in]:
  # both are fan_out 192 over fan_in 64, scaled sqrt(3), the results each other's transpose.
  g = jax.random.normal(jax.random.key(0), (64, 192))
  cfg = optim_cfg(SPEEDRUN, "optim.muon_bf16=false", "optim.muon_layout=sharded")
  tx = optim.scale_by_muon(cfg)
  params = {"o": {"kernel": g}, "attn": {"qkv": g.T}}
  out, _ = tx.update(params, tx.init(params))
  np.testing.assert_allclose(out["attn"]["qkv"], out["o"]["kernel"].T, rtol=1e-5, atol=1e-6)
  assert optim.aspect_scale((192, 64), "rows") == pytest.approx(3 ** 0.5)  # rows: as stored


def test_adamw_computes_in_float32_and_keeps_bf16_moments():
  # As the muon recipe's Adam groups (optim.in_float32): bf16 arithmetic rounded every moment
  # update and beta (0.95 -> 0.9492). Reference: optax's AdamW in float32, its moments rounded to
  # bf16 after each step; float32 parameters step exactly as plain optax.adamw.
  cfg = optim_cfg(BASE, "optim.warmup_steps=0", "optim.grad_clip=0", "optim.weight_decay=0.1")
  rng = np.random.default_rng(0)
  ref32 = optax.adamw(lambda s: cfg.lr * optim.lr_factor(cfg, 100)(s), b1=cfg.beta1,
                      b2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay)
  bf16 = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
                                if x.dtype == jnp.float32 else x, t)
  for dtype in (jnp.bfloat16, jnp.float32):
    p = {"w": jnp.asarray(rng.standard_normal((16, 16)), dtype)}
    tx = optim.make_optimizer(cfg, {"w": "matrix"}, 100)
    state, ref_state = tx.init(p), ref32.init(jax.tree.map(lambda x: x.astype(jnp.float32), p))
    for _ in range(5):
      g = {"w": jnp.asarray(rng.standard_normal((16, 16)) * 1e-3, dtype)}
      upd, state = jax.jit(tx.update)(g, state, p)
      f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
      want, ref_state = jax.jit(ref32.update)(f32(g), ref_state, f32(p))
      ref_state = bf16(ref_state) if dtype == jnp.bfloat16 else ref_state
      np.testing.assert_allclose(np.asarray(upd["w"], np.float32), want["w"], rtol=1e-5, atol=1e-9)
    assert {x.dtype for x in jax.tree.leaves(state) if x.ndim == 2} == {jnp.dtype(dtype)}
