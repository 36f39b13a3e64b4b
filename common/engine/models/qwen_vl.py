"""Qwen2-VL: a ViT with 2-D RoPE whose patch merger folds 2×2 patches into one token (the encode
stage), and a Qwen2 LLM with M-RoPE (prefill, decode).

What differs from LLaVA, and where it is handled:
- an image's token count follows its size: grid (t, h, w) patches give t·h·w / merge² tokens, so
  each `ImageInput` carries its grid, and the vision tower runs every image of a batch as one packed
  sequence with attention kept inside each image;
- positions have three streams (temporal, height, width): text advances all three by one per
  token, an image's tokens take their grid coordinates, and text after an image resumes at one past
  the largest position used. So the positions of a prompt are computed once at admission
  (`mrope_positions`), and every token after the prompt sits at its index plus `rope_delta`, the
  one number a later stage (decode on another instance) needs to go on.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

from common.engine.models.llama import LlamaForCausalLM
from common.engine.request import ImageInput


def image_token_count(grid_thw: tuple[int, int, int], merge: int) -> int:
    """LLM tokens of one image: its patches, merge×merge of them folded into one."""
    t, h, w = grid_thw
    return t * h * w // (merge * merge)


def mrope_positions(
    token_ids: list[int], image_token_id: int, grids: list[tuple[int, int, int]], merge: int
) -> tuple[torch.Tensor, int]:
    """The [3, len(token_ids)] M-RoPE positions of a prompt, and its rope delta: the position of
    token i ≥ len(token_ids) is i + delta in all three streams.

    Each run of image tokens belongs to the next image in `grids`, in prompt order; the run must
    be exactly that image's token count."""
    ids = torch.as_tensor(token_ids)
    is_image = (ids == image_token_id).tolist()
    pieces: list[torch.Tensor] = []
    grids_left = iter(grids)
    next_pos, i, n = 0, 0, len(token_ids)
    while i < n:
        j = i
        while j < n and is_image[j] == is_image[i]:
            j += 1
        if not is_image[i]:
            pieces.append(torch.arange(next_pos, next_pos + j - i).expand(3, -1))
            next_pos += j - i
        else:
            try:
                t, h, w = next(grids_left)
            except StopIteration:
                raise ValueError("the prompt has more image placeholder runs than images") from None
            gh, gw = h // merge, w // merge
            if t * gh * gw != j - i:
                raise ValueError(
                    f"an image of grid {(t, h, w)} needs {t * gh * gw} placeholders, the prompt has {j - i}"
                )
            tt = torch.arange(t).view(-1, 1, 1).expand(t, gh, gw).flatten()
            hh = torch.arange(gh).view(1, -1, 1).expand(t, gh, gw).flatten()
            ww = torch.arange(gw).view(1, 1, -1).expand(t, gh, gw).flatten()
            pieces.append(torch.stack([tt, hh, ww]) + next_pos)
            next_pos += max(gh, gw)  # an image has t = 1: the next text starts past its grid
        i = j
    if next(grids_left, None) is not None:
        raise ValueError("more images than image placeholder runs in the prompt")
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    return positions, next_pos - n


class Qwen2VisionEncoder(nn.Module):
    """Patches of several images → their merged features, one tensor per image."""

    def __init__(self, vision_config) -> None:
        super().__init__()
        vision_config._attn_implementation = "sdpa"
        self.visual = Qwen2VisionTransformerPretrainedModel(vision_config)
        self.merge = vision_config.spatial_merge_size

    def rebuild_buffers(self, vision_config) -> None:
        """The rotary table is not in the checkpoint: made again after a load on the meta device."""
        self.visual.rotary_pos_emb = type(self.visual.rotary_pos_emb)(vision_config)

    @torch.no_grad()
    def forward(
        self, images: list[ImageInput], device: torch.device, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        patches = torch.cat([img.pixel_values for img in images]).to(device, dtype)
        grid = torch.as_tensor([img.grid_thw for img in images], device=device)
        merged = self.visual(patches, grid_thw=grid).pooler_output  # [all images' tokens, hidden]
        sizes = [image_token_count(img.grid_thw, self.merge) for img in images]
        return list(merged.split(sizes))


class Qwen2VLModel(nn.Module):
    """The parts an instance's roles need: the vision tower for encode, the LLM for prefill/decode."""

    mrope = True

    def __init__(
        self, config, inv_freq: torch.Tensor, attention_scaling: float, with_vision: bool, with_language: bool
    ) -> None:
        super().__init__()
        self.config = config
        self.image_token_id = config.image_token_id
        self.merge = config.vision_config.spatial_merge_size
        text = config.text_config
        section = (text.rope_parameters or {}).get("mrope_section")
        self.language_model = (
            LlamaForCausalLM(
                text, inv_freq, attention_scaling, qkv_bias=True, o_bias=False, mrope_section=section
            )
            if with_language
            else None
        )
        self.vision = Qwen2VisionEncoder(config.vision_config) if with_vision else None

    def encode(
        self, images: list[ImageInput], device: torch.device, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        return self.vision(images, device, dtype)

    def positions(self, token_ids: list[int], images: list[ImageInput]) -> tuple[torch.Tensor, int]:
        return mrope_positions(token_ids, self.image_token_id, [img.grid_thw for img in images], self.merge)
