"""The request processor (000 §4.1): the checkpoint's own HF processor turns messages and images
into prompt token ids with expanded image placeholders and pixel tensors; each image gets a hash
of its decoded content, the key of the feature cache and the feature store."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import jinja2
import jinja2.meta
import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from transformers import AutoProcessor, AutoTokenizer, Qwen2VLImageProcessorPil
from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

from common.engine.errors import InputError
from common.engine.loader import CheckpointError, load_config
from common.engine.models.qwen_vl import VARIANTS as QWEN_VL
from common.engine.request import ImageInput
from common.engine.video_input import VideoPatching

# The families that take clips, and how each picks, sizes and stamps their frames.
VIDEO_RULES = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}


class ImageTooLarge(InputError):
    """An image whose header declares more pixels than allowed: refused before it is decoded."""


class Frames(Protocol):
    """A clip's sampled frames (common/video.py's Clip)."""

    frames: np.ndarray  # [n, H, W, 3] uint8
    indices: list[int]  # of the sampled frames among the clip's
    sample_fps: float
    source_fps: float

    @property
    def content_hash(self) -> str: ...


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
        raise InputError(f"cannot decode image: {image_fault(exc)}") from exc


def image_fault(exc: Exception) -> str:
    """Why PIL could not read an image, in words for the client: PIL's own message for a file it
    does not recognise names the Python object it read from (`<_io.BytesIO object at 0x…>`)."""
    if isinstance(exc, UnidentifiedImageError):
        return "it is not in an image format this server reads (PNG, JPEG, WebP, GIF, BMP, TIFF, ...)"
    text = re.sub(r"<[\w.]+ object at 0x[0-9a-fA-F]+>", "the image", str(exc)) or type(exc).__name__
    return text if len(text) <= 200 else f"{text[:200]}…"


class RequestProcessor:
    """The checkpoint's own tokenizer, chat template and image processor, for its family: LLaVA's
    HF processor as it is; for the Qwen-VL family the tokenizer and the PIL image processor, with
    the processor's placeholder rule (one image becomes grid_t·grid_h·grid_w / merge² pad tokens),
    because transformers' Qwen-VL processors insist on a video processor that needs torchvision."""

    def __init__(self, model_dir: str | Path) -> None:
        # transformers warns that torchvision is missing and falls back to its PIL image processor,
        # which is what we want on CPU-only machines; the warning is noise.
        logging.getLogger("transformers").setLevel(logging.ERROR)
        model_dir = Path(model_dir)
        self.family = load_config(model_dir).model_type
        try:
            if self.family in QWEN_VL:
                self.hf = None
                self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
                self.images = Qwen2VLImageProcessorPil.from_pretrained(model_dir, local_files_only=True)
                self.image_token = "<|image_pad|>"
                self.video_token: str | None = "<|video_pad|>"
                self.videos: VideoPatching | None = (
                    VideoPatching.of(model_dir, self.images, VIDEO_RULES[self.family])
                    if self.family in VIDEO_RULES
                    else None
                )
                self.template = _chat_template(model_dir) or self.tokenizer.chat_template
            else:
                self.hf = AutoProcessor.from_pretrained(model_dir, local_files_only=True)
                self.tokenizer = self.hf.tokenizer
                self.image_token = self.hf.image_token
                self.video_token = None
                self.videos = None
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"{model_dir}: cannot load the tokenizer/processor files: {exc}") from exc
        template = self.template if self.hf is None else self.hf.chat_template
        self.defines_tools = _renders_tools(template)
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = (
            self.tokenizer.convert_tokens_to_ids(self.video_token) if self.video_token else None
        )

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """The pad tokens images (and clips) fill: where their features go in a prompt."""
        return (self.image_token_id,) + ((self.video_token_id,) if self.video_token_id is not None else ())

    def chat_prompt(self, messages: list[dict], tools: Sequence[dict] = ()) -> str:
        """Apply the checkpoint's chat template; image parts become the model's image token. With
        `tools` (OpenAI function definitions), a template that `defines_tools` lists them."""
        more = {"tools": list(tools)} if tools else {}
        if self.hf is None:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.template, add_generation_prompt=True, tokenize=False, **more
            )
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **more)

    def process(
        self, prompt: str, images: list[Image.Image], videos: Sequence[Frames] = ()
    ) -> ProcessedPrompt:
        """Tokenise `prompt` (which holds one image token per image, and one video token per clip)
        and preprocess the images and clips."""
        marks = prompt.count(self.image_token)
        if marks != len(images):
            raise InputError(f"prompt has {marks} image placeholders but {len(images)} images were given")
        if videos and self.videos is None:
            raise InputError(f"{self.family} models take no video here; send images")
        if self.video_token is not None and prompt.count(self.video_token) != len(videos):
            found = prompt.count(self.video_token)
            raise InputError(f"prompt has {found} video placeholders but {len(videos)} videos were given")
        if self.family in QWEN_VL:
            return self._process_grids(prompt, images, videos)
        if images:
            enc = self.hf(text=prompt, images=images, return_tensors="pt")
            pixels = enc["pixel_values"]
        else:
            enc = self.hf.tokenizer(prompt, return_tensors="pt")
            pixels = None
        ids = enc["input_ids"][0]
        positions = (ids == self.image_token_id).nonzero().squeeze(1)
        counts = _tokens_per_image(positions, len(images))
        sizes = enc["image_sizes"].tolist() if "image_sizes" in enc else [None] * len(images)
        inputs = []
        for img, n, tiles, size in zip(images, counts, pixels if images else [], sizes, strict=True):
            if size is None:
                inputs.append(ImageInput(content_hash(img), n, pixel_values=tiles))
            else:  # LLaVA-NeXT: the image's own tiles (the batch pads them), and its size to stitch to
                kept = tiles[: self._tiles(size)]
                inputs.append(ImageInput(content_hash(img), n, pixel_values=kept, image_size=tuple(size)))
        return ProcessedPrompt(ids.tolist(), inputs, positions)

    def _tiles(self, image_size: list[int]) -> int:
        """LLaVA-NeXT: how many of the (padded) tiles the processor made are this image's."""
        images = self.hf.image_processor
        return image_size_to_num_patches(image_size, images.image_grid_pinpoints, images.crop_size["height"])

    def _process_grids(
        self, prompt: str, images: list[Image.Image], videos: Sequence[Frames]
    ) -> ProcessedPrompt:
        """Each image (and clip) becomes its own number of pad tokens, and its patches with their
        grid; the inputs in the order the prompt places them."""
        pictures = self._picture_inputs(images)
        clips = list(videos)
        marks = [self.image_token] + ([self.video_token] if self.video_token else [])
        pieces = re.split(f"({'|'.join(map(re.escape, marks))})", prompt)
        inputs: list[ImageInput] = []
        text = pieces[0]
        for mark, piece in zip(pieces[1::2], pieces[2::2], strict=True):
            if mark == self.image_token:
                item = pictures.pop(0)
                text += mark * item.num_tokens + piece
            else:
                clip = clips.pop(0)
                item = self.videos(clip.frames, clip.content_hash, clip.sample_fps)
                text += self.videos.text(item, clip.indices, clip.source_fps, mark) + piece
            inputs.append(item)
        ids = torch.as_tensor(self.tokenizer(text)["input_ids"])
        positions = torch.isin(ids, torch.as_tensor(self.placeholder_ids)).nonzero().squeeze(1)
        if len(positions) != sum(item.num_tokens for item in inputs):
            raise InputError("the prompt's text holds image or video pad tokens of its own")
        return ProcessedPrompt(ids.tolist(), inputs, positions)

    def _picture_inputs(self, images: list[Image.Image]) -> list[ImageInput]:
        inputs: list[ImageInput] = []
        if images:
            enc = self.images(images=images, return_tensors="pt")
            merge = self.images.merge_size
            offset = 0
            for img, grid in zip(images, enc["image_grid_thw"].tolist(), strict=True):
                patches = grid[0] * grid[1] * grid[2]
                pixels = enc["pixel_values"][offset : offset + patches]
                offset += patches
                inputs.append(
                    ImageInput(
                        content_hash(img),
                        patches // (merge * merge),
                        pixel_values=pixels,
                        grid_thw=tuple(grid),
                    )
                )
        return inputs


def _tokens_per_image(positions: torch.Tensor, num_images: int) -> list[int]:
    """How many of the prompt's image placeholders each image has: one run of them per image
    (LLaVA-NeXT's differ with the image's size; chat templates separate images by text), or, for
    images all one size placed side by side, equal shares."""
    if not num_images:
        return []
    breaks = (positions[1:] - positions[:-1] != 1).nonzero().squeeze(1) + 1
    runs = [len(run) for run in torch.tensor_split(positions, breaks.tolist())]
    if len(runs) == num_images:
        return runs
    if len(positions) % num_images == 0:
        return [len(positions) // num_images] * num_images
    raise InputError("cannot tell which image placeholders belong to which image; put text between images")


def _renders_tools(template: str | None) -> bool:
    """Whether a chat template reads the `tools` it is given (and so knows tool calls and results:
    Qwen2.5-VL's and Qwen3-VL's do, LLaVA's do not)."""
    if not template:
        return False
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:  # HF's own environment has extensions; read it as text then
        return re.search(r"\btools\b", template) is not None


def _chat_template(model_dir: Path) -> str | None:
    """A release's chat_template.json (the processor's template), if it has one."""
    path = model_dir / "chat_template.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["chat_template"]
    except (ValueError, KeyError) as exc:
        raise CheckpointError(f"{path} holds no chat_template: {exc}") from exc


# The picture budgets are measured on, before the checkpoint's processor resizes it: what a
# LLaVA-1.5 processor makes 336 px of, and a Qwen2-VL one, at 28 px a token, 256 tokens.
REFERENCE_IMAGE = (448, 448)


def reference_image(processor: RequestProcessor) -> ImageInput:
    """REFERENCE_IMAGE (random pixels) through the checkpoint's own processor: the image the
    encode curve is profiled on, and the unit τe counts in where an image's cost follows its size."""
    w, h = REFERENCE_IMAGE
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8))
    (image,) = processor.process(processor.image_token, [picture]).images
    return image
