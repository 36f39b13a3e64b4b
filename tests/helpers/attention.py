"""The decode-attention tests' cache, metadata and slot-by-slot reference: what the CPU paths and the
INT8 KV checks run their attention against."""

from __future__ import annotations

import torch

from common.engine.attention import AttentionMetadata, decode_context, varlen_attention_reference

BS, HEADS, KV_HEADS, DIM, BLOCKS = 4, 6, 2, 16, 512


def cache(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (BLOCKS * BS, KV_HEADS, DIM)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def meta_for(tables: list[list[int]], lengths: list[int], per_decode: bool, prefills=(), num_prefill=0):
    """Metadata for decodes (each writing its last token) after `prefills`; per_decode: the CPU
    path (`decode_contexts`), else the batched one (padded block grid and -inf bias)."""
    slots = [t[(n - 1) // BS] * BS + (n - 1) % BS for t, n in zip(tables, lengths, strict=True)]
    prefill_slots = [s for p in prefills for s in p.context_slots[-p.q_len :].tolist()]
    meta = AttentionMetadata(torch.tensor(prefill_slots + slots), list(prefills), num_prefill, None, None, BS)
    if per_decode:
        meta.decode_contexts = [decode_context(t, n, BS) for t, n in zip(tables, lengths, strict=True)]
    else:
        grid = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.long)
        for i, t in enumerate(tables):
            grid[i, : len(t)] = torch.tensor(t)
        valid = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
        meta.decode_blocks = grid
        meta.decode_bias = torch.zeros(valid.shape).masked_fill_(~valid, float("-inf"))[:, None, None]
    return meta


def context_of(cache_part: torch.Tensor, table: list[int], length: int) -> torch.Tensor:
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(length)])
    return cache_part[slots]


def reference(q, k_cache, v_cache, tables, lengths) -> torch.Tensor:
    """The varlen reference kernel over each decode's context, taken slot by slot."""
    ks = torch.cat([context_of(k_cache, t, n) for t, n in zip(tables, lengths, strict=True)])
    vs = torch.cat([context_of(v_cache, t, n) for t, n in zip(tables, lengths, strict=True)])
    cu_q = torch.arange(len(tables) + 1, dtype=torch.int32)
    cu_k = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return varlen_attention_reference(q, ks, vs, cu_q, cu_k, 1, max(lengths), causal=True)
