"""Triton kernels for a CUDA decode step: attention that reads the paged cache where it lies, and
the decoder's small ops fused (RMSNorm with its residual add, RoPE with the KV write, SwiGLU).

Each function here states its semantics by the reference of the same name in decoder_ops.py and
takes the same arguments; `decoder_ops.select_ops` checks each against it on the device before
using it. Only imported where Triton is (the GPU image; CPU torch ships without it). Under
TRITON_INTERPRET=1 the same kernels run on CPU tensors, which is how the tests check them where
no GPU is.

Kernels are compiled once per shape class — dtype, head counts, head dim, block size — not per
step: the sizes that change from step to step (tokens, batch, table width) are runtime arguments
that Triton is told not to specialise on. Nothing here reads a device value back to the host, so
every function may run inside a captured CUDA graph once it has run once outside (the capture's
warm-up compiles it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens of context one step of the attention loop reads: four 16-token blocks, so that enough
# bytes are in flight per load (one block a step left a program waiting on each load's latency).
TILE = 64
# A split of the context is at least this many tiles; splits fill the device when batch × kv
# heads alone would leave most of its multiprocessors idle (batch 1 of a model with 4 kv heads).
MIN_TILES_PER_SPLIT = 2


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


@triton.jit
def _rounded(x, ty: tl.constexpr):
    """x rounded to `ty` and back: where the eager op would have stored an intermediate."""
    return x.to(ty).to(tl.float32)


# -- RMSNorm with its residual add ------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_x", "stride_d", "stride_o", "stride_r"])
def _add_rms_norm_kernel(
    X, Delta, W, Out, Res, stride_x, stride_d, stride_o, stride_r, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr, WEIGHT_AFTER: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:
        d = tl.load(Delta + row * stride_d + cols, mask=ok, other=0.0).to(tl.float32)
        x = _rounded(x + d, Res.dtype.element_ty)  # the residual stream, as the eager add stores it
        tl.store(Res + row * stride_r + cols, x.to(Res.dtype.element_ty), mask=ok)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    if WEIGHT_AFTER:  # noqa: SIM108 - float32: normalised, stored, then scaled (two roundings, as eager)
        y = _rounded(x * rstd, Out.dtype.element_ty) * w
    else:  # half precision: one rounding of the scaled value, as torch's rms_norm with a weight
        y = x * rstd * w
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=ok)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, n = x.shape
    out = torch.empty_like(x)
    res = torch.empty_like(x) if delta is not None else x
    block = _pow2(n, 16)
    _add_rms_norm_kernel[(rows,)](
        x, delta if delta is not None else x, weight, out, res,
        x.stride(0), (delta if delta is not None else x).stride(0), out.stride(0), res.stride(0), eps,
        N=n, BLOCK=block, HAS_DELTA=delta is not None, WEIGHT_AFTER=x.dtype == torch.float32,
        num_warps=min(16, max(1, block // 512)), enable_fp_fusion=False,
    )  # fmt: skip
    return out, res


# -- RoPE and the KV write --------------------------------------------------------------------------


@triton.jit
def _turn(X, base, stride_h, heads, cos, sin, dims, partner, HEADS_PAD: tl.constexpr, DIM: tl.constexpr):
    """Rows `heads` of one token turned by RoPE in float32, rounded where eager rounds:
    x·cos + x[(d + dim/2) % dim]·sin, sin's first half negated (models/llama.py, apply_rotary)."""
    h = tl.arange(0, HEADS_PAD)
    ok = (h < heads)[:, None] & (dims < DIM)[None, :]
    rows = X + base + h[:, None] * stride_h
    x = tl.load(rows + dims[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(rows + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    ty = X.dtype.element_ty
    return _rounded(_rounded(x * cos, ty) + _rounded(x2 * sin, ty), ty), h, ok


@triton.jit(
    do_not_specialize=[
        "stride_qt", "stride_kt", "stride_vt", "stride_ct", "stride_st", "stride_ot",
    ]
)  # fmt: skip
def _rotary_kv_kernel(
    Q, K, V, Cos, Sin, Slots, QOut, KCache, VCache,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_ot, stride_oh, stride_cs, stride_ch,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr, KV_PAD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    partner = (dims + DIM // 2) % DIM
    cos = tl.load(Cos + t * stride_ct + dims, mask=dims < DIM, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(Sin + t * stride_ct + dims, mask=dims < DIM, other=0.0).to(tl.float32)[None, :]
    q, h, ok = _turn(Q, t * stride_qt, stride_qh, HEADS, cos, sin, dims, partner, HEADS_PAD, DIM)
    tl.store(
        QOut + t * stride_ot + h[:, None] * stride_oh + dims[None, :], q.to(QOut.dtype.element_ty), mask=ok
    )
    slot = tl.load(Slots + t * stride_st).to(tl.int64)
    k, h, ok = _turn(K, t * stride_kt, stride_kh, KV_HEADS, cos, sin, dims, partner, KV_PAD, DIM)
    at = slot * stride_cs + h[:, None] * stride_ch + dims[None, :]
    tl.store(KCache + at, k.to(KCache.dtype.element_ty), mask=ok)
    v = tl.load(V + t * stride_vt + h[:, None] * stride_vh + dims[None, :], mask=ok, other=0.0)
    tl.store(VCache + at, v.to(VCache.dtype.element_ty), mask=ok)


def rotary_kv_write(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    cos2, sin2 = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)  # [tokens, dim]
    if k_cache.stride() != v_cache.stride():
        raise ValueError("the key and value caches must share a layout")
    _rotary_kv_kernel[(tokens,)](
        q, k, v, cos2, sin2, slots, out, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos2.stride(0),
        slots.stride(0), out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1),
        HEADS=heads, KV_HEADS=kv_heads, DIM=dim, DIM_PAD=_pow2(dim, 16), HEADS_PAD=_pow2(heads),
        KV_PAD=_pow2(kv_heads), num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out


# -- SwiGLU -----------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["stride_g", "stride_u", "stride_o"])
def _silu_mul_kernel(G, U, Out, stride_g, stride_u, stride_o, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = tl.load(G + row * stride_g + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    ty = Out.dtype.element_ty
    silu = _rounded(tl.math.div_rn(g, 1.0 + tl.exp(-g)), ty)  # eager stores silu's output, then multiplies
    tl.store(Out + row * stride_o + cols, (silu * u).to(ty), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    rows, n = gate.shape
    out = torch.empty((rows, n), dtype=gate.dtype, device=gate.device)
    block = min(1024, _pow2(n, 16))
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](
        gate, up, out, gate.stride(0), up.stride(0), out.stride(0), N=n, BLOCK=block,
        num_warps=4, enable_fp_fusion=False,
    )  # fmt: skip
    return out
