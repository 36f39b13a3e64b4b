"""Between the wire (common.protocol) and the engine (common.engine): pure functions."""

from __future__ import annotations

import torch

from common.engine.processor import ProcessedPrompt
from common.engine.request import ImageInput
from common.protocol import RequestSpec


def to_prompt(
    spec: RequestSpec,
    image_token_id: int,
    pixels: list[torch.Tensor | None],
    features: list[torch.Tensor | None],
) -> ProcessedPrompt:
    """A processed prompt for the engine: one ImageInput per image, with pixels or features."""
    ids = torch.as_tensor(spec.prompt_token_ids)
    positions = (ids == image_token_id).nonzero().squeeze(1)
    images = [
        ImageInput(img.content_hash, img.num_tokens, pixel_values=px, features=ft)
        for img, px, ft in zip(spec.images, pixels, features, strict=True)
    ]
    expected = sum(img.num_tokens for img in spec.images)
    if len(positions) != expected:
        raise ValueError(f"prompt has {len(positions)} image placeholders, its images need {expected}")
    return ProcessedPrompt(list(spec.prompt_token_ids), images, positions)
