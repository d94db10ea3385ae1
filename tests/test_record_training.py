"""Several training steps of the record recipe equal to the record's, step by step.

The reference is benchmarks/record_torch.py: modded-nanogpt train_gpt.py (587b45fb) re-derived in
PyTorch (model, Muon with its Newton-Schulz, the Adam groups, lr / momentum / window schedules,
the row-sum loss, the FP8 head emulated). nanotext runs configs/speedrun_record.yml at the record's
12 layers and 128-wide heads, 128 wide, on one device, one row per step (the record's per-GPU
work). nanotext first trains 4 steps from its init, so no weight is at its zero init (the head
and the projections start at zero, which makes a first step blind to most of the network); both
then start from those weights (export-torch's mapping) with fresh optimizers at step 0 and train
on the same rows, documents separated by an end-of-text token.

Value embeddings (issue 18 saw the value tables 3e-4 apart after one step): in float32 they agree
like everything else (1e-5). In the record's bf16 recipe an Adam first step is lr * g / (|g| +
eps), about +-lr for every entry with a gradient, so an entry whose gradient is below the two
implementations' bf16 rounding can take the other sign (and land 2 lr = 1.2 away), or sum to
exactly zero on one side only (no step there: lr = 0.6 apart). Measured at a 2,048-token row:
0.3% of the value-table entries, with gradients ~100x below the median; the record's own float32
and bf16 recipes differ from each other in the same way and by as much, and Adam on the head
does the same (2 x 0.22). Not a defect of either side: the bf16 test pins that every difference
after the first step is a rounding or such a whole step.
"""

import os
import sys

import numpy as np
import pytest

from conftest import REPO, extra

torch = extra("torch")  # the record reference is written in PyTorch
pytestmark = pytest.mark.torch
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
import learning_check as lc  # noqa: E402
import record_torch as rt  # noqa: E402

EOT = 0
DIMS = ["model.d_model=128", "model.num_heads=1", "model.head_dim=128", "model.mlp_dim=512",
        "model.vocab_size=256", "model.embed_rows=250", "model.align=0", "train.batch_size=1",
        "data.source=synthetic", "data.tokenizer=none", f"data.eot_id={EOT}",
        "train.eval_every=0", "train.eval_seq_len=0"]
FLOAT32 = ["model.dtype=float32", "model.embed_dtype=float32", "optim.muon_bf16=false",
           "model.fp8_head=false"]
# Float32: 12 steps of a 75-step schedule on 2,048-token rows: windows of 1 block, then 2.
WARM, STEPS, N, T = 4, 12, 75, 2048
# bf16 recipe: 10 steps of the real shape's 150-step schedule on 4,096-token rows.
BF16_STEPS, BF16_N, BF16_T = 10, 150, 4096


def markov_rows(n: int, T: int, seed: int) -> list:
  """`n` one-row batches of T tokens: a random Markov chain (3 successors per token) over ids
  1..249, with an end-of-text token starting a new document about every 400 tokens."""
  rng = np.random.default_rng(seed)
  successors = rng.integers(1, 250, size=(250, 3))
  out = []
  for _ in range(n):
    toks = np.zeros(T + 1, np.int32)
    choice, new_doc = rng.integers(0, 3, T + 1), rng.random(T + 1) < 1 / 400
    for i in range(1, T + 1):
      toks[i] = EOT if new_doc[i] else successors[toks[i - 1], choice[i]]
    out.append({"inputs": toks[None, :-1], "targets": toks[None, 1:]})
  return out


def rel(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def rel_all(got: dict, want: dict) -> float:
  """Relative distance of two state dicts taken as one vector."""
  num = sum(np.sum((got[k].astype(np.float64) - want[k]) ** 2) for k in want)
  return float(np.sqrt(num / sum(np.sum(want[k].astype(np.float64) ** 2) for k in want)))


@pytest.mark.fast
def test_schedules_are_the_records():
  """lr, Muon momentum and long window of every step, nanotext against the reference."""
  from nanotext import optim, wiring
  from nanotext.window_schedule import long_window
  cfg = wiring.load(lc.CONFIG, [])
  momentum = optim.muon_momentum(cfg.optim)
  for n in (12, 13, N, BF16_N, 1770):
    lr = optim.lr_factor(cfg.optim, n, xp=np)
    steps = range(n)
    assert [long_window(cfg.attention, s, n) // 128 for s in steps] == \
        [rt.window_blocks(s, n) for s in steps]
    np.testing.assert_allclose([lr(s) for s in steps], [rt.lr_factor(s, n) for s in steps],
                               rtol=1e-6)
    np.testing.assert_allclose([momentum(s) for s in steps], [rt.muon_momentum(s) for s in steps],
                               rtol=1e-6)
  assert {rt.window_blocks(s, N) for s in range(STEPS)} == {1, 2}  # both sizes run below


@pytest.mark.parametrize("path", ["logits", "loss_sum"])
def test_fp8_head_computes_the_records_codes(path):
  """nanotext's FP8 head at train (model.logits and the fused model.loss_sum the train step
  uses) against the record's, one 4,096-token row with the summed loss: loss, gradient into the
  network and head gradient (record scale)."""
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx
  run = lc.make_run(lc.CONFIG, DIMS + ["model.num_layers=2", "train.seq_len=4096"])
  graphdef, params = nnx.split(run.create_model())
  T, d, V = 4096, 128, 256
  rng = np.random.default_rng(0)
  x = rng.standard_normal((T, d)).astype(np.float32)
  x = np.asarray(jnp.asarray(x / np.sqrt((x ** 2).mean(-1, keepdims=True)), jnp.bfloat16))
  head = (0.4 * rng.standard_normal((d, V))).astype(np.float32)
  targets = rng.integers(0, 250, T)
  params["head"]["kernel"].value = jnp.asarray(head)

  def loss(params, x):
    model = nnx.merge(graphdef, params)
    if path == "loss_sum":
      return model.loss_sum(x[None], jnp.asarray(targets)[None], loss_denominator=1)
    logits = model.logits(x[None], loss_denominator=1)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets[None]).sum()
  ours, (g_params, g_x) = jax.value_and_grad(loss, argnums=(0, 1))(params, jnp.asarray(x))
  ref = rt.RecordGPT(250, d, 1e-7, dtype=torch.bfloat16, fp8_head=True)
  ref.lm_head.weight.data = torch.tensor(head.T * np.float32(np.sqrt(d)))
  x_t = torch.tensor(np.asarray(x, np.float32)).bfloat16().requires_grad_()
  theirs = torch.nn.functional.cross_entropy(ref.logits(x_t), torch.tensor(targets),
                                             reduction="sum")
  theirs.backward()
  # Measured: 8e-8, 1.2e-4 and 1.0e-4. Rounding the head's output and its gradient to bf16 in
  # nanotext's scale (sqrt(d) times smaller), as before, changed 1.3% of the gradient's e5m2
  # codes: 2e-5, 1.6e-2 and 1.4e-2.
  assert float(ours) == pytest.approx(theirs.item(), rel=1e-5)
  assert rel(np.asarray(g_x, np.float32), x_t.grad.float().numpy()) < 1e-3
  g_head = np.asarray(g_params["head"]["kernel"].value).T / np.sqrt(d)
  assert rel(g_head, ref.lm_head.weight.grad.numpy()) < 1e-3


@pytest.fixture(scope="module")
def warm():
  """(float32 run, its compiled programs, params trained WARM steps, the STEPS rows to come)."""
  run = lc.make_run(lc.CONFIG, DIMS + FLOAT32 + [f"train.seq_len={T}", f"train.steps={N}"])
  rows = markov_rows(WARM + STEPS, T, seed=0)
  state = run.init_state()
  execs = lc.compile_nanotext(run, state, rows[WARM:])  # steps 0..WARM-1 use the first program
  state, _ = lc.train_nanotext(run, state, rows[:WARM], execs)
  return run, execs, lc.host_params(state), rows[WARM:]


@pytest.mark.slow
def test_float32_steps_equal_the_records(warm):
  run, execs, params, rows = warm
  start = lc.torch_state(run, params)
  state, ours = lc.train_nanotext(run, run.state_from_params(params), rows, execs)
  model, opt = lc.make_reference(run, start, dtype="float32", fp8_head=False, ns_dtype="float32")
  theirs = lc.train_reference(run, model, opt, rows)
  print(lc.table({"nanotext": ours, "record (torch)": theirs}, "record (torch)", 0))
  # Measured: 1e-7 at most (float32 round-off), the loss going 1.74 -> 2.17 (the fresh
  # optimizer's first steps) -> 1.30.
  np.testing.assert_allclose(ours, theirs, rtol=1e-4)
  assert theirs[-1] < theirs[0]
  got, want = lc.torch_state(run, lc.host_params(state)), lc.reference_params(model)
  for name in want:
    # Measured: 3.8e-5 at most (attention projections), while the matrices moved 50-100%.
    assert rel(got[name], want[name]) < 1e-3, name
  for name in [k for k in want if "embed" in k]:
    # No entry a whole Adam step apart in float32 (a sign flip puts one 2 lr = 1.2 away):
    # measured 2.2e-5 relative, 4.8e-3 at most for an entry (a gradient near zero, which Adam's
    # normalisation makes sensitive to round-off; the fused loss sums in its own order).
    assert rel(got[name], want[name]) < 1e-4, name
    assert np.abs(got[name] - want[name]).max() < 0.05, name
  assert rel(want["blocks.0.attn.c_proj.weight"], start["blocks.0.attn.c_proj.weight"]) > 0.1


@pytest.mark.slow
def test_bf16_recipe_and_fp8_head_track_the_record(warm):
  """The record's recipe (bf16 tables and activations, bf16 Newton-Schulz) with the FP8 head and
  with the bf16 head, at 4,096-token rows: each run against the reference with the same head."""
  params32, rows = warm[2], markov_rows(BF16_STEPS, BF16_T, seed=1)
  runs = {}
  for fp8 in (True, False):
    run = lc.make_run(lc.CONFIG, DIMS + [f"train.seq_len={BF16_T}", f"train.steps={BF16_N}",
                                         f"model.fp8_head={str(fp8).lower()}"])
    params = lc.as_run_dtypes(run, params32)
    start = lc.torch_state(run, params)
    after1 = {}  # both sides' parameters after the first step

    def ours_after(step, st, run=run):
      if step == 0:
        after1["ours"] = lc.torch_state(run, lc.host_params(st))

    def theirs_after(step, model):
      if step == 0:
        after1["theirs"] = lc.reference_params(model)

    state, ours = lc.train_nanotext(run, run.state_from_params(params), rows,
                                    after_step=ours_after)
    model, opt = lc.make_reference(run, start, dtype="bfloat16", fp8_head=fp8)
    theirs = lc.train_reference(run, model, opt, rows, after_step=theirs_after)
    runs[fp8] = dict(ours=ours, theirs=theirs, after1=after1, start=start,
                     got=lc.torch_state(run, lc.host_params(state)),
                     want=lc.reference_params(model))
  fp8, bf16 = runs[True], runs[False]
  print(lc.table({"nanotext FP8": fp8["ours"], "record FP8": fp8["theirs"],
                  "nanotext bf16 head": bf16["ours"], "record bf16 head": bf16["theirs"]},
                 "record FP8", 0))
  off = {k: np.abs(np.subtract(r["ours"], r["theirs"])) / r["theirs"] for k, r in runs.items()}
  rms = lambda x: float(np.sqrt(np.mean(np.square(x))))
  fp8_effect = np.abs(np.subtract(fp8["theirs"], bf16["theirs"])) / bf16["theirs"]
  shift = rel_all(fp8["want"], bf16["want"])
  params_off = {k: rel_all(r["got"], r["want"]) for k, r in runs.items()}
  print(f"|nanotext - record| / record, RMS over steps: FP8 head {rms(off[True]):.2e}, bf16 head "
        f"{rms(off[False]):.2e}; the record's FP8 vs bf16 head {rms(fp8_effect):.2e}. "
        f"Parameters: {params_off[True]:.3f} and {params_off[False]:.3f} apart, the record's "
        f"two heads {shift:.3f}")
  # bf16 noise: at most 7.7e-4 (bf16 head) and 1.3e-3 (FP8 head) measured over two sets of rows;
  # the record's own bf16 and float32 recipes differ by up to 3.7e-4. Issue 18's FP8 head was
  # 10-24% off. The FP8 head rounds the final hidden state to 3 mantissa bits, so the two sides'
  # bf16 differences upstream flip some of its e4m3 codes: it amplifies them (2.9e-5 vs 1.3e-5
  # at the first step, same weights), the head itself computing the record's codes
  # (test_fp8_head_computes_the_records_codes): RMS 6.6e-4 vs 2.4e-4 measured.
  assert off[False].max() < 1.5e-3 and off[True].max() < 3e-3
  assert rms(off[True]) < 4 * rms(off[False])
  # The record's FP8 head moves its loss from its bf16 head's by 2.2e-3 RMS (4.3e-3 at most) on
  # these rows; nanotext's FP8 head reproduces that shift to 0.30 of it (measured).
  assert rms(off[True]) < 0.5 * rms(fp8_effect)
  # Parameters after 10 steps: nanotext is closer to the record than the record's FP8 head is to
  # its bf16 head (Muon and Adam turn bf16 rounding into whole steps, so both grow with steps;
  # measured 0.50 (FP8) and 0.45 of it; the record's bf16 and float32 recipes are as far apart).
  for k in runs:
    assert params_off[k] < 0.75 * shift
  # After the first step every difference in the embedding tables is a rounding (at most two
  # bf16 ulps of the entry: the gradient's sum order and the update each round; measured one
  # entry in 32,000 two ulps apart) or a whole Adam step: lr 0.6 where one side's gradient summed to exactly zero
  # (no step) and the other's did not, 2 lr where the signs differ; such entries are rare
  # (measured 0.3%) and their gradients ~100x below the median.
  # A rounding is measured at the entry's scale before the step too: a step that cancels most of
  # an entry leaves its rounding at the old scale (on an AVX2-only AMD EPYC one value-table entry
  # came out 0.00221 here and 0.00233 in the record: 8 bf16 ulps of the result, within two of
  # the entry before the step).
  lr = rt.ADAM_LR["embed"]
  for name in [k for k in bf16["want"] if "embed" in k]:
    ours, theirs = bf16["after1"]["ours"][name], bf16["after1"]["theirs"][name]
    d = np.abs(ours - theirs)
    scale = np.maximum(np.maximum(np.abs(ours), np.abs(theirs)), np.abs(bf16["start"][name]))
    rounding = d <= 2.0 ** -6 * scale
    whole = (np.abs(d - lr) < 0.05) | (np.abs(d - 2 * lr) < 0.05)
    assert np.all(rounding | whole), name
    assert whole.mean() < 0.01, name
