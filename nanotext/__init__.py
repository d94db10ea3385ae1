"""nanotext: a small, config-driven JAX framework for pretraining GPT-style language models."""

__version__ = "0.1.0"
