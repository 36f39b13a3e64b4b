"""INT8 KV for the prefill→decode wire (opt-in: `TRIDENT_KV_WIRE=int8`).

A layer group's KV buffer, [layers, 2, blocks, block_size, kv_heads, head_dim] as
`KVCache.export_blocks` makes it, travels as int8 values with one float32 scale per layer, key or
value, block and head — the `block_size × head_dim` values that share a scale come from one head
of one block, so an outlier head or a late block does not coarsen the rest:

    scale = max |x| / 127 over the group        q = round(x / scale)        x' = q · scale

so |x − x'| ≤ scale / 2 for every value (plus the engine dtype's rounding of x'). On the wire it
is one uint8 buffer: the int8 values, then the scales. A bfloat16 cache's KV shrinks to a little
over half (2 bytes a value become 1, plus 4 bytes per 16 × 128 values at 7B's shapes), a float32
cache's to a little over a quarter. The decoder turns it back into its own dtype before import;
its cache stays in that dtype.
"""

from __future__ import annotations

import math

import torch

from common.protocol.tensors import int8_kv_nbytes, int8_kv_scales_shape

QMAX = 127


def quantize(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values of `buf`'s shape and float32 scales [layers, 2, blocks, heads]."""
    x = buf.float()
    amax = x.abs().amax(dim=(3, 5))  # over the slots of a block and the head's dims
    scales = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    q = (x / scales[:, :, :, None, :, None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scales[:, :, :, None, :, None]).to(dtype)


def pack(buf: torch.Tensor) -> torch.Tensor:
    """`buf` as one flat uint8 buffer: its int8 values, then its scales."""
    q, scales = quantize(buf)
    return torch.cat((q.reshape(-1).view(torch.uint8), scales.reshape(-1).view(torch.uint8)))


def unpack(packed: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The KV buffer of `shape` in `dtype` that `pack` made `packed` from (to within its scales)."""
    shape = tuple(shape)
    if packed.dtype != torch.uint8 or packed.numel() != int8_kv_nbytes(shape):
        raise ValueError(
            f"an int8 KV buffer of shape {shape} is {int8_kv_nbytes(shape)} uint8 bytes, "
            f"got {packed.numel()} {packed.dtype}"
        )
    values = math.prod(shape)
    q = packed[:values].view(torch.int8).view(shape)
    scales = packed[values:].clone().view(torch.float32).view(int8_kv_scales_shape(shape))  # clone: aligned
    return dequantize(q, scales, dtype)
