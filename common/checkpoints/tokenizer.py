"""Real byte-level BPE tokenizers and processors, trained from the packaged corpus at write time."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    CLIPImageProcessorPil,
    LlavaNextImageProcessorPil,
    LlavaNextProcessor,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    Qwen2VLImageProcessorPil,
)

from common.checkpoints.presets import CLIP_MEAN, CLIP_STD, LlavaNextPreset, Preset, QwenVLPreset

UNK, BOS, EOS, PAD, IMAGE = "<unk>", "<s>", "</s>", "<pad>", "<image>"
# Trainer special tokens take the first ids in this order: <unk>=0, <s>=1, </s>=2, <pad>=3, <image>=4.
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, IMAGE)

# The special tokens of Qwen2-VL, Qwen2.5-VL and Qwen3-VL. <|endoftext|> pads (there is no unk: byte-level
# BPE encodes anything), <|im_end|> ends a turn (eos), and each image is <|vision_start|> <|image_pad|>...
# <|vision_end|>.
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = (
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# The same order as Qwen's own ids, but first: <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2,
# <|vision_start|>=3, <|vision_end|>=4, <|image_pad|>=5, <|video_pad|>=6.
QWEN2_VL_SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)


@dataclass(frozen=True)
class SpecialIds:
    """Token ids the model config must agree with, plus how many ids the tokenizer can produce."""

    unk: int
    bos: int
    eos: int
    pad: int
    image: int
    num_tokens: int

    def dead_rows(self, lm_head: bool) -> list[int]:
        """Rows zeroed in embed_tokens (lm_head=False) or lm_head: ids that must never be generated."""
        # As inputs, <image> rows are replaced by image features and <pad> is masked, so zero is harmless.
        dead = [self.unk, self.pad, self.image]
        if lm_head:
            dead.append(self.bos)  # untied only: tied, this row is also the <s> embedding of every prompt
        return dead


@dataclass(frozen=True)
class QwenVLSpecialIds:
    """The Qwen-VL special-token ids, plus how many ids the tokenizer can produce."""

    pad: int  # <|endoftext|>
    im_start: int
    eos: int  # <|im_end|>
    vision_start: int
    vision_end: int
    image: int  # <|image_pad|>
    video: int  # <|video_pad|>
    num_tokens: int

    def dead_rows(self, lm_head: bool) -> list[int]:
        """Rows zeroed in embed_tokens (lm_head=False) or lm_head: ids that must never be generated."""
        # As inputs, the pad rows are replaced by vision features and <|endoftext|> is masked.
        dead = [self.pad, self.image, self.video]
        if lm_head:
            # Untied only (tied, these rows are also the embeddings of every chat/vision prompt): the
            # markers the chat template and the processor place, which a reply never contains.
            dead += [self.im_start, self.vision_start, self.vision_end]
        return dead


def read_package_text(name: str) -> str:
    """Read a text file shipped inside common/checkpoints (the corpus or the chat template)."""
    return resources.files("common.checkpoints").joinpath(name).read_text(encoding="utf-8")


def train_bpe(vocab_size: int, special_tokens: tuple[str, ...], unk: str | None) -> Tokenizer:
    """Train a byte-level BPE on the packaged corpus; the same inputs give the same vocab and merges.

    The special tokens take the first ids, in the order given; the result has no post-processor.
    """
    tok = Tokenizer(models.BPE(unk_token=unk) if unk is not None else models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        # Seeding all 256 byte symbols means any input encodes without <unk>, like a Llama tokenizer.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    # Paragraphs are the training "sentences", so merges never straddle two unrelated passages.
    paragraphs = [p for p in read_package_text("corpus.txt").split("\n\n") if p.strip()]
    tok.train_from_iterator(paragraphs, trainer=trainer)
    return tok


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """The LLaVA (Llama-style) tokenizer: <unk>, and <s> prepended to every encoded prompt."""
    tok = train_bpe(vocab_size, SPECIAL_TOKENS, UNK)
    bos_id = tok.token_to_id(BOS)
    # LLaVA's Llama tokenizer prepends <s> to every encoded prompt; mirror that in the post-processor.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def build_tokenizer(preset: Preset) -> tuple[PreTrainedTokenizerFast, SpecialIds]:
    """The HF tokenizer for a preset and its special ids; the chat template lives on the processor."""
    backend = train_tokenizer(preset.tokenizer_vocab)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        # Gives the tokenizer an `image_token` attribute, which LlavaProcessor reads.
        extra_special_tokens={"image_token": IMAGE},
        model_max_length=preset.max_position_embeddings,
        padding_side="left",
    )
    ids = SpecialIds(
        unk=hf_tok.convert_tokens_to_ids(UNK),
        bos=hf_tok.convert_tokens_to_ids(BOS),
        eos=hf_tok.convert_tokens_to_ids(EOS),
        pad=hf_tok.convert_tokens_to_ids(PAD),
        image=hf_tok.convert_tokens_to_ids(IMAGE),
        num_tokens=len(hf_tok),
    )
    if ids.num_tokens > preset.vocab_size:
        raise ValueError(f"tokenizer has {ids.num_tokens} tokens but the model only {preset.vocab_size} rows")
    return hf_tok, ids


def build_processor(
    preset: Preset, tokenizer: PreTrainedTokenizerFast
) -> LlavaProcessor | LlavaNextProcessor:
    """A LlavaProcessor (CLIP image processing + chat template) matching the preset's vision tower; for
    LLaVA-NeXT a LlavaNextProcessor, whose image processor also tiles at the preset's grid pinpoints."""
    # Every tile (LLaVA-1.5: the image) is CLIP-processed: shortest edge resized and centre-cropped to the
    # tower's image_size, rescaled and normalised.
    clip_processing = {
        "size": {"shortest_edge": preset.image_size},
        "crop_size": {"height": preset.image_size, "width": preset.image_size},
        "do_resize": True,
        "do_center_crop": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "image_mean": list(CLIP_MEAN),
        "image_std": list(CLIP_STD),
    }
    # The PIL backends are instantiated directly because torchvision is not installed; they still save as
    # "CLIPImageProcessor" / "LlavaNextImageProcessor", so a machine with torchvision loads the fast backend
    # from the same file.
    if isinstance(preset, LlavaNextPreset):
        image_processor = LlavaNextImageProcessorPil(
            **clip_processing,
            image_grid_pinpoints=[list(pinpoint) for pinpoint in preset.image_grid_pinpoints],
            # Pads every image's tile stack to the batch's most tiles, so pixel_values stack to one tensor.
            do_pad=True,
        )
        processor_class = LlavaNextProcessor
    else:
        image_processor = CLIPImageProcessorPil(**clip_processing)
        processor_class = LlavaProcessor
    return processor_class(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=preset.patch_size,
        vision_feature_select_strategy="default",
        # The CLIP tower emits a CLS token; "default" drops it, so one tile = (size / patch)^2 tokens.
        num_additional_image_tokens=1,
        chat_template=read_package_text("chat_template.jinja"),
        image_token=IMAGE,
    )


def build_qwen_vl_tokenizer(preset: QwenVLPreset) -> tuple[PreTrainedTokenizerFast, QwenVLSpecialIds]:
    """The HF tokenizer for a Qwen-VL preset of any family (no BOS, no unk) and its special ids."""
    backend = train_bpe(preset.tokenizer_vocab, QWEN2_VL_SPECIAL_TOKENS, None)
    # Adds no tokens (Qwen prepends nothing); keeps byte-level offsets untrimmed, as Qwen's tokenizer does.
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        # `image_token` / `video_token` attributes, which the Qwen-VL processors read.
        extra_special_tokens={"image_token": IMAGE_PAD, "video_token": VIDEO_PAD},
        model_max_length=preset.max_position_embeddings,
        padding_side="left",
        errors="replace",
    )
    ids = QwenVLSpecialIds(
        pad=hf_tok.convert_tokens_to_ids(ENDOFTEXT),
        im_start=hf_tok.convert_tokens_to_ids(IM_START),
        eos=hf_tok.convert_tokens_to_ids(IM_END),
        vision_start=hf_tok.convert_tokens_to_ids(VISION_START),
        vision_end=hf_tok.convert_tokens_to_ids(VISION_END),
        image=hf_tok.convert_tokens_to_ids(IMAGE_PAD),
        video=hf_tok.convert_tokens_to_ids(VIDEO_PAD),
        num_tokens=len(hf_tok),
    )
    if ids.num_tokens > preset.vocab_size:
        raise ValueError(f"tokenizer has {ids.num_tokens} tokens but the model only {preset.vocab_size} rows")
    return hf_tok, ids


def build_qwen_vl_image_processor(preset: QwenVLPreset) -> Qwen2VLImageProcessorPil:
    """Qwen2-VL's dynamic-resolution image processor (every Qwen-VL family's), matching the preset's
    patching, pixel bounds and normalisation."""
    # The PIL backend is instantiated directly because torchvision is not installed; it saves as
    # "Qwen2VLImageProcessor", so a machine with torchvision loads the fast backend from the same file.
    return Qwen2VLImageProcessorPil(
        min_pixels=preset.min_pixels,
        max_pixels=preset.max_pixels,
        patch_size=preset.patch_size,
        temporal_patch_size=preset.temporal_patch_size,
        merge_size=preset.spatial_merge_size,
        do_resize=True,
        do_rescale=True,
        do_normalize=True,
        do_convert_rgb=True,
        image_mean=list(preset.image_mean),
        image_std=list(preset.image_std),
    )
