"""nanotext: a small, config-driven JAX framework for pretraining GPT-style language models."""

__version__ = "0.1.0"

# signals registers the exit handler that must run after all others (jax's backend teardown
# among them), so it is imported before anything that imports jax.
from nanotext import signals  # noqa: E402

__all__ = ["signals"]
