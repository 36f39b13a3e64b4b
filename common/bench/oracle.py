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

from PIL import Image


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


def hf_greedy(model_dir: Path, chats: list[Chat], max_tokens: int) -> list[str]:
    """Each chat's greedy answer from HF `generate` on the checkpoint in `model_dir`, as text.

    The server is asked with `ignore_eos`, so it generates exactly `max_tokens`; so does this (eos
    does not end it), and the text is decoded without special tokens, as the server streams it.
    """
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = LlavaForConditionalGeneration.from_pretrained(model_dir).eval()
    processor = AutoProcessor.from_pretrained(model_dir)
    config = copy.deepcopy(model.generation_config)
    config.do_sample, config.eos_token_id = False, None  # as `ignore_eos`: eos does not end it
    config.pad_token_id = processor.tokenizer.pad_token_id or 0
    answers = []
    for chat in chats:
        content = [{"type": "image"}] * len(chat.image_urls) + [{"type": "text", "text": chat.text}]
        prompt = processor.apply_chat_template(
            [{"role": "user", "content": content}], add_generation_prompt=True
        )
        images = [_decode(u) for u in chat.image_urls] or None
        enc = processor(text=prompt, images=images, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, generation_config=config, max_new_tokens=max_tokens)
        ids = out[0, enc["input_ids"].shape[1] :].tolist()
        assert len(ids) == max_tokens, f"HF stopped after {len(ids)} of {max_tokens} tokens"
        answers.append(processor.tokenizer.decode(ids, skip_special_tokens=True))
    return answers
