"""Decoding a video a request sent, bounded, and sampling its frames the way the Qwen-VL families do.

    clip = decode_video(data, VideoLimits(), fps=2.0, max_frames=32)
    clip.frames          # [n, H, W, 3] uint8, n even (two frames make one temporal patch)
    clip.timestamps      # seconds of each sampled frame from the clip's start
    clip.sample_fps      # frames per second of video the samples stand for

A video is hostile until shown otherwise. Nothing is decoded before the container has been read
twice cheaply: its header (declared size, length and codec), then every packet without decoding
one (`demux`), which counts what the clip really holds whatever its header says. Only then are
frames decoded, the sampled ones kept, under a deadline checked at every packet. Every refusal is
a `VideoError` (an InputError: a 4xx), `VideoTooLarge` (413) where a bound was passed.

Sampling follows the served family's transformers video processor (`rule`, a key of RULES):
`fps` frames per second of video, at least MIN_FRAMES and at most `max_frames`, each the decoded
frame at its index. Qwen2-VL and Qwen2.5-VL ("qwen2"): an even count, at `arange(0, total, total /
count)` truncated. Qwen3-VL ("qwen3"): any count, at `linspace(0, total - 1, count)` rounded.
"""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.engine.processor import InputError

if TYPE_CHECKING:
    import av

MIN_FRAMES = 4  # the Qwen-VL processors' least
FRAME_FACTOR = 2  # frames per temporal patch: a count is rounded to a multiple of it


class VideoError(InputError):
    """A video that cannot be decoded, or is not a video (400)."""


class VideoTooLarge(VideoError):
    """A video past one of the bounds (413)."""


@dataclass(frozen=True)
class VideoLimits:
    max_bytes: int = 64 << 20
    max_duration_s: float = 600.0
    max_source_frames: int = 9_000  # frames the clip holds (decoded up to the last one sampled)
    max_frame_pixels: int = 3840 * 2160  # 4K UHD; 8K is refused before a frame is decoded
    max_sampled_pixels: int = 128 * 1280 * 720  # all sampled frames together, before resizing
    deadline_s: float = 30.0  # reading, demuxing and decoding in all
    max_fps: float = 8.0  # what a request may ask for
    max_frames: int = 128


@dataclass
class Clip:
    frames: np.ndarray  # [n, H, W, 3] uint8
    indices: list[int]  # of the sampled frames among the clip's, in order
    timestamps: list[float]  # seconds from the clip's first frame
    sample_fps: float  # sampled frames per second of video (transformers' `sampled_fps`)
    source_fps: float  # the clip's own frames per second (transformers' `metadata.fps`)
    duration_s: float
    source_frames: int
    codec: str

    @property
    def content_hash(self) -> str:
        """sha256 of the sampled frames: the feature cache's key, whatever container held them."""
        h = hashlib.sha256(f"video:{self.frames.shape}:".encode())
        h.update(np.ascontiguousarray(self.frames).tobytes())
        return h.hexdigest()


def sample_count(source_frames: int, source_fps: float, fps: float, max_frames: int) -> int:
    """How many frames to sample: `fps` per second of video, within [MIN_FRAMES, max_frames] and
    never more than the clip holds, rounded down to an even count (up from below MIN_FRAMES)."""
    wanted = source_frames / source_fps * fps if source_fps > 0 else source_frames
    ceiling = min(max_frames, source_frames)
    count = min(max(wanted, MIN_FRAMES), ceiling)
    return _enough(int(count // FRAME_FACTOR * FRAME_FACTOR), source_frames)


def _enough(count: int, held: int) -> int:
    """`count` frames to sample from a clip of `held`, if they fill a temporal patch at least."""
    if count < FRAME_FACTOR:
        raise VideoError(f"the video holds {held} frame(s); at least {FRAME_FACTOR} are needed")
    return count


def qwen2_picks(total: int, source_fps: float, fps: float, max_frames: int) -> list[int]:
    """Qwen2-VL's and Qwen2.5-VL's frames (`Qwen2VLVideoProcessor.sample_frames`)."""
    return frame_indices(total, sample_count(total, source_fps, fps, max_frames))


def qwen3_picks(total: int, source_fps: float, fps: float, max_frames: int) -> list[int]:
    """Qwen3-VL's frames (`Qwen3VLVideoProcessor.sample_frames`): `fps` per second of video,
    truncated, within [MIN_FRAMES, max_frames] and never more than the clip holds, any count (the
    last is repeated to fill a temporal patch), evenly from the first frame to the last, rounded."""
    wanted = int(total / source_fps * fps) if source_fps > 0 else total
    count = _enough(min(max(wanted, MIN_FRAMES), max_frames, total), total)
    return np.linspace(0, total - 1, count).round().astype(int).tolist()


RULES: dict[str, Callable[[int, float, float, int], list[int]]] = {"qwen2": qwen2_picks, "qwen3": qwen3_picks}


def decode_video(
    data: bytes,
    limits: VideoLimits,
    fps: float = 2.0,
    max_frames: int = 32,
    *,
    rule: str = "qwen2",
    clock=time.monotonic,
) -> Clip:
    """The sampled frames of `data`, picked by `rule` (a key of RULES); raises VideoError /
    VideoTooLarge naming the cause."""
    if len(data) > limits.max_bytes:
        raise VideoTooLarge(f"the video is {len(data):,} bytes, more than the {limits.max_bytes:,} allowed")
    if not 0 < fps <= limits.max_fps:
        raise VideoError(f"fps must be above 0 and at most {limits.max_fps:g}, not {fps:g}")
    if not 1 <= max_frames <= limits.max_frames:
        raise VideoError(f"max_frames must be 1 to {limits.max_frames}, not {max_frames}")
    av = _pyav()
    deadline = clock() + limits.deadline_s
    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            stream = _video_stream(container)
            _check_header(stream, container, limits)
            codec = stream.codec_context.name
            times = _demux(container, stream, limits, deadline, clock)
        rate = _rate(times)
        picks = RULES[rule](len(times), rate, fps, max_frames)
        count = len(picks)
        # Read again from the start for the frames (a seek may land anywhere near it).
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            frames = _decode(container, _video_stream(container), set(picks), limits, deadline, clock)
    except av.error.InvalidDataError:
        raise VideoError(
            "the file is not a video this server can read, or it is damaged or cut short"
        ) from None
    except (av.error.FFmpegError, UnicodeDecodeError, ValueError, IndexError, MemoryError) as exc:
        if isinstance(exc, VideoError):
            raise
        raise VideoError(f"cannot decode the video: {exc}") from None
    missing = [i for i in picks if i not in frames]
    if missing:
        raise VideoError(f"the video broke off: {len(missing)} of its {count} sampled frames did not decode")
    shapes = {frames[i].shape for i in picks}
    if len(shapes) > 1:
        raise VideoError(f"the video's frame size changes mid-clip ({', '.join(map(str, sorted(shapes)))})")
    duration = len(times) / rate if rate > 0 else 0.0  # as the container counts it: frames / rate
    return Clip(
        frames=np.stack([frames[i] for i in picks]),
        indices=picks,
        timestamps=[round(times[i] - times[0], 6) for i in picks],
        sample_fps=count / duration if duration > 0 else fps,
        source_fps=rate,
        duration_s=duration,
        source_frames=len(times),
        codec=codec,
    )


def _pyav():
    """PyAV, imported when a clip is first decoded: a server without it (an offline bundle leaves it
    out: 35 MB) serves text and images, and says so to a request that sends a clip."""
    try:
        import av
        import av.error
    except ImportError:
        raise VideoError(
            "this server cannot decode video: PyAV (the `av` package) is not installed here; "
            "send the clip's frames as images, or ask the operator to install it"
        ) from None
    return av


def frame_indices(total: int, count: int) -> list[int]:
    """transformers' rule (`Qwen2VLVideoProcessor.sample_frames`): `count` evenly spaced indices
    from 0, each truncated, computed in float32 as torch computes them."""
    return torch.arange(0, total, total / count).int().tolist()[:count]


def _rate(times: list[float]) -> float:
    """Frames per second of the clip, from its frames' times (0: a single instant)."""
    span = times[-1] - times[0]
    return (len(times) - 1) / span if span > 0 else 0.0


def _video_stream(container: av.container.InputContainer) -> av.video.stream.VideoStream:
    if not container.streams.video:
        raise VideoError("the file holds no video stream")
    stream = container.streams.video[0]
    if stream.codec_context is None:
        tag = getattr(stream, "codec_tag", "") or "unknown"
        raise VideoError(
            f"the video's codec ({tag!r}) is not one this server decodes; send H.264, VP9 or AV1"
        )
    stream.thread_type = "AUTO"
    return stream


def _check_header(stream, container, limits: VideoLimits) -> None:
    """What the container declares, refused before anything is decoded."""
    ctx = stream.codec_context
    width, height = ctx.width or 0, ctx.height or 0
    if width * height > limits.max_frame_pixels:
        raise _too_many_pixels("the video's frames are", width, height, limits)
    declared = _declared_duration(stream, container)
    if declared is not None and declared > limits.max_duration_s:
        raise VideoTooLarge(
            f"the video is {declared:.1f} s long, more than the {limits.max_duration_s:g} s allowed"
        )
    if stream.frames and stream.frames > limits.max_source_frames:
        raise VideoTooLarge(
            f"the video holds {stream.frames:,} frames, more than the {limits.max_source_frames:,} allowed"
        )


def _declared_duration(stream, container) -> float | None:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / _pyav().time_base
    return None


def _demux(container, stream, limits: VideoLimits, deadline: float, clock) -> list[float]:
    """The presentation time of every frame, in order, read from the packets alone: what the clip
    really holds, which a header may misstate."""
    times: list[float] = []
    for packet in container.demux(stream):
        if clock() > deadline:
            raise VideoTooLarge(f"reading the video took over {limits.deadline_s:g} s")
        if packet.size == 0 or packet.pts is None:
            continue  # the flush packet, or one without a time
        times.append(float(packet.pts * packet.time_base))
        if len(times) > limits.max_source_frames:
            raise VideoTooLarge(f"the video holds more than the {limits.max_source_frames:,} frames allowed")
    if not times:
        raise VideoError("the video stream holds no frames")
    times.sort()  # decode order is not presentation order where frames are reordered (B-frames)
    if times[-1] - times[0] > limits.max_duration_s:
        raise VideoTooLarge(
            f"the video runs {times[-1] - times[0]:.1f} s, more than the {limits.max_duration_s:g} s allowed"
        )
    return times


def _decode(
    container, stream, picks: set[int], limits: VideoLimits, deadline: float, clock
) -> dict[int, np.ndarray]:
    """The frames at the picked indices (in presentation order), as RGB arrays."""
    kept: dict[int, np.ndarray] = {}
    pixels = 0
    last = max(picks)
    for index, frame in enumerate(container.decode(stream)):
        if clock() > deadline:
            raise VideoTooLarge(f"decoding the video took over {limits.deadline_s:g} s")
        if frame.width * frame.height > limits.max_frame_pixels:
            raise _too_many_pixels("a frame is", frame.width, frame.height, limits)
        if index in picks:
            pixels += frame.width * frame.height
            if pixels > limits.max_sampled_pixels:
                raise VideoTooLarge(
                    f"the sampled frames hold over {limits.max_sampled_pixels:,} pixels; ask for fewer frames"
                )
            kept[index] = frame.to_ndarray(format="rgb24")
        if index >= last:
            break
    return kept


def _too_many_pixels(what: str, width: int, height: int, limits: VideoLimits) -> VideoTooLarge:
    allowed = f"{limits.max_frame_pixels:,}"
    return VideoTooLarge(f"{what} {width}x{height}, more than the {allowed} pixels allowed")
