"""The request processor (000 §4.1): the checkpoint's own HF processor turns messages and images
into prompt token ids with expanded image placeholders and pixel tensors; each image gets a hash
of its decoded content, the key of the feature cache and the feature store."""

from __future__ import annotations

import hashlib
import io
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from transformers import AutoProcessor

from common.engine.loader import CheckpointError
from common.engine.request import ImageInput


class InputError(ValueError):
    """Bad user input (an undecodable image, a prompt the model cannot take); maps to a 4xx."""


class ImageTooLarge(InputError):
    """An image whose header declares more pixels than allowed: refused before it is decoded."""


@dataclass
class ProcessedPrompt:
    token_ids: list[int]
    images: list[ImageInput]
    image_positions: torch.Tensor  # [total_image_tokens] prompt positions of placeholders


def content_hash(image: Image.Image) -> str:
    """sha256 of the decoded pixels, so the same picture in another file format hashes the same."""
    h = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def load_image(data: bytes | str | Path | Image.Image, max_pixels: int | None = None) -> Image.Image:
    """Decode an image from bytes or a path into RGB; undecodable input raises InputError. With
    `max_pixels`, the size its header declares is checked before any pixel is decoded, so a small
    file that claims 20000×20000 pixels costs nothing (ImageTooLarge)."""
    if isinstance(data, Image.Image):
        return data.convert("RGB")
    try:
        src = io.BytesIO(data) if isinstance(data, bytes) else open(data, "rb")  # noqa: SIM115
        with src, Image.open(src) as img:
            width, height = img.size
            if max_pixels is not None and width * height > max_pixels:
                raise ImageTooLarge(
                    f"image is {width}x{height} pixels, more than the {max_pixels:,} allowed; send it smaller"
                )
            return img.convert("RGB")
    except Image.DecompressionBombError as exc:  # PIL's own cap, when ours is off or larger
        raise ImageTooLarge(f"image declares too many pixels to decode: {exc}") from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"cannot decode image: {exc}") from exc


class RequestProcessor:
    def __init__(self, model_dir: str | Path) -> None:
        # transformers warns that torchvision is missing and falls back to its PIL image processor,
        # which is what we want on CPU-only machines; the warning is noise.
        logging.getLogger("transformers").setLevel(logging.ERROR)
        try:
            self.hf = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{model_dir}: cannot load the tokenizer/processor files: {exc}") from exc
        self.tokenizer = self.hf.tokenizer
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.hf.image_token)

    def chat_prompt(self, messages: list[dict]) -> str:
        """Apply the checkpoint's chat template; image parts become the model's image token."""
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def process(self, prompt: str, images: list[Image.Image]) -> ProcessedPrompt:
        """Tokenise `prompt` (which holds one image token per image) and preprocess the images."""
        marks = prompt.count(self.hf.image_token)
        if marks != len(images):
            raise InputError(f"prompt has {marks} image placeholders but {len(images)} images were given")
        if images:
            enc = self.hf(text=prompt, images=images, return_tensors="pt")
            pixels = enc["pixel_values"]
        else:
            enc = self.hf.tokenizer(prompt, return_tensors="pt")
            pixels = None
        ids = enc["input_ids"][0]
        positions = (ids == self.image_token_id).nonzero().squeeze(1)
        per_image = len(positions) // max(1, len(images))
        if images and per_image * len(images) != len(positions):
            raise InputError("image placeholders do not split evenly between the images")
        inputs = [
            ImageInput(content_hash(img), per_image, pixel_values=pixels[i]) for i, img in enumerate(images)
        ]
        return ProcessedPrompt(ids.tolist(), inputs, positions)
