"""How Trident's workers run on NVIDIA GPUs, said once: what bench/gpu_serve.py runs on a GPU and
checks, and what compose.gpu.yaml and `trident kubernetes --gpu` deploy (tests/test_gpu_deploy.py
holds the three equal).

Device selection: every worker computes on `cuda` (the first GPU its container or process sees),
one GPU reserved per worker. Where the instances of a method share one GPU — bench/gpu_serve.py's
single-GPU machine, compose's `count: 1` on a one-GPU host, Kubernetes nodes that time-slice a GPU —
each holds its kind's share of that GPU's memory (TRIDENT_GPU_MEMORY_SHARE): weights, KV cache
and working memory together, so that processes starting at once cannot take each other's memory.
Transfers take the worker's default path (`auto`); the check records the path each worker took.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from common.planner.types import METHOD_KINDS
from common.roles import InstanceKind

DEVICE = "cuda"
GPUS_PER_INSTANCE = 1  # compose's device count, Kubernetes' nvidia.com/gpu
TRANSFER = "auto"
# Shares of one GPU's memory, for one instance of each kind of a method on it: every method's sum is
# 0.95, the rest left to the CUDA contexts (each process's own, outside torch's allocator). An
# encoder holds the vision tower alone (no KV cache); prefill and decode a language model and KV each.
MEMORY_SHARES: Mapping[InstanceKind, float] = MappingProxyType({
    InstanceKind.E: 0.08,
    InstanceKind.P: 0.42,
    InstanceKind.D: 0.45,
    InstanceKind.EP: 0.5,
    InstanceKind.ED: 0.53,
    InstanceKind.EPD: 0.95,
})  # fmt: skip


def memory_share_setting() -> str:
    """TRIDENT_GPU_MEMORY_SHARE's value: every kind's share (services/settings.py reads it)."""
    return ",".join(f"{kind.value}={share:g}" for kind, share in MEMORY_SHARES.items())


def worker_env() -> dict[str, str]:
    """The environment every GPU worker gets, whatever its kind: each picks its own share."""
    return {
        "TRIDENT_DEVICE": DEVICE,
        "TRIDENT_TRANSFER": TRANSFER,
        "TRIDENT_GPU_MEMORY_SHARE": memory_share_setting(),
    }


def method_share(method: str) -> float:
    """What one instance of each kind of `method` holds of the GPU together."""
    return round(sum(MEMORY_SHARES[kind] for kind in METHOD_KINDS[method]), 6)
