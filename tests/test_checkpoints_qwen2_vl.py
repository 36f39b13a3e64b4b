"""The Qwen2-VL presets of the checkpoint writer: a Qwen2-VL release's files, loadable and usable by HF."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil
from typer.testing import CliRunner

from common.checkpoints import PRESETS, Qwen2VLPreset, count_parameters, is_checkpoint_dir, write_checkpoint
from common.checkpoints.presets import placeholder_config
from common.checkpoints.weights import tensor_specs
from tests.helpers.checkpoints import (
    IMAGE_PAD,
    RELEASE_FILES,
    VISION,
    _one_torch_thread,  # noqa: F401  (autouse: one torch thread)
    check_greedy_generate_is_not_collapsed,
    check_the_image_changes_the_output,
    checkpoint_files,
    safetensors_keys,
    seeded_image,
    squashed,
)
from trident.cli.app import app

QWEN_PRESETS = ("tiny-qwen2-vl", "small-qwen2-vl", "qwen2-vl-7b")
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-qwen2-vl checkpoint (seed 0), written once per module; treat it as read-only."""
    return write_checkpoint(tmp_path_factory.mktemp("qwen") / "tiny-qwen2-vl", "tiny-qwen2-vl", seed=0)


@pytest.fixture(scope="module")
def qwen_model(qwen_dir: Path) -> Qwen2VLForConditionalGeneration:
    return Qwen2VLForConditionalGeneration.from_pretrained(qwen_dir).eval()


def _template(directory: Path) -> str:
    return json.loads((directory / "chat_template.json").read_text())["chat_template"]


def test_tiny_loads_with_hf(qwen_dir: Path) -> None:
    assert {p.name for p in qwen_dir.iterdir()} == RELEASE_FILES
    assert is_checkpoint_dir(qwen_dir)
    manifest = json.loads((qwen_dir / "trident_checkpoint.json").read_text())
    assert manifest["format"] == "trident-qwen2-vl" and manifest["preset"] == "tiny-qwen2-vl"
    raw = json.loads((qwen_dir / "config.json").read_text())
    assert raw["model_type"] == "qwen2_vl"
    assert raw["architectures"] == ["Qwen2VLForConditionalGeneration"]

    model, info = Qwen2VLForConditionalGeneration.from_pretrained(qwen_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert safetensors_keys(qwen_dir) == set(model.state_dict())
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    cfg, text = model.config, model.config.text_config
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|vision_end|>", IMAGE_PAD)}
    assert cfg.image_token_id == ids[IMAGE_PAD] == tok.image_token_id
    assert cfg.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>") == tok.video_token_id
    assert (cfg.vision_start_token_id, cfg.vision_end_token_id) == (
        ids["<|vision_start|>"],
        ids["<|vision_end|>"],
    )
    assert text.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert text.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    assert text.vocab_size == model.get_input_embeddings().weight.shape[0] >= len(tok)
    assert text.rope_parameters["mrope_section"] == [2, 3, 3]
    assert text.rope_parameters["rope_type"] == "default" and text.rope_parameters["rope_theta"] == 1e6
    assert text.max_position_embeddings == 4096 and text.num_key_value_heads == 2
    assert cfg.vision_config.hidden_size == text.hidden_size == 64
    assert not cfg.tie_word_embeddings
    generation = json.loads((qwen_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.eos_token_id, tok.pad_token_id]

    # Qwen2 attention: biased q/k/v, bias-free o_proj. Norms are 1 +- noise, biases small and non-zero.
    attn = model.model.language_model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
    assert attn.o_proj.bias is None
    norm = model.model.language_model.norm.weight
    assert 0.85 < norm.min() < norm.max() < 1.15 and not torch.all(norm == 1)
    assert 0 < attn.q_proj.bias.abs().max() < 0.1
    assert 0 < model.model.visual.merger.ln_q.bias.abs().max() < 0.1


def test_same_seed_is_byte_identical_and_other_seed_differs(qwen_dir: Path, tmp_path: Path) -> None:
    again = checkpoint_files(write_checkpoint(tmp_path / "again", "tiny-qwen2-vl", seed=0))
    assert again == checkpoint_files(qwen_dir)
    other = checkpoint_files(write_checkpoint(tmp_path / "other", "tiny-qwen2-vl", seed=1))
    assert other["model.safetensors"] != again["model.safetensors"]
    assert other["tokenizer.json"] == again["tokenizer.json"]
    assert other["config.json"] == again["config.json"]


def test_tokenizer_special_tokens(qwen_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
    specials += [IMAGE_PAD, "<|video_pad|>"]
    assert [tok.convert_tokens_to_ids(t) for t in specials] == list(range(7))
    assert tok.bos_token is None and tok.unk_token is None
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    # Nothing is prepended, special tokens are atomic, and byte-level BPE round-trips any text.
    ids = tok(f"<|im_start|>user\n{VISION}Hi, café!<|im_end|>").input_ids
    assert ids[:2] == [1, tok("user").input_ids[0]] and ids[-1] == 2
    assert ids.count(tok.image_token_id) == 1
    assert tok.decode(tok("naïve 🙂 text").input_ids) == "naïve 🙂 text"


def test_chat_template_one_image(qwen_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    template = _template(qwen_dir)
    assert tok.chat_template == template  # tokenizer_config.json carries the same template
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}
    ]
    text = tok.apply_chat_template(
        messages, chat_template=template, add_generation_prompt=True, tokenize=False
    )
    assert text == (
        f"{SYSTEM}<|im_start|>user\n{VISION}What is in the picture?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok(text).input_ids.count(tok.image_token_id) == 1
    no_prompt = tok.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert no_prompt == text.removesuffix("<|im_start|>assistant\n")


def test_chat_template_conversation(qwen_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(qwen_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare "},
                {"type": "image"},
                {"type": "text", "text": " and "},
                {"type": "image"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Both are noisy."}]},
        {"role": "user", "content": "Which is brighter?"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        f"<|im_start|>user\nCompare {VISION} and {VISION}<|im_end|>\n"
        "<|im_start|>assistant\nBoth are noisy.<|im_end|>\n"
        "<|im_start|>user\nWhich is brighter?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert plain == f"{SYSTEM}<|im_start|>user\nHi<|im_end|>\n"


def test_image_processor(qwen_dir: Path) -> None:
    processor = Qwen2VLImageProcessorPil.from_pretrained(qwen_dir)
    preset = PRESETS["tiny-qwen2-vl"]
    raw = json.loads((qwen_dir / "preprocessor_config.json").read_text())
    assert raw["image_processor_type"] == "Qwen2VLImageProcessor"
    assert (raw["min_pixels"], raw["max_pixels"]) == (56 * 56, 112 * 112)
    assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (14, 2, 2)
    out = processor(images=[seeded_image(0, (56, 56)), seeded_image(1, (112, 84))], return_tensors="pt")
    grids = out["image_grid_thw"]
    # 56x56 -> 4x4 patches; 112 wide x 84 high -> 6 rows x 8 columns of 14-pixel patches.
    assert grids.tolist() == [[1, 4, 4], [1, 6, 8]]
    patch_dim = 3 * preset.temporal_patch_size * preset.patch_size**2
    assert tuple(out["pixel_values"].shape) == (int(grids.prod(dim=1).sum()), patch_dim) == (64, 1176)
    # A handful of placeholder tokens each: one per 2x2 group of patches.
    assert [int(g.prod()) // processor.merge_size**2 for g in grids] == [4, 12]
    big = processor(images=[seeded_image(2, (640, 480))], return_tensors="pt")["image_grid_thw"][0]
    assert int(big.prod()) * preset.patch_size**2 <= preset.max_pixels


@pytest.mark.parametrize(
    ("image_seed", "size"),
    [(3, (56, 56)), (4, (112, 84)), (5, (90, 70)), (None, None)],
    ids=["image-56x56", "image-112x84", "image-90x70", "text-only"],
)
def test_hf_greedy_generate_is_not_collapsed(
    qwen_model: Qwen2VLForConditionalGeneration, qwen_dir: Path, image_seed: int | None, size
) -> None:
    check_greedy_generate_is_not_collapsed(qwen_model, qwen_dir, image_seed, size)


def test_the_image_changes_the_output(qwen_model: Qwen2VLForConditionalGeneration, qwen_dir: Path) -> None:
    check_the_image_changes_the_output(qwen_model, qwen_dir)


def test_sharded_and_tied_variant_loads(qwen_model: Qwen2VLForConditionalGeneration, tmp_path: Path) -> None:
    # The tiny shapes with small-qwen2-vl's storage choices: several shards plus an index, tied embeddings.
    preset = dataclasses.replace(
        PRESETS["tiny-qwen2-vl"], tie_word_embeddings=True, max_shard_bytes=256 * 1024
    )
    directory = write_checkpoint(tmp_path / "sharded", preset, seed=0)
    assert (directory / "model.safetensors.index.json").exists()
    assert len(list(directory.glob("model-*-of-*.safetensors"))) > 1
    assert "lm_head.weight" not in safetensors_keys(directory)
    model, info = Qwen2VLForConditionalGeneration.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.tie_word_embeddings
    assert torch.equal(model.lm_head.weight, model.get_input_embeddings().weight)
    # Per-tensor seeding: a layer tensor is identical whatever the sharding.
    name = "model.visual.blocks.1.mlp.fc2.weight"
    assert torch.equal(model.state_dict()[name], qwen_model.state_dict()[name])


def test_preset_parameter_counts_and_shapes() -> None:
    big = PRESETS["qwen2-vl-7b"]
    assert isinstance(big, Qwen2VLPreset) and big.dtype == "bfloat16" and not big.tie_word_embeddings
    assert math.isclose(count_parameters("qwen2-vl-7b"), 8.29e9, rel_tol=2e-3)
    assert 80e6 <= count_parameters("small-qwen2-vl") <= 120e6
    assert count_parameters("tiny-qwen2-vl") < 1e6
    shapes = {s.name: s.shape for s in tensor_specs(placeholder_config(big), big.torch_dtype)}
    assert shapes["model.language_model.embed_tokens.weight"] == (152064, 3584)
    assert shapes["lm_head.weight"] == (152064, 3584)
    assert shapes["model.visual.patch_embed.proj.weight"] == (1280, 3, 2, 14, 14)
    assert shapes["model.visual.blocks.31.attn.qkv.weight"] == (3840, 1280)
    assert shapes["model.visual.merger.mlp.0.weight"] == (5120, 5120)
    assert shapes["model.visual.merger.mlp.2.weight"] == (3584, 5120)
    assert shapes["model.language_model.layers.27.self_attn.k_proj.weight"] == (512, 3584)
    assert shapes["model.language_model.layers.27.self_attn.q_proj.bias"] == (3584,)
    assert "model.language_model.layers.27.self_attn.o_proj.bias" not in shapes
    assert shapes["model.language_model.layers.27.mlp.down_proj.weight"] == (3584, 18944)
    config = placeholder_config(big)
    assert config.text_config.rope_parameters["mrope_section"] == [16, 24, 24]
    assert config.text_config.rope_parameters["rope_theta"] == 1e6
    for name in QWEN_PRESETS:
        preset = PRESETS[name]
        assert 2 * sum(preset.mrope_section) == preset.text_hidden // preset.text_heads


def test_invalid_preset_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="mrope_section"):
        dataclasses.replace(PRESETS["tiny-qwen2-vl"], mrope_section=(4, 4, 4))


def test_cli_make_model(tmp_path: Path) -> None:
    runner = CliRunner()
    target = tmp_path / "model"
    result = runner.invoke(app, ["make-model", str(target), "--preset", "tiny-qwen2-vl", "--seed", "2"])
    assert result.exit_code == 0, result.output
    assert "tiny-qwen2-vl" in result.output
    assert f"parameters: {count_parameters('tiny-qwen2-vl')}" in result.output
    assert json.loads((target / "config.json").read_text())["model_type"] == "qwen2_vl"
    again = runner.invoke(app, ["make-model", str(target), "--preset", "tiny-qwen2-vl"])
    assert again.exit_code == 2 and "--force" in again.output
    # A Qwen2-VL checkpoint is one of ours: --force may replace it, with one of either family.
    forced = runner.invoke(app, ["make-model", str(target), "--preset", "tiny-llava", "--force"])
    assert forced.exit_code == 0, forced.output
    assert json.loads((target / "config.json").read_text())["model_type"] == "llava"


def test_cli_help_lists_the_presets() -> None:
    result = CliRunner().invoke(app, ["make-model", "--help"])
    assert result.exit_code == 0
    assert all(name in squashed(result.output) for name in PRESETS)
    assert all(name in result.output for name in QWEN_PRESETS)


def test_cli_unknown_preset_lists_valid_ones(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["make-model", str(tmp_path / "m"), "--preset", "qwen-huge"])
    assert result.exit_code == 2
    assert all(name in squashed(result.output) for name in PRESETS)
    assert not (tmp_path / "m").exists()
