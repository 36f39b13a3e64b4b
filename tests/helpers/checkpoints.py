"""What the checkpoint writer's tests share across families: a release's files, seeded test images,
HF's greedy answer on a Qwen-VL checkpoint and the checks every family's tiny preset passes."""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors import safe_open
from transformers import AutoTokenizer, PreTrainedModel, Qwen2VLImageProcessorPil

IMAGE_PAD = "<|image_pad|>"
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
RELEASE_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "chat_template.json",
    "trident_checkpoint.json",
}


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Autouse where imported. As in test_checkpoints.py: the tiny model gains nothing from threads on
    a shared 2-core box."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def checkpoint_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def safetensors_keys(directory: Path) -> set[str]:
    keys: set[str] = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            keys.update(f.keys())
    return keys


def seeded_image(seed: int, size: tuple[int, int]) -> Image.Image:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def expand_image_pads(text: str, grid_thw: torch.Tensor, merge_size: int) -> str:
    """What Qwen2VLProcessor does: the i-th <|image_pad|> becomes t*h*w / merge^2 copies of itself."""
    head, *rests = text.split(IMAGE_PAD)
    assert len(rests) == len(grid_thw)
    counts = [int(grid.prod()) // merge_size**2 for grid in grid_thw]
    return head + "".join(IMAGE_PAD * n + rest for n, rest in zip(counts, rests, strict=True))


def squashed(output: str) -> str:
    # Rich wraps long lines inside boxes; dropping box edges and whitespace rejoins split names.
    return "".join(output.replace("│", "").split())


def qwen_greedy(
    model: PreTrainedModel, directory: Path, text: str, image: Image.Image | None
) -> tuple[list[int], list[float]]:
    """HF's 24 greedy tokens on a Qwen-VL checkpoint, and the gap between the top two logits at each."""
    tok = AutoTokenizer.from_pretrained(directory)
    content = [{"type": "image"}] if image is not None else []
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": text}]}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    extra: dict[str, torch.Tensor] = {}
    if image is not None:
        processor = Qwen2VLImageProcessorPil.from_pretrained(directory)
        pixels = processor(images=[image], return_tensors="pt")
        prompt = expand_image_pads(prompt, pixels["image_grid_thw"], processor.merge_size)
        extra = {"pixel_values": pixels["pixel_values"], "image_grid_thw": pixels["image_grid_thw"]}
    enc = tok(prompt, return_tensors="pt")
    if image is not None:
        # transformers 5 needs the token types to lay out M-RoPE positions over the image grid.
        extra["mm_token_type_ids"] = (enc["input_ids"] == model.config.image_token_id).int()
        assert int(extra["mm_token_type_ids"].sum()) == int(pixels["image_grid_thw"].prod()) // 4
    with torch.no_grad():
        out = model.generate(
            **enc,
            **extra,
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    new_tokens = out.sequences[0, enc["input_ids"].shape[1] :].tolist()
    top2 = torch.stack([torch.topk(step[0], 2).values for step in out.scores])
    return new_tokens, (top2[:, 0] - top2[:, 1]).tolist()


def check_greedy_generate_is_not_collapsed(
    model: PreTrainedModel, directory: Path, image_seed: int | None, size: tuple[int, int] | None
) -> None:
    """24 new tokens, at least 4 distinct, a decisive top-1 and no dead token winning."""
    image = None if image_seed is None else seeded_image(image_seed, size)
    new_tokens, gaps = qwen_greedy(model, directory, "What is in the picture?", image)
    assert len(new_tokens) == 24
    assert len(set(new_tokens)) >= 4
    # The winner is decided far above float32 noise at most steps.
    assert statistics.median(gaps) > 1e-2
    assert sum(gap > 1e-3 for gap in gaps) >= 20
    # Greedy text decodes cleanly: no pad, placeholder or marker (zero lm_head rows) ever wins.
    assert not set(new_tokens) & {0, 1, 3, 4, 5, 6}


def check_the_image_changes_the_output(model: PreTrainedModel, directory: Path) -> None:
    # Same prompt, same grid, different pixels: the vision tower's features reach the text model.
    a, _ = qwen_greedy(model, directory, "Describe it.", seeded_image(6, (56, 56)))
    b, _ = qwen_greedy(model, directory, "Describe it.", seeded_image(7, (56, 56)))
    assert a != b
