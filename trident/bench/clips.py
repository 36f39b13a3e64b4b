"""Real video files written here with PyAV (FFmpeg), for the benchmarks and the tests: a clip is
frames of a texture that moves, so a decoder has motion and detail to work on and a vision tower
something to see, deterministic from a seed.

    data = clip_bytes(8.0, (640, 360), seed=3)      # 8 s of 640x360 H.264 in mp4, 10 fps
    url = clip_data_url(8.0, (640, 360), seed=3)     # the same as a data: URL for `video_url`
"""

from __future__ import annotations

import base64
import functools
import io
from collections.abc import Iterable, Iterator

import numpy as np
from PIL import Image

BENCH_FPS = 10  # frames per second of the clips a benchmark sends: enough for 2-fps sampling


def encode_clip(
    frames: Iterable[np.ndarray],
    fps: int,
    size: tuple[int, int],
    codec: str = "libx264",
    fmt: str = "mp4",
    options: dict[str, str] | None = None,
) -> bytes:
    """`frames` ([height, width, 3] uint8 each) as a `fmt` file of `codec` at `fps`."""
    import av  # here: a client that sends no clip runs without PyAV (an offline bundle leaves it out)

    out = io.BytesIO()
    with av.open(out, mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        if options:
            stream.options = options
        for pixels in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def moving_texture(count: int, size: tuple[int, int], seed: int, detail: int = 1) -> Iterator[np.ndarray]:
    """`count` frames of `size` (width, height) panning across a random texture twice their size,
    with detail at 1/`detail` of the frame's resolution (upscaled)."""
    width, height = size
    rng = np.random.default_rng(seed)
    texture = rng.integers(0, 256, (2 * height // detail, 2 * width // detail, 3), dtype=np.uint8)
    if detail > 1:
        texture = np.asarray(Image.fromarray(texture).resize((2 * width, 2 * height), Image.BICUBIC))
    for i in range(count):
        y, x = (3 * i) % height, (5 * i) % width
        yield np.ascontiguousarray(texture[y : y + height, x : x + width])


@functools.lru_cache(maxsize=32)
def clip_bytes(seconds: float, size: tuple[int, int], seed: int, fps: int = BENCH_FPS) -> bytes:
    """`seconds` of a moving texture at `size` (each dimension rounded down to even, as H.264's
    4:2:0 needs), H.264 in mp4."""
    size = (max(2, size[0] // 2 * 2), max(2, size[1] // 2 * 2))
    count = max(2, round(seconds * fps))
    options = {"preset": "ultrafast", "crf": "28"}
    return encode_clip(moving_texture(count, size, seed, detail=4), fps, size, options=options)


def clip_data_url(seconds: float, size: tuple[int, int], seed: int) -> str:
    return video_data_url(clip_bytes(seconds, size, seed))


def video_data_url(data: bytes) -> str:
    """An mp4 file as a data: URL, what a `video_url` part carries inline."""
    return "data:video/mp4;base64," + base64.b64encode(data).decode()
