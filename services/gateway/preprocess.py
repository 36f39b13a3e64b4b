"""Images, from fetched bytes to the engine's input, off the event loop and off the text path.

A request with images is decoded and processed on a pool of `workers` threads; each processing
step borrows one of `workers` `RequestProcessor`s made at start (a tokenizer must not be used by
two threads at once). At most `workers` such requests are in the pool at once, and the images of
one request decode side by side. Text-only requests keep the gateway's own processor thread, so
they never queue behind images.

Memory is bounded by checking, from the images' headers and before any pixel is decoded, that
each image and the request's images together stay within their pixel caps: at most `workers`
requests × `max_request_pixels` decoded pixels are held at once. What a large decode took is
handed back to the system afterwards (`give_back_memory`): glibc keeps freed memory in its
per-thread arenas, where it would stay held by the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import io
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from common.engine.processor import (
    ImageTooLarge,
    InputError,
    ProcessedPrompt,
    RequestProcessor,
    image_fault,
    load_image,
)
from common.errors import APIError
from common.video import Clip, VideoError, VideoLimits, VideoTooLarge, decode_video

TRIM_AFTER_PIXELS = 4_000_000  # a decode this large leaves enough freed memory to hand back


class ImagePreprocessor:
    def __init__(self, model_dir: Path, workers: int, max_pixels: int, max_request_pixels: int) -> None:
        self.workers = workers or min(4, os.cpu_count() or 1)
        self.max_pixels = max_pixels
        self.max_request_pixels = max_request_pixels
        self.pool = ThreadPoolExecutor(
            self.workers, thread_name_prefix="gateway-images", initializer=_yield_cpu
        )
        self._slots = asyncio.Semaphore(self.workers)
        self._processors: queue.SimpleQueue[RequestProcessor] = queue.SimpleQueue()
        for _ in range(self.workers):  # made now, so the memory they hold counts as idle memory
            self._processors.put(RequestProcessor(model_dir))

    async def process(
        self, prompt: str, blobs: list[bytes], videos: list[bytes] = (), sampling: VideoSampling | None = None
    ) -> ProcessedPrompt:
        """`prompt` (one image token per image, one video token per clip) with `blobs` (and the
        clips in `videos`, sampled as `sampling` says) decoded and preprocessed; a 4xx APIError for
        images or clips too large, undecodable, or too many pixels together."""
        self.check_pixels(blobs)
        loop = asyncio.get_running_loop()
        async with self._slots:
            # Clips first: a refused one costs the request no image decode.
            clips = [await loop.run_in_executor(self.pool, self._decode_video, v, sampling) for v in videos]
            images = await asyncio.gather(*(loop.run_in_executor(self.pool, self._decode, b) for b in blobs))
            pixels = sum(image.width * image.height for image in images) + sum(
                c.frames.size // 3 for c in clips
            )
            try:
                return await loop.run_in_executor(self.pool, self._process, prompt, images, clips)
            finally:
                for image in images:
                    image.close()
                del images
                if pixels >= TRIM_AFTER_PIXELS:
                    await loop.run_in_executor(self.pool, give_back_memory)

    def check_pixels(self, blobs: list[bytes]) -> None:
        """Each image's and all images' pixels, read from their headers (nothing is decoded)."""
        total = 0
        for i, blob in enumerate(blobs):
            width, height = _declared_size(blob, i)
            if width * height > self.max_pixels:
                raise APIError(
                    413,
                    f"image {i + 1} is {width}x{height} pixels, more than the {self.max_pixels:,} allowed; "
                    "send it smaller",
                    param="image_url",
                    code="image_too_large",
                )
            total += width * height
        if total > self.max_request_pixels:
            raise APIError(
                413,
                f"the request's {len(blobs)} images hold {total:,} pixels in all, more than the "
                f"{self.max_request_pixels:,} one request may (TRIDENT_MAX_REQUEST_PIXELS); send fewer or "
                "smaller images",
                param="messages",
                code="image_too_large",
            )

    def _decode(self, blob: bytes) -> Image.Image:
        try:
            return load_image(blob, max_pixels=self.max_pixels)
        except ImageTooLarge as exc:
            raise APIError(413, str(exc), param="image_url", code="image_too_large") from exc
        except InputError as exc:
            raise APIError(400, str(exc), param="image_url") from exc

    def _decode_video(self, blob: bytes, sampling: VideoSampling | None) -> Clip:
        """One clip's sampled frames (common/video.py: bounded, under its own deadline)."""
        assert sampling is not None
        try:
            return decode_video(blob, sampling.limits, sampling.fps, sampling.max_frames, rule=sampling.rule)
        except VideoTooLarge as exc:
            raise APIError(413, str(exc), param="video_url", code="video_too_large") from exc
        except VideoError as exc:
            raise APIError(400, str(exc), param="video_url") from exc

    def _process(self, prompt: str, images: list[Image.Image], clips: list[Clip] = ()) -> ProcessedPrompt:
        processor = self._processors.get()  # one is free: no more jobs than processors run at once
        try:
            return processor.process(prompt, images, clips)
        except InputError as exc:
            raise APIError(400, str(exc)) from exc
        finally:
            self._processors.put(processor)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


@dataclass(frozen=True)
class VideoSampling:
    """A request's clips: the bounds, and the rate and most frames it asked for (or the defaults)."""

    limits: VideoLimits
    fps: float
    max_frames: int
    rule: str  # the served family's way of picking frames (common/video.py's RULES)


IMAGE_THREAD_NICE = 10  # bulk work: on busy cores the event loop and the text path come first


def _yield_cpu() -> None:
    """Lower this image thread's CPU priority (Linux schedules threads by their own niceness), so
    that a busy pool slows the images down, not every other request."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), IMAGE_THREAD_NICE)


def _declared_size(blob: bytes, index: int) -> tuple[int, int]:
    try:
        with Image.open(io.BytesIO(blob)) as img:
            return img.size
    except Image.DecompressionBombError as exc:
        raise APIError(413, f"image {index + 1}: {exc}", param="image_url", code="image_too_large") from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise APIError(
            400, f"image {index + 1} cannot be decoded: {image_fault(exc)}", param="image_url"
        ) from exc


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_malloc_trim = getattr(_libc, "malloc_trim", None)  # glibc only; musl and others have none


def give_back_memory() -> None:
    """Return the memory freed in malloc's arenas to the system (glibc's `malloc_trim`)."""
    if _malloc_trim is not None:
        _malloc_trim(0)
