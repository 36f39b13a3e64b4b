"""Where a decode task's KV goes as it is pulled: straight into the blocks the decoder reserved for
it (common/engine/kv_landing.py), one transfer Sink (common/transfer/sink.py) per layer group.

A group's bytes are viewed as the buffer the prefill instance exported — [layers, 2, blocks, block
size, heads, dim] in the KV's dtype, or INT8 on the wire (common/engine/kv_quant.py), turned back
into that dtype first — and written into the blocks for its layers, on the transfer's copier
thread (small ones on the caller's): from the prefill's own memory where it is on this host (a
memfd, or its GPU by CUDA IPC), else from the buffer or message the bytes came in.
"""

from __future__ import annotations

import torch

from common.engine import kv_quant
from common.engine.kv_landing import KvLanding
from common.protocol import KvGroup, KvLocation
from common.protocol.tensors import KvWire, nbytes_of, torch_dtype
from common.transfer import Sink


class KvGroupSink(Sink):
    """One layer group's KV, written into the landing's blocks."""

    def __init__(self, landing: KvLanding, kv: KvLocation, group: KvGroup) -> None:
        self.landing, self.group = landing, group
        self.dtype = torch_dtype(kv.dtype)
        self.int8 = kv.wire == KvWire.INT8
        wire = kv.wire_form(group.shape)
        self.wire_shape, self.wire_dtype = tuple(wire["shape"]), torch_dtype(wire["dtype"])
        self.nbytes = nbytes_of(self.wire_shape, wire["dtype"])

    def write(self, source: torch.Tensor) -> None:
        buffer = source.view(self.wire_dtype).view(self.wire_shape)
        if self.int8:
            buffer = kv_quant.unpack(buffer, self.group.shape, self.dtype)
        self.landing.write(self.group.layer_start, buffer)


def sinks(landing: KvLanding, kv: KvLocation) -> list[KvGroupSink]:
    """One sink per layer group, in layer order."""
    return [KvGroupSink(landing, kv, g) for g in kv.groups]


def num_blocks(kv: KvLocation) -> int:
    """The blocks the KV fills (each group's buffer spans them all)."""
    return max(g.shape[2] for g in kv.groups)
