"""Blocks that a request's KV, prefilled on another instance, is written into before the request
joins this engine (`Handoff.land`, then `Handoff.commit`).

The bytes arrive on a transfer's copier thread (common/transfer/sink.py) while this engine steps:
each layer group is written straight into the reserved blocks, once, off the engine's thread. The
blocks belong to no running request until the commit, so no step reads them meanwhile. `close()`
waits for a write under way and refuses any later one: the commit and a drop both close first, so
no block is written after it was admitted or given back.
"""

from __future__ import annotations

import threading

import torch

from common.engine.kv_cache import KVCache


class LandingClosed(RuntimeError):
    """A write after the landing was committed or dropped."""


class KvLanding:
    """A request's reserved blocks (`block_ids`, in its table's order), open for its KV's writes."""

    def __init__(self, request_id: str, cache: KVCache, block_ids: list[int]) -> None:
        self.request_id = request_id
        self.block_ids = list(block_ids)
        self._cache = cache
        self._lock = threading.Lock()
        self._open = True

    def write(self, layer_start: int, buffer: torch.Tensor) -> None:
        """One group's buffer [layers, 2, blocks, block size, heads, dim] (as `export_blocks`
        makes it, any dtype and device) into the blocks for layers from `layer_start`, done when
        this returns (on a GPU the copy runs on the calling thread's current stream, which is
        waited for: the engine's stream knows nothing of it). ValueError where its shape does not
        fit this cache."""
        if buffer.dim() != 6:  # import_blocks checks the rest of its shape
            raise ValueError(f"a KV buffer has 6 dimensions, not {buffer.dim()}")
        layers = range(layer_start, layer_start + buffer.shape[0])
        if layers.stop > (have := self._cache.spec.num_layers):
            raise ValueError(f"KV for layers {layers.start}-{layers.stop - 1}: this model has {have}")
        if buffer.shape[2] > len(self.block_ids):
            raise ValueError(f"KV of {buffer.shape[2]} blocks; {len(self.block_ids)} were reserved for it")
        with self._lock:
            if not self._open:
                raise LandingClosed(f"the KV landing of {self.request_id} is closed")
            with torch.inference_mode():
                self._cache.import_blocks(self.block_ids[: buffer.shape[2]], layers, buffer)
            if self._cache.kv.is_cuda:
                torch.cuda.current_stream(self._cache.kv.device).synchronize()

    def close(self) -> None:
        """No write after this returns (one under way is waited for)."""
        with self._lock:
            self._open = False
