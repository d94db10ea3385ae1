"""nanotext: config-driven GPT pretraining in JAX.

`pip install -e .` installs what training needs (no torch, no CUDA); `pip install -e '.[test]'`
adds the test suite's needs (torch and transformers for the conversion tests, matplotlib, TFDS).
"""

from setuptools import find_packages, setup

setup(
    name="nanotext",
    version="0.1.0",
    description="A small, config-driven JAX framework for pretraining GPT-style language models",
    python_requires=">=3.10",
    packages=find_packages(include=["nanotext", "nanotext.*"]),
    package_data={"nanotext.data": ["shakespeare/*.md", "shakespeare/*.txt", "shakespeare/*.tsv",
                                    "shakespeare/*.json", "shakespeare/texts/*.txt.gz"]},
    # Only what `python -m nanotext.train` and the converters need on the default paths.
    install_requires=[
        "jax>=0.7",
        "flax>=0.12.0",
        "optax>=0.2.6",
        "orbax-checkpoint>=0.11.20",
        "grain>=0.2.12",
        "ml-collections>=1.0",
        "absl-py>=2.0",
        "pyyaml>=6.0",
        "tokenizers>=0.20",
        "safetensors>=0.4",
        "tensorboardX>=2.6",
        "numpy>=1.26",
    ],
    extras_require={
        # data.source=tfds (pulls pyarrow, about 150 MB)
        "tfds": ["tensorflow-datasets>=4.9.9"],
        # python -m nanotext.data.fineweb and data.tokenizer=gpt2
        "fineweb": ["huggingface_hub>=0.24", "tiktoken>=0.7"],
        "gpt2": ["tiktoken>=0.7"],
        "plots": ["matplotlib>=3.8"],
        # python -m nanotext.compile: libtpu compiles for TPU slices on any machine. jax[tpu] at
        # the jax version nanotext is tested with pins the libtpu built for it (0.10.2 ->
        # libtpu 0.0.42.1); move both together.
        "tpu": ["jax[tpu]==0.10.2"],
        # python -m nanotext.compile --topology=h100: XLA's GPU compiler as the jax CUDA plugin, at
        # the installed jax's version (no CUDA runtime, driver or GPU needed to compile; about
        # 400 MB installed). Move with jax, as the tpu extra.
        "gpu-compile": ["jax-cuda13-plugin==0.10.2", "jax-cuda13-pjrt==0.10.2"],
        # The test suite: torch and transformers check the HF conversions, and every optional
        # path above is tested. Where a CUDA build of torch is not wanted, install a CPU one first.
        # pytest-xdist runs the suite in two workers (README's Tests); pyflakes checks that no
        # file has an unused import or an undefined name (tests/test_layout.py). ml_dtypes 0.7.0
        # takes 0.42 s to import (0.006 s for 0.6.0), in each of the hundreds of processes the
        # suite starts: about 100 s of its CPU (benchmarks/RESULTS.md, "Test suite time"); jax
        # needs >= 0.5, and nanotext runs on 0.7 as well.
        "test": ["pytest>=8", "pytest-xdist>=3.8", "torch", "transformers", "matplotlib>=3.8",
                 "tensorflow-datasets>=4.9.9", "huggingface_hub>=0.24", "ml_dtypes<0.7",
                 "pyflakes>=3"],
    },
)
