"""The prefill stage's side of KV streamed while prefill runs (common/engine/kv_stream.py).

In the step that ends a request's prompt, on the engine thread, `StreamSink.begin` reserves one
transfer handle per layer group and one for the outcome (the tail), and tells the event loop;
the handler queues the decode task at once, pointing at those handles, and settles the prefill
task. Each group's handle is filled as the forward passes the group's last layer; a decoder's pull
that comes first waits at this instance for it. The tail — whether the request ended here, and its
output tokens — is filled once the step's first token is out (`StreamedKv.finish`), so a decoder
never has the request before this instance has said its first token.

Small KV (a group within the inline limit) does not stream: it rides in the task after the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.engine import kv_quant
from common.engine.request import Request
from common.protocol.tensors import KvWire, int8_kv_nbytes, nbytes_of
from common.transfer import TransferBackend

if TYPE_CHECKING:
    from services.worker.engine_loop import EngineLoop


@dataclass
class StreamedKv:
    """One request's streamed KV: its handles, and what its decode task says of the prefill."""

    request_id: str
    transfer: TransferBackend
    wire: KvWire
    shapes: list[tuple[int, ...]]
    handles: list[str]  # one per group of layers, in layer order
    tail: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # those it came with; the step makes one more
    num_tokens: int  # computed once the step is over
    rope_delta: int
    cached_tokens: int

    def group(self, index: int, buffer: torch.Tensor) -> None:
        """On the engine thread, inside the forward. A GPU buffer stays on the GPU (within the
        transfer's device budget): a decoder on this host copies it GPU to GPU."""
        self.transfer.fill(self.handles[index], kv_quant.pack(buffer) if self.wire == KvWire.INT8 else buffer)

    def finish(self, ended: bool, outputs: list[int]) -> bool:
        """Serve the outcome: `ended` here (the first token finished it), with these outputs."""
        tail = torch.tensor([int(ended), *outputs], dtype=torch.int64)
        return self.transfer.fill(self.tail, tail)

    @property
    def all_handles(self) -> tuple[str, ...]:
        return (*self.handles, self.tail)

    def release(self) -> None:
        for handle in self.all_handles:
            self.transfer.release(handle)


class StreamSink:
    """What a prefill instance's engine streams into: every request leaving for decode whose KV
    groups are too big to ride inline, while the handler's `kv_stream` is on."""

    def __init__(self, handler, engine: EngineLoop, dtype: str) -> None:
        self.handler = handler  # the PrefillHandler: its kv_stream, kv_wire, transfer and announce
        self.engine = engine
        self.dtype = dtype  # the cache's

    def begin(self, req: Request, shapes: list[tuple[int, ...]]) -> StreamedKv | None:
        """On the engine thread, before the forward of the request's last prompt chunk."""
        handler, transfer = self.handler, self.handler.ctx.transfer
        wire = handler.kv_wire
        nbytes = int8_kv_nbytes(shapes[0]) if wire == KvWire.INT8 else nbytes_of(shapes[0], self.dtype)
        if not handler.kv_stream or nbytes <= transfer.config.inline_max_bytes:
            return None
        if len(req.output_token_ids) + 1 >= req.params.max_tokens:
            return None  # its first token is its last: it will not need decode
        stream = StreamedKv(
            request_id=req.request_id,
            transfer=transfer,
            wire=wire,
            shapes=shapes,
            handles=[transfer.reserve() for _ in shapes],
            tail=transfer.reserve(),
            prompt_token_ids=tuple(req.prompt_token_ids),
            output_token_ids=tuple(req.output_token_ids),
            num_tokens=req.num_tokens,
            rope_delta=req.rope_delta,
            cached_tokens=req.num_cached_tokens,
        )
        self.engine.event_loop.call_soon_threadsafe(handler.announce, stream)
        return stream
