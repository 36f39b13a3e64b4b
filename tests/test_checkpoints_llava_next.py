"""The LLaVA-NeXT (LLaVA-1.6) presets of the checkpoint writer: loadable by HF's own classes, any-resolution
tiling whose placeholder count follows the image's size, and the earlier families' files unchanged."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import tokenizers
import torch
import transformers
from transformers import (
    AutoProcessor,
    AutoTokenizer,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessorPil,
    LlavaNextProcessor,
)
from typer.testing import CliRunner

from common.checkpoints import PRESETS, LlavaNextPreset, count_parameters, is_checkpoint_dir, write_checkpoint
from common.checkpoints.presets import placeholder_config
from common.checkpoints.tokenizer import build_processor
from common.checkpoints.weights import tensor_specs
from tests.helpers.checkpoints import (
    _one_torch_thread,  # noqa: F401  (autouse: one torch thread)
    checkpoint_files,
    safetensors_keys,
    seeded_image,
    squashed,
)
from trident.cli.app import app

TINY, SMALL, REAL = "tiny-llava-next", "small-llava-next", "llava-next-7b"
PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"
# (width, height) of test images and the tiny preset's placeholder count for each: 49 for the base tile,
# then the tile grid's patches unpadded to the image's aspect, one newline per patch row.
TINY_TOKENS = {
    (90, 70): 199,  # 2x2 tiles, 14x14 patches unpadded to 10 rows: 49 + 10 * 14 + 10
    (70, 90): 203,  # 2x2 tiles, unpadded to 10 columns: 49 + 14 * 10 + 14
    (123, 77): 169,  # 2x2 tiles, unpadded to 8 rows: 49 + 8 * 14 + 8
    (300, 290): 259,  # 2x2 tiles, under 2 rows of padding so none dropped: 49 + 14 * 14 + 14
    (56, 56): 112,  # 1x2 tiles (as big a fit as 2x2, less padding), 7x14 unpadded to 8 columns: 49 + 56 + 7
    (160, 40): 159,  # 1x3 tiles, 7x21 patches unpadded to 5 rows: 49 + 5 * 21 + 5
    (40, 150): 175,  # 3x1 tiles, 21x7 patches unpadded to 5 columns: 49 + 21 * 5 + 21
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-llava-next checkpoint (seed 0), written once per module; treat it as read-only."""
    return write_checkpoint(tmp_path_factory.mktemp("llava_next") / TINY, TINY, seed=0)


@pytest.fixture(scope="module")
def tiny_model(tiny_dir: Path) -> LlavaNextForConditionalGeneration:
    return LlavaNextForConditionalGeneration.from_pretrained(tiny_dir).eval()


def _preset(name: str) -> LlavaNextPreset:
    preset = PRESETS[name]
    assert isinstance(preset, LlavaNextPreset)
    return preset


def test_tiny_loads_with_hf(tiny_dir: Path) -> None:
    preset = _preset(TINY)
    assert is_checkpoint_dir(tiny_dir)
    manifest = json.loads((tiny_dir / "trident_checkpoint.json").read_text())
    assert (manifest["format"], manifest["preset"]) == ("trident-llava-next", TINY)
    raw = json.loads((tiny_dir / "config.json").read_text())
    assert raw["model_type"] == "llava_next"
    assert raw["architectures"] == ["LlavaNextForConditionalGeneration"]

    model, info = LlavaNextForConditionalGeneration.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert safetensors_keys(tiny_dir) == set(model.state_dict())
    processor = AutoProcessor.from_pretrained(tiny_dir)
    tok = processor.tokenizer
    cfg, vision, text = model.config, model.config.vision_config, model.config.text_config
    assert cfg.image_token_index == tok.convert_tokens_to_ids("<image>") == processor.image_token_id == 4
    assert (text.bos_token_id, text.eos_token_id, text.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert (vision.image_size, vision.patch_size) == (56, 8)
    assert cfg.image_grid_pinpoints == [[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]]
    assert cfg.vision_feature_layer == -2 and cfg.vision_feature_select_strategy == "default"
    # The base tile's count, as llava-v1.6's 576 for 336-px tiles of 14-px patches.
    assert cfg.image_seq_length == preset.num_image_tokens == 49
    assert text.vocab_size == model.get_input_embeddings().weight.shape[0] == len(tok)
    assert not cfg.tie_word_embeddings
    # image_newline is drawn like a token embedding: a distinct input, not HF's near-zero init.
    newline = model.model.image_newline
    assert newline.shape == (64,) and 0.7 < newline.std() < 1.3


def test_same_seed_is_byte_identical_and_other_seed_differs(tiny_dir: Path, tmp_path: Path) -> None:
    again = checkpoint_files(write_checkpoint(tmp_path / "again", TINY, seed=0))
    assert again == checkpoint_files(tiny_dir)
    other_dir = write_checkpoint(tmp_path / "other", TINY, seed=1)
    other = checkpoint_files(other_dir)
    assert {name for name in again if other[name] != again[name]} == {
        "model.safetensors",
        "trident_checkpoint.json",  # records the seed
    }
    first = LlavaNextForConditionalGeneration.from_pretrained(tiny_dir).state_dict()
    second = LlavaNextForConditionalGeneration.from_pretrained(other_dir).state_dict()
    assert not any(
        torch.equal(first[name], second[name]) for name in ("model.image_newline", "lm_head.weight")
    )


def test_processor_tiles_and_expands_by_image_size(tiny_dir: Path) -> None:
    processor = AutoProcessor.from_pretrained(tiny_dir)
    # The PIL backend loads from the same files a torchvision machine would read as the fast one.
    assert type(processor) is LlavaNextProcessor
    assert type(processor.image_processor) is LlavaNextImageProcessorPil
    saved = json.loads((tiny_dir / "processor_config.json").read_text())
    assert saved["image_processor"]["image_processor_type"] == "LlavaNextImageProcessor"
    assert (saved["patch_size"], saved["num_additional_image_tokens"]) == (8, 1)

    wide, tall = seeded_image(0, (90, 70)), seeded_image(1, (70, 90))
    out = processor(text=[PROMPT, PROMPT], images=[wide, tall], return_tensors="pt", padding=True)
    counts = [row.tolist().count(processor.image_token_id) for row in out["input_ids"]]
    assert counts == [199, 203]
    # Per image: a base tile and 2x2 tiles, each one 56x56 crop; sizes are (height, width).
    assert tuple(out["pixel_values"].shape) == (2, 5, 3, 56, 56)
    assert out["image_sizes"].tolist() == [[70, 90], [90, 70]]
    # A 1x3-tiled image has one tile fewer; batched with a 2x2 one, its stack is zero-padded to 5.
    out = processor(
        text=[PROMPT, PROMPT], images=[seeded_image(2, (160, 40)), wide], return_tensors="pt", padding=True
    )
    assert tuple(out["pixel_values"].shape) == (2, 5, 3, 56, 56)
    assert torch.all(out["pixel_values"][0, 4] == 0) and not torch.all(out["pixel_values"][0, 3] == 0)


@pytest.mark.parametrize("size", list(TINY_TOKENS), ids=[f"{w}x{h}" for w, h in TINY_TOKENS])
def test_placeholders_match_the_model_features(
    tiny_model: LlavaNextForConditionalGeneration, tiny_dir: Path, size: tuple[int, int]
) -> None:
    # Processor, the preset's own count and the features HF's model packs all agree for each image size.
    processor = AutoProcessor.from_pretrained(tiny_dir)
    out = processor(text=PROMPT, images=[seeded_image(3, size)], return_tensors="pt")
    count = out["input_ids"][0].tolist().count(processor.image_token_id)
    width, height = size
    assert count == _preset(TINY).image_tokens(height, width) == TINY_TOKENS[size]
    with torch.no_grad():
        features = tiny_model.model.get_image_features(out["pixel_values"], out["image_sizes"]).pooler_output
    assert [f.shape[0] for f in features] == [count]


def test_real_preset_counts_agree_with_its_processor(tiny_dir: Path) -> None:
    # llava-v1.6's 336-px tiles and pinpoints: the preset's own count is LlavaNextProcessor's.
    preset = _preset(REAL)
    processor = build_processor(preset, AutoTokenizer.from_pretrained(tiny_dir))
    for width, height in [(336, 336), (640, 480), (480, 640), (1024, 200), (200, 1200), (1000, 999)]:
        out = processor(text=PROMPT, images=[seeded_image(6, (width, height))], return_tensors="pt")
        count = out["input_ids"][0].tolist().count(processor.image_token_id)
        assert count == preset.image_tokens(height, width), (width, height)
    assert preset.image_tokens(1000, 999) == 576 + 48 * 48 + 48


@pytest.mark.parametrize(
    ("text", "size"),
    [("USER: Tell me about the weather. ASSISTANT:", None), (PROMPT, (90, 70)), (PROMPT, (160, 40))],
    ids=["text", "image-2x2", "image-1x3"],
)
def test_hf_greedy_generate_wanders(
    tiny_model: LlavaNextForConditionalGeneration, tiny_dir: Path, text: str, size: tuple[int, int] | None
) -> None:
    processor = AutoProcessor.from_pretrained(tiny_dir)
    inputs = processor(
        text=text, images=None if size is None else [seeded_image(4, size)], return_tensors="pt"
    )
    greedy = {"do_sample": False, "max_new_tokens": 24, "min_new_tokens": 24}
    with torch.no_grad():
        out = tiny_model.generate(**inputs, **greedy, output_scores=True, return_dict_in_generate=True)
    new_tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(new_tokens) == 24 and len(set(new_tokens)) >= 8
    # The winner is decided far above float32 noise at most steps.
    decisive = [float(-scores[0].topk(2).values.diff()) > 1e-3 for scores in out.scores]
    assert sum(decisive) >= 20
    tok = processor.tokenizer
    assert not set(new_tokens) & {
        processor.image_token_id,
        tok.pad_token_id,
        tok.unk_token_id,
        tok.bos_token_id,
    }


def test_image_newline_reaches_the_output(
    tiny_model: LlavaNextForConditionalGeneration, tiny_dir: Path
) -> None:
    # A loader that drops image_newline (or places it wrong) is caught by a logits comparison.
    processor = AutoProcessor.from_pretrained(tiny_dir)
    inputs = processor(text=PROMPT, images=[seeded_image(5, (90, 70))], return_tensors="pt")
    with torch.no_grad():
        logits = tiny_model(**inputs).logits[0, -1]
        saved = tiny_model.model.image_newline.detach().clone()
        tiny_model.model.image_newline.zero_()
        try:
            without = tiny_model(**inputs).logits[0, -1]
        finally:
            tiny_model.model.image_newline.copy_(saved)
    assert (logits - without).abs().max() > 0.1


def test_preset_parameter_counts_and_shapes() -> None:
    real = _preset(REAL)
    assert real.dtype == "bfloat16" and not real.tie_word_embeddings
    assert (real.image_size, real.patch_size, real.vision_projection_dim) == (336, 14, 768)
    assert real.image_grid_pinpoints == ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
    # llava-1.5-7b's parameters plus the 4096-wide image_newline, counted on the meta device.
    assert count_parameters(REAL) == count_parameters("llava-1.5-7b") + 4096
    assert math.isclose(count_parameters(REAL), 7.063e9, rel_tol=1e-3)
    shapes = {s.name: s.shape for s in tensor_specs(placeholder_config(real), real.torch_dtype)}
    assert shapes["model.image_newline"] == (4096,)
    assert shapes["model.language_model.embed_tokens.weight"] == shapes["lm_head.weight"] == (32064, 4096)
    assert shapes["model.vision_tower.embeddings.patch_embedding.weight"] == (1024, 3, 14, 14)
    assert shapes["model.multi_modal_projector.linear_1.weight"] == (4096, 1024)
    small = _preset(SMALL)
    assert small.tie_word_embeddings and small.max_shard_bytes == 256 << 20
    assert 80e6 <= count_parameters(SMALL) <= 130e6 and count_parameters(TINY) < 1e6
    assert small.image_tokens(384, 384) == 144 + 24 * 24 + 24


def test_invalid_pinpoints_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of image_size"):
        LlavaNextPreset(**{**vars(_preset(TINY)), "image_grid_pinpoints": ((56, 100),)})


def test_cli_make_model_and_preset_lists(tmp_path: Path) -> None:
    runner = CliRunner()
    target = tmp_path / "model"
    result = runner.invoke(app, ["make-model", str(target), "--preset", TINY, "--seed", "2"])
    assert result.exit_code == 0, result.output
    assert f"parameters: {count_parameters(TINY)}" in result.output
    assert json.loads((target / "config.json").read_text())["model_type"] == "llava_next"
    help_text = runner.invoke(app, ["make-model", "--help"])
    assert help_text.exit_code == 0
    assert "LLaVA-NeXT:tiny-llava-next,small-llava-next,llava-next-7b." in squashed(help_text.output)
    assert all(name in squashed(help_text.output) for name in PRESETS)
    unknown = runner.invoke(app, ["make-model", str(tmp_path / "m"), "--preset", "llava-next-huge"])
    assert unknown.exit_code == 2
    assert all(name in squashed(unknown.output) for name in PRESETS)
    assert not (tmp_path / "m").exists()


# sha256 over "name sha256(file)" lines of each file the earlier families' tiny presets write (seed 0), as
# written before LLaVA-NeXT was added; the files record the transformers version, so only these pin it.
EARLIER_DIGESTS = {
    # config.json gained `architectures`, as a release records it; every other file as before.
    # The Qwen-VL chat template renders tools, calls and results (issue 48): its two files changed.
    "tiny-llava": "41d959d420ce5a490834d8c1231b223dc045810764538acb91cbaf63bb83c5f2",
    "tiny-qwen2-vl": "23704ee3ac875f1c703f251819dafd067fc4e34847cd30e86d3c8c598ac68cfa",
    "tiny-qwen2.5-vl": "358b3445f2498b6188f1cdbccd3b51dcb01f3883f41808c58597cbf4bfeb7b3f",
    "tiny-qwen3-vl": "d17cd6392a59cb0a0b691a04b086b68c0c7ba74af3a72f723afbfe5403ae4b16",
}


@pytest.mark.skipif(
    (transformers.__version__, tokenizers.__version__) != ("5.24.0", "0.23.3"),
    reason="the pinned digests are of files written with transformers 5.24.0 and tokenizers 0.23.3",
)
@pytest.mark.parametrize("name", list(EARLIER_DIGESTS))
def test_earlier_families_write_the_same_bytes(name: str, tmp_path: Path) -> None:
    files = checkpoint_files(write_checkpoint(tmp_path / name, name, seed=0))
    lines = "".join(f"{file} {hashlib.sha256(data).hexdigest()}\n" for file, data in files.items())
    assert hashlib.sha256(lines.encode()).hexdigest() == EARLIER_DIGESTS[name]
