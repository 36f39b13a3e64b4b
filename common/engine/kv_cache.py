"""The paged KV cache tensors, and moving one request's blocks in and out of contiguous buffers.

Layout, one tensor for all layers so a group of layers is a slice:

    kv[layer, 0 = key | 1 = value, block, slot in block, kv head, head dim]

A token at position `pos` of a request lives in block `table[pos // block_size]`, slot
`pos % block_size`; flattened, that is slot index `table[pos // bs] * bs + pos % bs`.

One block past the last (`scratch_block`) belongs to no request: the padding rows of a captured
decode step (decode_graphs.py) write their K/V there and read it back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return per_token * self.block_size * torch.finfo(self.dtype).bits // 8


class KVCache:
    """Owns the cache tensor; the BlockManager decides which of its `num_blocks` belong to whom."""

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device | str = "cpu") -> None:
        self.spec = spec
        self.num_blocks = num_blocks
        self.scratch_block = num_blocks  # the extra block: never handed out
        self.kv = torch.zeros(
            spec.num_layers,
            2,
            num_blocks + 1,
            spec.block_size,
            spec.num_kv_heads,
            spec.head_dim,
            dtype=spec.dtype,
            device=device,
        )

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value slot views of one layer: each [(num_blocks + 1) * block_size, kv_heads, head_dim]."""
        k, v = self.kv[index]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def export_blocks(self, block_ids: list[int], layers: range) -> torch.Tensor:
        """Copy a request's blocks for `layers` into one contiguous buffer (the unit moved P→D).

        Shape [len(layers), 2, len(block_ids), block_size, kv_heads, head_dim].
        """
        index = torch.as_tensor(block_ids, device=self.kv.device)
        return self.kv[layers.start : layers.stop].index_select(2, index).contiguous()

    def import_blocks(self, block_ids: list[int], layers: range, buffer: torch.Tensor) -> None:
        """Write a buffer made by `export_blocks` into this cache's `block_ids` for `layers`."""
        expected = (len(layers), 2, len(block_ids), *self.kv.shape[3:])
        if tuple(buffer.shape) != expected:
            raise ValueError(f"KV buffer shape {tuple(buffer.shape)} does not match {expected}")
        index = torch.as_tensor(block_ids, device=self.kv.device)
        self.kv[layers.start : layers.stop].index_copy_(2, index, buffer.to(self.kv))

    def copy_block(self, src: int, dst: int) -> None:
        """Block `src`'s KV, every layer's, into block `dst` (a fork's own copy of a shared prompt's
        last, partial block: the copies write their answers after it)."""
        self.kv[:, :, dst] = self.kv[:, :, src]


def layer_groups(num_layers: int, group_size: int) -> list[range]:
    """Split layers into consecutive groups of `group_size` (the last may be shorter)."""
    if group_size <= 0:
        raise ValueError("group_size must be positive")
    return [range(s, min(s + group_size, num_layers)) for s in range(0, num_layers, group_size)]


def num_blocks_for(spec: KVSpec, cache_bytes: int) -> int:
    """How many blocks fit in a byte cap."""
    return max(0, cache_bytes // spec.bytes_per_block)


def gpu_kv_bytes(free: int, total: int, held: int, fraction: float, share: float | None) -> int:
    """Bytes for the KV cache on a GPU with `free` of `total` bytes free, this process holding `held`
    already (its weights): `fraction` of what is free or, with a `share` of the device (instances
    sharing one GPU), of what is left of that share, and never more than is free. Each instance's
    room then follows from its own share, whatever the others took first."""
    room = free if share is None else min(free, int(share * total) - held)
    return max(0, int(room * fraction))
