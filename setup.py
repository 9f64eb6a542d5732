from setuptools import setup

setup(
    name="vlrl",
    version="0.1.0",
    description="Reinforcement learning (GRPO) and SFT for vision-language models in one torchrun trainer",
    python_requires=">=3.10",
    packages=["grpo", "models", "models.families", "rollout", "data", "tools"],
    py_modules=["train"],
    install_requires=[
        "torch>=2.11,<2.14",
        "transformers>=5.5,<6",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "pillow>=10",
        "pyarrow>=15",
        "pyyaml>=6",
        "omegaconf>=2.4",
        "numpy>=1.26",
        "sympy>=1.12",
        # geo3k reward: mathruler's normalization rules (EasyR1's scorer); it imports pylatexenc
        # and tqdm without declaring them. Its sympy step is replaced (data/mathparse.py).
        "mathruler==0.1.0",
        "pylatexenc>=2.10",
        "tqdm>=4",
        "tensorboard>=2.15",
        # video decoding (data/video.py); the wheel bundles FFmpeg (about 36 MB)
        "av>=12",
    ],
    extras_require={
        "vllm": ["vllm>=0.26.0"],
        # Qwen3.5's Gated DeltaNet in training on CUDA: flash-linear-attention's varlen Triton kernels
        "fla": ["fla-core>=0.6.0"],
        # model.liger_kernel (auto: on for Qwen2.5-VL on CUDA when installed): fused RMSNorm, rotary and SwiGLU (Triton)
        "liger": ["liger-kernel>=0.8"],
        "dev": ["pytest>=8"],
        # experiment trackers for logging.backends (grpo/trackers.py); not needed by the tests
        "wandb": ["wandb>=0.17"],
        "mlflow": ["mlflow>=2.14"],
    },
)
