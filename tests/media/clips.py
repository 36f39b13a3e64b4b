"""Real video files for the tests, written with PyAV (FFmpeg): each frame a solid colour that
encodes its index, so a test can tell which frames were sampled."""

from __future__ import annotations

import io

import av
import numpy as np

from trident.bench.clips import encode_clip, moving_texture


def frame_colour(index: int) -> tuple[int, int, int]:
    return (index * 37) % 256, (index * 91) % 256, (index * 53) % 256


def make_clip(
    frames: int,
    fps: int = 10,
    size: tuple[int, int] = (64, 48),
    codec: str = "libx264",
    fmt: str = "mp4",
    seed: int | None = None,
) -> bytes:
    """`frames` frames of `size` (width, height) at `fps`, in `fmt` (mp4, mpegts, matroska): solid
    colours, or with `seed` a random texture that moves (detail for a vision tower to see)."""
    if seed is None:
        pictures = (np.full((size[1], size[0], 3), frame_colour(i), dtype=np.uint8) for i in range(frames))
    else:
        pictures = moving_texture(frames, size, seed)
    options = {"preset": "ultrafast", "crf": "10"} if codec == "libx264" else None
    return encode_clip(pictures, fps, size, codec, fmt, options)


def empty_clip() -> bytes:
    """A container with a video stream and not one frame in it."""
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height = 64, 48
        stream.pix_fmt = "yuv420p"
    return out.getvalue()


def declare_duration(mp4: bytes, seconds_in_timescale: int = 1) -> bytes:
    """The same mp4 with its movie and track headers (mvhd, tkhd, mdhd) declaring a near-zero
    duration: a container that lies about its length (its sample tables still hold the truth)."""
    data = bytearray(mp4)
    for box, offset in ((b"mvhd", 16), (b"mdhd", 16), (b"tkhd", 20)):
        at = data.find(box)
        while at != -1:
            version = data[at + 4]
            assert version == 0, "version-1 headers are not written by this helper's muxer"
            data[at + 4 + offset : at + 8 + offset] = seconds_in_timescale.to_bytes(4, "big")
            at = data.find(box, at + 4)
    return bytes(data)
