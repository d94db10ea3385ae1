"""Next-token cross-entropy, whole or in sequence chunks that never hold [B, T, V] logits at once."""

import jax
import jax.numpy as jnp

from nanotext import sharding


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

  @jax.checkpoint  # keep only the chunk's inputs; its logits are recomputed in the backward pass
  def chunk_sum(x_BCD, y_BC):
    return model.loss_sum(x_BCD, y_BC, denominator, train)

  def body(total, xy):
    return total + chunk_sum(*xy), None
  total, _ = jax.lax.scan(body, jnp.zeros([], jnp.float32), (x_NBCD, y_NBC))
  return total / denominator
