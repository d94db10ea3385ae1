"""flax.nnx model family."""

from nanotext.model.gpt import GPT, count_params

__all__ = ["GPT", "count_params"]
