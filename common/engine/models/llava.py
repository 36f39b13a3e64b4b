"""LLaVA-1.5: CLIP vision tower + MLP projector (the encode stage) and a Llama LLM (prefill, decode)."""

from __future__ import annotations

import torch
from torch import nn
from transformers import CLIPVisionConfig, CLIPVisionModel

from common.engine.models.llama import LlamaForCausalLM, tied_embeddings
from common.engine.models.vision_ops import lighten
from common.engine.request import ImageInput


class Projector(nn.Module):
    """Maps selected vision features into the LLM's embedding space: linear, activation, linear."""

    def __init__(self, vision_dim: int, text_dim: int, act: str, bias: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias)
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)
        if act != "gelu":
            raise ValueError(f"unsupported projector_hidden_act {act!r}; LLaVA-1.5 uses 'gelu'")
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class VisionEncoder(nn.Module):
    """Pixels → projected image features, one row per image token."""

    def __init__(self, vision_config: CLIPVisionConfig, text_dim: int, llava_config) -> None:
        super().__init__()
        vision_config._attn_implementation = "sdpa"
        self.vision_tower = CLIPVisionModel(vision_config)
        lighten(self.vision_tower)  # the same model, computed faster (vision_ops.py)
        layer = llava_config.vision_feature_layer
        self.feature_layers = [layer] if isinstance(layer, int) else list(layer)
        self.strategy = llava_config.vision_feature_select_strategy
        if self.strategy not in ("default", "full"):
            raise ValueError(f"unsupported vision_feature_select_strategy {self.strategy!r}")
        bias = getattr(llava_config, "multimodal_projector_bias", True)
        self.multi_modal_projector = Projector(
            vision_config.hidden_size * len(self.feature_layers),
            text_dim,
            llava_config.projector_hidden_act,
            bias,
        )

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [images, 3, H, W] → [images, image_tokens, text_hidden]."""
        out = self.vision_tower(pixel_values, output_hidden_states=True, return_dict=True)
        picked = [out.hidden_states[i] for i in self.feature_layers]
        if self.strategy == "default":  # drop the CLS token
            picked = [h[:, 1:] for h in picked]
        return self.multi_modal_projector(torch.cat(picked, dim=-1))


class LlavaModel(nn.Module):
    """The parts an instance's roles need: the vision side for encode, the LLM for prefill/decode."""

    mrope = False  # one position stream: token i sits at position i
    vision_encoder: type[VisionEncoder] = VisionEncoder  # LLaVA-NeXT's stitches tiles

    def __init__(
        self, config, inv_freq: torch.Tensor, attention_scaling: float, with_vision: bool, with_language: bool
    ) -> None:
        super().__init__()
        self.config = config
        self.image_token_id = config.image_token_index
        self.language_model = (
            LlamaForCausalLM(config.text_config, inv_freq, attention_scaling, tied=tied_embeddings(config))
            if with_language
            else None
        )
        self.vision = (
            self.vision_encoder(config.vision_config, config.text_config.hidden_size, config)
            if with_vision
            else None
        )

    def encode(
        self, images: list[ImageInput], device: torch.device, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """Every image is the same size here: one batch through the tower, a feature tensor each."""
        return list(self.vision(torch.stack([img.pixel_values for img in images]).to(device, dtype)))
