"""One request's KV moved P→D between two processes of one host: host-local against the byte stream.

    python bench/transfer.py --kv [--kv-shape 32,32,128] [--kv-tokens 2048] [--kv-dtype bfloat16]
                                 [--device cpu|cuda:0] [--quick]

An owner process holds a request's KV as the prefill exports it: one buffer per group of 4 layers,
[layers, 2, blocks, block size, kv heads, head dim] (default: llava-1.5-7b's 32 layers, 32 KV heads
of 128, bfloat16, 2,048 tokens: 1 GiB), on `--device`. This process, the decoder, pulls every group
at once (`pull_many`) into a paged KV cache on the same device, its blocks shuffled, two ways:

- blocks: as decode does (services/decode/kv_sinks.py): each group written straight into the
  blocks reserved for it (`KvLanding`), on the transfer's copier threads;
- buffered: as decode did before: into pool buffers, taken out of the pool (a copy), then
  imported into the blocks (`import_ms`: what the engine's thread spent on it).

Each sample publishes the KV afresh first (not timed), since a request's KV is pulled once: a GPU
tensor is shared (host-local) or moved to host memory (stream) anew, a CPU one copied into a memfd
anew. Per backend (TCP, and UCX where it loads; `backends` picks), two paths:

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

from common.engine.kv_cache import KVCache, KVSpec
from common.engine.kv_landing import KvLanding
from common.protocol import KvGroup, KvLocation
from common.protocol.tensors import DTYPE_SIZES, torch_dtype
from common.transfer import TransferConfig, TransferPath, create_backend, ucx_available
from common.transfer.testing import OwnerProcess, TensorSpec, make_tensor, same_bytes
from services.decode import kv_sinks
from trident.bench.machine import sync

PATHS = {"stream": False, "host_local": True}
MODES = ("blocks", "buffered")


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


class Decoder:
    """A paged KV cache twice the request's size, and its blocks for the request, shuffled."""

    def __init__(self, shape: KvShape, device: str) -> None:
        blocks = math.ceil(shape.tokens / shape.block_size)
        spec = KVSpec(
            shape.layers, shape.kv_heads, shape.head_dim, shape.block_size, torch_dtype(shape.dtype)
        )
        self.cache = KVCache(spec, 2 * blocks, device)
        self.block_ids = torch.randperm(2 * blocks, generator=torch.Generator().manual_seed(0))[
            :blocks
        ].tolist()
        self.shape = shape

    def location(self, specs: list[TensorSpec], handles: list[str]) -> KvLocation:
        groups, start = [], 0
        for spec, handle in zip(specs, handles, strict=True):
            groups.append(
                KvGroup(layer_start=start, layer_end=start + spec.shape[0], handle=handle, shape=spec.shape)
            )
            start += spec.shape[0]
        return KvLocation(
            owner="bench", address="-", groups=tuple(groups), num_tokens=self.shape.tokens,
            block_size=self.shape.block_size, dtype=self.shape.dtype,
        )  # fmt: skip

    async def pull(self, puller, address: str, specs: list[TensorSpec], handles: list[str], mode: str):
        """One request's KV into the blocks; (pulls, seconds the import took on this thread)."""
        if mode == "blocks":
            landing = KvLanding("bench", self.cache, self.block_ids)
            return await puller.pull_many(
                address, handles, kv_sinks.sinks(landing, self.location(specs, handles))
            ), 0.0
        pulled = await puller.pull_many(address, handles)
        t0 = time.perf_counter()
        start = 0
        for p in pulled:
            buffer = p.take()  # out of the pool buffer, as decode's pull did
            self.cache.import_blocks(
                self.block_ids[: buffer.shape[2]], range(start, start + buffer.shape[0]), buffer
            )
            start += buffer.shape[0]
        sync(self.cache.kv.device)
        return pulled, time.perf_counter() - t0

    def holds(self, specs: list[TensorSpec]) -> bool:
        start = 0
        for spec in specs:
            layers = range(start, start + spec.shape[0])
            if not same_bytes(self.cache.export_blocks(self.block_ids, layers).cpu(), make_tensor(spec)):
                return False
            start = layers.stop
        return True


async def time_path(
    backend: str, host_local: bool, shape: KvShape, device: str, repeats: int, mode: str = "blocks"
) -> dict:
    """Pull the whole KV into the decoder's blocks `repeats` times (after two warm-ups), each time
    freshly published."""
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
        decoder = Decoder(shape, device)
        samples, imports, paths = [], [], set()
        for i in range(repeats + 2):
            handles = await asyncio.to_thread(owner.republish)
            decoder.cache.kv.zero_()
            sync(decoder.cache.kv.device)
            t0 = time.perf_counter()
            pulled, import_seconds = await decoder.pull(puller, owner.address, specs, handles, mode)
            if i >= 2:
                samples.append(time.perf_counter() - t0)
                imports.append(import_seconds)
            paths |= {p.path for p in pulled}
        assert decoder.holds(specs), f"{backend} {mode}: the blocks do not hold the bytes"
        await puller.close()
    finally:
        await asyncio.to_thread(owner.stop)
    want = TransferPath.HOST_LOCAL if host_local else TransferPath.STREAM
    assert paths == {want}, f"{backend} {'host-local' if host_local else 'stream'} pulls took {paths}"
    p50 = statistics.median(samples)
    return {
        "p50_ms": p50 * 1e3, "max_ms": max(samples) * 1e3, "GBps": shape.nbytes / p50 / 1e9,
        "import_ms": statistics.median(imports) * 1e3,
    }  # fmt: skip


def run(
    shape: KvShape, device: str, quick: bool, backends: list[str] | None = None
) -> tuple[dict[str, dict], dict[str, object]]:
    """Every backend, path and way into the blocks: the results by "<backend>_<path>" (into the
    blocks, as decode does) and "<backend>_<path>_buffered", and the key figures."""
    repeats = 3 if quick else 10
    backends = backends or (["ucx"] if ucx_available() else []) + ["tcp"]
    results: dict[str, dict] = {}
    for backend in backends:
        for path, host_local in PATHS.items():
            for mode in MODES:
                name = f"{backend}_{path}" + ("" if mode == "blocks" else f"_{mode}")
                results[name] = asyncio.run(time_path(backend, host_local, shape, device, repeats, mode))
    figures: dict[str, object] = {"kv_bytes": shape.nbytes, "kv_shape": shape.describe(), "device": device}
    for name, r in results.items():
        figures[f"{name}_p50_ms"] = round(r["p50_ms"], 3)
        figures[f"{name}_GBps"] = round(r["GBps"], 2)
        if name.endswith("_buffered"):
            figures[f"{name}_import_ms"] = round(r["import_ms"], 3)
            blocks = results[name.removesuffix("_buffered")]
            figures[f"{name.removesuffix('_buffered')}_into_blocks_speedup"] = round(
                r["p50_ms"] / blocks["p50_ms"], 2
            )
    for backend in backends:
        stream, local = results[f"{backend}_stream"], results[f"{backend}_host_local"]
        figures[f"{backend}_host_local_speedup"] = round(stream["p50_ms"] / local["p50_ms"], 2)
    return results, figures


def table(results: dict[str, dict], shape: KvShape) -> str:
    lines = [
        f"KV of one request: {shape.describe()} = {shape.nbytes / 2**20:.0f} MiB",
        "| backend | path | into the blocks | p50 ms | max ms | GB/s (at p50) | engine thread ms |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        backend, _, rest = name.partition("_")
        path = rest.removesuffix("_buffered")
        way = "buffered, then imported" if rest.endswith("_buffered") else "straight"
        lines.append(
            f"| {backend} | {path} | {way} | {r['p50_ms']:.2f} | {r['max_ms']:.2f} | {r['GBps']:.2f} "
            f"| {r['import_ms']:.2f} |"
        )
    return "\n".join(lines)
