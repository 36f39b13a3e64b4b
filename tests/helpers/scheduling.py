"""Scripted scheduler scenarios without a model: requests of a given shape, and a batch "run" by
hand (features appear, tokens are computed and sampled)."""

from __future__ import annotations

import torch

from common.engine.request import ImageInput, Request
from common.engine.sampling import SamplingParams
from common.engine.scheduler import Batch


def req(rid: str, prompt: int, images: int = 0, decoding: bool = False) -> Request:
    imgs = [ImageInput(f"{rid}-img{i}", 4, pixel_values=torch.zeros(1)) for i in range(images)]
    r = Request(rid, [1] * prompt, SamplingParams(max_tokens=8), imgs)
    return r


def complete(batch: Batch) -> None:
    """Pretend the runner ran the batch: features appear, tokens get computed and sampled."""
    for r, idx in batch.encodes:
        for i in idx:
            r.images[i].features = torch.zeros(4, 2)
    for r, n in batch.prefills:
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(7)
    for r in batch.decodes:
        r.num_computed_tokens += 1
        r.output_token_ids.append(7)


def names(batch: Batch) -> dict[str, list]:
    return {
        "encode": [(r.request_id, len(i)) for r, i in batch.encodes],
        "prefill": [(r.request_id, n) for r, n in batch.prefills],
        "decode": [r.request_id for r in batch.decodes],
    }
