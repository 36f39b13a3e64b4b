"""Synthetic request workloads shaped like the papers' datasets, with Poisson, bursty or replayed arrivals.

A `WorkloadShape` holds four small distributions (images per request, image resolution, text tokens,
output tokens); `generate` draws requests from one and times them with an arrival process scaled to a
target rate. Image tokens depend on the model, so `generate` takes a tokens-per-image function.

Where the numbers come from: 002 (EPD-Serve §4.1) states its datasets' means, which ShareGPT-4o and
the text/image mix use directly. 000 Figure 8 / 001 Figure 9 (HydraInfer) show the five benchmark
datasets' per-stage workload for LLaVA-NeXT only as a chart, so those shapes are assumed from what the
datasets are (COCO, Open Images, phone photos) and from HydraInfer's benchmark, which sends each
dataset's question as-is in `USER: <image>\\n{question}\\nASSISTANT:` with no short-answer instruction.
Every "assumed" below is a judgement to revise against a measured trace, not a figure from a paper.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from common.planner.trace import TraceEntry, rescale_times

Arrival = Literal["poisson", "gamma", "replay"]


@dataclass(frozen=True)
class Discrete:
    """An empirical distribution: `values[i]` with probability proportional to `weights[i]` (equal
    weights when none are given)."""

    values: tuple[Any, ...]
    weights: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.values or (self.weights and len(self.weights) != len(self.values)):
            raise ValueError("Discrete needs values, and one weight per value if weights are given")

    def sample(self, rng: np.random.Generator, n: int) -> list[Any]:
        p = np.asarray(self.weights or [1.0] * len(self.values), dtype=float)
        picks = rng.choice(len(self.values), size=n, p=p / p.sum())
        return [self.values[i] for i in picks]

    @property
    def mean(self) -> float:
        p = np.asarray(self.weights or [1.0] * len(self.values), dtype=float)
        return float(np.dot(np.asarray(self.values, dtype=float), p / p.sum()))


@dataclass(frozen=True)
class LogNormal:
    """Token counts: a lognormal with the given mean, log-space spread `sigma`, rounded and clipped to
    [low, high] (clipping moves the mean a little; the bounds are wide enough that it stays close)."""

    mean: float
    sigma: float
    low: int = 1
    high: int = 1 << 20

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        mu = math.log(self.mean) - self.sigma**2 / 2
        draws = np.rint(rng.lognormal(mu, self.sigma, size=n))
        return [int(x) for x in np.clip(draws, self.low, self.high)]


def fixed(value: Any) -> Discrete:
    """A constant, e.g. 002's output length fixed at 64 tokens."""
    return Discrete((value,))


Lengths = Discrete | LogNormal


@dataclass(frozen=True)
class WorkloadShape:
    """What one dataset's requests look like; `source` says where each number comes from."""

    name: str
    description: str
    source: str
    images: Discrete  # images per request
    resolution: Discrete  # (width, height) of each image
    text_tokens: Lengths  # the prompt's text: question or instruction, without the chat template
    output_tokens: Lengths
    videos: Discrete = Discrete((0,))  # video clips per request, drawn apart from the images
    clip: Discrete = Discrete(((8.0, 640, 360),))  # (seconds, width, height) of each clip


# Image resolutions of the source collections (assumed from how each collection is published).
_COCO = Discrete(  # POPE samples COCO val2014: mostly 640 px on the long side
    ((640, 480), (640, 427), (480, 640), (500, 375), (427, 640), (640, 640)),
    (0.45, 0.25, 0.12, 0.08, 0.05, 0.05),
)
_OPEN_IMAGES = Discrete(  # TextCaps and TextVQA use Open Images, published at up to 1024 px
    ((1024, 768), (1024, 683), (768, 1024), (1024, 576), (1024, 1024), (683, 1024)),
    (0.45, 0.20, 0.15, 0.08, 0.07, 0.05),
)
_PHONE = Discrete(  # VizWiz: photos taken by blind users on phones, portrait more often than not
    ((968, 1296), (1296, 968), (1936, 2592), (2592, 1936), (480, 640), (640, 480)),
    (0.35, 0.25, 0.15, 0.10, 0.10, 0.05),
)
_MME = Discrete(  # MME mixes COCO photos, posters, artworks, landmarks and text screenshots
    ((640, 480), (480, 640), (500, 375), (1024, 768), (450, 650), (1280, 720), (300, 300)),
    (0.30, 0.10, 0.10, 0.15, 0.15, 0.10, 0.10),
)
# Weighted mean (798, 649), matching 002's stated average of 802x652.
_SHAREGPT4O = Discrete(
    ((1024, 768), (1024, 1024), (800, 600), (640, 480), (512, 512), (1280, 720), (600, 800)),
    (0.20, 0.10, 0.20, 0.25, 0.15, 0.05, 0.05),
)
_ONE = fixed(1)

SHAPES: dict[str, WorkloadShape] = {
    s.name: s
    for s in (
        WorkloadShape(
            "textcaps",
            "image captioning of pictures with text in them; open-ended, the longest outputs",
            "assumed: Open Images resolutions; one fixed caption instruction; LLaVA-NeXT writes a "
            "paragraph when not told to keep it to one sentence (000 Fig. 8 / 001 Fig. 9 show it as "
            "the most decode-heavy of the five)",
            _ONE,
            _OPEN_IMAGES,
            LogNormal(18, 0.05, 14, 24),
            LogNormal(60, 0.5, 8, 512),
        ),
        WorkloadShape(
            "pope",
            "object-hallucination probes: 'Is there a <object> in the image?'",
            "assumed: COCO resolutions; short fixed-form questions; answers 'Yes, there is ...'",
            _ONE,
            _COCO,
            LogNormal(11, 0.12, 8, 16),
            LogNormal(14, 0.5, 2, 128),
        ),
        WorkloadShape(
            "mme",
            "perception and cognition yes/no questions; almost no decode work",
            "HydraInfer's MME analysis with LLaVA-1.5 (questions 12-41 tokens, mean ~20; answers 2-3 "
            "tokens with EOS); 000 §5.2 notes MME needs the fewest output tokens; resolutions assumed",
            _ONE,
            _MME,
            LogNormal(20, 0.2, 12, 48),
            Discrete((2, 3), (0.88, 0.12)),
        ),
        WorkloadShape(
            "textvqa",
            "questions about text in the picture (signs, labels, brands)",
            "assumed: Open Images resolutions; short questions; sentence-long answers",
            _ONE,
            _OPEN_IMAGES,
            LogNormal(11, 0.3, 5, 40),
            LogNormal(16, 0.6, 2, 128),
        ),
        WorkloadShape(
            "vizwiz",
            "questions blind users asked about their own phone photos; large images, often unanswerable",
            "assumed: phone-camera resolutions; spoken questions of varied length; descriptive answers",
            _ONE,
            _PHONE,
            LogNormal(14, 0.6, 3, 128),
            LogNormal(40, 0.6, 2, 256),
        ),
        WorkloadShape(
            "sharegpt4o",
            "ShareGPT-4o conversations: one image and a short instruction",
            "002 §4.1: mean image 802x652, mean text 9.6 tokens, output fixed at 64 tokens; "
            "resolution mix and text spread assumed",
            _ONE,
            _SHAREGPT4O,
            LogNormal(9.6, 0.5, 1, 64),
            fixed(64),
        ),
        WorkloadShape(
            "mix",
            "half text-only, half one image, like 002's VisualWebInstruct subset",
            "002 §4.1: 256 text-image and 256 text-only requests, images 1280x720, mean text 63.1 "
            "tokens, output fixed at 64 tokens; text spread assumed",
            Discrete((0, 1), (0.5, 0.5)),
            fixed((1280, 720)),
            LogNormal(63.1, 0.6, 4, 1024),
            fixed(64),
        ),
        WorkloadShape(
            "video-mix",
            "mix with short video clips: a third of requests carry a clip, half an image (some both)",
            "assumed: mix's text and outputs; clips of 4-16 s at 360p-720p, the lengths and sizes "
            "users send Qwen-VL to describe; one in three requests with one (004 works the E/P/D "
            "case through a 30-frame clip)",
            Discrete((0, 1), (0.5, 0.5)),
            fixed((1280, 720)),
            LogNormal(63.1, 0.6, 4, 1024),
            fixed(64),
            Discrete((0, 1), (2 / 3, 1 / 3)),
            Discrete(
                ((4.0, 640, 360), (8.0, 640, 360), (8.0, 1280, 720), (16.0, 640, 360)), (0.3, 0.3, 0.2, 0.2)
            ),
        ),
        WorkloadShape(
            "text",
            "mix's text-only half: the same prompts and outputs, no image",
            "as mix",
            fixed(0),
            fixed((1280, 720)),
            LogNormal(63.1, 0.6, 4, 1024),
            fixed(64),
        ),
    )
}


# ---- image tokens per image ----

_PATCH = 14  # CLIP ViT-L/14 at 336 px: a 24x24 grid of patch features per tile
_TILE = 336
# LLaVA-NeXT's grid pinpoints as (height, width), in HF's order (the tie-break depends on it).
_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))


def llava15_tokens(width: int, height: int, tokens: int = 576) -> int:
    """LLaVA-1.5 resizes every image to 336x336: the same 576 tokens whatever the size."""
    return tokens


def llava_next_tokens(width: int, height: int) -> int:
    """LLaVA-NeXT (anyres): 576 for the whole image resized to 336 px, plus the tiles of the grid
    pinpoint that best fits the image, with padding rows/columns removed and one newline token per
    row. This is HF transformers' `LlavaNextProcessor` count for the default pinpoints (checked
    against it in the tests): 2,340 for 1024x768, at most 2,928 (a square image)."""
    grid_h, grid_w = _best_pinpoint(width, height)
    rows, cols = grid_h // _PATCH, grid_w // _PATCH  # features of the tiles, 24 per tile side
    if width / height > cols / rows:  # wider than the grid: the padding is rows at top and bottom
        rows -= (rows - int(round(height * cols / width, 7))) // 2 * 2
    else:
        cols -= (cols - int(round(width * rows / height, 7))) // 2 * 2
    base = (_TILE // _PATCH) ** 2
    return base + rows * cols + rows


def qwen2_vl_tokens(
    width: int, height: int, *, factor: int = 28, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280
) -> int:
    """Qwen2-VL / Qwen2.5-VL (native resolution): the image resized to multiples of `factor`
    (patch 14 × merge 2; Qwen3-VL: 32) with its area held within [min_pixels, max_pixels], one
    token per factor×factor square — the image processor's rule at a release's defaults (checked
    against it in the tests): 999 for 1024x768, at most 1,280."""
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return (h // factor) * (w // factor)


def qwen2_vl_clip_tokens(
    seconds: float,
    width: int,
    height: int,
    *,
    fps: float = 2.0,
    max_frames: int = 32,
    source_fps: int = 10,
    factor: int = 28,
    min_pixels: int = 128 * 28 * 28,
    max_pixels: int = 768 * 28 * 28,
) -> int:
    """Qwen2-VL / Qwen2.5-VL: a clip's tokens at the server's default sampling (`fps` frames per
    second of video, at least 4, at most `max_frames` and the clip's own, an even count), two
    frames to a temporal patch, each patch as many tokens as one frame resized within the video
    processor's per-frame bounds (common/video.py and common/engine/video_input.py do this)."""
    held = max(2, round(seconds * source_fps))
    frames = int(min(max(seconds * fps, 4), max_frames, held)) // 2 * 2
    per_patch = qwen2_vl_tokens(width, height, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    return frames // 2 * per_patch


def _best_pinpoint(width: int, height: int) -> tuple[int, int]:
    """The pinpoint keeping most of the image's pixels, then wasting the fewest (LLaVA-NeXT's rule)."""
    best, best_key = _PINPOINTS[0], (-1, 0)
    for h, w in _PINPOINTS:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        key = (effective, -(w * h - effective))
        if key > best_key:
            best, best_key = (h, w), key
    return best


# ---- generating a trace ----


def generate(
    shape: WorkloadShape | str,
    *,
    rate: float,
    num_requests: int | None = None,
    duration: float | None = None,
    arrival: Arrival = "poisson",
    cv: float = 2.0,
    timestamps: Sequence[float] | None = None,
    seed: int = 0,
    image_tokens: Callable[[int, int], int] | int = llava15_tokens,
    clip_tokens: Callable[[float, int, int], int] | int = qwen2_vl_clip_tokens,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> list[TraceEntry]:
    """A trace of `num_requests` requests, or of those arriving within `duration` seconds, drawn from
    `shape` at a mean of `rate` requests/s. The first request arrives at 0.

    `arrival`: "poisson" (exponential gaps), "gamma" (gaps with coefficient of variation `cv`; above
    1 is burstier than Poisson) or "replay" (`timestamps`, any unit-consistent times, rescaled to
    `rate` with their shape kept; `num_requests` defaults to all of them). With `num_requests` the
    drawn gaps are stretched so the trace's mean rate is exactly `rate`; with `duration` the count
    is random, `rate * duration` on average.
    `image_tokens`: tokens per image from (width, height), or a fixed count; `clip_tokens`: per
    video clip from (seconds, width, height), or a fixed count.
    `max_prompt_tokens` / `max_output_tokens`: clip text and outputs to fit a model's context.

    Deterministic from `seed`; requests and arrival times use separate streams, so the same seed and
    count give the same requests under any arrival process or rate (and Poisson/gamma times just
    scale with 1/rate), which keeps a rate sweep's points comparable.
    """
    shape = _shape(shape)
    arrival_rng, size_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    times = _arrivals(arrival, rate, num_requests, duration, cv, timestamps, arrival_rng)
    sizing = _Sizing(
        _per_item(image_tokens, "image_tokens"),
        _per_item(clip_tokens, "clip_tokens"),
        max_prompt_tokens,
        max_output_tokens,
    )
    drawn = _draw(shape, size_rng, len(times))
    return [
        sizing.entry(shape.name, i, float(t), d) for i, (t, d) in enumerate(zip(times, drawn, strict=True))
    ]


@dataclass(frozen=True)
class _Drawn:
    """One request's draw from a shape: its images' and clips' sizes, text and output tokens."""

    num_images: int
    images: tuple
    clips: tuple
    text: int
    output: int


def _draw(shape: WorkloadShape, rng: np.random.Generator, n: int) -> list[_Drawn]:
    counts = shape.images.sample(rng, n)
    sizes = shape.resolution.sample(rng, sum(counts))
    texts = shape.text_tokens.sample(rng, n)
    outputs = shape.output_tokens.sample(rng, n)
    # Drawn after the rest, so that a shape without clips draws what it did before they existed.
    video_counts = shape.videos.sample(rng, n)
    clips = shape.clip.sample(rng, sum(video_counts))
    drawn, used, used_clips = [], 0, 0
    for k, v, text, out in zip(counts, video_counts, texts, outputs, strict=True):
        drawn.append(
            _Drawn(k, tuple(sizes[used : used + k]), tuple(clips[used_clips : used_clips + v]), text, out)
        )
        used += k
        used_clips += v
    return drawn


@dataclass(frozen=True)
class _Sizing:
    """How a draw becomes a request: tokens per image and per clip, and the caps on prompt and output."""

    per_image: Callable[..., int]
    per_clip: Callable[..., int]
    max_prompt_tokens: int | None
    max_output_tokens: int | None

    def entry(self, dataset: str, i: int, arrival: float, d: _Drawn) -> TraceEntry:
        img = sum(self.per_image(w, h) for w, h in d.images)
        vid = sum(self.per_clip(*c) for c in d.clips)
        text, out = d.text, d.output
        if self.max_prompt_tokens is not None:
            if img + vid > self.max_prompt_tokens:
                raise ValueError(
                    f"request {i}: its {d.num_images} image(s) and {len(d.clips)} clip(s) take {img + vid} "
                    "tokens > max_prompt_tokens"
                )
            text = min(text, self.max_prompt_tokens - img - vid)
        if self.max_output_tokens is not None:
            out = min(out, self.max_output_tokens)
        return TraceEntry(
            arrival=arrival,
            prompt_tokens=text + img + vid,
            num_images=d.num_images,
            image_tokens=img,
            output_tokens=out,
            image_sizes=d.images,
            num_videos=len(d.clips),
            video_tokens=vid,
            clips=d.clips,
            request_id=f"{dataset}-{i:06d}",
            dataset=dataset,
        )


def _shape(shape: WorkloadShape | str) -> WorkloadShape:
    if isinstance(shape, WorkloadShape):
        return shape
    if shape not in SHAPES:
        raise ValueError(f"unknown workload shape {shape!r}; known: {', '.join(SHAPES)}")
    return SHAPES[shape]


def _per_item(tokens: Callable[..., int] | int, name: str) -> Callable[..., int]:
    """Tokens per image (or clip) from its size: `tokens` itself, or a fixed count."""
    if callable(tokens):
        return tokens
    if tokens < 0:
        raise ValueError(f"{name} must be >= 0, got {tokens}")
    return lambda *size: tokens


def _arrivals(
    arrival: str,
    rate: float,
    num_requests: int | None,
    duration: float | None,
    cv: float,
    timestamps: Sequence[float] | None,
    rng: np.random.Generator,
) -> list[float]:
    """Arrival times from 0, per the chosen process, checking the arguments on the way."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if arrival not in ("poisson", "gamma", "replay"):
        raise ValueError(f"unknown arrival {arrival!r}; known: poisson, gamma, replay")
    if (timestamps is not None) != (arrival == "replay"):
        raise ValueError("timestamps go with arrival='replay', and only with it")
    if num_requests is not None and duration is not None:
        raise ValueError("give num_requests or duration, not both")
    if num_requests is not None and num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if duration is not None and not duration > 0:
        raise ValueError(f"duration must be > 0 seconds, got {duration}")
    if arrival == "replay":
        return _replay(list(timestamps or ()), rate, num_requests, duration)
    if num_requests is None and duration is None:
        raise ValueError("give num_requests or duration")
    if arrival == "gamma" and not cv > 0:
        raise ValueError(f"cv must be > 0, got {cv}")

    def gaps(n: int) -> np.ndarray:
        if arrival == "poisson":
            return rng.exponential(1 / rate, size=n)
        shape = 1 / cv**2  # a gamma with mean 1/rate and standard deviation cv/rate
        return rng.gamma(shape, 1 / (rate * shape), size=n)

    if num_requests is not None:  # stretched to the exact rate, so a sweep's points are where they say
        return rescale_times([0.0, *np.cumsum(gaps(num_requests - 1)).tolist()], rate)
    times = [0.0]
    while times[-1] < duration:  # draw in chunks until past the end, then cut there
        times.extend((times[-1] + np.cumsum(gaps(int(rate * duration) + 16))).tolist())
    return [t for t in times if t < duration]


def _replay(
    timestamps: list[float], rate: float, num_requests: int | None, duration: float | None
) -> list[float]:
    """`num_requests`: the first that many timestamps, rescaled (the mean rate is exact).
    `duration`: all of them rescaled, then cut (the mean rate is the whole recording's)."""
    if not timestamps:
        raise ValueError("arrival='replay' needs timestamps")
    if not all(math.isfinite(t) for t in timestamps):
        raise ValueError("timestamps must be finite numbers")
    ordered = sorted(timestamps)
    if num_requests is not None:
        if num_requests > len(ordered):
            raise ValueError(f"num_requests={num_requests} but only {len(ordered)} timestamps")
        ordered = ordered[:num_requests]
    times = rescale_times(ordered, rate)
    return times if duration is None else [t for t in times if t < duration]
