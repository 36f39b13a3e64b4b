"""The random-weight checkpoint writer and `trident make-model`: loadable by HF, deterministic, usable."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import AutoProcessor, AutoTokenizer, LlavaForConditionalGeneration
from typer.testing import CliRunner

from common.checkpoints import PRESETS, count_parameters, is_checkpoint_dir, write_checkpoint
from common.checkpoints.presets import build_config, meta_model
from common.checkpoints.weights import tensor_specs
from common.models import ModelError, resolve_model
from trident.cli.app import app

PROMPT = "USER: <image>\nWhat is in the picture? ASSISTANT:"


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # The tiny models are far too small to gain from threads, and on a shared 2-core box OpenMP spin-waits
    # make a 32-token generate ~15x slower whenever another process holds a core.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _safetensors_keys(directory: Path) -> set[str]:
    keys: set[str] = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            keys.update(f.keys())
    return keys


def _image(seed: int, size: tuple[int, int] = (90, 70)) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def test_tiny_loads_with_hf(tiny_model_dir: Path) -> None:
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    model, info = LlavaForConditionalGeneration.from_pretrained(tiny_model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tok = processor.tokenizer
    cfg = model.config
    assert cfg.image_token_index == tok.convert_tokens_to_ids("<image>") == processor.image_token_id
    assert (cfg.text_config.bos_token_id, cfg.text_config.eos_token_id, cfg.text_config.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert cfg.vision_feature_layer == -2 and cfg.vision_feature_select_strategy == "default"
    assert cfg.projector_hidden_act == "gelu" and cfg.text_config.num_key_value_heads == 2
    assert cfg.text_config.vocab_size == model.get_input_embeddings().weight.shape[0] == len(tok)
    # Stored names are exactly HF's own state_dict names (untied: nothing dropped).
    assert _safetensors_keys(tiny_model_dir) == set(model.state_dict())
    assert AutoTokenizer.from_pretrained(tiny_model_dir)("hello").input_ids[0] == tok.bos_token_id


def test_same_seed_is_byte_identical_and_other_seed_differs(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = _files(write_checkpoint(tmp_path / "again", "tiny-llava", seed=0))
    assert again == _files(tiny_model_dir)
    other = _files(write_checkpoint(tmp_path / "other", "tiny-llava", seed=1))
    assert other["model.safetensors"] != again["model.safetensors"]
    assert other["tokenizer.json"] == again["tokenizer.json"]


def test_tiny_is_small_on_disk(tiny_model_dir: Path) -> None:
    total = sum(p.stat().st_size for p in tiny_model_dir.iterdir())
    assert total < 5 * 1024 * 1024
    assert (tiny_model_dir / "model.safetensors").exists()
    assert not (tiny_model_dir / "model.safetensors.index.json").exists()


def test_image_placeholder_expansion(tiny_model_dir: Path) -> None:
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    preset = PRESETS["tiny-llava"]
    out = processor(text=PROMPT, images=[_image(0, (123, 77))], return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    assert ids[0] == processor.tokenizer.bos_token_id
    assert ids.count(processor.image_token_id) == preset.num_image_tokens == 49
    assert tuple(out["pixel_values"].shape) == (1, 3, preset.image_size, preset.image_size)


def test_chat_template_two_images(tiny_model_dir: Path) -> None:
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare them."}],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Both are noisy."}]},
        {"role": "user", "content": "Which is brighter?"},
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "Be brief. USER: <image>\n<image>\nCompare them. ASSISTANT: Both are noisy.</s>"
        "USER: Which is brighter? ASSISTANT:"
    )
    out = processor(text=text, images=[_image(1), _image(2)], return_tensors="pt")
    assert out["input_ids"][0].tolist().count(processor.image_token_id) == 2 * 49
    assert out["pixel_values"].shape[0] == 2


@pytest.mark.parametrize(
    ("text", "image_seed"),
    [("USER: Tell me about the weather. ASSISTANT:", None), ("Hello", None), (PROMPT, 3), (PROMPT, 4)],
    ids=["chat-text", "bare-text", "image-a", "image-b"],
)
def test_hf_greedy_generate_is_not_collapsed(tiny_model_dir: Path, text: str, image_seed: int | None) -> None:
    processor = AutoProcessor.from_pretrained(tiny_model_dir)
    model = LlavaForConditionalGeneration.from_pretrained(tiny_model_dir).eval()
    images = None if image_seed is None else [_image(image_seed)]
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    new_tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    assert len(new_tokens) == 32
    assert len(set(new_tokens)) >= 8
    top2 = torch.stack([torch.topk(step[0], 2).values for step in out.scores])
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    assert statistics.median(gaps) > 1e-2
    # Greedy text decodes cleanly: no special or zero (unused) rows ever win.
    assert not set(new_tokens) & {processor.image_token_id, processor.tokenizer.pad_token_id}


def test_sharded_and_tied_variant_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    # The tiny shapes with the small/7b storage choices: several shards plus an index, tied embeddings.
    preset = dataclasses.replace(PRESETS["tiny-llava"], tie_word_embeddings=True, max_shard_bytes=256 * 1024)
    directory = write_checkpoint(tmp_path / "sharded", preset, seed=0)
    assert (directory / "model.safetensors.index.json").exists()
    assert len(list(directory.glob("model-*-of-*.safetensors"))) > 1
    assert "lm_head.weight" not in _safetensors_keys(directory)
    model, info = LlavaForConditionalGeneration.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert torch.equal(model.lm_head.weight, model.get_input_embeddings().weight)
    # Per-tensor seeding: a layer tensor is identical whatever the sharding (it is not tied-dependent).
    reference = LlavaForConditionalGeneration.from_pretrained(tiny_model_dir).state_dict()
    name = "model.language_model.layers.1.mlp.down_proj.weight"
    assert torch.equal(model.state_dict()[name], reference[name])


def test_preset_parameter_counts_and_shapes() -> None:
    assert 7.0e9 <= count_parameters("llava-1.5-7b") <= 7.1e9
    assert 50e6 <= count_parameters("small-llava") <= 150e6
    big = PRESETS["llava-1.5-7b"]
    assert big.num_image_tokens == 576 and big.dtype == "bfloat16"
    shapes = {s.name: s.shape for s in tensor_specs(build_config(big, 1, 2, 3, 32000), big.torch_dtype)}
    assert shapes["model.language_model.embed_tokens.weight"] == (32064, 4096)
    assert shapes["lm_head.weight"] == (32064, 4096)
    assert shapes["model.vision_tower.embeddings.patch_embedding.weight"] == (1024, 3, 14, 14)
    assert shapes["model.multi_modal_projector.linear_1.weight"] == (4096, 1024)
    assert shapes["model.multi_modal_projector.linear_2.weight"] == (4096, 4096)
    small = PRESETS["small-llava"]
    small_specs = tensor_specs(build_config(small, 1, 2, 3, 4), small.torch_dtype)
    state_names = set(meta_model(build_config(small, 1, 2, 3, 4)).state_dict())
    assert {s.name for s in small_specs} == state_names - {"lm_head.weight"}


def test_cli_make_model(tmp_path: Path) -> None:
    runner = CliRunner()
    target = tmp_path / "model"
    result = runner.invoke(app, ["make-model", str(target), "--preset", "tiny-llava", "--seed", "0"])
    assert result.exit_code == 0, result.output
    assert str(target) in result.output and "tiny-llava" in result.output
    assert f"parameters: {count_parameters('tiny-llava')}" in result.output
    assert (target / "config.json").exists()

    again = runner.invoke(app, ["make-model", str(target)])
    assert again.exit_code == 2 and "--force" in again.output
    forced = runner.invoke(app, ["make-model", str(target), "--seed", "1", "--force"])
    assert forced.exit_code == 0, forced.output

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    refused = runner.invoke(app, ["make-model", str(tmp_path / "notes"), "--force"])
    assert refused.exit_code == 2
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


def test_cli_unknown_preset_lists_valid_ones(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["make-model", str(tmp_path / "m"), "--preset", "huge"])
    assert result.exit_code == 2
    flat = " ".join(result.output.replace("│", " ").split())
    assert all(name in flat for name in PRESETS)
    assert not (tmp_path / "m").exists()


def test_model_option_takes_a_directory_or_a_preset_written_once(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--model .trident/models/small-llava` in the docs failed in a fresh clone until a `trident make-model`
    step nobody mentioned: every --model now also takes a preset name and writes it on first use."""
    assert resolve_model(tiny_model_dir) == tiny_model_dir  # a directory is taken as it is
    said: list[str] = []
    models = tmp_path / "models"
    written = resolve_model("tiny-llava", models, said.append)
    assert written == models / "tiny-llava" and is_checkpoint_dir(written)
    assert len(said) == 1 and str(written) in said[0]
    manifest = next(written.glob("*.json"))
    before = manifest.stat().st_mtime_ns
    assert resolve_model("tiny-llava", models, said.append) == written  # reused, not rewritten
    assert len(said) == 1 and manifest.stat().st_mtime_ns == before
    assert resolve_model(None, models) == written  # the default preset
    with pytest.raises(ModelError, match=r"does not exist.*small-llava"):
        resolve_model(tmp_path / "nope", models)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelError, match="is not a directory"):
        resolve_model(tmp_path / "file", models)
    # A directory of the preset's name in the working directory wins over the preset.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "small-llava").mkdir()
    assert resolve_model("small-llava", models) == Path("small-llava")


def test_cli_model_options_refuse_what_is_neither_a_directory_nor_a_preset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each command that takes --model says what it takes, as a usage error, before starting anything."""
    monkeypatch.chdir(tmp_path)
    for args in (
        ["up", "--model", str(tmp_path / "nope")],
        ["bench", "compare", "--model", "huge-llava", "--ttft-slo", "1", "--tbt-slo", "1", "--duration", "1",
         "--sweep", "1:1:1", "--out", str(tmp_path / "out")],
        ["generate", "--model", "huge-llava", "--prompt", "x"],
    ):  # fmt: skip
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        flat = " ".join(result.output.replace("│", " ").split())
        assert "preset name" in flat and "tiny-llava" in flat, (args, flat)
    assert not (tmp_path / "out").exists()
