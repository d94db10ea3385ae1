"""Numerics that depend on scale, checked at the shapes the shipped configs run.

A toy-shape test can pass while the real shape is wrong: the FP8 head's backward scale clipped
every target gradient at one 49,152-token row while the 64-token tests passed. Each path whose
numerics depend on a width, a row length, a vocabulary or an accumulation length is tested here
at the shipped configs' values (speedrun_record.yml: d 768, rows of 49,152, tables of 50,257
rows, head 50,304; speedrun.yml: d 1024, head 50,432), sliced to fit a CPU: the head alone at full
T and d, a small vocabulary where the vocabulary does not matter, one block where depth does not.

| path | shape tested | test |
| --- | --- | --- |
| FP8 head gradient scale, both loss reductions | T 49,152, d 768 and 1024 | test_fp8_head_gradients_at_full_rows |
| FP8 codes equal the record's | d 768, 1 and 8 rows | test_fp8_codes_are_the_records |
| row_sum vs mean | T 49,152, d 768 and 1024 | test_fp8_head_gradients_at_full_rows |
| chunked cross-entropy | T 49,152, d 768, chunk 256 | test_chunked_loss_at_full_rows |
| soft-cap and log-sum-exp at the full head | V 50,304 and 50,432 | test_softcapped_loss_at_full_vocabulary |
| remat policies | T 49,152, d 768 | test_remat_at_full_rows |
| gradient accumulation (FP8 head, row sums) | 2 rows of 49,152 | test_grad_accum_at_full_rows |
| embedding gradient accumulation | T 49,152, 4 tables of 50,257 x 768 | test_embedding_gradients_at_full_rows |
| Newton-Schulz in bf16 | MLP and QKV shapes at d 768 and 1024 | test_newton_schulz_at_real_widths |
| token ids vs 50,257-row tables | record vocabulary, synthetic data | test_synthetic_ids_index_the_tables |
| eval windows of the schedule | 1,770 steps, rows of 262,144 | test_eval_windows_are_the_records |
| rotary angles | 262,144 positions | test_rotary_angles_at_validation_length |
"""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from conftest import REPO
from nanotext import config, optim, trainer, window_schedule, wiring
from nanotext.model import GPT
from nanotext.model.layers import fp8_head_scales, lookup, rms_norm
from nanotext.model.loss import cross_entropy
from nanotext.model.rope import rope_frequencies

RECORD = f"{REPO}/configs/speedrun_record.yml"
SPEEDRUN = f"{REPO}/configs/speedrun.yml"
ROW = 48 * 1024  # the record's train_seq_len


def rel(a, b):
  """|a - b| / |b| over every entry, in float32 on the device: a [49152, 1024] gradient took
  0.5-2.5 s as float64 numpy copies (bf16 -> float64 converts element by element)."""
  return float(_rel(jnp.asarray(a), jnp.asarray(b)))


@jax.jit
def _rel(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jnp.linalg.norm(a - b) / jnp.linalg.norm(b)


def head_model(d, vocab, *overrides):
  """A two-block record model of width d whose head is all that matters (small token table)."""
  cfg = config.load(RECORD, [f"model.d_model={d}", "model.num_layers=2", f"model.vocab_size={vocab}",
                             "model.embed_rows=64", "model.value_embeds=0", "model.num_heads=1",
                             f"model.head_dim={d}", f"model.mlp_dim={d}", "model.align=0",
                             *overrides])
  cfg = config.finalize(cfg, mesh_sizes={}, data_dir="")
  return GPT(cfg.model, cfg.attention, rngs=nnx.Rngs(0))


def head_inputs(d, vocab, T, dtype, seed=1):
  """RMS-normalised hidden states [1, T, d], a head whose logits spread over a few units, targets."""
  kw, kx, ky = jax.random.split(jax.random.key(seed), 3)
  w = jax.random.normal(kw, (d, vocab)) * 3 / np.sqrt(d)
  x = rms_norm(jax.random.normal(kx, (1, T, d))).astype(dtype)
  y = jax.random.randint(ky, (1, T), 0, vocab)
  return x, w, y


def head_grads(d, vocab, T, *, fp8, per_row, chunk=0, dtype="bfloat16"):
  """(dL/dx, dL/dW) of the loss through GPT.logits and cross_entropy, as the train step takes it."""
  model = head_model(d, vocab, f"model.fp8_head={str(fp8).lower()}", f"model.dtype={dtype}")
  x, w, y = head_inputs(d, vocab, T, jnp.dtype(dtype))
  graphdef, state = nnx.split(model)

  def loss(x, w):
    params = nnx.to_pure_dict(state)
    params["head"]["kernel"] = w
    s = nnx.state(nnx.merge(graphdef, state))
    nnx.replace_by_pure_dict(s, params)
    return cross_entropy(nnx.merge(graphdef, s), x, y, chunk, train=True, per_row=per_row)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)


@pytest.mark.slow
@pytest.mark.parametrize("d", [768, 1024])
def test_fp8_head_gradients_at_full_rows(d):
  """FP8 gradients within a few percent of the float32 head for both reductions, and row_sum's
  gradient exactly T times mean's. The old tokens-based scale gave 91% / 77% error with row_sum."""
  f32 = {r: head_grads(d, 512, ROW, fp8=False, per_row=r, dtype="float32") for r in (False, True)}
  (mean_loss, (gx_m, gw_m)), (sum_loss, (gx_s, gw_s)) = f32[False], f32[True]
  np.testing.assert_allclose(sum_loss, mean_loss * ROW, rtol=1e-5)
  assert rel(gx_s, gx_m * ROW) < 1e-5 and rel(gw_s, gw_m * ROW) < 1e-5
  for per_row in (False, True):
    _, (gx, gw) = head_grads(d, 512, ROW, fp8=True, per_row=per_row)
    _, (rx, rw) = f32[per_row]
    assert rel(gx, rx) < 0.06 and rel(gw, rw) < 0.06, (per_row, rel(gx, rx), rel(gw, rw))


@pytest.mark.fast
@pytest.mark.parametrize("rows", [1, 8])
def test_fp8_codes_are_the_records(rows):
  """The record sums each GPU's row: its head sees the per-token gradient g = dL/dz and rounds
  g / (1/448) to e5m2. nanotext's head weights are the record's / sqrt(d) and its loss divides the
  summed token losses by the rows, so it sees sqrt(d) g / rows; with fp8_head_scales' grad_s the
  codes are bit for bit the record's."""
  d = 768
  g = np.asarray(jax.random.normal(jax.random.key(0), (4096, 64))) * 0.1
  g[:, 0] = -0.999  # a target entry, the largest code: 448 * 0.999
  record = (g / np.float32(1 / 448)).astype(np.float32).astype(ml_dtypes.float8_e5m2)
  x_s, w_s, grad_s = fp8_head_scales(d, rows)
  ours = (np.float32(np.sqrt(d)) * g / rows / np.float32(grad_s)).astype(np.float32)
  ours = np.clip(ours, -57344, 57344).astype(ml_dtypes.float8_e5m2)
  assert np.array_equal(ours.view(np.uint8), record.view(np.uint8))
  np.testing.assert_allclose((x_s, w_s * np.sqrt(d)), (np.sqrt(d) / 448, 24 / 448), rtol=1e-12)


@pytest.mark.slow
def test_chunked_loss_at_full_rows():
  """192 chunks of 256 positions: the same loss and gradients as the whole row (float32)."""
  whole = head_grads(768, 1024, ROW, fp8=False, per_row=True, dtype="float32")
  chunked = head_grads(768, 1024, ROW, fp8=False, per_row=True, chunk=256, dtype="float32")
  np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-5)
  assert rel(chunked[1][0], whole[1][0]) < 1e-5 and rel(chunked[1][1], whole[1][1]) < 1e-5


def mlp_run(*overrides, rows=1):
  """The record config cut to one MLP-only block of width 768 at the record's row length, on one
  device: what remat and accumulation change at full rows, at a cost a CPU test can pay. Random
  head and projections (not the record's zeros), so every parameter gets a gradient."""
  return wiring.prepare(RECORD, [
      "model.num_layers=1", "model.no_attention_layers=[0]", "model.value_embeds=0",
      "model.unet_skips=false", "model.num_heads=1", "model.head_dim=768", "model.mlp_dim=768",
      "model.vocab_size=512", "model.embed_rows=0", f"train.seq_len={ROW}",
      f"train.batch_size={rows}", "train.loss_chunk=0", "data.source=synthetic",
      "data.tokenizer=none", "data.eot_id=0", "mesh.fsdp=1",
      "model.zero_init_head=false", "model.zero_init_proj=false", *overrides],
      devices=jax.devices()[:1])


def tokens(rows, T=ROW, vocab=512, seed=0):
  return jax.random.randint(jax.random.key(seed), (rows, T), 0, vocab)


@pytest.mark.slow
def test_remat_at_full_rows():
  """Recomputing a block's activations at T = 49,152 (bf16) gives the kept activations' gradients
  to bf16 rounding: XLA fuses the recomputed forward differently (measured <= 0.55% relative,
  bf16's ulp is 0.39%). The x0-mix lambdas' gradient is one sum of 37.7M products whose absolute
  sum is ~2,070 times the result, so its bf16 value moves with XLA's fusion choices whatever the
  policy (measured 0.24-1.9% from float32: jax 0.10 and 0.11, YNNPACK reductions on and off);
  it is held against the float32 model's, every policy including none."""
  toks = tokens(1)
  grads = {}
  for policy in ("none", "dots", "full", "float32"):
    dtype = ["model.dtype=float32"] if policy == "float32" else []
    run = mlp_run(f"model.remat={'none' if dtype else policy}", *dtype)
    fn = jax.jit(jax.grad(lambda p: trainer.loss_fn(run.graphdef, p, toks, toks, per_row=True)))
    grads[policy] = fn(run.init_state()["params"])
  for policy in ("none", "dots", "full"):
    assert rel(grads[policy]["blocks"][0]["lambdas"], grads["float32"]["blocks"][0]["lambdas"]) \
        < 3e-2, policy
  for policy in ("dots", "full"):
    for a, b in zip(jax.tree.leaves(grads[policy]), jax.tree.leaves(grads["none"])):
      assert np.abs(np.asarray(b, np.float32)).max() > 0, policy
      assert a.shape == (2,) or rel(a, b) < 1e-2, policy  # (2,): the lambdas, held above


@pytest.mark.slow
def test_grad_accum_at_full_rows():
  """Two rows of 49,152 in one step or as two micro-batches of one row: the same gradient, FP8 head
  on, row sums (each micro-batch's FP8 scale is its own rows). AdamW with beta1 0 and an eps far
  above the gradient makes the update -lr * g / eps, so the new params show the gradient."""
  adam = ["optim.name=adamw", "optim.beta1=0", "optim.eps=1e6", "optim.lr=1.0",
          "optim.warmup_steps=0", "optim.grad_clip=0", "optim.weight_decay=0"]
  toks = np.asarray(tokens(2, ROW + 1))
  batch = {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
  deltas = []
  for accum in (1, 2):
    run = mlp_run(*adam, f"train.grad_accum={accum}", rows=2)
    state = run.init_state()
    before = jax.tree.map(np.asarray, state["params"])
    step = trainer.make_train_step(run, *window_schedule.step_stage(run.cfg, 0))
    after, metrics = step(state, batch)
    deltas.append(jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, after["params"], before))
    assert np.isfinite(float(metrics["loss"]))
  for a, b in zip(jax.tree.leaves(deltas[1]), jax.tree.leaves(deltas[0])):
    assert np.abs(b).max() > 0 and rel(a, b) < 2e-2


def zipf_tokens(n, vocab, seed=0):
  """Token ids with GPT-2-like frequencies: the commonest a few percent of a row."""
  rng = np.random.default_rng(seed)
  p = 1.0 / np.arange(1, vocab + 1)
  return rng.choice(vocab, size=n, p=p / p.sum()).astype(np.int32)


@pytest.mark.slow
def test_embedding_gradients_at_full_rows():
  """Four bf16 tables of 50,257 x 768 (token + 3 value embeddings) read at one row of 49,152
  Zipf-distributed ids: each frequent token's gradient (a sum of ~1,000-4,500 rows) is within bf16
  rounding of float64. Summed in bf16 (jnp.take's own transpose) they were 5-8% off."""
  V, D, k = 50257, 768, 16
  ids = zipf_tokens(ROW, V)[None]
  values = [jax.random.normal(jax.random.key(9 + i), (V, D)).astype(jnp.bfloat16) for i in range(4)]
  g = [jax.random.normal(jax.random.key(i), (1, ROW, D), jnp.float32).astype(jnp.bfloat16)
       for i in range(4)]

  def ours(values):  # layers.lookup reads .embedding.get_value() and .dtype of each Embed
    tables = [SimpleNamespace(embedding=SimpleNamespace(get_value=lambda v=v: v),
                              dtype=jnp.bfloat16) for v in values]
    return lookup(tables, ids)
  _, vjp = jax.vjp(ours, values)
  got = vjp(tuple(g))[0]
  bf16_sum = jax.vjp(lambda t: jnp.take(t, ids, axis=0), values[0])[1](g[0])[0]
  top = np.argsort(-np.bincount(ids[0], minlength=V))[:k]  # the k commonest tokens
  # float32 holds every bf16 value exactly; each token's rows are summed in float64.
  g32 = [np.asarray(x[0].astype(jnp.float32)) for x in g]
  want = [np.stack([g32[i][ids[0] == t].sum(0, dtype=np.float64) for t in top]) for i in range(4)]
  for i in range(4):
    assert rel(got[i][top], want[i]) < 5e-3  # bf16's final rounding
  old = rel(bf16_sum[top], want[0])
  assert old > 2e-2, old  # the scale-dependent error the float32 sum removes


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(768, 3072), (3, 768, 768), (4096, 1024)])
def test_newton_schulz_at_real_widths(shape):
  """bf16 Newton-Schulz (float32 accumulation and coefficients) on Muon's matrix shapes of
  speedrun_record.yml (768: MLP in, merged QKV) and speedrun.yml (1024: MLP out), against the
  record's iteration in float64: within bf16 noise and no systematic scale error, as at toy
  shapes (its sums run over the matrices' widths, which a toy shape does not reach)."""
  from test_muon_record import ns_record
  g = np.asarray(jax.random.normal(jax.random.key(0), shape), np.float32)
  g = g + 3 * np.asarray(jax.random.normal(jax.random.key(1), shape[:-1] + (1,)))  # a rank-1 lift
  ours = np.asarray(optim.orthogonalize_all(
      {"w": jnp.asarray(g)}, "sharded",
      lambda x: optim.newton_schulz(x, optim.NS_COEFFS, 5, jnp.bfloat16))["w"], np.float64)
  want = np.stack([ns_record(m.T).T for m in g.reshape((-1,) + shape[-2:])]).reshape(shape)
  assert rel(ours, want) < 0.03
  assert abs(np.linalg.norm(ours) / np.linalg.norm(want) - 1) < 0.01


@pytest.mark.slow
@pytest.mark.parametrize("path,d,vocab", [(RECORD, 768, 50304), (SPEEDRUN, 1024, 50432)])
def test_softcapped_loss_at_full_vocabulary(path, d, vocab):
  """Soft-capped cross-entropy over the full head (a 512-token slice): float32 equal to a
  float64 reference, the FP8 head's loss within 0.5% of it."""
  T = 512
  x, w, y = head_inputs(d, vocab, T, jnp.float32)
  want = 15 * np.tanh(np.asarray(x[0], np.float64) @ np.asarray(w, np.float64) / 15)
  want = float(np.mean(np.log(np.exp(want - want.max(1, keepdims=True)).sum(1)) +
                       want.max(1) - want[np.arange(T), np.asarray(y[0])]))
  for fp8, tol in ((False, 1e-6), (True, 5e-3)):
    model = head_model(d, vocab, f"model.fp8_head={str(fp8).lower()}", "model.dtype=float32")
    model.head.kernel.value = w
    graphdef, state = nnx.split(model)  # as arguments: closed-over weights compile as constants
    got = float(jax.jit(lambda s, x: cross_entropy(nnx.merge(graphdef, s), x, y))(state, x))
    assert abs(got / want - 1) < tol, (fp8, got, want)


@pytest.mark.slow
@pytest.mark.parametrize("path", [RECORD, SPEEDRUN])
def test_synthetic_ids_index_the_tables(path):
  """The record's 50,257-row tables under a 50,304 (50,432) row head: synthetic ids stay below
  the tables' rows (ids up to the head's rows gathered NaN rows: loss NaN at step 0)."""
  run = wiring.prepare(path, [
      "model.num_layers=2", "model.d_model=64", "model.num_heads=1", "model.head_dim=64",
      "model.mlp_dim=128", "model.align=0", "train.seq_len=4096", "train.batch_size=1",
      "attention.window=512", "data.source=synthetic", "train.loss_chunk=0", "model.remat=none",
      "mesh.fsdp=1"], devices=jax.devices()[:1])
  assert (run.cfg.model.embed_rows, run.cfg.model.vocab_size) in ((50257, 50304), (50257, 50432))
  batch = next(run.train_iter())
  assert batch["inputs"].max() < 50257 and batch["inputs"].max() > 50000
  step = trainer.make_train_step(run, *window_schedule.step_stage(run.cfg, 0))
  _, metrics = step(run.init_state(), trainer.global_batch(run, batch))
  assert np.isfinite(float(metrics["loss"]))


def test_eval_windows_are_the_records():
  """Validation after each of the record's 1,770 steps on rows of 262,144 tokens uses the
  record's windows: get_window_size_blocks(step) = next_multiple_of_n(1728 step / 1770, 128) / 128
  blocks for long layers, half for short ones (its block mask keeps at least the query's block)."""
  cfg = wiring.finalize(wiring.load(RECORD), jax.devices())
  assert cfg.train.eval_seq_len == 262144 and cfg.train.eval_windows == "step"
  for step in range(cfg.train.steps + 1):
    blocks = max(1, -(-1728 * step // (1770 * 128)))  # ceil(1728 step / 1770 / 128), >= 1
    want = tuple(128 * (blocks if c == "L" else max(1, blocks // 2)) for c in "LSSSLSSLSSSL")
    assert window_schedule.eval_windows(cfg, step) == want, step
    if step < cfg.train.steps:
      assert window_schedule.step_windows(cfg, step) == want, step


@pytest.mark.torch
def test_rotary_angles_at_validation_length():
  """The record's rotary table (built in float32 by torch: linspace, pow, positions times
  frequencies) at all 262,144 validation positions: nanotext's frequencies are the same float32
  numbers, so the angles are too; cos and sin of angles up to 2.6e5 rad within float32 rounding."""
  import torch
  K, T = 128, 4 * 64 * 1024
  freq_rec = ((1 / 1024) ** torch.linspace(0, 1, steps=K // 4, dtype=torch.float32)).numpy()
  freq = rope_frequencies(K, 1024.0, True).astype(np.float32)
  assert np.array_equal(freq[:K // 4], freq_rec) and not freq[K // 4:].any()
  theta = (torch.arange(T, dtype=torch.float32)[:, None] * torch.from_numpy(freq_rec)).numpy()
  ours = np.asarray(jnp.arange(T, dtype=jnp.float32)[:, None] * jnp.asarray(freq[:K // 4]))
  assert np.array_equal(ours, theta)
  exact = np.cos(theta.astype(np.float64))
  assert np.abs(np.asarray(jnp.cos(jnp.asarray(theta)), np.float64) - exact).max() < 1e-6
