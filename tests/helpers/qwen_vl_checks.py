"""The checks every Qwen-VL family's presets pass (Qwen2.5-VL, Qwen3-VL): a `Test...` subclass in
the family's test module names the family and its presets."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel, Qwen2VLImageProcessorPil
from typer.testing import CliRunner

from common.checkpoints import PRESETS, QwenVLPreset, count_parameters, is_checkpoint_dir, write_checkpoint
from common.checkpoints.presets import placeholder_config
from common.checkpoints.tokenizer import QWEN2_VL_SPECIAL_TOKENS, read_package_text
from common.checkpoints.weights import tensor_specs
from tests.helpers.checkpoints import (
    IMAGE_PAD,
    RELEASE_FILES,
    VISION,
    check_greedy_generate_is_not_collapsed,
    check_the_image_changes_the_output,
    checkpoint_files,
    safetensors_keys,
    seeded_image,
    squashed,
)
from trident.cli.app import app

# Image sizes (width, height) the family checks feed the tiny presets: from 4 placeholder tokens up to the
# tiny presets' pixel caps, one of them not a multiple of the patch grid.
IMAGE_SIZES = [(56, 56), (112, 84), (168, 168), (90, 70)]


class QwenVLFamilyChecks:
    """What one Qwen-VL family's presets must do; a `Test...` subclass names the family and its presets."""

    FAMILY: ClassVar[str]
    TINY: ClassVar[str]
    SMALL: ClassVar[str]
    REAL: ClassVar[str]
    MANIFEST_FORMAT: ClassVar[str]
    PROCESSOR_CLASS: ClassVar[str]
    # The real-shape preset's parameter count (the release's) and some of its tensors' shapes.
    REAL_PARAMETERS: ClassVar[float]
    REAL_SHAPES: ClassVar[dict[str, tuple[int, ...]]]
    # The patch grids (t, h, w) the tiny preset's image processor gives the IMAGE_SIZES images.
    TINY_GRIDS: ClassVar[list[list[int]]]

    @pytest.fixture(autouse=True)
    def _one_torch_thread(self) -> Iterator[None]:
        # As in test_checkpoints.py: the tiny model gains nothing from threads on a shared 2-core box.
        before = torch.get_num_threads()
        torch.set_num_threads(1)
        yield
        torch.set_num_threads(before)

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_dir(cls, tmp_path_factory: pytest.TempPathFactory) -> Path:
        """The tiny preset's checkpoint (seed 0), written once per class; treat it as read-only."""
        return write_checkpoint(tmp_path_factory.mktemp(cls.FAMILY) / cls.TINY, cls.TINY, seed=0)

    @pytest.fixture(scope="class")
    @classmethod
    def tiny_model(cls, tiny_dir: Path) -> PreTrainedModel:
        return cls.preset(cls.TINY).model_class.from_pretrained(tiny_dir).eval()

    @staticmethod
    def preset(name: str) -> QwenVLPreset:
        preset = PRESETS[name]
        assert isinstance(preset, QwenVLPreset)
        return preset

    def test_tiny_loads_with_hf(self, tiny_dir: Path) -> None:
        preset = self.preset(self.TINY)
        assert {p.name for p in tiny_dir.iterdir()} == RELEASE_FILES
        assert is_checkpoint_dir(tiny_dir)
        manifest = json.loads((tiny_dir / "trident_checkpoint.json").read_text())
        assert (manifest["format"], manifest["preset"]) == (self.MANIFEST_FORMAT, self.TINY)
        raw = json.loads((tiny_dir / "config.json").read_text())
        assert raw["model_type"] == self.FAMILY
        assert raw["architectures"] == [preset.model_class.__name__]

        model, info = preset.model_class.from_pretrained(tiny_dir, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        assert safetensors_keys(tiny_dir) == set(model.state_dict())
        tok = AutoTokenizer.from_pretrained(tiny_dir)
        cfg, text = model.config, model.config.text_config
        assert cfg.image_token_id == tok.image_token_id == tok.convert_tokens_to_ids(IMAGE_PAD)
        assert cfg.video_token_id == tok.video_token_id == tok.convert_tokens_to_ids("<|video_pad|>")
        assert (cfg.vision_start_token_id, cfg.vision_end_token_id) == (3, 4)
        assert text.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
        assert text.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
        assert text.vocab_size == model.get_input_embeddings().weight.shape[0] >= len(tok)
        assert text.rope_parameters["mrope_section"] == list(preset.mrope_section)
        assert model.model.visual.merger(torch.zeros(4, preset.vision_hidden)).shape[-1] == text.hidden_size
        assert not cfg.tie_word_embeddings
        generation = json.loads((tiny_dir / "generation_config.json").read_text())
        assert generation["eos_token_id"] == [tok.eos_token_id, tok.pad_token_id]
        # Norms are 1 +- noise: a loader that forgets one is caught by a comparison.
        norm = model.model.language_model.norm.weight
        assert 0.85 < norm.min() < norm.max() < 1.15 and not torch.all(norm == 1)

    def test_same_seed_is_byte_identical_and_other_seed_differs(self, tiny_dir: Path, tmp_path: Path) -> None:
        again = checkpoint_files(write_checkpoint(tmp_path / "again", self.TINY, seed=0))
        assert again == checkpoint_files(tiny_dir)
        other = checkpoint_files(write_checkpoint(tmp_path / "other", self.TINY, seed=1))
        assert other["model.safetensors"] != again["model.safetensors"]
        assert {name for name in again if other[name] != again[name]} == {
            "model.safetensors",
            "trident_checkpoint.json",  # records the seed
        }

    def test_tokenizer_and_chat_template(self, tiny_dir: Path) -> None:
        tok = AutoTokenizer.from_pretrained(tiny_dir)
        assert [tok.convert_tokens_to_ids(t) for t in QWEN2_VL_SPECIAL_TOKENS] == list(range(7))
        assert tok.bos_token is None and tok.unk_token is None
        # Every Qwen-VL family places an image as Qwen2-VL does, so the template is Qwen2-VL's.
        template = read_package_text("qwen2_vl_chat_template.jinja")
        assert tok.chat_template == template
        assert json.loads((tiny_dir / "chat_template.json").read_text()) == {"chat_template": template}
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text.endswith(f"<|im_start|>user\n{VISION}What?<|im_end|>\n<|im_start|>assistant\n")
        assert tok(text).input_ids.count(tok.image_token_id) == 1
        assert json.loads((tiny_dir / "tokenizer_config.json").read_text())["processor_class"] == (
            self.PROCESSOR_CLASS
        )

    def test_image_processor(self, tiny_dir: Path) -> None:
        preset = self.preset(self.TINY)
        raw = json.loads((tiny_dir / "preprocessor_config.json").read_text())
        assert raw["image_processor_type"] == "Qwen2VLImageProcessor"
        assert raw["processor_class"] == self.PROCESSOR_CLASS
        assert raw["size"] == {"shortest_edge": preset.min_pixels, "longest_edge": preset.max_pixels}
        assert (raw["image_mean"], raw["image_std"]) == (list(preset.image_mean), list(preset.image_std))
        processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_dir)
        assert (processor.patch_size, processor.merge_size, processor.temporal_patch_size) == (
            preset.patch_size,
            2,
            2,
        )
        out = processor(
            images=[seeded_image(i, size) for i, size in enumerate(IMAGE_SIZES)], return_tensors="pt"
        )
        grids = out["image_grid_thw"]
        assert grids.tolist() == self.TINY_GRIDS
        patch_dim = 3 * preset.temporal_patch_size * preset.patch_size**2
        assert tuple(out["pixel_values"].shape) == (int(grids.prod(dim=1).sum()), patch_dim)
        big = processor(images=[seeded_image(2, (640, 480))], return_tensors="pt")["image_grid_thw"][0]
        assert int(big.prod()) * preset.patch_size**2 <= preset.max_pixels

    @pytest.mark.parametrize(
        "size", [*IMAGE_SIZES, None], ids=[*(f"{w}x{h}" for w, h in IMAGE_SIZES), "text"]
    )
    def test_hf_greedy_generate_is_not_collapsed(
        self, tiny_model: PreTrainedModel, tiny_dir: Path, size: tuple[int, int] | None
    ) -> None:
        # Qwen2-VL's check (24 new tokens, >= 4 distinct, decisive top-1, no dead token) on this family.
        check_greedy_generate_is_not_collapsed(tiny_model, tiny_dir, None if size is None else 3, size)

    def test_the_image_changes_the_output(self, tiny_model: PreTrainedModel, tiny_dir: Path) -> None:
        check_the_image_changes_the_output(tiny_model, tiny_dir)

    def test_sharded_and_tied_variant_loads(self, tiny_model: PreTrainedModel, tmp_path: Path) -> None:
        # The tiny shapes with the small preset's storage choices: several shards plus an index, tied.
        preset = dataclasses.replace(
            self.preset(self.TINY), tie_word_embeddings=True, max_shard_bytes=256 << 10
        )
        directory = write_checkpoint(tmp_path / "sharded", preset, seed=0)
        assert (directory / "model.safetensors.index.json").exists()
        assert len(list(directory.glob("model-*-of-*.safetensors"))) > 1
        assert "lm_head.weight" not in safetensors_keys(directory)
        model, info = preset.model_class.from_pretrained(directory, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        assert torch.equal(model.lm_head.weight, model.get_input_embeddings().weight)
        # Per-tensor seeding: a layer tensor is identical whatever the sharding.
        name = "model.visual.blocks.1.attn.qkv.weight"
        assert torch.equal(model.state_dict()[name], tiny_model.state_dict()[name])

    def test_preset_parameter_counts_and_shapes(self) -> None:
        real, small = self.preset(self.REAL), self.preset(self.SMALL)
        assert real.dtype == "bfloat16" and not real.tie_word_embeddings
        assert small.tie_word_embeddings and small.max_shard_bytes == 256 << 20
        assert math.isclose(count_parameters(self.REAL), self.REAL_PARAMETERS, rel_tol=2e-3)
        assert 80e6 <= count_parameters(self.SMALL) <= 130e6
        assert count_parameters(self.TINY) < 1e6
        shapes = {s.name: s.shape for s in tensor_specs(placeholder_config(real), real.torch_dtype)}
        assert {name: shapes.get(name) for name in self.REAL_SHAPES} == self.REAL_SHAPES
        assert shapes["lm_head.weight"] == shapes["model.language_model.embed_tokens.weight"]
        for name in (self.TINY, self.SMALL, self.REAL):
            assert 2 * sum(self.preset(name).mrope_section) == self.preset(name).head_dim

    def test_cli_make_model(self, tmp_path: Path) -> None:
        runner = CliRunner()
        target = tmp_path / "model"
        result = runner.invoke(app, ["make-model", str(target), "--preset", self.TINY, "--seed", "2"])
        assert result.exit_code == 0, result.output
        assert f"parameters: {count_parameters(self.TINY)}" in result.output
        assert json.loads((target / "config.json").read_text())["model_type"] == self.FAMILY
        assert json.loads((target / "trident_checkpoint.json").read_text())["seed"] == 2
        help_text = runner.invoke(app, ["make-model", "--help"])
        assert help_text.exit_code == 0
        assert all(name in squashed(help_text.output) for name in PRESETS)
        unknown = runner.invoke(app, ["make-model", str(tmp_path / "m"), "--preset", "qwen-huge"])
        assert unknown.exit_code == 2
        assert all(name in squashed(unknown.output) for name in PRESETS)
        assert not (tmp_path / "m").exists()
