"""The Qwen3-VL presets of the checkpoint writer: the checks every Qwen-VL family passes, and DeepStack,
Qwen3 attention and Qwen3-VL's image processor settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel, Qwen2VLImageProcessorPil

from common.checkpoints import PRESETS
from common.checkpoints.presets import placeholder_config
from tests.helpers.checkpoints import expand_image_pads, seeded_image
from tests.helpers.qwen_vl_checks import QwenVLFamilyChecks


class TestQwen3VL(QwenVLFamilyChecks):
    FAMILY = "qwen3_vl"
    TINY, SMALL, REAL = "tiny-qwen3-vl", "small-qwen3-vl", "qwen3-vl-8b"
    MANIFEST_FORMAT = "trident-qwen3-vl"
    PROCESSOR_CLASS = "Qwen3VLProcessor"
    REAL_PARAMETERS = 8.77e9
    REAL_SHAPES: ClassVar[dict[str, tuple[int, ...]]] = {
        "model.visual.patch_embed.proj.weight": (1152, 3, 2, 16, 16),
        "model.visual.patch_embed.proj.bias": (1152,),
        "model.visual.pos_embed.weight": (2304, 1152),
        "model.visual.blocks.26.attn.qkv.weight": (3456, 1152),
        "model.visual.blocks.26.mlp.linear_fc1.weight": (4304, 1152),
        "model.visual.merger.norm.weight": (1152,),
        "model.visual.merger.linear_fc2.weight": (4096, 4608),
        "model.visual.deepstack_merger_list.2.norm.weight": (4608,),
        "model.visual.deepstack_merger_list.2.linear_fc2.weight": (4096, 4608),
        "model.language_model.embed_tokens.weight": (151936, 4096),
        "model.language_model.layers.35.self_attn.q_proj.weight": (4096, 4096),
        "model.language_model.layers.35.self_attn.k_proj.weight": (1024, 4096),
        "model.language_model.layers.35.self_attn.q_norm.weight": (128,),
        "model.language_model.layers.35.mlp.down_proj.weight": (4096, 12288),
    }
    # 16-px patches, sides rounded to multiples of 32; 160x160 is the cap.
    TINY_GRIDS: ClassVar[list[list[int]]] = [[1, 4, 4], [1, 6, 8], [1, 10, 10], [1, 4, 6]]

    def test_image_processor_is_qwen3_vls(self, tiny_dir: Path) -> None:
        raw = json.loads((tiny_dir / "preprocessor_config.json").read_text())
        # As a Qwen3-VL release: 16-px patches, mean/std 0.5, pixel bounds only as size.*_edge.
        assert (raw["patch_size"], raw["merge_size"], raw["temporal_patch_size"]) == (16, 2, 2)
        assert raw["image_mean"] == raw["image_std"] == [0.5, 0.5, 0.5]
        assert raw["size"] == {"shortest_edge": 64 * 64, "longest_edge": 160 * 160}
        assert "min_pixels" not in raw and "max_pixels" not in raw
        processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_dir)
        # Mid-grey normalises to 0 with mean = std = 0.5.
        grey = seeded_image(0, (64, 64)).point(lambda _: 128)
        assert processor(images=[grey], return_tensors="pt")["pixel_values"].abs().max() < 0.01
        real = PRESETS["qwen3-vl-8b"]
        assert (real.min_pixels, real.max_pixels) == (65536, 16777216)

    def test_vision_tower_and_qwen3_attention(self, tiny_model: PreTrainedModel) -> None:
        vision, text = tiny_model.config.vision_config, tiny_model.config.text_config
        assert (vision.depth, vision.hidden_size, vision.out_hidden_size) == (3, 32, 64)
        assert (vision.patch_size, vision.num_position_embeddings) == (16, 64)
        assert vision.deepstack_visual_indexes == [0, 1] and vision.hidden_act == "gelu_pytorch_tanh"
        assert tiny_model.model.visual.num_grid_per_side == 8
        assert 0 < tiny_model.model.visual.patch_embed.proj.bias.abs().max() < 0.1
        # Qwen3 attention: explicit head_dim, q/k RMSNorm over each head, no biases; interleaved M-RoPE.
        assert (text.head_dim, text.attention_bias) == (16, False)
        assert text.rope_parameters == {
            "rope_type": "default",
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
            "rope_theta": 5e6,
        }
        attn = tiny_model.model.language_model.layers[0].self_attn
        assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (16,)
        assert 0.85 < attn.q_norm.weight.min() < attn.q_norm.weight.max() < 1.15
        assert all(p.bias is None for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        real = placeholder_config(PRESETS["qwen3-vl-8b"])
        assert real.vision_config.deepstack_visual_indexes == [8, 16, 24]
        assert real.text_config.rope_parameters["mrope_section"] == [24, 20, 20]
        assert (real.text_config.head_dim, real.text_config.max_position_embeddings) == (128, 262144)

    def test_deepstack_features_reach_the_text_model(
        self, tiny_model: PreTrainedModel, tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        processor = Qwen2VLImageProcessorPil.from_pretrained(tiny_dir)
        pixels = processor(images=[seeded_image(9, (112, 84))], return_tensors="pt")
        with torch.no_grad():
            vision = tiny_model.model.visual(pixels["pixel_values"], grid_thw=pixels["image_grid_thw"])
        # Blocks 0 and 1 each give one feature per merged token (6x8 patches -> 12), at the text width.
        assert [tuple(f.shape) for f in vision.deepstack_features] == [(12, 64), (12, 64)]
        assert all(f.abs().mean() > 0.1 for f in vision.deepstack_features)

        tok = AutoTokenizer.from_pretrained(tiny_dir)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        enc = tok(expand_image_pads(prompt, pixels["image_grid_thw"], 2), return_tensors="pt")
        inputs = {**enc, **pixels, "mm_token_type_ids": (enc["input_ids"] == tok.image_token_id).int()}

        def last_logits() -> torch.Tensor:
            with torch.no_grad():
                return tiny_model(**inputs).logits[0, -1]

        with_deepstack = last_logits()
        monkeypatch.setattr(tiny_model.model.language_model, "_deepstack_process", lambda h, *_: h)
        without = last_logits()
        assert (with_deepstack - without).abs().max() > 0.1
