"""Engine fixtures: HF transformers on the same tiny checkpoint is the correctness oracle."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image

from common.engine.config import EngineConfig
from common.engine.engine import Engine

logging.getLogger("transformers").setLevel(logging.ERROR)


def make_image(seed: int, size: tuple[int, int] = (80, 64)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture
def images():
    return [make_image(i) for i in range(4)]


@pytest.fixture
def make_engine(tiny_model_dir):
    """Build an engine with config overrides; every engine made is integrity-checked at teardown."""
    made: list[Engine] = []

    def build(**overrides) -> Engine:
        engine = Engine(tiny_model_dir, EngineConfig(**overrides))
        made.append(engine)
        return engine

    yield build
    for engine in made:
        engine.check_integrity()


@pytest.fixture
def hf_generate(hf_tiny):
    """Greedy HF `generate` for one prompt: the generated ids, cut after the first eos."""
    model, processor = hf_tiny

    def run(prompt: str, imgs: list[Image.Image], max_tokens: int) -> list[int]:
        enc = processor(text=prompt, images=imgs or None, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False)
        ids = out[0, enc["input_ids"].shape[1] :].tolist()
        eos = model.config.text_config.eos_token_id
        return ids[: ids.index(eos) + 1] if eos in ids else ids

    return run


def hf_inputs(processed, image_token_id: int, ids: torch.Tensor) -> dict:
    """HF's model inputs for a prompt our processor made (`processed`), over token ids `ids`
    [1, n] (the prompt, maybe with generated tokens after it), for any family."""
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    images = processed.images
    if not images:
        return kwargs
    if images[0].grid_thw is not None:  # Qwen-VL: patches, grids, and the token types M-RoPE needs
        kwargs["pixel_values"] = torch.cat([img.pixel_values for img in images])
        kwargs["image_grid_thw"] = torch.as_tensor([img.grid_thw for img in images])
        kwargs["mm_token_type_ids"] = (ids == image_token_id).int()
    elif images[0].image_size is not None:  # LLaVA-NeXT: tiles padded to the most any image has
        most = max(img.pixel_values.shape[0] for img in images)
        tiles = torch.zeros(len(images), most, *images[0].pixel_values.shape[1:])
        for i, img in enumerate(images):
            tiles[i, : img.pixel_values.shape[0]] = img.pixel_values
        kwargs["pixel_values"] = tiles
        kwargs["image_sizes"] = torch.as_tensor([img.image_size for img in images])
    else:  # LLaVA-1.5: one fixed-size tensor per image
        kwargs["pixel_values"] = torch.stack([img.pixel_values for img in images])
    return kwargs
