"""A clip's sampled frames → the Qwen-VL vision tower's video patches, the way transformers'
`Qwen2VLVideoProcessor` makes them (Qwen2-VL and Qwen2.5-VL share it), without torchvision,
which that processor needs and this machine's CPU build of torch has none of:

- the bounds on a frame's pixels come from the release's video_preprocessor_config.json, or
  where it has none from its preprocessor_config.json (what transformers falls back to), with
  `min_pixels`/`max_pixels` over `size`, and the processor's defaults where neither says;
- each frame is resized to a multiple of patch·merge within them (`smart_resize`), bicubic (PIL's,
  where transformers uses torchvision's: the pixels may differ in the last bits, the shapes not),
  scaled to [0, 1] and normalised with the image processor's mean and std;
- the frames are padded to a whole number of temporal patches with copies of the last, and cut
  into [t·h·w, 3·temporal·patch·patch] in the processor's patch order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from common.engine.request import ImageInput

DEFAULT_MIN_PIXELS = 128 * 28 * 28  # Qwen2VLVideoProcessor's own
DEFAULT_MAX_PIXELS = 768 * 28 * 28


@dataclass(frozen=True)
class VideoPatching:
    min_pixels: int
    max_pixels: int
    patch: int
    temporal: int
    merge: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float

    @classmethod
    def of(cls, model_dir: Path, images) -> VideoPatching:
        """The release's video bounds, and the image processor (`images`) for the rest."""
        found: dict = {}
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            path = model_dir / name
            if path.is_file():
                found = json.loads(path.read_text())
                break
        size = found.get("size") or {}
        return cls(
            min_pixels=int(found.get("min_pixels") or size.get("shortest_edge") or DEFAULT_MIN_PIXELS),
            max_pixels=int(found.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_PIXELS),
            patch=images.patch_size,
            temporal=images.temporal_patch_size,
            merge=images.merge_size,
            mean=tuple(images.image_mean),
            std=tuple(images.image_std),
            rescale=images.rescale_factor,
        )

    def __call__(self, frames: np.ndarray, content_hash: str, sample_fps: float) -> ImageInput:
        """`frames` [n, H, W, 3] uint8 → the clip's ImageInput (video=True)."""
        n, height, width, _ = frames.shape
        factor = self.patch * self.merge
        h, w = smart_resize(
            height, width, factor=factor, min_pixels=self.min_pixels, max_pixels=self.max_pixels
        )
        resized = np.stack(
            [np.asarray(Image.fromarray(f).resize((w, h), Image.BICUBIC), dtype=np.float32) for f in frames]
        )
        mean, std = np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
        video = torch.from_numpy((resized * np.float32(self.rescale) - mean) / std).permute(0, 3, 1, 2)
        if pad := -n % self.temporal:
            video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
        t, gh, gw = video.shape[0] // self.temporal, h // self.patch, w // self.patch
        m, p = self.merge, self.patch
        patches = video.reshape(t, self.temporal, 3, gh // m, m, p, gw // m, m, p)
        patches = patches.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * gh * gw, 3 * self.temporal * p * p)
        return ImageInput(
            content_hash,
            t * gh * gw // (m * m),
            pixel_values=patches.contiguous(),
            grid_thw=(t, gh, gw),
            video=True,
            seconds_per_patch=self.temporal / sample_fps,
        )
