"""Next-token cross-entropy of a model, whole or in sequence chunks that never hold [B, T, V]
logits at once: `loss_fn` (what the train and eval steps and the memory estimate trace)."""

import jax
import jax.numpy as jnp
from flax import nnx

from nanotext import sharding, window_schedule
from nanotext.errors import UserError
from nanotext.model.kernels.masks import segment_ids_from_tokens


def check_config(t) -> None:
  """The train section's loss chunks divide the rows they cut (train.loss_chunk the training
  rows, train.eval_loss_chunk the validation rows)."""
  # Every training row length: train.seq_len's first, then the sequence-length warmup's shorter
  # ones (validation rows keep their length).
  for n in reversed(window_schedule.seq_lens(t)):
    if not 0 < t.loss_chunk < n or n % t.loss_chunk == 0:
      continue
    if n == t.seq_len:
      raise UserError(f"train.loss_chunk={t.loss_chunk} does not divide train.seq_len={n}")
    raise UserError(f"train.loss_chunk={t.loss_chunk} does not divide the {n}-token rows of "
                    f"the sequence-length warmup (train.seq_len_start={t.seq_len_start}, "
                    f"train.seq_len_step={t.seq_len_step}): pick a chunk dividing every row length")
  eval_len = t.eval_seq_len or t.seq_len
  if 0 < t.eval_loss_chunk < eval_len and eval_len % t.eval_loss_chunk:
    raise UserError(f"train.eval_loss_chunk={t.eval_loss_chunk} does not divide the validation "
                    f"rows' {eval_len} tokens (train.eval_seq_len, or train.seq_len if 0)")


def loss_fn(graphdef, params, inputs_BT, targets_BT, eot_id=None, windows=None, chunk=0,
            train=True, per_row=False, runtime_windows=None):
  """Next-token cross-entropy (the mean; with `per_row`, each row's sum averaged over rows);
  with `eot_id`, attention stays within documents.

  `windows`: per-layer sliding windows (static ints) of one schedule stage; None = the final ones.
  `runtime_windows`: int32 [layers], the windows applied (`windows` then their static bounds).
  `chunk`: train.loss_chunk (0 = the whole sequence's logits at once). `train=False`: evaluation
  (no FP8 head).
  """
  segments_BT = None if eot_id is None else segment_ids_from_tokens(inputs_BT, eot_id)
  model = nnx.merge(graphdef, params)
  x_BTD = model.hidden(inputs_BT, segments_BT, windows, runtime_windows)
  with jax.named_scope("loss"):
    return cross_entropy(model, x_BTD, targets_BT, chunk, train, per_row)


def cross_entropy(model, x_BTD, targets_BT, chunk: int = 0, train: bool = True,
                  per_row: bool = False):
  """Cross-entropy of the model's logits of x_BTD against targets (`model.loss_sum`, the head
  fused with the loss; `train=False`: the evaluation head): the summed token loss
  divided by the tokens (the mean), or with `per_row` by the rows (each row's summed loss,
  averaged over rows: train.loss_reduction=row_sum, the record's reduction='sum' on one row per
  GPU). The head learns that divisor, so its FP8 gradient scale follows the reduction.

  With 0 < `chunk` < T the positions are taken `chunk` at a time (every row at once, so the batch
  stays sharded): each chunk's float32 logits live only inside a rematerialised scan step, and the
  backward pass recomputes them chunk by chunk. Peak loss memory is then [B, chunk, V] instead of
  the logits, their soft-cap and their gradient at [B, T, V] each. Same value and gradients as the
  whole-sequence loss up to float32 summation order.
  """
  B, T, D = x_BTD.shape
  denominator = B if per_row else B * T
  if chunk <= 0 or chunk >= T:  # 0 = whole rows (-1 = auto, unresolved outside a run: whole)
    return model.loss_sum(x_BTD, targets_BT, denominator, train) / denominator
  n = T // chunk
  x_NBCD = sharding.constrain(x_BTD.reshape(B, n, chunk, D).swapaxes(0, 1),
                              (None, "batch", "act_length", "act_embed"))
  y_NBC = targets_BT.reshape(B, n, chunk).swapaxes(0, 1)
  # The head weight as the head's matmuls read it (an FP8 head's e4m3 codes, else the weight in
  # the model dtype), made and gathered (FSDP) once, before the loop. Read inside it, the weight
  # was gathered again in each chunk (the record's eval on v6e-8: 1,024 gathers, 83 GiB a step)
  # and twice in each chunk of the backward pass; made inside it, an FP8 head's weight was
  # gathered in float32 and quantized again in each chunk of the backward pass. The float weight
  # is what is differentiated: its gradient summed whole over the chunks, reduced once.
  w_DV, b_DV = model.loss_weight(train, gather=True)
  w_DV = sharding.constrain(w_DV, (None, "vocab"))

  @jax.checkpoint  # keep only the chunk's inputs; its logits are recomputed in the backward pass
  def chunk_sum(x_BCD, y_BC, w_DV, b_DV):
    # Read with the chunk's rows through a barrier, the FP8 dequantize stays beside its GEMM in
    # the loop: hoisted out of it, a GPU's forward head GEMMs ran in float32, on operands XLA had
    # left unrounded.
    x_BCD, b_DV = jax.lax.optimization_barrier((x_BCD, b_DV))
    return model.loss_sum(x_BCD, y_BC, denominator, train, (w_DV, b_DV))

  def body(total, xy):
    return total + chunk_sum(*xy, w_DV, b_DV), None
  total, _ = jax.lax.scan(body, jnp.zeros([], jnp.float32), (x_NBCD, y_NBC))
  return total / denominator
