"""A request as sent between services (`RequestSpec`) seen as the engine sees it: its processed
prompt, and the prefix-cache keys of its prompt's full blocks. A prefill instance admits the
prompt; a gateway computes the same keys to find where they are cached (services/gateway/kv_routing.py),
so both go through `spec_prompt` and cannot disagree."""

from __future__ import annotations

from collections.abc import Collection

import torch

from common.engine.prefix import block_hashes
from common.engine.processor import ProcessedPrompt
from common.engine.request import ImageInput, Request
from common.protocol import RequestSpec, SamplingParams


def spec_prompt(
    spec: RequestSpec,
    placeholders: int | Collection[int],
    pixels: list[torch.Tensor | None],
    features: list[torch.Tensor | None],
) -> ProcessedPrompt:
    """The engine's view of a request: one ImageInput per image (or clip), with its pixels or its
    features. `placeholders`: the model's image (and video) pad token ids."""
    ids = torch.as_tensor(spec.prompt_token_ids)
    marks = torch.as_tensor([placeholders] if isinstance(placeholders, int) else sorted(placeholders))
    positions = torch.isin(ids, marks).nonzero().squeeze(1)
    images = []
    for img, px, ft in zip(spec.images, pixels, features, strict=True):
        extra = {  # families whose images vary; clips
            "grid_thw": img.grid_thw,
            "image_size": img.image_size,
            "video": img.video,
            "seconds_per_patch": img.seconds_per_patch,
        }
        images.append(ImageInput(img.content_hash, img.num_tokens, pixel_values=px, features=ft, **extra))
    expected = sum(img.num_tokens for img in spec.images)
    if len(positions) != expected:
        raise ValueError(f"prompt has {len(positions)} image placeholders, its images need {expected}")
    return ProcessedPrompt(list(spec.prompt_token_ids), images, positions)


def spec_block_hashes(spec: RequestSpec, placeholders: int | Collection[int], block_size: int) -> list[bytes]:
    """The prefix-cache keys of the prompt's full blocks, as a prefill instance of that block size
    computes them (common/engine/prefix.py)."""
    req = _spec_request(spec, placeholders)
    return block_hashes(req, len(req.prompt_token_ids) // block_size, block_size)


def spec_image_spans(spec: RequestSpec, placeholders: int | Collection[int]) -> list[tuple[int, int]]:
    """Each image's placeholders in the prompt, (first position, last + 1): an image lies in a
    cached prefix of n tokens when its span ends at n or before."""
    return _spec_request(spec, placeholders).image_spans() if spec.images else []


def _spec_request(spec: RequestSpec, placeholders: int | Collection[int]) -> Request:
    none = [None] * len(spec.images)
    prompt = spec_prompt(spec, placeholders, none, none)
    return Request(
        spec.request_id,
        prompt.token_ids,
        SamplingParams(),
        prompt.images,
        image_positions=prompt.image_positions,
    )
