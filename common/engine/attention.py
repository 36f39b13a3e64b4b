"""Attention over the paged KV cache for a mixed batch of prefill chunks and decodes.

The tokens of one iteration are packed with no padding: prefill chunks first, then one token per
decode. Each sequence attends to its whole context (cached tokens plus the ones in this batch):

    packed queries   | chunk A (n_a) | chunk B (n_b) | d1 | d2 | d3 |
    context of A     | A's cached tokens ... | A's n_a new tokens |   (causal within the chunk)

Prefill chunks run one SDPA call each. On a CPU each decode attends to its context where it lies
in the cache: one SDPA call when its blocks are one run of consecutive ids (the block manager keeps
them so), one a run merged by their log-sum-exps when a long context has a few runs (a shared
prompt prefix, then its own), and a gathered copy otherwise — copying a context costs about as
much as attending to it.
Elsewhere decodes run as one batched call over their contexts gathered to the longest one and
masked; on CUDA with flash-attn installed (and a half-precision cache), everything runs as one
varlen call over gathered contexts. Where the model runs fused ops (decoder_ops.py: on CUDA), a
paged decode kernel reads every decode's context where it lies instead (`paged_decode`, with
each decode's block table and context length), and a varlen call, if any, covers the prefill
chunks alone.

The varlen call goes through whatever kernel `varlen_kernel` picks for the iteration: flash-attn's
in production. `use_varlen_kernel` forces the varlen path with another kernel on any device and
dtype — tests run it on CPU with `varlen_attention_reference`, a pure-torch statement of the same
semantics, so the CUDA path's metadata is checked where no GPU is.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.engine.block_manager import blocks_needed

log = logging.getLogger(__name__)

# flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...,
# causal=...) -> [total_q, heads, dim]; `varlen_attention_reference` documents the semantics.
VarlenKernel = Callable[..., torch.Tensor]


def _installed_flash() -> VarlenKernel | None:
    """flash-attn's varlen kernel, if installed at a version whose causal mask is aligned to the
    bottom right (≥ 2.1; 2.0 aligned it top-left, which would silently break chunked prefill)."""
    try:
        import flash_attn
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    version = tuple(int(n) for n in re.findall(r"\d+", getattr(flash_attn, "__version__", "0"))[:2])
    if version < (2, 1):  # pragma: no cover - depends on the machine
        log.warning("flash-attn %s aligns its causal mask top-left; using SDPA", flash_attn.__version__)
        return None
    return flash_attn_varlen_func


#: The production varlen kernel: flash-attn's, or None when it is not installed.
flash_attn_varlen_func: VarlenKernel | None = _installed_flash()
# Set by `use_varlen_kernel`: the varlen path runs through it on every device and dtype.
_forced_kernel: VarlenKernel | None = None
_FLASH_DTYPES = (torch.float16, torch.bfloat16)  # the only dtypes flash-attn takes


@dataclass
class PrefillSeq:
    q_start: int  # offset of this chunk's first token in the packed batch
    q_len: int
    context_slots: torch.Tensor  # [context_len] flat KV slot of every token the chunk may see


# CPU SDPA that also returns each query's log-sum-exp of scores, for merging attention over runs.
_sdpa_with_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# A context in several runs is read in place, a call a run, from this length and up to this many
# runs; shorter or more scattered ones are gathered. `python bench/decode_attention.py` on a 2-core
# EPYC, one thread, small-llava's shapes, a 32-token prefix then the rest: merging two runs took
# 1.1x the gathered copy's time at 512 tokens and 0.65x at 2048.
MERGE_FROM_TOKENS = 768
MERGE_MAX_RUNS = 4


@dataclass
class DecodeContext:
    """Where one decode's `length`-token context lies: `runs` of (first slot, slots), in position
    order, read where they lie; or else `blocks` (its block table), gathered."""

    length: int
    runs: tuple[tuple[int, int], ...] | None = None
    blocks: torch.Tensor | None = None


def decode_context(table: list[int], length: int, block_size: int) -> DecodeContext:
    """How a decode whose blocks are `table` reads its `length`-token context on a CPU."""
    used = table[: blocks_needed(length, block_size)]
    starts = [0] + [i for i in range(1, len(used)) if used[i] != used[i - 1] + 1]
    if len(starts) == 1 or (
        _sdpa_with_lse is not None and len(starts) <= MERGE_MAX_RUNS and length >= MERGE_FROM_TOKENS
    ):
        ends = [*starts[1:], len(used)]
        runs = [(used[a] * block_size, (b - a) * block_size) for a, b in zip(starts, ends, strict=True)]
        first, slots = runs[-1]
        runs[-1] = (first, slots - (len(used) * block_size - length))  # the last block, partly filled
        return DecodeContext(length, runs=tuple(runs))
    return DecodeContext(length, blocks=torch.as_tensor(used))


@dataclass
class AttentionMetadata:
    """Per-iteration index tensors, built once by the runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    prefills: list[PrefillSeq]
    num_prefill_tokens: int
    decode_blocks: torch.Tensor | None  # [num_decodes, max_blocks] block tables, padded
    decode_bias: torch.Tensor | None  # [num_decodes, 1, 1, max_context] 0 or -inf
    block_size: int = 0  # the cache's, for reading decode_blocks or decode_contexts' blocks
    # Set (on a CPU): each decode attends by itself, to its context here, and the two above are None.
    decode_contexts: list[DecodeContext] | None = None
    # Set: the whole batch is one call of this varlen kernel (flash-attn's, or a test's stand-in).
    varlen_kernel: VarlenKernel | None = None
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    flash_slots: torch.Tensor | None = None  # [total_context] for the varlen call
    max_q: int = 0
    max_k: int = 0
    # Set: decodes attend through this paged kernel (paged_decode.py) over `decode_blocks` (int32
    # block tables) and `decode_lens` (int32 context lengths), read in place; decode_bias is None.
    paged_decode: Callable[..., torch.Tensor] | None = None
    decode_lens: torch.Tensor | None = None

    @property
    def use_flash(self) -> bool:
        return self.varlen_kernel is not None


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
) -> torch.Tensor:  # fmt: skip
    """q [tokens, heads, dim], k/v [tokens, kv_heads, dim]; caches [slots, kv_heads, dim]."""
    # A cache in another dtype than the model's (a half-precision cache under a float32 model,
    # EngineConfig.kv_cache_dtype) takes keys and values rounded to it, and is read back as below.
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    return attend(q, k_cache, v_cache, meta)


def attend(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """`paged_attention` once this step's keys and values are in the cache (a fused op wrote them)."""
    if meta.use_flash and meta.paged_decode is None:
        return _flash(q, k_cache, v_cache, meta)
    if not meta.prefills:  # decodes only: their output is the whole output, with no copy into it
        return _decode_batch(q, k_cache, v_cache, meta)
    out = torch.empty_like(q)
    if meta.use_flash:  # the prefill chunks' rows, one varlen call
        out[: meta.num_prefill_tokens] = _flash(q[: meta.num_prefill_tokens], k_cache, v_cache, meta)
    for seq in meta.prefills if not meta.use_flash else ():
        out[seq.q_start : seq.q_start + seq.q_len] = _prefill_one(q, k_cache, v_cache, seq)
    if len(q) > meta.num_prefill_tokens:
        out[meta.num_prefill_tokens :] = _decode_batch(q[meta.num_prefill_tokens :], k_cache, v_cache, meta)
    return out


def _prefill_one(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: PrefillSeq
) -> torch.Tensor:
    # 4-D inputs: with 3-D ones, CPU SDPA falls back to its slow math kernel.
    qs = q[seq.q_start : seq.q_start + seq.q_len].transpose(0, 1)[None]  # [1, heads, q_len, dim]
    # Copies already, so a half-precision cache's rows come back in the queries' dtype on the way.
    ks = gather_rows(k_cache, seq.context_slots).to(q.dtype).transpose(0, 1)[None]  # [1, kv_heads, ctx, dim]
    vs = gather_rows(v_cache, seq.context_slots).to(q.dtype).transpose(0, 1)[None]
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
    if meta.paged_decode is not None:
        return meta.paged_decode(q, k_cache, v_cache, meta.decode_blocks, meta.decode_lens, meta.block_size)
    if meta.decode_contexts is not None:
        return _decode_each(q, k_cache, v_cache, meta)
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    block_size = meta.block_size
    blocks = meta.decode_blocks.reshape(-1)
    ks = gather_rows(k_cache.view(-1, block_size, kv_heads, dim), blocks)
    vs = gather_rows(v_cache.view(-1, block_size, kv_heads, dim), blocks)
    # Cut the block padding beyond the longest context: the reduction length, and so the float
    # summation order, then matches an unpaged cache.
    width = meta.decode_bias.shape[-1]
    # [batch, kv_heads, context, dim], in the queries' dtype (a half-precision cache's copy converts)
    ks = ks.view(batch, -1, kv_heads, dim)[:, :width].transpose(1, 2).to(q.dtype)
    vs = vs.view(batch, -1, kv_heads, dim)[:, :width].transpose(1, 2).to(q.dtype)
    qs = q.view(batch, kv_heads, heads // kv_heads, dim)  # query head h uses kv head h // group
    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=meta.decode_bias)
    return o.reshape(batch, heads, dim)


def _decode_each(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta) -> torch.Tensor:
    """Each decode by itself, over exactly its context: one SDPA call where the context is one run
    (the same numbers as an unpaged cache), a call a run merged where it is several, one call over
    a gathered copy otherwise. Query heads are laid out as in `_decode_batch`. A half-precision
    cache is read as it lies, the queries rounded to its dtype (reading half the bytes is the point
    of it; SDPA accumulates in float32 either way)."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    qs = q.to(k_cache.dtype).view(batch, 1, kv_heads, heads // kv_heads, dim)  # 4-D: SDPA's fast kernel
    out = torch.empty_like(q)
    for i, ctx in enumerate(meta.decode_contexts):
        if ctx.runs is None:
            ks = _gather_context(k_cache, ctx, meta.block_size)
            vs = _gather_context(v_cache, ctx, meta.block_size)
            o = F.scaled_dot_product_attention(qs[i], _heads_first(ks), _heads_first(vs))
        elif len(ctx.runs) == 1:
            ((first, slots),) = ctx.runs
            ks, vs = k_cache[first : first + slots], v_cache[first : first + slots]
            o = F.scaled_dot_product_attention(qs[i], _heads_first(ks), _heads_first(vs))
        else:
            o = _merged_runs(qs[i], k_cache, v_cache, ctx.runs)
        out[i] = o.view(heads, dim)
    return out


def _heads_first(rows: torch.Tensor) -> torch.Tensor:
    """[context, kv_heads, dim] → [1, kv_heads, context, dim], a view."""
    return rows.transpose(0, 1)[None]


def _merged_runs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, runs) -> torch.Tensor:
    """Attention over the union of `runs`: each run's softmax-weighted values, weighted by the share
    of the exponentiated scores its keys hold (exp of its log-sum-exp less the whole one's)."""
    outs, lses = [], []
    for first, slots in runs:
        ks, vs = _heads_first(k_cache[first : first + slots]), _heads_first(v_cache[first : first + slots])
        o, lse = _sdpa_with_lse(q, ks, vs)  # [1, kv_heads, group, dim], [1, kv_heads, group]
        outs.append(o)
        lses.append(lse)
    lse = torch.stack(lses)
    weights = (lse - lse.logsumexp(0)).exp_().unsqueeze(-1)
    return (torch.stack(outs) * weights).sum(0)


def _gather_context(cache: torch.Tensor, ctx: DecodeContext, block_size: int) -> torch.Tensor:
    kv_heads, dim = cache.shape[1:]
    rows = gather_rows(cache.view(-1, block_size, kv_heads, dim), ctx.blocks)
    return rows.view(-1, kv_heads, dim)[: ctx.length]


def _flash(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta) -> torch.Tensor:
    # Gathering contexts keeps any block size usable (flash's own paged path wants 256-token pages).
    ks = gather_rows(k_cache, meta.flash_slots).to(q.dtype)
    vs = gather_rows(v_cache, meta.flash_slots).to(q.dtype)
    return meta.varlen_kernel(
        q, ks, vs, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_q, meta.max_k, causal=True
    )


def gather_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t[index] along dim 0. Selecting from a 2-D view copies whole rows at memory speed; on the
    N-D tensor CPU index_select goes element by element, several times slower."""
    return t.reshape(t.shape[0], -1).index_select(0, index).view(len(index), *t.shape[1:])


def varlen_kernel(device: torch.device, dtype: torch.dtype) -> VarlenKernel | None:
    """The kernel for one varlen call over the batch, or None for the SDPA path.

    Production: flash-attn's on CUDA when installed and the cache is float16/bfloat16 (the only
    dtypes it takes; a float32 engine on CUDA runs SDPA). Inside `use_varlen_kernel`: that kernel,
    on any device and dtype."""
    if _forced_kernel is not None:
        return _forced_kernel
    if device.type == "cuda" and flash_attn_varlen_func is not None and dtype in _FLASH_DTYPES:
        return flash_attn_varlen_func
    return None


@contextmanager
def use_varlen_kernel(kernel: VarlenKernel | None = None) -> Iterator[VarlenKernel]:
    """Force the varlen (flash) path while inside, through `kernel` (default: the reference).

    For tests and debugging: on CPU it runs the CUDA path's metadata (cu_seqlens, gathered slots,
    max lengths) through `varlen_attention_reference`; on a GPU, swapping the reference in for
    flash-attn tells a kernel fault from a metadata fault. Metadata is built per iteration, so the
    kernel applies to iterations run inside the block. Process-wide state: not for concurrent use.
    """
    global _forced_kernel
    before, _forced_kernel = _forced_kernel, kernel or varlen_attention_reference
    try:
        yield _forced_kernel
    finally:
        _forced_kernel = before


def varlen_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
) -> torch.Tensor:  # fmt: skip
    """Pure-torch statement of flash-attn 2's `flash_attn_varlen_func` (forward, no dropout).

    Semantics, as flash-attn documents them:

    - q [total_q, heads, dim], k/v [total_k, kv_heads, dim]: sequences packed with no padding.
      Sequence b owns query rows cu_seqlens_q[b] : cu_seqlens_q[b + 1] and key rows
      cu_seqlens_k[b] : cu_seqlens_k[b + 1]; cu_seqlens are int32 [batch + 1], starting at 0 and
      ending at the total. Sequences never attend to each other.
    - max_seqlen_q/k: the longest query / key sequence in the batch (the kernel sizes its work
      by them; a bound below a real length is outside its contract, so here it is an error).
    - GQA/MQA: heads must be a multiple of kv_heads; query head h uses kv head h // (heads // kv_heads)
      (with 6 query and 2 kv heads, query heads 0-2 read kv head 0 and 3-5 kv head 1).
    - softmax_scale defaults to 1 / sqrt(dim).
    - causal (flash-attn ≥ 2.1): the mask is aligned to the bottom-right corner. With q_len ≤ k_len,
      query i sees keys 0 .. k_len - q_len + i — the queries are the last q_len positions of the
      context, as for a prefill chunk after cached tokens or a decode (q_len 1 sees every key).
      With q_len > k_len the first q_len - k_len rows see no key, and their output is zero.
    - Returns [total_q, heads, dim] in q's dtype. Scores, softmax and the weighted sum are
      computed in float32 (the kernel accumulates in float32 too), at least.

    The real kernel also requires fp16/bf16, CUDA tensors and a contiguous last dimension; this
    reference takes any float dtype and device (its purpose), but checks everything else.
    """
    _check_varlen_args(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p)
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    group = heads // kv_heads
    scale = dim**-0.5 if softmax_scale is None else softmax_scale
    work = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(bq) - 1):
        q_len, k_len = bq[b + 1] - bq[b], bk[b + 1] - bk[b]
        qs = q[bq[b] : bq[b + 1]].to(work).transpose(0, 1)  # [heads, q_len, dim]
        ks = k[bk[b] : bk[b + 1]].to(work).transpose(0, 1).repeat_interleave(group, 0)  # [heads, k_len, dim]
        vs = v[bk[b] : bk[b + 1]].to(work).transpose(0, 1).repeat_interleave(group, 0)
        scores = (qs @ ks.transpose(1, 2)) * scale  # [heads, q_len, k_len]
        if causal:
            allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
            probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            probs = probs.masked_fill(~allowed.any(-1, keepdim=True), 0.0)  # rows with no key: 0
        else:
            probs = scores.softmax(-1)
        out[bq[b] : bq[b + 1]] = (probs @ vs).transpose(0, 1).to(q.dtype)
    return out


def _check_varlen_args(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape:
        shapes = f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        raise ValueError(f"want q [total_q, heads, dim], k/v [total_k, kv_heads, dim]; got {shapes}")
    if q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]}), head dims equal"
        )
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError("q, k and v must share dtype and device")
    if dropout_p:
        raise ValueError("the reference computes no dropout (inference)")
    for name, cu, total, bound in (("q", cu_q, q.shape[0], max_q), ("k", cu_k, k.shape[0], max_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device:
            raise ValueError(f"cu_seqlens_{name} must be 1-D int32 on q's device: {cu.dtype}, {cu.device}")
        lens = cu.diff()
        if len(lens) == 0 or int(cu[0]) != 0 or int(cu[-1]) != total or bool((lens < 0).any()):
            raise ValueError(f"cu_seqlens_{name} must rise from 0 to {total}: {cu.tolist()}")
        if int(lens.max()) > bound:
            raise ValueError(f"max_seqlen_{name} {bound} is below the longest sequence ({int(lens.max())})")
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k disagree on the batch size: {len(cu_q)} vs {len(cu_k)}"
        )
