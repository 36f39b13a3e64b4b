"""Decode-sized matrix products on a CPU from weights packed once, at load (MKL's packed GEMM).

A decode step multiplies a few rows (one per running sequence) by every weight matrix. For one
row MKL runs a matrix-vector product that reads each weight once, at memory speed. For a few rows
it runs a general GEMM, and that first repacks the whole weight into its blocked layout — on every
call, so a step of 8 rows read and wrote the decoder's weights about three times over (small-llava,
one thread: 65 ms of products at 8 rows against 25 ms at one). Packing once at load and computing
from the packed copy takes the same products to 34 ms.

So each of the language model's projections keeps two forms of its weight:

    rows == 1                   F.linear on the weight as loaded (the matrix-vector product)
    2 <= rows <= PACKED_ROWS    MKL's GEMM on the packed copy
    rows > PACKED_ROWS          F.linear again: at prefill sizes repacking is a small part of the
                                product, and the unpacked kernel measured as fast or faster

The price is memory: the packed copy is another decoder's worth of weights (small-llava: 327 MB).
It is only made where it pays: on a CPU, in float32, on an instance that decodes. Both forms are
the same numbers; the packed kernel sums in another order, so results agree to float32 rounding
(the HF parity tests run with it on).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED_ROWS = 64  # the most rows computed from the packed weight (decode batches)
# MKL picks its packed layout for a row count; the layout packed for 32 rows measured best across
# 2-64 rows (one packed for 8 rows ran 1.5x slower at 32).
_PACKED_FOR = 32


def packing_available() -> bool:
    """Whether this torch build has MKL's packed GEMM (x86 builds with MKL do; ARM builds do not)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


class PackedLinear(nn.Module):
    """An `nn.Linear` that also holds its weight packed for MKL: `weight` and `bias` stay the
    loaded parameters (tied embeddings, state dicts and exports see no change)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        if linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu":
            raise ValueError("PackedLinear takes a float32 CPU Linear")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        # Not a buffer: the packed copy is an MKL-DNN tensor, made again from `weight` if ever needed.
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(linear.weight.detach(), _PACKED_FOR)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if 2 <= rows <= PACKED_ROWS:
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, rows)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        rows = f"packed for 2-{PACKED_ROWS} rows"
        return f"in_features={self.in_features}, out_features={self.out_features}, {rows}"


def pack_projections(language_model: nn.Module) -> int:
    """Replace every Linear of the decoder layers and the LM head with a PackedLinear, in place;
    returns the bytes the packed copies take."""
    added = 0
    for parent in list(language_model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                packed = PackedLinear(child)
                setattr(parent, name, packed)
                added += child.weight.numel() * child.weight.element_size()
    return added
