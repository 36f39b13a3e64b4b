"""The Qwen2.5-VL presets of the checkpoint writer, and the checks every later Qwen-VL family passes
(`QwenVLFamilyChecks` in tests/helpers/qwen_vl_checks.py, run for Qwen3-VL too)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from transformers import PreTrainedModel, Qwen2VLImageProcessorPil
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRMSNorm
from transformers.vision_utils import get_vision_window_index

from common.checkpoints import PRESETS
from common.checkpoints.presets import placeholder_config
from tests.helpers.checkpoints import seeded_image
from tests.helpers.qwen_vl_checks import QwenVLFamilyChecks


def _window_count(grid_thw: list[int], window_size: int) -> int:
    """How many attention windows HF's Qwen2.5-VL vision tower splits one image into."""
    _, cu_window_seqlens = get_vision_window_index(
        torch.tensor([grid_thw]), spatial_merge_size=2, window_size=window_size, patch_size=14
    )
    return len(cu_window_seqlens) - 1


class TestQwen2_5VL(QwenVLFamilyChecks):
    FAMILY = "qwen2_5_vl"
    TINY, SMALL, REAL = "tiny-qwen2.5-vl", "small-qwen2.5-vl", "qwen2.5-vl-7b"
    MANIFEST_FORMAT = "trident-qwen2.5-vl"
    PROCESSOR_CLASS = "Qwen2_5_VLProcessor"
    REAL_PARAMETERS = 8.29e9
    REAL_SHAPES: ClassVar[dict[str, tuple[int, ...]]] = {
        "model.visual.patch_embed.proj.weight": (1280, 3, 2, 14, 14),
        "model.visual.blocks.31.attn.qkv.weight": (3840, 1280),
        "model.visual.blocks.31.norm1.weight": (1280,),
        "model.visual.blocks.31.mlp.gate_proj.weight": (3420, 1280),
        "model.visual.blocks.31.mlp.down_proj.bias": (1280,),
        "model.visual.merger.mlp.0.weight": (5120, 5120),
        "model.visual.merger.mlp.2.weight": (3584, 5120),
        "model.language_model.embed_tokens.weight": (152064, 3584),
        "model.language_model.layers.27.self_attn.k_proj.weight": (512, 3584),
        "model.language_model.layers.27.self_attn.q_proj.bias": (3584,),
        "model.language_model.layers.27.mlp.down_proj.weight": (3584, 18944),
    }
    # 14-px patches; 168x168 is the cap.
    TINY_GRIDS: ClassVar[list[list[int]]] = [[1, 4, 4], [1, 6, 8], [1, 12, 12], [1, 4, 6]]

    def test_tiny_has_windowed_and_full_blocks_and_images_span_windows(self, tiny_dir: Path) -> None:
        vision = json.loads((tiny_dir / "config.json").read_text())["vision_config"]
        assert (vision["depth"], vision["window_size"], vision["fullatt_block_indexes"]) == (2, 56, [1])
        assert (vision["hidden_size"], vision["out_hidden_size"], vision["hidden_act"]) == (32, 64, "silu")
        # A window is 56 px = 2x2 merged tokens: the smallest image is one window, the others several.
        windows = [_window_count(grid, vision["window_size"]) for grid in self.TINY_GRIDS]
        assert windows == [1, 4, 9, 2]

    def test_window_attention_restricts_the_windowed_blocks(
        self, tiny_model: PreTrainedModel, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_dir)
        pixels = processor(images=[seeded_image(8, (168, 168))], return_tensors="pt")
        visual = tiny_model.model.visual

        def features() -> torch.Tensor:
            with torch.no_grad():
                return visual(pixels["pixel_values"], grid_thw=pixels["image_grid_thw"]).pooler_output

        windowed = features()
        # Full attention in every block, two ways: one window spanning the image, or no windowed block.
        monkeypatch.setattr(visual, "window_size", 10_000)
        one_window = features()
        monkeypatch.undo()
        monkeypatch.setattr(visual, "fullatt_block_indexes", [0, 1])
        all_full = features()
        assert torch.allclose(one_window, all_full, atol=1e-5)
        assert not torch.allclose(windowed, all_full, atol=1e-3)

    def test_vision_and_text_layers(self, tiny_model: PreTrainedModel) -> None:
        block = tiny_model.model.visual.blocks[0]
        # RMSNorm and a gated SiLU MLP with biases in the ViT; Qwen2 attention (biased q/k/v) in the text.
        assert isinstance(block.norm1, Qwen2_5_VLRMSNorm) and isinstance(block.norm2, Qwen2_5_VLRMSNorm)
        assert block.mlp.gate_proj.weight.shape == (96, 32) and block.mlp.up_proj.bias is not None
        assert 0 < block.mlp.down_proj.bias.abs().max() < 0.1
        assert tiny_model.model.visual.patch_embed.proj.bias is None
        attn = tiny_model.model.language_model.layers[0].self_attn
        assert attn.q_proj.bias is not None and attn.o_proj.bias is None
        text = tiny_model.config.text_config
        assert text.rope_parameters == {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e6}
        real = placeholder_config(PRESETS["qwen2.5-vl-7b"])
        assert real.vision_config.fullatt_block_indexes == [7, 15, 23, 31]
        assert (real.vision_config.window_size, real.vision_config.tokens_per_second) == (112, 2)
        assert real.text_config.max_position_embeddings == 128000
        assert real.text_config.rope_parameters["mrope_section"] == [16, 24, 24]
