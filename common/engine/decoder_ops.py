"""The decoder's fused ops on a GPU — their contracts, and which implementation a model runs.

A decode step of a 7B model on a GPU waits on its small kernels (docs/engine.md, "Measured (GPU)"):
some twenty a layer beside the four matrix products. With a `DecoderOps` set on the language model
(`LlamaForCausalLM.set_ops`) each layer runs

    add_rms_norm      the residual add and the next RMSNorm: one kernel where there were two
    rotary_kv_write   RoPE on queries and keys, and the keys and values written into the cache
    silu_mul          SwiGLU's silu(gate) * up
    paged_decode      decode attention read where the cache lies (paged_decode.py), no gather

and the step's residual stream is carried beside each layer's last output, added by the next
layer's norm. The functions below are the ops' reference semantics in torch, with the same
numbers as the eager path they replace (the same ops in the same order); `REFERENCE_OPS` runs
them, which is how the CPU tests drive the fused path through a whole engine. On CUDA,
`op_checks.select_ops` takes Triton's kernels (triton_ops.py), each checked against its reference
on the device at load; one that fails to compile or to agree falls back to its reference (the
decode attention to the gather path) and says why in `fallbacks`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.engine.paged_decode import paged_decode_reference


def add_rms_norm_reference(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + delta) · weight, x + delta); delta None: (RMSNorm(x) · weight, x). In float32
    normalised then scaled, in half precision one call with the weight (models/llama.py, RMSNorm)."""
    summed = x if delta is None else x + delta
    if summed.dtype != torch.float32:
        return F.rms_norm(summed, (summed.shape[-1],), weight, eps), summed
    return F.rms_norm(summed, (summed.shape[-1],), eps=eps).mul_(weight), summed


def rotary_kv_write_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Queries [tokens, heads, dim] turned by RoPE (`apply_rotary`'s x·cos + roll(x)·sin, cos/sin
    [tokens, 1, dim]) are returned; keys turned and values as they are go into cache slot
    `slots[t]` of token t, in the cache's dtype. q/k/v may be strided views (of one qkv product)."""
    turn = lambda x: x * cos + x.roll(x.shape[-1] // 2, -1) * sin  # noqa: E731 - models/llama.apply_rotary
    k_cache.index_copy_(0, slots, turn(k).to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
    return turn(q)


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) · up, [tokens, intermediate]; gate and up may be strided views."""
    return F.silu(gate) * up


@dataclass(frozen=True)
class DecoderOps:
    """The ops a decoder runs in place of its eager small ops; `names` says what implements each."""

    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary_kv_write: Callable[..., torch.Tensor]
    silu_mul: Callable[..., torch.Tensor]
    paged_decode: Callable[..., torch.Tensor] | None  # None: decodes gather their contexts as before
    names: dict[str, str] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)  # op → why it is not the fast one


REFERENCE_OPS = DecoderOps(
    add_rms_norm_reference, rotary_kv_write_reference, silu_mul_reference, paged_decode_reference,
    names=dict.fromkeys(("add_rms_norm", "rotary_kv_write", "silu_mul", "paged_decode"), "reference"),
)  # fmt: skip


@dataclass(frozen=True)
class Shapes:
    """What a model's kernels are compiled for: checked once, at load, with these."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    eps: float = 1e-6
