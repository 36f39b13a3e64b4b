"""Decoding a request's video, bounded (common/video.py), against real files written by FFmpeg:
frames sampled the way the Qwen-VL processors sample them, and every hostile video refused with
a VideoError (a 4xx; VideoTooLarge, 413, where a bound was passed) before it costs much."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from common.video import MIN_FRAMES, VideoError, VideoLimits, VideoTooLarge, decode_video, sample_count
from tests.media.clips import declare_duration, empty_clip, frame_colour, make_clip

LIMITS = VideoLimits()


def test_frames_are_sampled_evenly_at_the_asked_rate() -> None:
    clip = decode_video(make_clip(40, fps=10), LIMITS, fps=2.0, max_frames=32)  # 4 s of video
    picks = [0, 5, 10, 15, 20, 25, 30, 35]  # 2 per second, at arange(0, 40, 40 / 8)
    assert clip.frames.shape == (8, 48, 64, 3) and clip.frames.dtype == np.uint8
    assert clip.source_frames == 40 and clip.codec == "h264"
    assert clip.timestamps == pytest.approx([i / 10 for i in picks])
    assert clip.sample_fps == pytest.approx(2.0)  # 8 frames for 40 frames at 10 fps
    # Each sampled frame is the one at its index (solid colours; H.264 moves them a little).
    for frame, index in zip(clip.frames, picks, strict=True):
        assert np.abs(frame[24, 32].astype(int) - frame_colour(int(index))).max() <= 8, index


def test_counts_are_even_within_the_least_and_the_most() -> None:
    assert sample_count(40, 10.0, 2.0, 32) == 8
    assert sample_count(40, 10.0, 2.0, 5) == 4  # the most asked for, rounded down to even
    assert sample_count(10, 10.0, 0.5, 32) == MIN_FRAMES  # under the least: raised to it
    assert sample_count(3, 10.0, 2.0, 32) == 2  # never more than the clip holds
    assert sample_count(601, 30.0, 2.0, 768) == 40
    with pytest.raises(VideoError, match="at least 2"):
        sample_count(1, 10.0, 2.0, 32)


def test_the_same_frames_hash_the_same_and_others_do_not() -> None:
    data = make_clip(20)
    assert decode_video(data, LIMITS).content_hash == decode_video(data, LIMITS).content_hash
    assert decode_video(data, LIMITS).content_hash != decode_video(make_clip(22), LIMITS).content_hash


@pytest.fixture(scope="module")
def hostile() -> dict[str, tuple[bytes, type[VideoError], str]]:
    """name: (bytes, the error, words its message holds)."""
    good = make_clip(30)
    two_sizes = make_clip(10, fmt="mpegts") + make_clip(10, size=(32, 32), fmt="mpegts")
    return {
        "truncated": (good[: len(good) // 2], VideoError, "damaged or cut short"),
        "no frames": (empty_clip(), VideoError, "not a video this server can read"),
        "not a video": (bytes(range(256)) * 8, VideoError, "not a video"),
        "unknown codec": (good.replace(b"avc1", b"zzzz"), VideoError, "codec"),
        "10,000 frames": (make_clip(10_000, fps=100, size=(16, 16)), VideoTooLarge, "10,000 frames"),
        "10,000 frames, no header count": (
            make_clip(10_000, fps=100, size=(16, 16), fmt="mpegts"), VideoTooLarge, "frames allowed",
        ),
        "8K": (make_clip(1, size=(7680, 4320)), VideoTooLarge, "7680x4320"),
        "lies about its length": (
            declare_duration(make_clip(700, fps=1, size=(16, 16))), VideoTooLarge, "runs",
        ),
        "frame size changes": (two_sizes, VideoError, "frame size changes"),
    }  # fmt: skip


@pytest.mark.slow  # writing the 8K and 10,000-frame files takes seconds: `make test` only
@pytest.mark.parametrize(
    "name",
    ["truncated", "no frames", "not a video", "unknown codec", "10,000 frames",
     "10,000 frames, no header count", "8K", "lies about its length", "frame size changes"],
)  # fmt: skip
def test_a_hostile_video_is_refused_saying_why(hostile, name: str) -> None:
    data, error, words = hostile[name]
    with pytest.raises(error) as raised:
        decode_video(data, LIMITS, fps=2.0, max_frames=32)
    assert words in str(raised.value), str(raised.value)
    if error is VideoError:
        assert not isinstance(raised.value, VideoTooLarge)


def test_the_lying_header_passes_and_the_packets_tell() -> None:
    """The header of "lies about its length" declares a fraction of a second: only the packets
    (read without decoding) show the 700 s it runs."""
    import io

    import av

    data = declare_duration(make_clip(700, fps=1, size=(16, 16)))
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        assert float(stream.duration * stream.time_base) < 1.0


def test_bounds_on_bytes_rate_frames_and_time() -> None:
    data = make_clip(20)
    with pytest.raises(VideoTooLarge, match="bytes"):
        decode_video(data, VideoLimits(max_bytes=len(data) - 1))
    with pytest.raises(VideoError, match="fps must be"):
        decode_video(data, LIMITS, fps=LIMITS.max_fps * 2)
    with pytest.raises(VideoError, match="max_frames must be"):
        decode_video(data, LIMITS, max_frames=LIMITS.max_frames + 1)
    with pytest.raises(VideoTooLarge, match="sampled frames hold"):
        decode_video(data, VideoLimits(max_sampled_pixels=64 * 48 * 3))
    ticks = itertools.count(step=10.0)  # a clock that runs 10 s a look: past the deadline at once
    with pytest.raises(VideoTooLarge, match="took over"):
        decode_video(data, LIMITS, clock=lambda: next(ticks))


def test_without_pyav_a_clip_is_refused_and_the_gateway_still_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """An offline bundle leaves PyAV out (trident/bundle): the gateway then imports and serves text
    and images, and a clip gets a 4xx that says why."""
    import subprocess
    import sys

    data = make_clip(8, fps=10)
    for name in ("av", "av.error"):
        monkeypatch.setitem(sys.modules, name, None)  # `import av` raises ImportError, as where it is absent
    with pytest.raises(VideoError, match="PyAV"):
        decode_video(data, LIMITS)
    blocked = "import sys; sys.modules['av'] = None; import services.gateway.app, trident.bench.client"
    run = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-1500:]
