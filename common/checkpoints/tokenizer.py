"""A real byte-level BPE tokenizer and LLaVA processor, trained from the packaged corpus at write time."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import CLIPImageProcessorPil, LlavaProcessor, PreTrainedTokenizerFast

from common.checkpoints.presets import Preset

UNK, BOS, EOS, PAD, IMAGE = "<unk>", "<s>", "</s>", "<pad>", "<image>"
# Trainer special tokens take the first ids in this order: <unk>=0, <s>=1, </s>=2, <pad>=3, <image>=4.
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD, IMAGE)

# The OpenAI CLIP normalisation constants that LLaVA-1.5's image processor uses.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class SpecialIds:
    """Token ids the model config must agree with, plus how many ids the tokenizer can produce."""

    unk: int
    bos: int
    eos: int
    pad: int
    image: int
    num_tokens: int


def read_package_text(name: str) -> str:
    """Read a text file shipped inside common/checkpoints (the corpus or the chat template)."""
    return resources.files("common.checkpoints").joinpath(name).read_text(encoding="utf-8")


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on the packaged corpus; the same inputs give the same vocab and merges."""
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Seeding all 256 byte symbols means any input encodes without <unk>, like a Llama tokenizer.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    # Paragraphs are the training "sentences", so merges never straddle two unrelated passages.
    paragraphs = [p for p in read_package_text("corpus.txt").split("\n\n") if p.strip()]
    tok.train_from_iterator(paragraphs, trainer=trainer)
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


def build_processor(preset: Preset, tokenizer: PreTrainedTokenizerFast) -> LlavaProcessor:
    """A LlavaProcessor (CLIP image processing + chat template) matching the preset's vision tower."""
    # The PIL backend is instantiated directly because torchvision is not installed; it still saves as
    # "CLIPImageProcessor", so a machine with torchvision loads the fast backend from the same file.
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": preset.image_size},
        crop_size={"height": preset.image_size, "width": preset.image_size},
        do_resize=True,
        do_center_crop=True,
        do_rescale=True,
        do_normalize=True,
        do_convert_rgb=True,
        image_mean=list(CLIP_MEAN),
        image_std=list(CLIP_STD),
    )
    return LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=preset.patch_size,
        vision_feature_select_strategy="default",
        # The CLIP tower emits a CLS token; "default" drops it, so one image = (size / patch)^2 tokens.
        num_additional_image_tokens=1,
        chat_template=read_package_text("chat_template.jinja"),
        image_token=IMAGE,
    )
