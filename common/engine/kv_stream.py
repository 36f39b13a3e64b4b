"""KV streamed while prefill runs (EPD-Serve's layer-wise transfer, 002 §3.3): in the step that
computes a request's last prompt chunk, each group of layers' KV is exported as soon as the forward
has passed the group's last layer, so the next stage can pull it while later layers still run.

The engine knows nothing of transfer: a `KvSink` (the prefill stage's) decides which requests
stream and where each group's buffer goes. All of it runs on the engine thread, inside the step:

    step ─ prepare: sink.begin(req, shapes) for each request whose prefill ends in this step
         ─ forward: after layer g.stop - 1, stream.group(i, buffer) for every group g ending there

A buffer equals what `Handoff.export_kv` gives after the prefill, byte for byte: the same blocks of
the same cache, read once the last chunk's keys and values for those layers are written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from common.engine.kv_cache import KVCache, layer_groups
from common.engine.request import Request


class KvStream(Protocol):
    """One request's streamed KV, as the sink keeps it."""

    def group(self, index: int, buffer: torch.Tensor) -> None:
        """Group `index`'s buffer [layers, 2, blocks, block_size, kv_heads, head_dim], complete."""


class KvSink(Protocol):
    def begin(self, req: Request, shapes: list[tuple[int, ...]]) -> KvStream | None:
        """The request's prefill ends in this step: a stream for its groups (of these shapes), or
        None to leave it to the export after the step."""


class KvStreamer:
    """Hooks on the layers that end each group; active only during a step that has streams."""

    def __init__(
        self, layers: nn.ModuleList, cache: KVCache, block_tables, group_size: int, sink: KvSink
    ) -> None:
        self.cache = cache
        self.block_tables = block_tables  # request id → its block ids
        self.groups = layer_groups(len(layers), group_size)
        self.sink = sink
        self._active: list[tuple[list[int], KvStream]] = []
        self._hooks = [
            layers[g.stop - 1].register_forward_hook(self._hook(i)) for i, g in enumerate(self.groups)
        ]

    def prepare(self, finishing: Sequence[Request]) -> None:
        """Before the forward: open a stream for each request whose prefill this step ends."""
        self._active = []
        for req in finishing:
            table = list(self.block_tables(req.request_id))
            shapes = [(len(g), 2, len(table), *self.cache.kv.shape[3:]) for g in self.groups]
            stream = self.sink.begin(req, shapes)
            if stream is not None:
                self._active.append((table, stream))

    def end(self) -> None:
        """After the forward: no stream stays open past its step."""
        self._active = []

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()

    def _hook(self, index: int):
        layers = self.groups[index]

        def after_group(_module, _args, _output) -> None:
            for table, stream in self._active:
                stream.group(index, self.cache.export_blocks(table, layers))

        return after_group
