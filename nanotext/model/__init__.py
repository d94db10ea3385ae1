"""flax.nnx model family."""

from nanotext.model.gpt import GPT, count_params
from nanotext.model.draws import Keys

__all__ = ["GPT", "Keys", "count_params"]
