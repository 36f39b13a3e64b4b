"""What the engine's tests share: engines that check their integrity at the end, HF's greedy answer
on a prompt our processor made, a mixed batch against the oracle, and the prompts they ask."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.sampling import SamplingParams
from trident.bench.oracle import hf_model_inputs

QUESTIONS = [
    "What is in the picture?",
    "Tell me a long story about a small boat that sails to the island at night",
    "Hi",
    "Count the apples and the pears on the table, then say which fruit there is more of",
]


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


def hf_greedy(hf_model, processed, processor, max_tokens: int) -> list[int]:
    """HF `generate`'s greedy ids for a Qwen-VL prompt our processor made, images and clips alike
    (a clip's pixels and grid as its video processor makes them), cut after the first eos."""
    ids = torch.as_tensor([processed.token_ids])
    kinds = torch.zeros_like(ids, dtype=torch.int)
    kinds[ids == processor.image_token_id] = 1
    kinds[ids == processor.video_token_id] = 2
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": kinds}
    pictures = [i for i in processed.images if not i.video]
    videos = [i for i in processed.images if i.video]
    if pictures:
        inputs["pixel_values"] = torch.cat([i.pixel_values for i in pictures])
        inputs["image_grid_thw"] = torch.as_tensor([i.grid_thw for i in pictures])
    if videos:
        inputs["pixel_values_videos"] = torch.cat([v.pixel_values for v in videos])
        inputs["video_grid_thw"] = torch.as_tensor([v.grid_thw for v in videos])
        if hf_model.config.model_type == "qwen2_5_vl":
            inputs["second_per_grid_ts"] = torch.as_tensor([v.seconds_per_patch for v in videos])
    with torch.no_grad():
        out = hf_model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False)
    return until_eos(hf_model, out[0, ids.shape[1] :].tolist())
