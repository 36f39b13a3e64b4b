"""Model shapes for the random-weight LLaVA-1.5 checkpoints, and the HF config built from them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class Preset:
    """Every shape and storage choice of one checkpoint preset; the config is derived from this alone."""

    name: str
    # CLIP vision tower
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    vision_intermediate: int
    image_size: int
    patch_size: int
    # Llama language model
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    # Embedding / lm_head rows; may exceed the trained tokenizer (the extra rows are zero).
    vocab_size: int
    tokenizer_vocab: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str
    max_shard_bytes: int
    vision_projection_dim: int = 512
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens per image: one per patch, the CLS token dropped ("default" strategy)."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def torch_dtype(self) -> torch.dtype:
        """The storage dtype of every weight tensor."""
        return getattr(torch, self.dtype)


PRESETS: dict[str, Preset] = {
    "tiny-llava": Preset(
        name="tiny-llava",
        vision_hidden=64,
        vision_layers=2,
        vision_heads=4,
        vision_intermediate=128,
        image_size=56,
        patch_size=8,
        text_hidden=64,
        text_layers=4,
        text_heads=4,
        text_kv_heads=2,
        text_intermediate=176,
        vocab_size=1024,
        tokenizer_vocab=1024,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        dtype="float32",
        max_shard_bytes=2 * GIB,
    ),
    # Sharded on purpose (~370 MB in 256 MiB shards) so the index + tied-embedding load path runs on a CPU.
    "small-llava": Preset(
        name="small-llava",
        vision_hidden=384,
        vision_layers=6,
        vision_heads=6,
        vision_intermediate=1536,
        image_size=192,
        patch_size=16,
        text_hidden=768,
        text_layers=12,
        text_heads=12,
        text_kv_heads=4,
        text_intermediate=2048,
        vocab_size=8192,
        tokenizer_vocab=8192,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        dtype="float32",
        max_shard_bytes=256 * MIB,
    ),
    # The shapes of llava-hf/llava-1.5-7b-hf (CLIP ViT-L/14-336 + Llama-2-7B), random weights.
    "llava-1.5-7b": Preset(
        name="llava-1.5-7b",
        vision_hidden=1024,
        vision_layers=24,
        vision_heads=16,
        vision_intermediate=4096,
        image_size=336,
        patch_size=14,
        text_hidden=4096,
        text_layers=32,
        text_heads=32,
        text_kv_heads=32,
        text_intermediate=11008,
        vocab_size=32064,
        tokenizer_vocab=32000,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype="bfloat16",
        max_shard_bytes=2 * GIB,
        vision_projection_dim=768,
    ),
}


def get_preset(name: str) -> Preset:
    """Look a preset up by name, with an error that lists the valid names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}") from None


def build_config(preset: Preset, bos_id: int, eos_id: int, pad_id: int, image_id: int) -> LlavaConfig:
    """The LlavaConfig for a preset, with special-token ids taken from the trained tokenizer."""
    vision = CLIPVisionConfig(
        hidden_size=preset.vision_hidden,
        intermediate_size=preset.vision_intermediate,
        num_hidden_layers=preset.vision_layers,
        num_attention_heads=preset.vision_heads,
        image_size=preset.image_size,
        patch_size=preset.patch_size,
        projection_dim=preset.vision_projection_dim,
        hidden_act="quick_gelu",
        layer_norm_eps=1e-5,
    )
    text = LlamaConfig(
        vocab_size=preset.vocab_size,
        hidden_size=preset.text_hidden,
        intermediate_size=preset.text_intermediate,
        num_hidden_layers=preset.text_layers,
        num_attention_heads=preset.text_heads,
        num_key_value_heads=preset.text_kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        rms_norm_eps=preset.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta},
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        tie_word_embeddings=preset.tie_word_embeddings,
        dtype=preset.dtype,
    )
    return LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=image_id,
        image_seq_length=preset.num_image_tokens,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        multimodal_projector_bias=True,
        tie_word_embeddings=preset.tie_word_embeddings,
        dtype=preset.dtype,
    )


def meta_model(config: LlavaConfig) -> LlavaForConditionalGeneration:
    """Instantiate the model on the meta device: names and shapes without allocating any weights."""
    with torch.device("meta"):
        return LlavaForConditionalGeneration(config)


def count_parameters(preset: str | Preset) -> int:
    """Unique parameter count of a preset (tied weights counted once), computed on the meta device."""
    p = get_preset(preset) if isinstance(preset, str) else preset
    # Token ids do not change any shape, so placeholders are fine here.
    model = meta_model(build_config(p, bos_id=1, eos_id=2, pad_id=3, image_id=4))
    return sum(t.numel() for t in model.parameters())
