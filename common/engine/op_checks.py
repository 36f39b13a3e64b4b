"""Which fused ops a CUDA model runs: each candidate run once on small inputs of the model's own
shapes, against its reference.

`select_ops` runs these at load on CUDA: the run compiles the kernel for the model's
shape class (so no step waits on a compile, and no capture either), and a kernel that fails to
compile, to launch or to agree is not used. The tolerances catch a wrong kernel, not rounding: a
broken mask or index moves outputs by their own size, far past them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from common.engine import decoder_ops as ops
from common.engine.config import GpuKernels
from common.engine.paged_decode import (
    flash_paged_decode,
    flash_pages_fit,
    installed_flash_kvcache,
    paged_decode_reference,
)

log = logging.getLogger(__name__)

TOKENS = 5  # rows of each check: a few, so a row mix-up shows


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    # bf16 keeps 8 significant bits: a few roundings apart is ~1e-2 of an O(1) value.
    return {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 5e-2, "rtol": 5e-2}


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if not torch.isfinite(got).all():
        raise AssertionError(f"{what}: not finite")
    torch.testing.assert_close(
        got.float(), want.float(), **_tolerance(want.dtype), msg=lambda m: f"{what}: {m}"
    )


def _randn(*shape: int, device: torch.device, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def check_add_rms_norm(kernel: Callable, device: torch.device, dtype: torch.dtype, s: ops.Shapes) -> None:
    x = _randn(TOKENS, s.hidden, device=device, dtype=dtype, seed=1)
    delta = _randn(TOKENS, s.hidden, device=device, dtype=dtype, seed=2)
    weight = _randn(s.hidden, device=device, dtype=dtype, seed=3)
    for d in (delta, None):
        normed, summed = kernel(x, d, weight, s.eps)
        want_normed, want_summed = ops.add_rms_norm_reference(x, d, weight, s.eps)
        _close(summed, want_summed, "add_rms_norm's sum")
        _close(normed, want_normed, "add_rms_norm")


def _cos_sin(tokens: int, dim: int, device: torch.device, dtype: torch.dtype):
    angles = torch.arange(tokens)[:, None] * (10000.0 ** (-torch.arange(0, dim, 2) / dim))
    cos, sin = angles.cos(), angles.sin()
    cos, sin = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
    return cos[:, None].to(device, dtype), sin[:, None].to(device, dtype)


def check_rotary_kv_write(kernel: Callable, device: torch.device, dtype: torch.dtype, s: ops.Shapes) -> None:
    width = (s.heads + 2 * s.kv_heads) * s.head_dim  # q, k and v as views of one product, as on CUDA
    qkv = _randn(TOKENS, width, device=device, dtype=dtype, seed=4)
    q = qkv[:, : s.heads * s.head_dim].view(TOKENS, s.heads, s.head_dim)
    k = qkv[:, s.heads * s.head_dim : (s.heads + s.kv_heads) * s.head_dim].view(
        TOKENS, s.kv_heads, s.head_dim
    )
    v = qkv[:, (s.heads + s.kv_heads) * s.head_dim :].view(TOKENS, s.kv_heads, s.head_dim)
    cos, sin = _cos_sin(TOKENS, s.head_dim, device, dtype)
    slots = torch.tensor([9, 2, 30, 17, 5], device=device)
    caches = [torch.zeros(4 * 8, s.kv_heads, s.head_dim, device=device, dtype=dtype) for _ in range(4)]
    got = kernel(q, k, v, cos, sin, caches[0], caches[1], slots)
    want = ops.rotary_kv_write_reference(q, k, v, cos, sin, caches[2], caches[3], slots)
    _close(got, want, "rotary_kv_write's queries")
    _close(caches[0], caches[2], "rotary_kv_write's keys in the cache")
    _close(caches[1], caches[3], "rotary_kv_write's values in the cache")


def check_silu_mul(kernel: Callable, device: torch.device, dtype: torch.dtype, s: ops.Shapes) -> None:
    gate_up = _randn(TOKENS, 2 * s.intermediate, device=device, dtype=dtype, seed=5)
    gate, up = gate_up.chunk(2, dim=-1)
    _close(kernel(gate, up), ops.silu_mul_reference(gate, up), "silu_mul")


def check_paged_decode(kernel: Callable, device: torch.device, dtype: torch.dtype, s: ops.Shapes) -> None:
    """Decodes over scattered blocks, a partly filled last block, a shared first block, a table
    padded past its context, and one token of context."""
    bs, blocks = s.block_size, 12
    k_cache = _randn(blocks * bs, s.kv_heads, s.head_dim, device=device, dtype=dtype, seed=6)
    v_cache = _randn(blocks * bs, s.kv_heads, s.head_dim, device=device, dtype=dtype, seed=7)
    tables = torch.tensor([[3, 7, 1, 11], [3, 4, 5, 0], [10, 10, 10, 10], [2, 8, 9, 6]], dtype=torch.int32)
    lengths = torch.tensor([4 * bs, 2 * bs + 1, 1, 3 * bs - 2], dtype=torch.int32)
    q = _randn(len(tables), s.heads, s.head_dim, device=device, dtype=dtype, seed=8)
    tables, lengths = tables.to(device), lengths.to(device)
    got = kernel(q, k_cache, v_cache, tables, lengths, bs)
    _close(got, paged_decode_reference(q, k_cache, v_cache, tables, lengths, bs), "paged_decode")


CHECKS: dict[str, Callable[..., None]] = {
    "add_rms_norm": check_add_rms_norm,
    "rotary_kv_write": check_rotary_kv_write,
    "silu_mul": check_silu_mul,
    "paged_decode": check_paged_decode,
}


def shapes_of(text_config, block_size: int) -> ops.Shapes:
    """A text model's shapes, from its HF config, for `select_ops`."""
    heads = text_config.num_attention_heads
    return ops.Shapes(
        hidden=text_config.hidden_size,
        intermediate=text_config.intermediate_size,
        heads=heads,
        kv_heads=text_config.num_key_value_heads or heads,
        head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // heads,
        block_size=block_size,
        eps=text_config.rms_norm_eps,
    )


def select_ops(
    mode: GpuKernels, device: torch.device, dtype: torch.dtype, shapes: ops.Shapes
) -> ops.DecoderOps | None:
    """The ops a model on `device` runs: None (the eager ops) on a CPU or with `GpuKernels.TORCH`;
    on CUDA Triton's (flash-attn's paged decode where it is installed and the blocks fit it), each
    compiled and checked against its reference here, falling back one by one; None too when
    Triton does not import."""
    if mode is GpuKernels.TORCH or device.type != "cuda":
        return None
    try:
        from common.engine import triton_attention, triton_ops
    except Exception as exc:  # ImportError, or a Triton that cannot find its compiler
        log.warning("Triton unavailable (%s): the decoder runs torch's ops", exc)
        return None
    candidates: dict[str, list[tuple[str, Callable]]] = {
        "add_rms_norm": [("triton", triton_ops.add_rms_norm)],
        "rotary_kv_write": [("triton", triton_ops.rotary_kv_write)],
        "silu_mul": [("triton", triton_ops.silu_mul)],
        "paged_decode": [("triton", triton_attention.paged_decode)],
    }
    flash = installed_flash_kvcache()
    if flash is not None and flash_pages_fit(shapes.block_size, dtype):
        candidates["paged_decode"].insert(0, ("flash-attn", flash_paged_decode(flash)))
    return checked(candidates, device, dtype, shapes)


def checked(
    candidates: dict[str, list[tuple[str, Callable]]],
    device: torch.device,
    dtype: torch.dtype,
    shapes: ops.Shapes,
) -> ops.DecoderOps:
    """For each op, the first candidate that passes its check on these shapes (CHECKS: it
    compiles, runs, and agrees with the reference within rounding); where none does, the
    reference — or, for the paged decode, None (the gather path) — with the reasons."""
    chosen, names, fallbacks = {}, {}, {}
    for op, options in candidates.items():
        chosen[op], names[op] = (
            (None, "gather") if op == "paged_decode" else (getattr(ops.REFERENCE_OPS, op), "torch")
        )
        reasons = []
        for name, kernel in options:
            try:
                CHECKS[op](kernel, device, dtype, shapes)
            except Exception as exc:  # a compile error, a launch error, or a wrong answer
                reasons.append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
                log.warning("decoder op %s: %s fails its check: %s", op, name, reasons[-1])
                continue
            chosen[op], names[op] = kernel, name
            break
        if reasons:
            fallbacks[op] = "; ".join(reasons)
    return ops.DecoderOps(**chosen, names=names, fallbacks=fallbacks)
