"""Decode attention that reads the paged KV cache in place: its contract, and flash-attn's kernel.

A paged decode kernel takes one query row per decode and that decode's block table, and attends
over the decode's context where it lies in the cache — no copy of it first:

    kernel(q, k_cache, v_cache, tables, lengths, block_size) -> [batch, heads, dim]

`paged_decode_reference` states the semantics in torch. On CUDA the engine runs the Triton kernel
(triton_attention.py), or flash-attn's `flash_attn_with_kvcache(block_table=...)` where flash-attn
is installed and the cache's blocks are pages it takes (`flash_pages_fit`); decoder_ops.py picks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PagedDecodeKernel = Callable[..., torch.Tensor]

# flash-attn 2's paged path takes pages of a multiple of 256 tokens (its mha_fwd_kvcache checks
# "Paged KV cache block size must be divisible by 256"); the engine's blocks are 16 by default.
FLASH_PAGE_MULTIPLE = 256


def paged_decode_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
    lengths: torch.Tensor, block_size: int,
) -> torch.Tensor:  # fmt: skip
    """Pure-torch statement of a paged decode kernel.

    - q [batch, heads, dim]: one query row per decode (the token it decodes, after RoPE).
    - k_cache/v_cache [slots, kv_heads, dim]: the cache, slot = block * block_size + offset.
    - tables [batch, width] integer: decode b's context is positions 0 .. lengths[b] - 1, position
      p in slot tables[b, p // block_size] * block_size + p % block_size. Entries past
      ceil(lengths[b] / block_size) are padding (the graphs' scratch block): nothing of them
      counts (here they are read and masked; a kernel need not read them).
    - lengths [batch] integer, 1 ≤ lengths[b] ≤ width * block_size; the decoded token's own key
      and value are already in the cache at position lengths[b] - 1 (the step wrote them).
    - GQA: query head h reads kv head h // (heads // kv_heads); scale 1 / sqrt(dim); no causal mask
      (the query is the context's last position and sees all of it).
    - Returns [batch, heads, dim] in q's dtype; scores, softmax and the weighted sum in float32.

    Checks its arguments on the host: for tests and debugging, never inside a CUDA graph."""
    _check(q, k_cache, v_cache, tables, lengths, block_size)
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    work = torch.promote_types(q.dtype, torch.float32)
    width = tables.shape[1] * block_size
    offsets = torch.arange(block_size, device=q.device)
    slots = (tables.long()[:, :, None] * block_size + offsets).reshape(batch, width)
    ks, vs = k_cache[slots].to(work), v_cache[slots].to(work)  # [batch, width, kv_heads, dim]
    qs = q.to(work).view(batch, kv_heads, heads // kv_heads, dim)  # head h reads kv head h // group
    scores = torch.einsum("bkgd,bpkd->bkgp", qs, ks) * dim**-0.5
    past = torch.arange(width, device=q.device)[None, :] >= lengths[:, None]
    probs = scores.masked_fill(past[:, None, None, :], float("-inf")).softmax(-1)
    return torch.einsum("bkgp,bpkd->bkgd", probs, vs).reshape(batch, heads, dim).to(q.dtype)


def _check(q, k_cache, v_cache, tables, lengths, block_size) -> None:
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape != v_cache.shape:
        shapes = f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        raise ValueError(f"want q [batch, heads, dim] and caches [slots, kv_heads, dim]; got {shapes}")
    if q.shape[2] != k_cache.shape[2] or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"heads ({q.shape[1]}) must be a multiple of kv heads ({k_cache.shape[1]})")
    if k_cache.shape[0] % block_size:
        raise ValueError(f"the cache's {k_cache.shape[0]} slots are not whole blocks of {block_size}")
    if tables.dim() != 2 or tables.is_floating_point() or len(tables) != len(q):
        raise ValueError(f"tables must be integer [batch, width]: {tables.dtype} {tuple(tables.shape)}")
    if lengths.shape != (len(q),) or lengths.is_floating_point():
        raise ValueError(f"lengths must be integer [batch]: {lengths.dtype} {tuple(lengths.shape)}")
    if len(q) and not bool(((lengths >= 1) & (lengths <= tables.shape[1] * block_size)).all()):
        raise ValueError(f"lengths must be 1 .. {tables.shape[1] * block_size}: {lengths.tolist()}")
    if tables.numel() and not bool(((tables >= 0) & (tables < k_cache.shape[0] // block_size)).all()):
        raise ValueError("a block table names a block outside the cache")


def flash_pages_fit(block_size: int, dtype: torch.dtype) -> bool:
    """Whether flash-attn's paged kernel takes this cache: half precision, pages of 256k tokens."""
    return block_size % FLASH_PAGE_MULTIPLE == 0 and dtype in (torch.float16, torch.bfloat16)


def installed_flash_kvcache() -> Callable[..., torch.Tensor] | None:
    try:
        from flash_attn import flash_attn_with_kvcache
    except ImportError:
        return None
    return flash_attn_with_kvcache


def flash_paged_decode(kernel: Callable[..., torch.Tensor]) -> PagedDecodeKernel:
    """A paged decode kernel through flash-attn's `flash_attn_with_kvcache(block_table=...)`: the
    cache viewed as [blocks, block_size, kv_heads, dim] pages, tables and lengths in int32 (the
    engine keeps them so), the query as a one-token sequence."""

    def decode(q, k_cache, v_cache, tables, lengths, block_size) -> torch.Tensor:
        pages = (-1, block_size, *k_cache.shape[1:])
        out = kernel(
            q[:, None], k_cache.view(pages), v_cache.view(pages),
            cache_seqlens=lengths, block_table=tables, causal=True,
        )  # fmt: skip
        return out[:, 0]

    return decode
