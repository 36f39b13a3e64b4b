"""The Qwen-VL family: Qwen2-VL, Qwen2.5-VL and Qwen3-VL. A ViT with 2-D RoPE whose patch merger
folds 2×2 patches into one token (the encode stage), and a Qwen LLM with M-RoPE (prefill, decode).

What differs from LLaVA, and where it is handled:
- an image's token count follows its size: grid (t, h, w) patches give t·h·w / merge² tokens, so
  each `ImageInput` carries its grid, and the vision tower runs every image of a batch as one packed
  sequence with attention kept inside each image (Qwen2.5-VL: inside windows, in most blocks);
- positions have three streams (temporal, height, width): text advances all three by one per
  token, an image's tokens take their grid coordinates, and text after an image resumes one past
  its largest. So the positions of a prompt are computed once at admission (`mrope_positions`),
  and every token after the prompt sits at its index plus `rope_delta`, the one number a later
  stage (decode on another instance) needs to go on;
- Qwen3-VL's DeepStack: the tower also returns features taken from some of its blocks, which
  are added to the image tokens' hidden states after the LLM's first layers. They travel as more
  columns of the same feature tensor — [tokens, hidden · (1 + deepstack layers)] — so the feature
  cache, the E→P transfer and chunked prefill carry them as they carry the rest.

The vision towers are transformers' own modules (the checkpoints' weights load into them by name),
the patch embedding computed as one product (vision_ops.py); the LLM is ours (`models/llama.py`,
over the paged KV cache), with each variant's `TextArch`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

from common.engine.models.llama import LlamaForCausalLM, TextArch, tied_embeddings
from common.engine.models.vision_ops import lighten
from common.engine.request import ImageInput


@dataclass(frozen=True)
class Variant:
    vision: type  # transformers' vision tower for this model_type
    qkv_bias: bool  # Qwen2's q/k/v projections have biases; Qwen3's have q/k norms instead
    qwen3: bool  # q/k norms, interleaved M-RoPE, DeepStack


VARIANTS = {
    "qwen2_vl": Variant(Qwen2VisionTransformerPretrainedModel, qkv_bias=True, qwen3=False),
    "qwen2_5_vl": Variant(Qwen2_5_VisionTransformerPretrainedModel, qkv_bias=True, qwen3=False),
    "qwen3_vl": Variant(Qwen3VLVisionModel, qkv_bias=False, qwen3=True),
}


def image_token_count(grid_thw: tuple[int, int, int], merge: int) -> int:
    """LLM tokens of one image: its patches, merge×merge of them folded into one."""
    t, h, w = grid_thw
    return t * h * w // (merge * merge)


def mrope_positions(
    token_ids: list[int],
    placeholder_ids: int | Collection[int],
    grids: list[tuple[int, int, int]],
    merge: int,
    intervals: list[float] | None = None,
) -> tuple[torch.Tensor, int]:
    """The [3, len(token_ids)] M-RoPE positions of a prompt, and its rope delta: the position of
    token i ≥ len(token_ids) is i + delta in all three streams.

    Each run of one placeholder token (an image's or a video's) belongs to the next entry of
    `grids`, in prompt order; the run must be exactly its token count. A video's temporal patches
    sit `intervals[k]` apart in the temporal stream (1 for images and Qwen2-VL videos), truncated,
    as transformers places them; the text after a picture or clip resumes one past its rows and
    columns (not its time), as transformers does."""
    marks = {placeholder_ids} if isinstance(placeholder_ids, int) else set(placeholder_ids)
    kind = [t if t in marks else None for t in token_ids]
    intervals = intervals or [1.0] * len(grids)
    pieces: list[torch.Tensor] = []
    grids_left = iter(zip(grids, intervals, strict=True))
    next_pos, i, n = 0, 0, len(token_ids)
    while i < n:
        j = i
        while j < n and kind[j] == kind[i]:
            j += 1
        if kind[i] is None:
            pieces.append(torch.arange(next_pos, next_pos + j - i).expand(3, -1))
            next_pos += j - i
        else:
            try:
                (t, h, w), interval = next(grids_left)
            except StopIteration:
                raise ValueError("the prompt has more image placeholder runs than images") from None
            gh, gw = h // merge, w // merge
            if t * gh * gw != j - i:
                raise ValueError(
                    f"an image of grid {(t, h, w)} needs {t * gh * gw} placeholders, the prompt has {j - i}"
                )
            steps = (torch.arange(t) * interval).long()
            tt = steps.view(-1, 1, 1).expand(t, gh, gw).flatten()
            hh = torch.arange(gh).view(1, -1, 1).expand(t, gh, gw).flatten()
            ww = torch.arange(gw).view(1, 1, -1).expand(t, gh, gw).flatten()
            pieces.append(torch.stack([tt, hh, ww]) + next_pos)
            next_pos += max(gh, gw)  # past its rows and columns, whatever its length in time
        i = j
    if next(grids_left, None) is not None:
        raise ValueError("more images than image placeholder runs in the prompt")
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    return positions, next_pos - n


class QwenVisionEncoder(nn.Module):
    """Patches of several images → their merged features (DeepStack's beside them), one tensor
    per image."""

    def __init__(self, vision_config, tower: type) -> None:
        super().__init__()
        vision_config._attn_implementation = "sdpa"
        # Built for real, not on the meta device: its rotary tables are buffers no checkpoint holds.
        with torch.device("cpu"):
            self.visual = tower(vision_config)
        lighten(self.visual)  # the same model, computed faster (vision_ops.py)
        self.merge = vision_config.spatial_merge_size

    @torch.no_grad()
    def forward(
        self, images: list[ImageInput], device: torch.device, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        patches = torch.cat([img.pixel_values for img in images]).to(device, dtype)
        grid = torch.as_tensor([img.grid_thw for img in images], device=device)
        out = self.visual(patches, grid_thw=grid)
        merged = out.pooler_output  # [all images' tokens, hidden]
        extra = getattr(out, "deepstack_features", None) or []
        if extra:
            merged = torch.cat([merged, *extra], dim=-1)
        sizes = [image_token_count(img.grid_thw, self.merge) for img in images]
        return list(merged.split(sizes))


class QwenVLModel(nn.Module):
    """The parts an instance's roles need: the vision tower for encode, the LLM for prefill/decode."""

    mrope = True

    def __init__(
        self, config, inv_freq: torch.Tensor, attention_scaling: float, with_vision: bool, with_language: bool
    ) -> None:
        super().__init__()
        variant = VARIANTS[config.model_type]
        self.config = config
        self.image_token_id = config.image_token_id
        video_token_id = getattr(config, "video_token_id", None)
        # The pad tokens images and clips fill (the processor's `placeholder_ids`).
        self.placeholder_ids = [config.image_token_id] + (
            [video_token_id] if video_token_id is not None else []
        )
        self.merge = config.vision_config.spatial_merge_size
        # Qwen2.5-VL: a video's temporal patches sit tokens_per_second × their seconds apart in
        # M-RoPE's temporal stream; Qwen2-VL: one apart.
        self.tokens_per_second = (
            config.vision_config.tokens_per_second if config.model_type == "qwen2_5_vl" else None
        )
        # Qwen3-VL: a clip's temporal patches are apart in the prompt (each after its time stamp),
        # each placed as a picture of one patch in time.
        self.stamped_clips = variant.qwen3
        text = config.text_config
        rope = text.rope_parameters or {}
        arch = TextArch(
            qkv_bias=variant.qkv_bias or None,
            o_bias=False if variant.qkv_bias else None,
            qk_norm=variant.qwen3,
            mrope_section=tuple(rope.get("mrope_section") or ()) or None,
            mrope_interleaved=variant.qwen3 or bool(rope.get("mrope_interleaved")),
        )
        self.language_model = (
            LlamaForCausalLM(text, inv_freq, attention_scaling, arch, tied=tied_embeddings(config))
            if with_language
            else None
        )
        self.vision = QwenVisionEncoder(config.vision_config, variant.vision) if with_vision else None

    def encode(
        self, images: list[ImageInput], device: torch.device, dtype: torch.dtype
    ) -> list[torch.Tensor]:
        return self.vision(images, device, dtype)

    def positions(self, token_ids: list[int], images: list[ImageInput]) -> tuple[torch.Tensor, int]:
        grids: list[tuple[int, int, int]] = []
        intervals: list[float] = []
        for img in images:
            t, h, w = img.grid_thw
            if img.video and self.stamped_clips:
                grids += [(1, h, w)] * t
                intervals += [1.0] * t
            else:
                grids.append((t, h, w))
                intervals.append(self._interval(img))
        return mrope_positions(token_ids, self.placeholder_ids, grids, self.merge, intervals)

    def _interval(self, img: ImageInput) -> float:
        if img.video and self.tokens_per_second is not None and img.seconds_per_patch is not None:
            return self.tokens_per_second * img.seconds_per_patch
        return 1.0
