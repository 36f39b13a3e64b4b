"""A Llama-family decoder over the paged KV cache: GQA, RoPE (with the config's scaling), RMSNorm,
SwiGLU — and the variations of it the served families use (`TextArch`): Qwen2's q/k/v biases,
Qwen3's per-head q/k norms, Qwen-VL's M-RoPE, Qwen3-VL's DeepStack.

Parameter names follow HF's LlamaModel (`layers.N.self_attn.q_proj.weight`, ...) so a checkpoint's
text-model weights load by name once the family's prefix is stripped. On a GPU the loader then
calls `fuse_projections`, which stacks q/k/v into one `qkv_proj` and gate/up into one
`gate_up_proj`: two matrix products a layer instead of five, with the same numbers (each output is
the same dot product), and fewer kernels where launching them is what a decode step waits on. On
a CPU it does not pay (the wider products ran 7 % slower at 8 and 32 rows), so there the
projections stay apart.

On CUDA the model runs fused ops (`set_ops`, decoder_ops.py): RMSNorm with the residual add before
it, RoPE with the KV write, SwiGLU in one kernel each, and decode attention read in place. The
residual stream then runs beside each layer's last output — a layer takes and gives (residual,
delta), the hidden state being their sum, which the next norm adds — with the eager path's
numbers wherever the ops keep them (their references do: the CPU tests run them).

Inside a decoder layer, submodules are called through `.forward`, not `module(...)`: nn.Module's
call wrapper (hook dispatch; nothing sets hooks below the layers) measured 1.2 ms of a 31 ms
batch-1 decode step (about 13 calls a layer, each paying for it with the caches cold from the
matrix products). Layers themselves are called as modules: KV streaming and the core board hook
them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from common.engine.attention import AttentionMetadata, attend, paged_attention
from common.engine.kv_cache import KVCache

if TYPE_CHECKING:
    from common.engine.decoder_ops import DecoderOps


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the weight dtype, as the reference implementation does.
        # torch's rms_norm: in float32 the same numbers as x * rsqrt(mean(x²) + eps), to the bit; on
        # CUDA one fused kernel where those were four.
        if x.dtype != torch.float32:
            # bf16/fp16 (the GPU's dtypes): one kernel, computing in float32 inside, where HF's recipe
            # (upcast, normalise, round, scale) takes four; the last rounding moves, nothing more.
            return nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return nn.functional.rms_norm(x, (x.shape[-1],), eps=self.eps).mul_(self.weight)


@dataclass(frozen=True)
class TextArch:
    """How a family's decoder differs from Llama's. None biases: the config's `attention_bias`."""

    qkv_bias: bool | None = None  # Qwen2: True (and o_proj without)
    o_bias: bool | None = None
    qk_norm: bool = False  # Qwen3: q and k RMS-normalised per head, before RoPE
    mrope_section: tuple[int, ...] | None = None  # Qwen-VL: frequencies per position stream (t, h, w)
    mrope_interleaved: bool = False  # Qwen3-VL: streams interleaved over frequencies, not in sections


def tied_embeddings(config) -> bool:
    """Whether the LM head is the embedding matrix: the text config says so, or (Qwen-VL releases)
    only the top-level config does."""
    for part in (config.text_config, config):
        tied = getattr(part, "tie_word_embeddings", None)
        if tied is not None:
            return bool(tied)
    return False


class Rotary(nn.Module):
    """cos/sin tables by position; inv_freq and its scaling come from transformers' RoPE registry.

    With an `mrope_section` (Qwen-VL's M-RoPE) positions are [3, tokens] — temporal, height and
    width streams — and each rotary frequency turns with one of them: in contiguous sections
    (Qwen2-VL, Qwen2.5-VL: section j with stream j % 3), or interleaved (Qwen3-VL: frequency i with
    stream i % 3 while that stream's section lasts, the temporal stream after). Text tokens carry
    one position in all three streams, which makes it plain RoPE again."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, arch: TextArch = TextArch()) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = attention_scaling
        self.mrope_section = list(arch.mrope_section) if arch.mrope_section else None
        self.interleaved = arch.mrope_interleaved
        if self.mrope_section and sum(self.mrope_section) != inv_freq.numel():
            raise ValueError(
                f"mrope_section {self.mrope_section} must sum to head_dim / 2 = {inv_freq.numel()}"
            )

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [tokens, 1, dim] for `apply_rotary`, once a step: sin's first half negated."""
        freqs = positions[..., None].float() * self.inv_freq  # [(3,) tokens, dim / 2]
        if self.mrope_section is not None:
            if positions.dim() == 1:  # text only: every stream at the same position
                freqs = freqs.expand(3, -1, -1)
            freqs = self._mix_streams(freqs)
        cos, sin = freqs.cos() * self.scaling, freqs.sin() * self.scaling  # [tokens, dim / 2]
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        return cos[:, None].to(dtype), sin[:, None].to(dtype)

    def _mix_streams(self, freqs: torch.Tensor) -> torch.Tensor:
        """[3, tokens, dim / 2] → [tokens, dim / 2]: each frequency from its stream."""
        if not self.interleaved:
            parts = freqs.split(self.mrope_section, dim=-1)
            return torch.cat([part[j % 3] for j, part in enumerate(parts)], dim=-1)
        out = freqs[0].clone()
        for stream in (1, 2):
            picked = slice(stream, 3 * self.mrope_section[stream], 3)
            out[..., picked] = freqs[stream, ..., picked]
        return out


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, dim]; cos/sin [tokens, 1, dim] from `Rotary`. The reference turns x as
    x·cos + (-x₂, x₁)·sin, x₁ and x₂ its halves; with sin's first half negated once a step that is
    x·cos + (x₂, x₁)·sin — the same products, bit for bit, in two fewer operations a call."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Attention(nn.Module):
    def __init__(self, cfg, arch: TextArch) -> None:
        super().__init__()
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        kv_heads = cfg.num_key_value_heads or heads
        head_dim = getattr(cfg, "head_dim", None) or hidden // heads
        bias = getattr(cfg, "attention_bias", False)
        qkv_bias = bias if arch.qkv_bias is None else arch.qkv_bias
        o_bias = bias if arch.o_bias is None else arch.o_bias
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        self.qk_norm = arch.qk_norm
        if arch.qk_norm:
            self.q_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, cfg.rms_norm_eps)
        self.fused = False  # q/k/v stacked into `qkv_proj` (fuse)

    def fuse(self) -> None:
        """q/k/v → one `qkv_proj` (queries, keys, values side by side); after loading."""
        self.qkv_proj = fused_linear(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj
        self.fused = True

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata, ops=None) -> torch.Tensor:
        n, heads, kv_heads, dim = x.shape[0], self.heads, self.kv_heads, self.head_dim
        if ops is not None:
            q, k, v = self._project(x)
            q = ops.rotary_kv_write(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping)
            return self.o_proj.forward(attend(q, k_cache, v_cache, meta).reshape(n, -1))
        if self.fused:
            qkv = self.qkv_proj.forward(x)
            qk = qkv[:, : (heads + kv_heads) * dim].view(n, heads + kv_heads, dim)
            if self.qk_norm:  # Qwen3: per-head norms, before RoPE
                qk = torch.cat(
                    (self.q_norm.forward(qk[:, :heads]), self.k_norm.forward(qk[:, heads:])), dim=1
                )
            qk = apply_rotary(qk, cos, sin)  # queries and keys turn alike: one pass for both
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
        else:
            q = self.q_proj.forward(x).view(n, heads, dim)
            k = self.k_proj.forward(x).view(n, kv_heads, dim)
            if self.qk_norm:
                q, k = self.q_norm.forward(q), self.k_norm.forward(k)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
            v = self.v_proj.forward(x).view(n, kv_heads, dim)
        o = paged_attention(q, k, v, k_cache, v_cache, meta)  # [tokens, heads, head_dim]
        return self.o_proj.forward(o.reshape(n, -1))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values [tokens, (kv_)heads, dim] before RoPE (views of one product
        when stacked), Qwen3's per-head norms applied."""
        n, heads, kv_heads, dim = x.shape[0], self.heads, self.kv_heads, self.head_dim
        if self.fused:
            qkv = self.qkv_proj.forward(x)
            q = qkv[:, : heads * dim].view(n, heads, dim)
            k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(n, kv_heads, dim)
            v = qkv[:, (heads + kv_heads) * dim :].view(n, kv_heads, dim)
        else:
            q = self.q_proj.forward(x).view(n, heads, dim)
            k = self.k_proj.forward(x).view(n, kv_heads, dim)
            v = self.v_proj.forward(x).view(n, kv_heads, dim)
        if self.qk_norm:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        return q, k, v


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.fused = False  # gate/up stacked into `gate_up_proj` (fuse)

    def fuse(self) -> None:
        """gate/up → one `gate_up_proj`; after loading."""
        self.gate_up_proj = fused_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj
        self.fused = True

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj.forward(x), self.up_proj.forward(x)
        if ops is not None:
            return self.down_proj.forward(ops.silu_mul(gate, up))
        # In place: no step keeps gate or up, and a prefill's are tokens × intermediate each.
        return self.down_proj.forward(nn.functional.silu(gate, inplace=True).mul_(up))


def fused_linear(*parts: nn.Linear) -> nn.Linear:
    """One Linear whose output is the outputs of `parts` side by side (their weights stacked)."""
    weight = torch.cat([p.weight for p in parts])
    bias = torch.cat([p.bias for p in parts]) if parts[0].bias is not None else None
    out = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias, requires_grad=False)
    return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg, arch: TextArch) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, arch)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ops: DecoderOps | None = None  # set by LlamaForCausalLM.set_ops

    def forward(self, x, cos, sin, k_cache, v_cache, meta):
        """x [tokens, hidden] → the same; with ops, (residual, delta) → the same (see the module
        docstring). Submodules through `.forward`: see the module docstring too."""
        ops = self.ops
        if ops is None:
            x = x + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, k_cache, v_cache, meta)
            return x + self.mlp.forward(self.post_attention_layernorm.forward(x))
        residual, delta = x
        norm = self.input_layernorm
        h, residual = ops.add_rms_norm(residual, delta, norm.weight, norm.eps)
        a = self.self_attn.forward(h, cos, sin, k_cache, v_cache, meta, ops)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(residual, a, norm.weight, norm.eps)
        return residual, self.mlp.forward(h, ops)


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head; `forward` takes packed embeddings."""

    def __init__(
        self, cfg, inv_freq: torch.Tensor, attention_scaling: float, arch: TextArch = TextArch(),
        tied: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, arch) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(inv_freq, attention_scaling, arch)
        self.ops: DecoderOps | None = None  # set_ops

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
        deepstack: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """embeds [tokens, hidden], positions [tokens] (or [3, tokens] with M-RoPE) → final hidden
        states [tokens, hidden]. `deepstack` (Qwen3-VL): (rows, extra [rows, k, hidden]) — after
        layer i < k, the image tokens at `rows` get their i-th extra visual features added."""
        cos, sin = self.rotary(positions, embeds.dtype)
        x = embeds if self.ops is None else (embeds, None)
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = cache.layer(i)
            x = layer(x, cos, sin, k_cache, v_cache, meta)
            if deepstack is not None and i < deepstack[1].shape[1]:
                rows, extra = deepstack
                if self.ops is not None:  # the sum the next norm would make, made here: same order
                    x = x[0] + x[1]
                x = x.index_add(0, rows, extra[:, i].to(x.dtype))
                if self.ops is not None:
                    x = (x, None)
        if self.ops is None:
            return self.norm.forward(x)
        return self.ops.add_rms_norm(x[0], x[1], self.norm.weight, self.norm.eps)[0]

    def set_ops(self, ops: DecoderOps | None) -> None:
        """Run `ops` (decoder_ops.py) in place of the eager small ops; None: the eager ops. Decode
        graphs captured before are captured anew (decode_graphs.py)."""
        self.ops = ops
        for layer in self.layers:
            layer.ops = ops

    def fuse_projections(self) -> None:
        """Stack each layer's q/k/v and gate/up projections (the loader does on a GPU, once loaded)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.forward(hidden).float()
