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
