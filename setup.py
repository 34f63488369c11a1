"""mtrain: a Megatron-core-native RL trainer with embedded SGLang.

`kernels/` and `converters/` are top-level folders that import as `mtrain.kernels` and
`mtrain.converters` through the symbolic links `mtrain/kernels` and `mtrain/converters`, so a plain
checkout imports exactly as an installed copy does (a top-level `kernels` package would collide with
the `kernels` package that newer SGLang and transformers import).
"""
from setuptools import setup

setup(
    name="mtrain",
    version="0.1.0",
    python_requires=">=3.12",  # megatron-core 0.19 needs 3.12
    packages=[
        "mtrain", "mtrain.layouts", "mtrain.reshard", "mtrain.rollout", "mtrain.models",
        "mtrain.algorithms", "mtrain.data", "mtrain.compat", "mtrain.trainer", "mtrain.tools", "mtrain.rollout.agents",
        "mtrain.serve", "mtrain.kernels", "mtrain.converters",
    ],
    package_data={"mtrain": ["configs/*.yaml"]},
    install_requires=[
        # torch itself is chosen by an extra: `cpu` pins the version; the README's install adds PyTorch's CPU
        # index, where `torch==2.13.0` resolves to 2.13.0+cpu (CI, laptops). On a GPU box the site's CUDA torch is
        # used as it is (BUILD.md). megatron-core 0.19.2 needs torch>=2.6.
        "megatron-core==0.19.2",
        "transformers==5.12.1",  # the version SGLang 0.5.17 pins; the GPU bundle carries the same
        "safetensors>=0.4",
        "sentencepiece>=0.2",
        "gguf>=0.10",
        "accelerate>=1.0",
        "psutil>=5.9",  # megatron dist checkpointing needs it
        "pyyaml>=6.0",
        "tqdm>=4.60",
        "einops>=0.7",
        "numpy>=1.26",
        "bm25s>=0.2",  # the retrieval tool (mtrain/tools/retrieval.py)
    ],
    extras_require={
        "cpu": ["torch==2.13.0", "triton>=3.3"],
        "test": ["pytest>=8", "pyarrow>=15", "matplotlib>=3.8", "fastapi>=0.110", "uvicorn>=0.29", "openai>=1.40", "httpx>=0.27",
                 "math-verify>=0.7", "datasets>=2.18", "wandb>=0.17", "peft>=0.17"],
        # the OpenAI front (mtrain.serve) and agents written against the openai client; sglang brings them too
        "server": ["fastapi>=0.110", "uvicorn>=0.29", "openai>=1.40"],
        "gpu": ["sglang==0.5.17"],
        "tensorboard": ["tensorboard>=2.14"],  # metrics also to TensorBoard (train.log_tensorboard; jsonl always)
        "math": ["math-verify>=0.7"],  # reward.fn = mtrain.data.rewards:math_verify_reward
        "datasets": ["datasets>=2.18"],  # data.train_path = a save_to_disk folder
        "wandb": ["wandb>=0.17"],  # train.log_wandb
    },
    entry_points={
        "console_scripts": [
            "mtrain=mtrain.__main__:main",
            "mtrain-convert=mtrain.converters.__main__:main",
        ]
    },
)
