"""HF transformers' greedy answers to chats: what a benchmark holds a served answer against.

A chat here is one user turn, its images first and its text after, as the benchmarks send it. The
images are data: URLs and are decoded from the same bytes the server gets, so both sides see the
same pixels.
"""

from __future__ import annotations

import base64
import copy
import io
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from PIL import Image

if TYPE_CHECKING:
    import torch

    from common.engine.request import ImageInput


@dataclass(frozen=True)
class Chat:
    text: str
    image_urls: tuple[str, ...] = field(default_factory=tuple)

    def messages(self) -> list[dict]:
        """The chat as OpenAI `messages`."""
        parts: list[dict] = [{"type": "image_url", "image_url": {"url": u}} for u in self.image_urls]
        parts.append({"type": "text", "text": self.text})
        return [{"role": "user", "content": parts}]


def _decode(url: str) -> Image.Image:
    _, data = url.split(",", 1)
    return Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")


def hf_greedy(model_dir: Path, chats: list[Chat], max_tokens: int, device: str = "cpu") -> list[str]:
    """Each chat's greedy answer from HF `generate` on the checkpoint in `model_dir`, as text, run
    on `device` (the one the server answers from, for a like-for-like check).

    The server is asked with `ignore_eos`, so it generates exactly `max_tokens`; so does this (eos
    does not end it), and the text is decoded without special tokens, as the server streams it.
    """
    import torch
    from transformers import AutoModelForImageTextToText

    from common.engine.processor import RequestProcessor

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval().to(device)
    processor = RequestProcessor(model_dir)  # the checkpoint's own (LLaVA's HF processor as it is)
    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.eos_token_id = False, None  # as `ignore_eos`: eos does not end it
    config.pad_token_id = processor.tokenizer.pad_token_id or 0
    answers = []
    for chat in chats:
        content = [{"type": "image"}] * len(chat.image_urls) + [{"type": "text", "text": chat.text}]
        prompt = processor.chat_prompt([{"role": "user", "content": content}])
        processed = processor.process(prompt, [_decode(u) for u in chat.image_urls])
        ids = torch.as_tensor([processed.token_ids])
        enc = hf_model_inputs(processed.images, ids, torch.ones_like(ids), processor.image_token_id)
        enc = {k: v.to(device) for k, v in enc.items()}
        with torch.no_grad():
            out = model.generate(**enc, generation_config=config, max_new_tokens=max_tokens)
        ids = out[0, enc["input_ids"].shape[1] :].tolist()
        assert len(ids) == max_tokens, f"HF stopped after {len(ids)} of {max_tokens} tokens"
        answers.append(processor.tokenizer.decode(ids, skip_special_tokens=True))
    return answers


def hf_model_inputs(
    images: list[ImageInput], input_ids: torch.Tensor, attention_mask: torch.Tensor, image_token_id: int
) -> dict[str, torch.Tensor]:
    """The keyword arguments HF's own model class takes for prompts `RequestProcessor` made, for any
    family; `images` are all of the batch's, in order."""
    import torch

    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if not images:
        return kwargs
    if images[0].grid_thw is not None:  # Qwen-VL: patches, grids, and the token types M-RoPE needs
        kwargs["pixel_values"] = torch.cat([img.pixel_values for img in images])
        kwargs["image_grid_thw"] = torch.as_tensor([img.grid_thw for img in images])
        kwargs["mm_token_type_ids"] = (input_ids == image_token_id).int()
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
