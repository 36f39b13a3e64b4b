"""Decode attention over the paged KV cache, read where it lies: a Triton kernel.

One program per (decode, kv head, split of the context): it loads the kv head's group of query
heads once, walks the decode's block table `TILE` tokens at a time — each token's key and value
read from `table[pos // block_size] * block_size + pos % block_size` in the cache, nothing
gathered — and keeps an online softmax (running maximum, running sum, weighted values) in
float32. Positions at or past the decode's context length are masked, so a partly filled last
block and a padded table (the CUDA-graph buckets' scratch entries) are read no further than the
context. When batch × kv heads is too few programs to fill the device, the context is split and a
second small kernel merges the splits by their log-sum-exps.

Semantics: `paged_decode.paged_decode_reference`, argument for argument. Only imported where
Triton is; see triton_ops.py for how it is compiled and checked.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from common.engine.triton_ops import MIN_TILES_PER_SPLIT, TILE, _pow2


@triton.jit(do_not_specialize=["stride_tb", "tiles_per_split"])
def _paged_decode_kernel(
    Q, K, V, Tables, Lens, Out, PartAcc, PartMax, PartSum,
    stride_qb, stride_qh, stride_ks, stride_kh, stride_tb, stride_ob, stride_oh, scale, tiles_per_split,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(Lens + b)
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + rows
    row_ok = (rows < GROUP)[:, None] & (dims < DIM)[None, :]
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + dims[None, :], mask=row_ok, other=0.0)
    q = q.to(K.dtype.element_ty)
    top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    start = split * tiles_per_split * TILE
    stop = tl.minimum(length, start + tiles_per_split * TILE)
    for first in range(start, stop, TILE):
        pos = first + tl.arange(0, TILE)
        ok = pos < stop
        block = tl.load(Tables + b * stride_tb + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        at = (
            (block * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        )
        kv_ok = ok[:, None] & (dims < DIM)[None, :]
        k = tl.load(K + at, mask=kv_ok, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP_PAD, TILE]
        scores = tl.where(ok[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, axis=1))  # finite: the tile holds a position
        keep = tl.exp(top - new_top)
        p = tl.exp(scores - new_top[:, None])
        total = total * keep + tl.sum(p, axis=1)
        v = tl.load(V + at, mask=kv_ok, other=0.0)
        acc = acc * keep[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        top = new_top
    if SPLIT:  # partial results, merged by _merge_splits; an empty split leaves (-inf, 0, 0)
        part = (b * tl.num_programs(1) * GROUP + heads) * tl.num_programs(2) + split
        row = rows < GROUP
        tl.store(PartMax + part, top, mask=row)
        tl.store(PartSum + part, total, mask=row)
        tl.store(PartAcc + part[:, None] * DIM_PAD + dims[None, :], acc, mask=row[:, None])
    else:
        out = acc / total[:, None]
        at = Out + b * stride_ob + heads[:, None] * stride_oh + dims[None, :]
        tl.store(at, out.to(Out.dtype.element_ty), mask=row_ok)


@triton.jit
def _merge_splits(
    PartAcc, PartMax, PartSum, Out, stride_ob, stride_oh, splits,
    DIM: tl.constexpr, DIM_PAD: tl.constexpr, SPLIT_PAD: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLIT_PAD)
    dims = tl.arange(0, DIM_PAD)
    part = (b * tl.num_programs(1) + head) * splits + s
    ok = s < splits
    tops = tl.load(PartMax + part, mask=ok, other=float("-inf"))
    weights = tl.exp(tops - tl.max(tops, axis=0))  # split 0 holds position 0: the maximum is finite
    total = tl.sum(tl.load(PartSum + part, mask=ok, other=0.0) * weights, axis=0)
    acc = tl.load(PartAcc + part[:, None] * DIM_PAD + dims[None, :], mask=ok[:, None], other=0.0)
    out = tl.sum(acc * weights[:, None], axis=0) / total
    tl.store(Out + b * stride_ob + head * stride_oh + dims, out.to(Out.dtype.element_ty), mask=dims < DIM)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter on a CPU: a few splits, so the tests run the merge
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_count(batch: int, kv_heads: int, width_tokens: int, device: torch.device) -> tuple[int, int]:
    """(splits, tiles a split) for a decode batch whose tables span `width_tokens`: from shapes
    alone (no device value is read), so a captured step keeps its grid."""
    tiles = triton.cdiv(width_tokens, TILE)
    want = triton.cdiv(2 * _multiprocessors(device), batch * kv_heads)  # two waves of programs
    splits = max(1, min(want, tiles // MIN_TILES_PER_SPLIT))
    per = triton.cdiv(tiles, splits)
    return triton.cdiv(tiles, per), per


def paged_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
    lengths: torch.Tensor, block_size: int, splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """q [batch, heads, dim]; caches [slots, kv_heads, dim]; tables [batch, width] block ids;
    lengths [batch] context lengths → [batch, heads, dim]. `splits` overrides the split count."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    width = tables.shape[1] * block_size
    n, per = split_count(batch, kv_heads, width, q.device)
    if splits is not None:
        per = triton.cdiv(triton.cdiv(width, TILE), splits)
        n = triton.cdiv(triton.cdiv(width, TILE), per)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dim_pad = _pow2(dim, 16)
    if n > 1:
        part_acc = torch.empty(batch * heads * n, dim_pad, dtype=torch.float32, device=q.device)
        part_max = torch.empty(batch * heads * n, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # not read: SPLIT is off
    _paged_decode_kernel[(batch, kv_heads, n)](
        q, k_cache, v_cache, tables, lengths, out, part_acc, part_max, part_sum,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), tables.stride(0),
        out.stride(0), out.stride(1), dim**-0.5, per,
        GROUP=group, GROUP_PAD=_pow2(group, 16), DIM=dim, DIM_PAD=dim_pad, BLOCK_SIZE=block_size,
        TILE=TILE, SPLIT=n > 1, PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4,
    )  # fmt: skip
    if n > 1:
        _merge_splits[(batch, heads)](
            part_acc, part_max, part_sum, out, out.stride(0), out.stride(1), n,
            DIM=dim, DIM_PAD=dim_pad, SPLIT_PAD=_pow2(n, 2), num_warps=4,
        )  # fmt: skip
    return out
