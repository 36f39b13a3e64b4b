"""A Llama-family decoder over the paged KV cache: GQA, RoPE (with the config's scaling), RMSNorm, SwiGLU.

Parameter names follow HF's LlamaModel (`layers.N.self_attn.q_proj.weight`, ...) so a checkpoint's
text-model weights load by name once the LLaVA prefix is stripped.
"""

from __future__ import annotations

import torch
from torch import nn

from common.engine.attention import AttentionMetadata, paged_attention
from common.engine.kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the weight dtype, as the reference implementation does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos/sin tables by position; inv_freq and its scaling come from transformers' RoPE registry.

    With `mrope_section` (Qwen2-VL's M-RoPE) positions are [3, tokens] — temporal, height and width
    streams — and the rotary frequencies are cut into those sections, section j turning with stream
    j % 3; text tokens carry one position in all three streams, which makes it plain RoPE again."""

    def __init__(
        self, inv_freq: torch.Tensor, attention_scaling: float, mrope_section: list[int] | None = None
    ) -> None:
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = attention_scaling
        self.mrope_section = list(mrope_section) if mrope_section else None
        if self.mrope_section and sum(self.mrope_section) != inv_freq.numel():
            raise ValueError(
                f"mrope_section {self.mrope_section} must sum to head_dim / 2 = {inv_freq.numel()}"
            )

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # [(3,) tokens, dim / 2]
        if self.mrope_section is not None:
            if positions.dim() == 1:  # text only: every stream at the same position
                freqs = freqs.expand(3, -1, -1)
            parts = freqs.split(self.mrope_section, dim=-1)
            freqs = torch.cat([part[j % 3] for j, part in enumerate(parts)], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)  # [tokens, dim]
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, dim]; cos/sin [tokens, dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Attention(nn.Module):
    def __init__(
        self, hidden: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool, o_bias: bool
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata) -> torch.Tensor:
        n = x.shape[0]
        q = apply_rotary(self.q_proj(x).view(n, self.heads, self.head_dim), cos, sin)
        k = apply_rotary(self.k_proj(x).view(n, self.kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        o = paged_attention(q, k, v, k_cache, v_cache, meta)  # [tokens, heads, head_dim]
        return self.o_proj(o.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        self.self_attn = Attention(
            cfg.hidden_size, cfg.num_attention_heads, kv_heads, head_dim, qkv_bias, o_bias
        )
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, getattr(cfg, "mlp_bias", False))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, k_cache, v_cache, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Embeddings, decoder layers, final norm and LM head; `forward` takes packed embeddings.

    Llama's attention has biases on all four projections or none (`attention_bias`); Qwen2's has
    them on q, k and v only (`qkv_bias=True, o_bias=False`)."""

    def __init__(
        self, cfg, inv_freq: torch.Tensor, attention_scaling: float, *,
        qkv_bias: bool | None = None, o_bias: bool | None = None, mrope_section: list[int] | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.config = cfg
        bias = getattr(cfg, "attention_bias", False)
        qkv_bias = bias if qkv_bias is None else qkv_bias
        o_bias = bias if o_bias is None else o_bias
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, qkv_bias, o_bias) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(inv_freq, attention_scaling, mrope_section)

    def forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """embeds [tokens, hidden], positions [tokens] (or [3, tokens] with M-RoPE) → final hidden
        states [tokens, hidden]."""
        cos, sin = self.rotary(positions, embeds.dtype)
        x = embeds
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = cache.layer(i)
            x = layer(x, cos, sin, k_cache, v_cache, meta)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
