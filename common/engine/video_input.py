"""A clip's sampled frames → the Qwen-VL vision tower's video patches, the way transformers'
video processors make them (`Qwen2VLVideoProcessor` for Qwen2-VL and Qwen2.5-VL,
`Qwen3VLVideoProcessor` for Qwen3-VL), without torchvision, which they need and this machine's CPU
build of torch has none of:

- the bounds on the pixels come from the release's video_preprocessor_config.json, or where it has
  none from its preprocessor_config.json (what transformers falls back to), with
  `min_pixels`/`max_pixels` over `size`, and the processor's defaults where neither says; Qwen2's
  bound each frame, Qwen3's the whole clip (its frames × their pixels);
- each frame is resized to a multiple of patch·merge within them (`smart_resize`, each family's
  own), bicubic (PIL's, where transformers uses torchvision's: the pixels may differ in the last
  bits, the shapes not), scaled to [0, 1] and normalised with the image processor's mean and std;
- the frames are padded to a whole number of temporal patches with copies of the last, and cut
  into [t·h·w, 3·temporal·patch·patch] in the processor's patch order;
- the clip's text: Qwen2's is one run of t·h·w / merge² pad tokens; Qwen3-VL stamps each temporal
  patch with its time, `<1.3 seconds>`, and wraps its h·w / merge² pad tokens in vision start/end
  (`Qwen3VLProcessor.replace_video_token`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as clip_resize

from common.engine.request import ImageInput

# The processors' own bounds, per family: Qwen2VLVideoProcessor's per frame, Qwen3VLVideoProcessor's per clip.
DEFAULT_PIXELS = {"qwen2": (128 * 28 * 28, 768 * 28 * 28), "qwen3": (128 * 32 * 32, 768 * 32 * 32)}
UNKNOWN_FPS = 24.0  # what transformers assumes of a clip whose rate it cannot tell
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


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
    rule: str = "qwen2"  # the family's: how frames are picked (common/video.py's RULES), sized and stamped

    @classmethod
    def of(cls, model_dir: Path, images, rule: str = "qwen2") -> VideoPatching:
        """The release's video bounds, and the image processor (`images`) for the rest."""
        found: dict = {}
        for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
            path = model_dir / name
            if path.is_file():
                found = json.loads(path.read_text())
                break
        size = found.get("size") or {}
        least, most = DEFAULT_PIXELS[rule]
        return cls(
            min_pixels=int(found.get("min_pixels") or size.get("shortest_edge") or least),
            max_pixels=int(found.get("max_pixels") or size.get("longest_edge") or most),
            patch=images.patch_size,
            temporal=images.temporal_patch_size,
            merge=images.merge_size,
            mean=tuple(images.image_mean),
            std=tuple(images.image_std),
            rescale=images.rescale_factor,
            rule=rule,
        )

    def frame_size(self, n: int, height: int, width: int) -> tuple[int, int]:
        """(height, width) each of a clip's `n` frames is resized to."""
        factor = self.patch * self.merge
        bounds = {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels}
        if self.rule == "qwen3":
            return clip_resize(n, height, width, temporal_factor=self.temporal, factor=factor, **bounds)
        return smart_resize(height, width, factor=factor, **bounds)

    def __call__(self, frames: np.ndarray, content_hash: str, sample_fps: float) -> ImageInput:
        """`frames` [n, H, W, 3] uint8 → the clip's ImageInput (video=True)."""
        n, height, width, _ = frames.shape
        h, w = self.frame_size(n, height, width)
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

    def text(self, video: ImageInput, indices: list[int], source_fps: float, pad: str) -> str:
        """What the clip's one video mark in a prompt becomes: its pad tokens (`pad`), and for
        Qwen3-VL each temporal patch's time before its own vision start/end."""
        if self.rule != "qwen3":
            return pad * video.num_tokens
        t = video.grid_thw[0]
        per_patch = video.num_tokens // t
        stamps = patch_times(indices, source_fps or UNKNOWN_FPS, self.temporal)
        assert len(stamps) == t, (len(stamps), t)
        return "".join(f"<{s:.1f} seconds>{VISION_START}{pad * per_patch}{VISION_END}" for s in stamps)


def patch_times(indices: list[int], source_fps: float, temporal: int) -> list[float]:
    """Seconds into the clip of each temporal patch: the mean of the times of its first and last
    frame, the last frame repeated to fill the final patch (`Qwen3VLProcessor`'s stamps)."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % temporal)
    times = [i / source_fps for i in padded]
    return [(times[k] + times[k + temporal - 1]) / 2 for k in range(0, len(times), temporal)]
