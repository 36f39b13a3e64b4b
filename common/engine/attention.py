"""Attention over the paged KV cache for a mixed batch of prefill chunks and decodes.

The tokens of one iteration are packed with no padding: prefill chunks first, then one token per
decode. Each sequence attends to its whole context (cached tokens plus the ones in this batch):

    packed queries   | chunk A (n_a) | chunk B (n_b) | d1 | d2 | d3 |
    context of A     | A's cached tokens ... | A's n_a new tokens |   (causal within the chunk)

Prefill chunks run one SDPA call each; decodes run as one batched call over their contexts
gathered to the longest one and masked. On CUDA with flash-attn installed, everything runs as
one varlen call over gathered contexts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # optional CUDA kernel; the CPU path never needs it
    from flash_attn import flash_attn_varlen_func
except ImportError:  # pragma: no cover - depends on the machine
    flash_attn_varlen_func = None


@dataclass
class PrefillSeq:
    q_start: int  # offset of this chunk's first token in the packed batch
    q_len: int
    context_slots: torch.Tensor  # [context_len] flat KV slot of every token the chunk may see


@dataclass
class AttentionMetadata:
    """Per-iteration index tensors, built once by the runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    prefills: list[PrefillSeq]
    num_prefill_tokens: int
    decode_blocks: torch.Tensor | None  # [num_decodes, max_blocks] block tables, padded
    decode_bias: torch.Tensor | None  # [num_decodes, 1, 1, max_context] 0 or -inf
    num_cache_blocks: int = 0
    use_flash: bool = False
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    flash_slots: torch.Tensor | None = None  # [total_context] for the varlen call
    max_q: int = 0
    max_k: int = 0


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
) -> torch.Tensor:  # fmt: skip
    """q [tokens, heads, dim], k/v [tokens, kv_heads, dim]; caches [slots, kv_heads, dim]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    if meta.use_flash:
        return _flash(q, k_cache, v_cache, meta)
    out = torch.empty_like(q)
    for seq in meta.prefills:
        out[seq.q_start : seq.q_start + seq.q_len] = _prefill_one(q, k_cache, v_cache, seq)
    if meta.decode_blocks is not None:
        out[meta.num_prefill_tokens :] = _decode_batch(q[meta.num_prefill_tokens :], k_cache, v_cache, meta)
    return out


def _prefill_one(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: PrefillSeq
) -> torch.Tensor:
    # 4-D inputs: with 3-D ones, CPU SDPA falls back to its slow math kernel.
    qs = q[seq.q_start : seq.q_start + seq.q_len].transpose(0, 1)[None]  # [1, heads, q_len, dim]
    ks = gather_rows(k_cache, seq.context_slots).transpose(0, 1)[None]  # [1, kv_heads, ctx, dim]
    vs = gather_rows(v_cache, seq.context_slots).transpose(0, 1)[None]
    ctx = ks.shape[2]
    if ctx == seq.q_len:
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    else:
        # The chunk's queries sit at the end of the context: query i sees keys 0 .. ctx - q_len + i.
        mask = torch.ones(seq.q_len, ctx, dtype=torch.bool, device=q.device).tril(ctx - seq.q_len)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
    return o[0].transpose(0, 1)


def _decode_batch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta) -> torch.Tensor:
    """All decodes at once. Whole blocks are gathered (one index per block, not per token), and
    each KV head's group of query heads is laid out as a short query sequence, so SDPA runs with
    no GQA expansion of K and V."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    block_size = k_cache.shape[0] // meta.num_cache_blocks
    blocks = meta.decode_blocks.reshape(-1)
    ks = gather_rows(k_cache.view(-1, block_size, kv_heads, dim), blocks)
    vs = gather_rows(v_cache.view(-1, block_size, kv_heads, dim), blocks)
    # Cut the block padding beyond the longest context: the reduction length, and so the float
    # summation order, then matches an unpaged cache.
    width = meta.decode_bias.shape[-1]
    ks = ks.view(batch, -1, kv_heads, dim)[:, :width].transpose(1, 2)  # [batch, kv_heads, context, dim]
    vs = vs.view(batch, -1, kv_heads, dim)[:, :width].transpose(1, 2)
    qs = q.view(batch, kv_heads, heads // kv_heads, dim)  # query head h uses kv head h // group
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.decode_bias)
    return o.reshape(batch, heads, dim)


def _flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta) -> torch.Tensor:
    # Gathering contexts keeps any block size usable (flash's own paged path wants 256-token pages).
    ks, vs = gather_rows(k_cache, meta.flash_slots), gather_rows(v_cache, meta.flash_slots)
    return flash_attn_varlen_func(
        q, ks, vs, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_q, meta.max_k, causal=True
    )


def gather_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] along dim 0. Selecting from a 2-D view copies whole rows at memory speed; on the
    N-D tensor CPU index_select goes element by element, several times slower."""
    return t.reshape(t.shape[0], -1).index_select(0, index).view(len(index), *t.shape[1:])


def flash_available(device: torch.device) -> bool:
    return device.type == "cuda" and flash_attn_varlen_func is not None
