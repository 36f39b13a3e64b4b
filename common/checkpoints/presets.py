"""Model shapes of the random-weight checkpoints (LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and
the HF configs built from them."""

from __future__ import annotations

import dataclasses
import importlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    import torch
    from transformers import LlavaConfig, LlavaNextConfig, PreTrainedConfig, PreTrainedModel


def hf_class(name: str) -> type[PreTrainedModel]:
    """A transformers model class by name, imported when first asked for: the preset table itself,
    which the CLI reads to list its choices, imports no transformers."""
    return getattr(importlib.import_module("transformers"), name)


GIB = 1024**3
MIB = 1024**2

# The OpenAI CLIP normalisation constants of LLaVA-1.5's, LLaVA-NeXT's, Qwen2-VL's and Qwen2.5-VL's image
# processors.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class HFWeights:
    """What a preset's checkpoint is made of, for both families: the HF model class its `hf_model`
    names and the storage dtype of its weights (`dtype`, a field of each preset)."""

    hf_model: ClassVar[str]
    dtype: str

    @property
    def model_class(self) -> type[PreTrainedModel]:
        """The HF model class `hf_model` names."""
        return hf_class(self.hf_model)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The storage dtype of every weight tensor."""
        import torch  # here, not at the top: the CLI reads the presets without torch

        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class Preset(HFWeights):
    """Every shape and storage choice of one LLaVA-1.5 preset (and, with its tiling, of a LlavaNextPreset);
    the config is derived from this alone."""

    # The model family (selects the config, tokenizer, processor files and manifest format) and the name of
    # its HF model class, whose config_class is the config built.
    family: ClassVar[str] = "llava"
    hf_model: ClassVar[str] = "LlavaForConditionalGeneration"

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
        """Placeholder tokens of one image_size x image_size image (LLaVA-1.5: of every image): one per
        patch, the CLS token dropped ("default" strategy)."""
        return (self.image_size // self.patch_size) ** 2

    def config_fields(self) -> dict[str, object]:
        """The family's own entries of the top-level HF config."""
        return {
            # Recorded as a release has it, so architecture-dispatching loaders (HF's Auto classes,
            # llama.cpp's converter) pick the class.
            "architectures": [self.model_class.__name__],
            "image_seq_length": self.num_image_tokens,
        }


@dataclass(frozen=True, kw_only=True)
class LlavaNextPreset(Preset):
    """LLaVA-NeXT (LLaVA-1.6): LLaVA-1.5's CLIP tower, projector and Llama text model, over any-resolution
    tiles. An image is resized (aspect kept) and padded to the best of image_grid_pinpoints and cut into
    image_size x image_size tiles; the tiles and a downscaled whole-image base tile are encoded, the tiles'
    patch grid is unpadded back to the image's aspect with a learned image_newline after each row, and the
    base tile's features go first. So the placeholder count depends on the image's size (`image_tokens`)."""

    family: ClassVar[str] = "llava_next"
    hf_model: ClassVar[str] = "LlavaNextForConditionalGeneration"

    # (height, width) resolutions an image may be tiled at; each side a whole number of tiles.
    image_grid_pinpoints: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise ValueError(f"{self.name}: image_size must be a multiple of patch_size")
        if not self.image_grid_pinpoints or any(
            side <= 0 or side % self.image_size for pinpoint in self.image_grid_pinpoints for side in pinpoint
        ):
            raise ValueError(f"{self.name}: every pinpoint side must be a positive multiple of image_size")

    def config_fields(self) -> dict[str, object]:
        return {
            **super().config_fields(),
            "image_grid_pinpoints": [list(pinpoint) for pinpoint in self.image_grid_pinpoints],
        }

    def best_pinpoint(self, height: int, width: int) -> tuple[int, int]:
        """The tiling resolution of a height x width image: the most image pixels kept once it is scaled
        to fit (never counting upscaling), then the least padding; the first listed wins a tie."""

        def rank(pinpoint: tuple[int, int]) -> tuple[int, int]:
            scale = min(pinpoint[0] / height, pinpoint[1] / width)
            kept = min(int(height * scale) * int(width * scale), height * width)
            return kept, kept - pinpoint[0] * pinpoint[1]

        return max(self.image_grid_pinpoints, key=rank)

    def image_tokens(self, height: int, width: int) -> int:
        """Placeholder tokens of a height x width image: the base tile's, then the unpadded tile grid's
        patches with one newline per row."""
        per_tile = self.image_size // self.patch_size
        rows, cols = (side // self.image_size * per_tile for side in self.best_pinpoint(height, width))
        # The image fills the grid along one axis; drop the padding rows (or columns) of the other evenly.
        if width * rows > cols * height:
            rows -= (rows - int(round(height * (cols / width), 7))) // 2 * 2
        else:
            cols -= (cols - int(round(width * (rows / height), 7))) // 2 * 2
        return self.num_image_tokens + rows * cols + rows


@dataclass(frozen=True, kw_only=True)
class QwenVLPreset(HFWeights):
    """Every shape and storage choice of one Qwen vision-language preset; the config derives from it alone.

    The fields are what Qwen2-VL, Qwen2.5-VL and Qwen3-VL share: a ViT over Conv3d patches whose merger
    folds each spatial_merge_size^2 group of patches into one token of the text width, and a Qwen text
    model with multimodal rotary embeddings (M-RoPE). A subclass per family adds its own fields and says
    how they enter the HF config (`vision_fields`, `text_fields`).
    """

    # The model family (selects the config, tokenizer, processor files and manifest format), the name of its
    # HF model class (whose config_class is the config built) and the processor class a release's files name.
    family: ClassVar[str]
    hf_model: ClassVar[str]
    processor_class: ClassVar[str]
    # The vision tower's activation and the image processor's normalisation constants.
    vision_act: ClassVar[str]
    image_mean: ClassVar[tuple[float, float, float]] = CLIP_MEAN
    image_std: ClassVar[tuple[float, float, float]] = CLIP_STD
    # Whether preprocessor_config.json names the pixel bounds min_pixels / max_pixels besides `size`.
    pixel_bound_keys: ClassVar[bool] = True

    name: str
    # Vision transformer: width, blocks, heads, MLP width, square patch side in pixels.
    vision_hidden: int
    vision_depth: int
    vision_heads: int
    vision_intermediate: int
    patch_size: int
    # Qwen language model
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
        if self.text_heads % self.text_kv_heads:
            raise ValueError(f"{self.name}: text heads must be a multiple of kv heads")
        if 2 * sum(self.mrope_section) != self.head_dim:
            raise ValueError(f"{self.name}: mrope_section {self.mrope_section} must sum to head_dim / 2")
        # The vision rotary embedding splits each head in halves for rows and columns, each in pairs.
        if self.vision_hidden % self.vision_heads or (self.vision_hidden // self.vision_heads) % 4:
            raise ValueError(f"{self.name}: vision head dim must be a whole multiple of 4")
        if not self.image_factor**2 <= self.min_pixels <= self.max_pixels:
            raise ValueError(f"{self.name}: need {self.image_factor}^2 <= min_pixels <= max_pixels")

    @property
    def head_dim(self) -> int:
        """Width of one text attention head."""
        if self.text_hidden % self.text_heads:
            raise ValueError(f"{self.name}: text heads must divide the width")
        return self.text_hidden // self.text_heads

    @property
    def image_factor(self) -> int:
        """Resized image sides are multiples of this; one merged (placeholder) token covers factor^2 px."""
        return self.patch_size * self.spatial_merge_size

    def vision_fields(self) -> dict[str, object]:
        """The family's entries of the HF vision config: by default a ViT of its own width whose merger
        projects to out_hidden_size (Qwen2.5-VL, Qwen3-VL)."""
        return {
            "hidden_size": self.vision_hidden,
            "intermediate_size": self.vision_intermediate,
            "out_hidden_size": self.text_hidden,
        }

    def text_fields(self) -> dict[str, object]:
        """The family's entries of the HF text config: by default Qwen2 attention, no sliding window."""
        return {"max_window_layers": self.text_layers, "use_sliding_window": False}

    def rope_parameters(self) -> dict[str, object]:
        """The text model's M-RoPE: default rotary frequencies split over (t, h, w) by mrope_section."""
        return {
            "rope_type": "default",
            "mrope_section": list(self.mrope_section),
            "rope_theta": self.rope_theta,
        }


@dataclass(frozen=True, kw_only=True)
class Qwen2VLPreset(QwenVLPreset):
    """Qwen2-VL: LayerNorm ViT blocks with a quick-GELU MLP, full attention; Qwen2 text model."""

    family: ClassVar[str] = "qwen2_vl"
    hf_model: ClassVar[str] = "Qwen2VLForConditionalGeneration"
    processor_class: ClassVar[str] = "Qwen2VLProcessor"
    vision_act: ClassVar[str] = "quick_gelu"

    def __post_init__(self) -> None:
        super().__post_init__()
        # Qwen2VLVisionConfig states the MLP width as a whole multiple of the ViT width.
        if self.vision_intermediate % self.vision_hidden:
            raise ValueError(f"{self.name}: vision_intermediate must be a multiple of vision_hidden")

    def vision_fields(self) -> dict[str, object]:
        # Qwen2-VL names the ViT width embed_dim; its hidden_size is the merger's output (the text width).
        return {
            "embed_dim": self.vision_hidden,
            "mlp_ratio": self.vision_intermediate // self.vision_hidden,
            "hidden_size": self.text_hidden,
        }


@dataclass(frozen=True, kw_only=True)
class Qwen2_5VLPreset(QwenVLPreset):
    """Qwen2.5-VL: RMSNorm ViT blocks with a gated SiLU MLP; most blocks attend within windows of
    window_size pixels, the fullatt_block_indexes blocks over the whole image; Qwen2 text model."""

    family: ClassVar[str] = "qwen2_5_vl"
    hf_model: ClassVar[str] = "Qwen2_5_VLForConditionalGeneration"
    processor_class: ClassVar[str] = "Qwen2_5_VLProcessor"
    vision_act: ClassVar[str] = "silu"

    # Side of one attention window in pixels: a whole number of merged (factor x factor px) tokens.
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    # Video only: temporal positions per second of video.
    tokens_per_second: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window_size % self.image_factor:
            raise ValueError(f"{self.name}: window_size must be a multiple of {self.image_factor}")
        if not all(0 <= i < self.vision_depth for i in self.fullatt_block_indexes):
            raise ValueError(f"{self.name}: fullatt_block_indexes must name vision blocks")

    def vision_fields(self) -> dict[str, object]:
        return {
            **super().vision_fields(),
            "window_size": self.window_size,
            "fullatt_block_indexes": list(self.fullatt_block_indexes),
            "tokens_per_second": self.tokens_per_second,
        }


@dataclass(frozen=True, kw_only=True)
class Qwen3VLPreset(QwenVLPreset):
    """Qwen3-VL: LayerNorm ViT blocks with a tanh-GELU MLP and a learned (interpolated) position grid;
    DeepStack adds the features of deepstack_visual_indexes blocks to the first text layers' image
    positions; Qwen3 text model (q/k RMSNorm, no attention biases, explicit head_dim, interleaved M-RoPE)."""

    family: ClassVar[str] = "qwen3_vl"
    hf_model: ClassVar[str] = "Qwen3VLForConditionalGeneration"
    processor_class: ClassVar[str] = "Qwen3VLProcessor"
    vision_act: ClassVar[str] = "gelu_pytorch_tanh"
    image_mean: ClassVar[tuple[float, float, float]] = (0.5, 0.5, 0.5)
    image_std: ClassVar[tuple[float, float, float]] = (0.5, 0.5, 0.5)
    # A Qwen3-VL release states the pixel bounds only as size.{shortest,longest}_edge.
    pixel_bound_keys: ClassVar[bool] = False

    text_head_dim: int
    # Learned position embeddings: a square grid, bilinearly resampled to each image's patch grid.
    num_position_embeddings: int
    # Vision blocks whose output (merged by a merger of its own) is added after text layers 0, 1, ...
    deepstack_visual_indexes: tuple[int, ...]
    rope_theta: float = 5_000_000.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ValueError(f"{self.name}: num_position_embeddings must be a square")
        if not all(0 <= i < self.vision_depth for i in self.deepstack_visual_indexes):
            raise ValueError(f"{self.name}: deepstack_visual_indexes must name vision blocks")
        if len(self.deepstack_visual_indexes) > self.text_layers:
            raise ValueError(f"{self.name}: more deepstack features than text layers to take them")
        # Interleaved M-RoPE: frequency 3i+1 rotates by height (i < h), 3i+2 by width (i < w), the rest
        # by time, so the height and width runs must end inside the head_dim / 2 frequencies.
        _, h, w = self.mrope_section
        if max(3 * h - 2, 3 * w - 1) >= self.head_dim // 2:
            raise ValueError(f"{self.name}: interleaved mrope_section {self.mrope_section} overruns head_dim")

    @property
    def head_dim(self) -> int:
        return self.text_head_dim

    def vision_fields(self) -> dict[str, object]:
        return {
            **super().vision_fields(),
            "num_position_embeddings": self.num_position_embeddings,
            "deepstack_visual_indexes": list(self.deepstack_visual_indexes),
        }

    def text_fields(self) -> dict[str, object]:
        return {"head_dim": self.text_head_dim, "attention_bias": False}

    def rope_parameters(self) -> dict[str, object]:
        return {**super().rope_parameters(), "mrope_interleaved": True}


# The LLaVA and the Qwen vision-language families, one preset class each.
LLAVA_FAMILIES: tuple[type[Preset], ...] = (Preset, LlavaNextPreset)
QWEN_FAMILIES: tuple[type[QwenVLPreset], ...] = (Qwen2VLPreset, Qwen2_5VLPreset, Qwen3VLPreset)

# Any preset; `.family` tells them apart.
AnyPreset = Preset | QwenVLPreset

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
        vision_hidden=32,
        vision_intermediate=128,
        vision_depth=2,
        vision_heads=2,
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
        vision_hidden=384,
        vision_intermediate=1536,
        vision_depth=6,
        vision_heads=6,
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
        vision_hidden=1280,
        vision_intermediate=5120,
        vision_depth=32,
        vision_heads=16,
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


PresetT = TypeVar("PresetT", bound=AnyPreset)


def _like(base: str, family: type[PresetT], **changes: Any) -> PresetT:
    """A `family` preset with the `base` preset's shapes and storage except `changes`; fields with a
    default (rope_theta, ...) take the family's own default unless changed, and fields of the base's family
    that `family` lacks are dropped."""
    template = PRESETS[base]
    own = {f.name for f in dataclasses.fields(family)}
    shared = {
        f.name: getattr(template, f.name)
        for f in dataclasses.fields(template)
        if f.name in own and f.default is dataclasses.MISSING
    }
    return family(**{**shared, **changes})


# The later Qwen families: each tiny / small preset keeps the text model and storage of the Qwen2-VL one
# (Qwen2.5-VL-7B's text model is Qwen2-VL-7B's), so what differs is the family's own architecture.
PRESETS |= {
    # Windowed and full attention both run: block 0 attends within 56-px windows (2x2 merged tokens),
    # block 1 over the whole image; a 112-168 px image (the cap) spans 2x2 to 3x3 windows.
    "tiny-qwen2.5-vl": _like(
        "tiny-qwen2-vl",
        Qwen2_5VLPreset,
        name="tiny-qwen2.5-vl",
        vision_intermediate=96,
        window_size=56,
        fullatt_block_indexes=(1,),
        max_pixels=168 * 168,
    ),
    # ~100M parameters, tied and sharded like small-qwen2-vl; windows of 4x4 merged tokens.
    "small-qwen2.5-vl": _like(
        "small-qwen2-vl",
        Qwen2_5VLPreset,
        name="small-qwen2.5-vl",
        vision_intermediate=1024,
        window_size=112,
        fullatt_block_indexes=(2, 5),
    ),
    # The shapes of Qwen/Qwen2.5-VL-7B-Instruct (windowed gated-MLP ViT + Qwen2-VL-7B's text), random weights.
    "qwen2.5-vl-7b": _like(
        "qwen2-vl-7b",
        Qwen2_5VLPreset,
        name="qwen2.5-vl-7b",
        vision_intermediate=3420,
        window_size=112,
        fullatt_block_indexes=(7, 15, 23, 31),
        tokenizer_vocab=151665,
        max_position_embeddings=128000,
    ),
    # DeepStack runs: blocks 0 and 1 of 3 feed text layers 0 and 1. 16-px patches, an 8x8 position grid;
    # a 56x56 image becomes 64x64 = 4x4 patches = 4 placeholder tokens, 160x160 (the cap) 25.
    "tiny-qwen3-vl": _like(
        "tiny-qwen2-vl",
        Qwen3VLPreset,
        name="tiny-qwen3-vl",
        vision_intermediate=64,
        vision_depth=3,
        patch_size=16,
        num_position_embeddings=64,
        deepstack_visual_indexes=(0, 1),
        text_head_dim=16,
        mrope_section=(4, 2, 2),
        min_pixels=64 * 64,
        max_pixels=160 * 160,
    ),
    "small-qwen3-vl": _like(
        "small-qwen2-vl",
        Qwen3VLPreset,
        name="small-qwen3-vl",
        patch_size=16,
        num_position_embeddings=576,
        deepstack_visual_indexes=(1, 3, 5),
        text_head_dim=64,
        mrope_section=(12, 10, 10),
        min_pixels=64 * 64,
    ),
    # The shapes of Qwen/Qwen3-VL-8B-Instruct (SigLIP2-sized ViT with DeepStack + Qwen3-8B), random weights.
    "qwen3-vl-8b": Qwen3VLPreset(
        name="qwen3-vl-8b",
        vision_hidden=1152,
        vision_intermediate=4304,
        vision_depth=27,
        vision_heads=16,
        patch_size=16,
        num_position_embeddings=2304,
        deepstack_visual_indexes=(8, 16, 24),
        text_hidden=4096,
        text_layers=36,
        text_heads=32,
        text_kv_heads=8,
        text_head_dim=128,
        text_intermediate=12288,
        mrope_section=(24, 20, 20),
        vocab_size=151936,
        tokenizer_vocab=151669,
        max_position_embeddings=262144,
        tie_word_embeddings=False,
        dtype="bfloat16",
        max_shard_bytes=2 * GIB,
        min_pixels=256 * 256,
        max_pixels=4096 * 4096,
    ),
}


def _tile_grids(tile: int) -> tuple[tuple[int, int], ...]:
    """llava-v1.6's pinpoints for `tile`-pixel tiles: (height, width) of 1x2, 2x1, 2x2, 3x1 and 1x3 tiles."""
    return tuple((rows * tile, cols * tile) for rows, cols in ((1, 2), (2, 1), (2, 2), (3, 1), (1, 3)))


# LLaVA-NeXT: each preset keeps the CLIP tower, text model and storage of its LLaVA-1.5 counterpart (as
# llava-v1.6-vicuna-7b keeps llava-1.5-7b's) and tiles images with llava-v1.6's grids of that tower's tiles.
PRESETS |= {
    # 56-px tiles of 7x7 patches: a 90x70 (width x height) image tiles 2x2 and unpads to 10x14 patches,
    # 49 + 140 + 10 = 199 placeholder tokens; 70x90 gives 203, a wide 160x40 (1x3 tiles) 159, and a
    # square of 112 px or more the most, 259.
    "tiny-llava-next": _like(
        "tiny-llava", LlavaNextPreset, name="tiny-llava-next", image_grid_pinpoints=_tile_grids(56)
    ),
    # Tied and sharded like small-llava; 192-px tiles of 12x12 patches, up to 144 + 576 + 24 = 744 tokens.
    "small-llava-next": _like(
        "small-llava", LlavaNextPreset, name="small-llava-next", image_grid_pinpoints=_tile_grids(192)
    ),
    # The shapes of llava-hf/llava-v1.6-vicuna-7b-hf (CLIP ViT-L/14-336 + Vicuna-7B, i.e. llava-1.5-7b's,
    # plus image_newline), random weights; up to 576 + 2304 + 48 = 2928 tokens per image.
    "llava-next-7b": _like(
        "llava-1.5-7b",
        LlavaNextPreset,
        name="llava-next-7b",
        vision_projection_dim=768,
        image_grid_pinpoints=_tile_grids(336),
    ),
}


def get_preset(name: str) -> AnyPreset:
    """Look a preset up by name, with an error that lists the valid names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(PRESETS)}") from None


def build_config(
    preset: Preset, bos_id: int, eos_id: int, pad_id: int, image_id: int
) -> LlavaConfig | LlavaNextConfig:
    """The LlavaConfig (LlavaNextConfig for a LlavaNextPreset) for a preset, with special-token ids taken
    from the trained tokenizer."""
    from transformers import CLIPVisionConfig, LlamaConfig

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
    return preset.model_class.config_class(
        vision_config=vision,
        text_config=text,
        image_token_index=image_id,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=-2,
        multimodal_projector_bias=True,
        tie_word_embeddings=preset.tie_word_embeddings,
        dtype=preset.dtype,
        **preset.config_fields(),
    )


def build_qwen_vl_config(
    preset: QwenVLPreset,
    *,
    pad_id: int,
    eos_id: int,
    image_id: int,
    video_id: int,
    vision_start_id: int,
    vision_end_id: int,
) -> PreTrainedConfig:
    """The family's HF config (Qwen2VLConfig, ...) for a preset, with the trained tokenizer's special ids."""
    vision = {
        "depth": preset.vision_depth,
        "hidden_act": preset.vision_act,
        "num_heads": preset.vision_heads,
        "in_channels": 3,
        "patch_size": preset.patch_size,
        "spatial_merge_size": preset.spatial_merge_size,
        "temporal_patch_size": preset.temporal_patch_size,
        **preset.vision_fields(),
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
        "rms_norm_eps": preset.rms_norm_eps,
        "rope_parameters": preset.rope_parameters(),
        # As in Qwen's own releases: bos is <|endoftext|> but the tokenizer never prepends it.
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "tie_word_embeddings": preset.tie_word_embeddings,
        "dtype": preset.dtype,
        **preset.text_fields(),
    }
    return preset.model_class.config_class(
        # Recorded in config.json as a release has it, so architecture-dispatching loaders pick the class.
        architectures=[preset.model_class.__name__],
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
    model_classes = [hf_class(cls.hf_model) for cls in (*LLAVA_FAMILIES, *QWEN_FAMILIES)]
    try:
        model_class = next(cls for cls in model_classes if type(config) is cls.config_class)
    except StopIteration:
        raise TypeError(f"no model class for {type(config).__name__}") from None
    import torch

    with torch.device("meta"):
        return model_class(config)


def placeholder_config(preset: AnyPreset) -> PreTrainedConfig:
    """A preset's config with made-up token ids: right for shapes and counts, not for a checkpoint."""
    if isinstance(preset, QwenVLPreset):
        return build_qwen_vl_config(
            preset, pad_id=0, eos_id=2, image_id=5, video_id=6, vision_start_id=3, vision_end_id=4
        )
    return build_config(preset, bos_id=1, eos_id=2, pad_id=3, image_id=4)


def count_parameters(preset: str | AnyPreset) -> int:
    """Unique parameter count of a preset (tied weights counted once), computed on the meta device."""
    p = get_preset(preset) if isinstance(preset, str) else preset
    # Token ids do not change any shape, so placeholders are fine here.
    model = meta_model(placeholder_config(p))
    return sum(t.numel() for t in model.parameters())
