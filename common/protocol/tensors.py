"""How a tensor travels: inline in the message (small), or as a handle its owner serves (bulk)."""

from __future__ import annotations

import math
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

from pydantic import Field, model_validator

from common.protocol.codec import Record

if TYPE_CHECKING:
    import torch

# Names as torch spells them (`str(torch.float32)` minus the prefix); the wire never carries a
# numpy or pickle dtype, so any reader can check a payload's size from shape and dtype alone.
DTYPE_SIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip

Shape = tuple[Annotated[int, Field(ge=0)], ...]
Dtype = Annotated[str, Field(pattern="^(" + "|".join(DTYPE_SIZES) + ")$")]


def nbytes_of(shape: tuple[int, ...], dtype: str) -> int:
    """Bytes of a dense tensor of this shape and dtype."""
    return math.prod(shape) * DTYPE_SIZES[dtype]


class KvWire(StrEnum):
    """How a prefill instance's KV travels to decode (`TRIDENT_KV_WIRE`); decoders read both."""

    NATIVE = "native"  # each layer group's buffer in the KV cache's dtype
    INT8 = "int8"  # int8 values and a float32 scale per layer, block and head (common/engine/kv_quant.py)


def int8_kv_scales_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """INT8 KV on the wire (common/engine/kv_quant.py): one scale per (layer, key|value, block,
    head) of a KV buffer [layers, 2, blocks, block_size, heads, dim]."""
    layers, kv, blocks, _, heads, _ = shape
    return (layers, kv, blocks, heads)


def int8_kv_nbytes(shape: tuple[int, ...]) -> int:
    """Bytes on the wire of an INT8 KV buffer of `shape`: one per value, four per float32 scale."""
    return math.prod(shape) + 4 * math.prod(int8_kv_scales_shape(shape))


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"dtype {dtype} cannot travel")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a wire name."""
    import torch

    return getattr(torch, name)


class InlineTensor(Record):
    """A small tensor carried in the message itself (raw little-endian bytes, C order)."""

    shape: Shape
    dtype: Dtype
    data: bytes

    @model_validator(mode="after")
    def _size_matches(self) -> InlineTensor:
        if len(self.data) != nbytes_of(self.shape, self.dtype):
            raise ValueError(
                f"{len(self.data)} bytes do not make a {self.dtype} tensor of shape {self.shape}"
            )
        return self

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor) -> InlineTensor:
        """Copy a CPU or GPU tensor into an inline payload."""
        t = tensor.detach().to("cpu").contiguous()
        # Viewing as bytes keeps bfloat16 exact (numpy has no bfloat16 to round-trip through).
        import torch

        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return cls(shape=tuple(t.shape), dtype=dtype_name(t.dtype), data=raw)

    def to_tensor(self) -> torch.Tensor:
        """A fresh CPU tensor holding the payload."""
        import torch

        flat = (
            torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
            if self.data
            else torch.empty(0, dtype=torch.uint8)
        )
        return flat.view(torch_dtype(self.dtype)).reshape(self.shape)


class TensorRef(Record):
    """A tensor held by its owner and pulled over the bulk transfer by handle.

    `address` is the owner's transfer address ("ucx://..." or "tcp://host:port"); `owner` is its
    instance id, so a reader can tell from the registry whether the owner is still alive.
    """

    owner: str
    address: str
    handle: str
    shape: Shape
    dtype: Dtype

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape, self.dtype)
