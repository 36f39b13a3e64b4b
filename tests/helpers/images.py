"""Test images: seeded random pictures, the data: URLs a client sends them in, and a PNG that
declares more pixels than it holds."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
from PIL import Image


def make_image(seed: int, size: tuple[int, int] = (80, 64)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def data_url(img: Image.Image) -> str:
    """The image as a client sends it: a PNG in a data: URL."""
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares `width` x `height` pixels in its header and holds almost nothing."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )
