"""Engine fixtures: HF transformers on the same tiny checkpoint is the correctness oracle."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from PIL import Image

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.sampling import SamplingParams
from trident.bench.oracle import hf_model_inputs

logging.getLogger("transformers").setLevel(logging.ERROR)


def make_image(seed: int, size: tuple[int, int] = (80, 64)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture
def images():
    return [make_image(i) for i in range(4)]


@contextmanager
def engines(model_dir) -> Iterator[Callable[..., Engine]]:
    """A builder of engines on `model_dir` with config overrides; each is integrity-checked at the end."""
    made: list[Engine] = []

    def build(**overrides) -> Engine:
        engine = Engine(model_dir, EngineConfig(**overrides))
        made.append(engine)
        return engine

    yield build
    for engine in made:
        engine.check_integrity()


@pytest.fixture
def make_engine(tiny_model_dir):
    with engines(tiny_model_dir) as build:
        yield build


def check_mixed_batch(engine: Engine, hf_generate, questions: list[str], images: list, stride: int) -> None:
    """8 requests of different prompt lengths, image counts (0-2, from `images` at i % stride) and
    max_tokens, all in flight at once; each answers as HF does alone."""
    cases = [(questions[i % 4], i % 3, 8 + 5 * i) for i in range(8)]
    prompts = [engine.chat_prompt(q, n) for q, n, _ in cases]
    imgs = [images[i % stride : i % stride + n] for i, (_, n, _) in enumerate(cases)]
    reqs = [
        engine.add_request(p, im, SamplingParams(max_tokens=m))
        for p, im, (_, _, m) in zip(prompts, imgs, cases, strict=True)
    ]
    max_batch = 0
    while engine.has_unfinished():
        engine.step()
        max_batch = max(max_batch, len(engine.scheduler.running))
    assert max_batch >= 4, "requests should have run together"
    for req, p, im, (_, _, m) in zip(reqs, prompts, imgs, cases, strict=True):
        assert req.output_token_ids == hf_generate(p, im, m), req.request_id


@pytest.fixture(scope="session")
def hf_generate(hf_tiny):
    """Greedy HF `generate` for one prompt: the generated ids, cut after the first eos. Each answer
    is computed once per session (greedy HF is deterministic): several tests ask the same."""
    model, processor = hf_tiny
    answers: dict[tuple, list[int]] = {}

    def run(prompt: str, imgs: list[Image.Image], max_tokens: int) -> list[int]:
        key = (prompt, tuple((img.size, img.mode, img.tobytes()) for img in imgs), max_tokens)
        if key not in answers:
            enc = processor(text=prompt, images=imgs or None, return_tensors="pt")
            with torch.no_grad():
                out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False)
            ids = out[0, enc["input_ids"].shape[1] :].tolist()
            eos = model.config.text_config.eos_token_id
            answers[key] = ids[: ids.index(eos) + 1] if eos in ids else ids
        return list(answers[key])

    return run


def hf_greedy_ids(model, processed, image_token_id: int, max_tokens: int) -> list[int]:
    """HF `generate`'s greedy ids for a prompt our processor made, cut after the first eos that
    its generation config names."""
    ids = torch.as_tensor([processed.token_ids])
    with torch.no_grad():
        out = model.generate(
            **hf_inputs(processed, image_token_id, ids), max_new_tokens=max_tokens, do_sample=False
        )
    return until_eos(model, out[0, ids.shape[1] :].tolist())


def until_eos(model, new: list[int]) -> list[int]:
    """`new` cut after the first eos the model's generation config names, as our engine stops."""
    eos = model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    return new[: next((i + 1 for i, t in enumerate(new) if t in eos), len(new))]


def hf_inputs(processed, image_token_id: int, ids: torch.Tensor) -> dict:
    """HF's model inputs for a prompt our processor made (`processed`), over token ids `ids`
    [1, n] (the prompt, maybe with generated tokens after it), for any family."""
    return hf_model_inputs(processed.images, ids, torch.ones_like(ids), image_token_id)
