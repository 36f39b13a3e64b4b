"""One request's KV moved P→D between two processes of one host: host-local against the byte stream.

    python bench/transfer.py --kv [--kv-shape 32,32,128] [--kv-tokens 2048] [--kv-dtype bfloat16]
                                 [--device cpu|cuda:0] [--quick]

An owner process holds a request's KV as the prefill exports it: one buffer per group of 4 layers,
[layers, 2, blocks, block size, kv heads, head dim] (default: llava-1.5-7b's 32 layers, 32 KV heads
of 128, bfloat16, 2,048 tokens: 1 GiB), on `--device`. This process, the decoder, pulls every group
at once (`pull_many`) into buffers of its own on the same device, as decode's import does. Each
sample publishes the KV afresh first (not timed), since a request's KV is pulled once: a GPU
tensor is shared (host-local) or moved to host memory (stream) anew, a CPU one copied into a memfd
anew. Per backend (TCP, and UCX where it loads), two paths:

- stream: the puller asks for the bytes (`host_local=False`): they cross the transport, from host
  memory (a GPU tensor is first copied there) and, on a GPU, up to the device again;
- host_local: the puller copies straight from the owner's memory (memfd; CUDA IPC on a GPU). A
  UCX puller takes CPU tensors this way only when asked (`host_local_cpu`, as here): UCX's own
  shared memory pipelines the owner's and the puller's copies, which a memfd makes in turn.

A table goes to stdout; the last line is one JSON object.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass

import torch

from common.protocol.tensors import DTYPE_SIZES, torch_dtype
from common.transfer import TransferConfig, TransferPath, create_backend, ucx_available
from common.transfer.testing import OwnerProcess, TensorSpec, make_tensor, same_bytes

PATHS = {"stream": False, "host_local": True}


@dataclass(frozen=True)
class KvShape:
    layers: int = 32
    kv_heads: int = 32
    head_dim: int = 128
    tokens: int = 2048
    dtype: str = "bfloat16"
    block_size: int = 16
    group: int = 4  # layers per transfer (TRIDENT_KV_LAYER_GROUP)

    @classmethod
    def parse(cls, shape: str, tokens: int, dtype: str) -> KvShape:
        layers, heads, dim = (int(x) for x in shape.split(","))
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"--kv-dtype: one of {sorted(DTYPE_SIZES)}")
        return cls(layers, heads, dim, tokens, dtype)

    def specs(self, device: str) -> list[TensorSpec]:
        blocks = math.ceil(self.tokens / self.block_size)
        sizes = [min(self.group, self.layers - start) for start in range(0, self.layers, self.group)]
        tail = (2, blocks, self.block_size, self.kv_heads, self.head_dim)
        return [TensorSpec((n, *tail), self.dtype, 100 + i, device) for i, n in enumerate(sizes)]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s.shape) for s in self.specs("cpu")) * DTYPE_SIZES[self.dtype]

    def describe(self) -> str:
        return (
            f"{self.layers} layers x {self.kv_heads} KV heads x {self.head_dim} {self.dtype}, "
            f"{self.tokens} tokens, groups of {self.group} layers"
        )


async def time_path(backend: str, host_local: bool, shape: KvShape, device: str, repeats: int) -> dict:
    """Pull the whole KV `repeats` times (after two warm-ups), each time freshly published."""
    specs = shape.specs(device)
    owner = OwnerProcess(backend, specs)
    await asyncio.to_thread(owner.start, 300.0)
    try:
        gpu = device if device.startswith("cuda") else None
        config = TransferConfig(  # host_local_cpu: timed on UCX too (off there by default)
            backend=backend,
            timeout=300,
            host_local=host_local,
            host_local_cpu=True,
            device=gpu,  # type: ignore[arg-type]
        )
        puller = create_backend(config)
        await puller.start()
        outs = [torch.empty(s.shape, dtype=torch_dtype(s.dtype), device=device) for s in specs]
        samples, paths = [], set()
        for i in range(repeats + 2):
            handles = await asyncio.to_thread(owner.republish)
            t0 = time.perf_counter()
            pulled = await puller.pull_many(owner.address, handles, outs)
            if i >= 2:
                samples.append(time.perf_counter() - t0)
            paths |= {p.path for p in pulled}
        for out, spec in zip(outs, specs, strict=True):
            assert same_bytes(out.cpu(), make_tensor(spec)), f"{backend}: the bytes differ"
        await puller.close()
    finally:
        await asyncio.to_thread(owner.stop)
    want = TransferPath.HOST_LOCAL if host_local else TransferPath.STREAM
    assert paths == {want}, f"{backend} {'host-local' if host_local else 'stream'} pulls took {paths}"
    p50 = statistics.median(samples)
    return {"p50_ms": p50 * 1e3, "max_ms": max(samples) * 1e3, "GBps": shape.nbytes / p50 / 1e9}


def run(shape: KvShape, device: str, quick: bool) -> tuple[dict[str, dict], dict[str, object]]:
    """Every backend and path: the results by "<backend>_<path>", and the key figures."""
    repeats = 3 if quick else 10
    results: dict[str, dict] = {}
    for backend in (["ucx"] if ucx_available() else []) + ["tcp"]:
        for path, host_local in PATHS.items():
            results[f"{backend}_{path}"] = asyncio.run(time_path(backend, host_local, shape, device, repeats))
    figures: dict[str, object] = {"kv_bytes": shape.nbytes, "kv_shape": shape.describe(), "device": device}
    for name, r in results.items():
        figures[f"{name}_p50_ms"] = round(r["p50_ms"], 3)
        figures[f"{name}_GBps"] = round(r["GBps"], 2)
    for backend in {name.split("_")[0] for name in results}:
        stream, local = results[f"{backend}_stream"], results[f"{backend}_host_local"]
        figures[f"{backend}_host_local_speedup"] = round(stream["p50_ms"] / local["p50_ms"], 2)
    return results, figures


def table(results: dict[str, dict], shape: KvShape) -> str:
    lines = [
        f"KV of one request: {shape.describe()} = {shape.nbytes / 2**20:.0f} MiB",
        "| backend | path | p50 ms | max ms | GB/s (at p50) |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        backend, _, path = name.partition("_")
        lines.append(f"| {backend} | {path} | {r['p50_ms']:.2f} | {r['max_ms']:.2f} | {r['GBps']:.2f} |")
    return "\n".join(lines)
