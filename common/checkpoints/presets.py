"""Model shapes of the random-weight checkpoints (LLaVA-1.5, Qwen2-VL) and the HF configs built from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedConfig,
    PreTrainedModel,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class Preset:
    """Every shape and storage choice of one LLaVA-1.5 preset; the config is derived from this alone."""

    # The model family; selects the config, tokenizer, processor files and manifest format.
    family: ClassVar[str] = "llava"

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


@dataclass(frozen=True)
class Qwen2VLPreset:
    """Every shape and storage choice of one Qwen2-VL preset; the config is derived from this alone."""

    family: ClassVar[str] = "qwen2_vl"

    name: str
    # Vision transformer: Conv3d patch embedding, pre-norm blocks, then a merger that folds each
    # spatial_merge_size x spatial_merge_size group of patches into one token of the text width.
    vision_embed_dim: int
    vision_depth: int
    vision_heads: int
    vision_mlp_ratio: int
    patch_size: int
    # Qwen2 language model with multimodal rotary embeddings (M-RoPE)
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_intermediate: int
    # Rotary frequency pairs given to the (temporal, height, width) position ids; sums to head_dim / 2.
    mrope_section: tuple[int, int, int]
    # Embedding / lm_head rows; may exceed the trained tokenizer (the extra rows are zero).
    vocab_size: int
    tokenizer_vocab: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str
    max_shard_bytes: int
    # Image processor: an image is resized (aspect kept) to sides that are multiples of
    # patch_size * spatial_merge_size and an area within [min_pixels, max_pixels].
    min_pixels: int
    max_pixels: int
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0

    def __post_init__(self) -> None:
        if self.text_hidden % self.text_heads or self.text_heads % self.text_kv_heads:
            raise ValueError(f"{self.name}: text heads must divide the width and be a multiple of kv heads")
        if 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(f"{self.name}: mrope_section {self.mrope_section} must sum to head_dim / 2")
        # The vision rotary embedding splits each head in halves for rows and columns, each in pairs.
        if self.vision_embed_dim % self.vision_heads or (self.vision_embed_dim // self.vision_heads) % 4:
            raise ValueError(f"{self.name}: vision head dim must be a whole multiple of 4")
        if not self.image_factor**2 <= self.min_pixels <= self.max_pixels:
            raise ValueError(f"{self.name}: need {self.image_factor}^2 <= min_pixels <= max_pixels")

    @property
    def head_dim(self) -> int:
        """Width of one text attention head."""
        return self.text_hidden // self.text_heads

    @property
    def image_factor(self) -> int:
        """Resized image sides are multiples of this; one merged (placeholder) token covers factor^2 px."""
        return self.patch_size * self.spatial_merge_size

    @property
    def torch_dtype(self) -> torch.dtype:
        """The storage dtype of every weight tensor."""
        return getattr(torch, self.dtype)


# Any preset; `.family` tells them apart.
AnyPreset = Preset | Qwen2VLPreset

PRESETS: dict[str, AnyPreset] = {
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
    # Fast CPU tests: a 56x56 image is 4x4 patches = 4 placeholder tokens, 112x112 (the cap) is 16.
    "tiny-qwen2-vl": Qwen2VLPreset(
        name="tiny-qwen2-vl",
        vision_embed_dim=32,
        vision_depth=2,
        vision_heads=2,
        vision_mlp_ratio=4,
        patch_size=14,
        text_hidden=64,
        text_layers=4,
        text_heads=4,
        text_kv_heads=2,
        text_intermediate=176,
        mrope_section=(2, 3, 3),
        vocab_size=1024,
        tokenizer_vocab=1024,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        dtype="float32",
        max_shard_bytes=2 * GIB,
        min_pixels=56 * 56,
        max_pixels=112 * 112,
    ),
    # ~100M parameters for benchmarks; tied (like Qwen2-VL-2B) and sharded (~380 MB in 256 MiB shards).
    "small-qwen2-vl": Qwen2VLPreset(
        name="small-qwen2-vl",
        vision_embed_dim=384,
        vision_depth=6,
        vision_heads=6,
        vision_mlp_ratio=4,
        patch_size=14,
        text_hidden=768,
        text_layers=12,
        text_heads=12,
        text_kv_heads=4,
        text_intermediate=2048,
        mrope_section=(8, 12, 12),
        vocab_size=8192,
        tokenizer_vocab=8192,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        dtype="float32",
        max_shard_bytes=256 * MIB,
        min_pixels=56 * 56,
        max_pixels=448 * 448,
    ),
    # The shapes of Qwen/Qwen2-VL-7B-Instruct (675M-parameter ViT + Qwen2-7B), random weights.
    "qwen2-vl-7b": Qwen2VLPreset(
        name="qwen2-vl-7b",
        vision_embed_dim=1280,
        vision_depth=32,
        vision_heads=16,
        vision_mlp_ratio=4,
        patch_size=14,
        text_hidden=3584,
        text_layers=28,
        text_heads=28,
        text_kv_heads=4,
        text_intermediate=18944,
        mrope_section=(16, 24, 24),
        vocab_size=152064,
        tokenizer_vocab=151657,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        dtype="bfloat16",
        max_shard_bytes=2 * GIB,
        min_pixels=56 * 56,
        max_pixels=28 * 28 * 16384,
    ),
}


def get_preset(name: str) -> AnyPreset:
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


def build_qwen2_vl_config(
    preset: Qwen2VLPreset,
    *,
    pad_id: int,
    eos_id: int,
    image_id: int,
    video_id: int,
    vision_start_id: int,
    vision_end_id: int,
) -> Qwen2VLConfig:
    """The Qwen2VLConfig for a preset, with special-token ids taken from the trained tokenizer."""
    vision = {
        "depth": preset.vision_depth,
        "embed_dim": preset.vision_embed_dim,
        # The merger's output width: merged image tokens go straight into the text model.
        "hidden_size": preset.text_hidden,
        "hidden_act": "quick_gelu",
        "mlp_ratio": preset.vision_mlp_ratio,
        "num_heads": preset.vision_heads,
        "in_channels": 3,
        "patch_size": preset.patch_size,
        "spatial_merge_size": preset.spatial_merge_size,
        "temporal_patch_size": preset.temporal_patch_size,
    }
    text = {
        "vocab_size": preset.vocab_size,
        "hidden_size": preset.text_hidden,
        "intermediate_size": preset.text_intermediate,
        "num_hidden_layers": preset.text_layers,
        "num_attention_heads": preset.text_heads,
        "num_key_value_heads": preset.text_kv_heads,
        "hidden_act": "silu",
        "max_position_embeddings": preset.max_position_embeddings,
        "max_window_layers": preset.text_layers,
        "use_sliding_window": False,
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": list(preset.mrope_section),
            "rope_theta": preset.rope_theta,
        },
        # As in Qwen's own releases: bos is <|endoftext|> but the tokenizer never prepends it.
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "tie_word_embeddings": preset.tie_word_embeddings,
        "dtype": preset.dtype,
    }
    return Qwen2VLConfig(
        # Recorded in config.json as a release has it, so architecture-dispatching loaders pick the class.
        architectures=["Qwen2VLForConditionalGeneration"],
        vision_config=vision,
        text_config=text,
        image_token_id=image_id,
        video_token_id=video_id,
        vision_start_token_id=vision_start_id,
        vision_end_token_id=vision_end_id,
        tie_word_embeddings=preset.tie_word_embeddings,
        dtype=preset.dtype,
    )


def meta_model(config: PreTrainedConfig) -> PreTrainedModel:
    """Instantiate the model on the meta device: names and shapes without allocating any weights."""
    if isinstance(config, LlavaConfig):
        model_class: type[PreTrainedModel] = LlavaForConditionalGeneration
    elif isinstance(config, Qwen2VLConfig):
        model_class = Qwen2VLForConditionalGeneration
    else:
        raise TypeError(f"no model class for {type(config).__name__}")
    with torch.device("meta"):
        return model_class(config)


def placeholder_config(preset: AnyPreset) -> PreTrainedConfig:
    """A preset's config with made-up token ids: right for shapes and counts, not for a checkpoint."""
    if isinstance(preset, Qwen2VLPreset):
        return build_qwen2_vl_config(
            preset, pad_id=0, eos_id=2, image_id=5, video_id=6, vision_start_id=3, vision_end_id=4
        )
    return build_config(preset, bos_id=1, eos_id=2, pad_id=3, image_id=4)


def count_parameters(preset: str | AnyPreset) -> int:
    """Unique parameter count of a preset (tied weights counted once), computed on the meta device."""
    p = get_preset(preset) if isinstance(preset, str) else preset
    # Token ids do not change any shape, so placeholders are fine here.
    model = meta_model(placeholder_config(p))
    return sum(t.numel() for t in model.parameters())
