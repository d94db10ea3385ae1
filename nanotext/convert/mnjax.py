"""modded-nanogpt-jax (train.py at a9d3e04) parameters -> nanotext params of
configs/modded_nanogpt_jax.yml, so both can start from the same weights.

The port's tree: wte [V, D]; lm_head [D, V]; skip_weights [L/2]; h[i] with attn.c_qkv
[3*D, D] ([out, in]), attn.c_proj [D, D] ([in, out]), attn.lamb and attn.scale (scalars),
mlp.c_fc [D, 4D], mlp.c_proj [4D, D], lambdas [2]; flat names like "h.0.attn.c_qkv".

One difference is a relabelling, not a change of function: the port rotates each RoPE pair
(x1, x2) by +theta, nanotext by -theta. Negating the second half of every head's q and k
features (rows of c_qkv) turns one into the other exactly (QK-norm commutes with the sign), and
Muon and Adam updates commute with it bit for bit, so training follows the same path.
"""

import numpy as np

from nanotext.errors import UserError


def flip_rope_halves(c_qkv, num_heads: int, head_dim: int):
  """c_qkv [3*H*K, D] with the second half of each head's q and k rows negated."""
  w = np.array(c_qkv, copy=True).reshape(3, num_heads, head_dim, -1)
  w[:2, :, head_dim // 2:] *= -1
  return w.reshape(c_qkv.shape)


def params_from_port(flat: dict, model_cfg) -> dict:
  """{nanotext parameter name: array} (a GPT with fused_qkv, value_residual, attn_scale_learned)
  from the port's parameters as `trees.flatten` names them; `trees.fill`
  places them into a run's parameter tree, checking every name and shape."""
  m = model_cfg
  if not (m.fused_qkv and m.value_residual and m.attn_scale_learned and m.unet_skips):
    raise UserError("modded-nanogpt-jax weights need model.fused_qkv, value_residual, "
                    "attn_scale_learned and unet_skips (configs/modded_nanogpt_jax.yml)")
  vec = lambda x: np.asarray(x).reshape(-1)  # the port's scalars are 0-d, nanotext's [1]
  out = {"embed.embedding": flat["wte"], "skip_weights": flat["skip_weights"],
         "head.kernel": flat["lm_head"]}
  for i in range(m.num_layers):
    port, ours = f"h.{i}.", f"blocks.{i}."
    out.update({
        ours + "attn.qkv": flip_rope_halves(flat[port + "attn.c_qkv"], m.num_heads, m.head_dim),
        ours + "attn.o.kernel": flat[port + "attn.c_proj"],
        ours + "attn.v_residual": vec(flat[port + "attn.lamb"]),
        ours + "attn.scale_param": vec(flat[port + "attn.scale"]),
        ours + "mlp.fc.kernel": flat[port + "mlp.c_fc"],
        ours + "mlp.proj.kernel": flat[port + "mlp.c_proj"],
        ours + "lambdas": flat[port + "lambdas"]})
  return out
