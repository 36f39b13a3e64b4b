"""Request traces: what the planner replays and the benchmark sends, and the JSONL file both read and write.

A trace is a list of `TraceEntry` in arrival order, times in seconds from the first request. The file
format is documented in docs/workloads.md: an optional header line, then one JSON object per request.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.stats import quantile

if TYPE_CHECKING:
    from common.protocol import TraceRecord

FORMAT = "trident-trace"
VERSION = 1


@dataclass(frozen=True)
class TraceEntry:
    """One request: when it arrives, its sizes, and (for a measured trace) how it fared."""

    arrival: float  # seconds since the trace's first request
    prompt_tokens: int  # the whole LLM prompt, image tokens included
    num_images: int
    image_tokens: int  # summed over the request's images
    output_tokens: int
    image_sizes: tuple[tuple[int, int], ...] = ()  # (width, height) per image; empty when unknown
    request_id: str = ""
    dataset: str = ""
    ttft: float | None = None  # measured outcome, seconds; None for a trace not yet run
    tbt_p90: float | None = None
    slo_met: bool | None = None
    # What caches spared it (a measured trace: the request's record; a workload: its ideal): its
    # first `encoded_images` images needed no encoder run, and the prefill found its first
    # `cached_tokens` prompt tokens in its prefix cache.
    encoded_images: int = 0
    cached_tokens: int = 0
    # Video clips, beside the images: how many, their tokens (in the prompt, apart from
    # image_tokens), and (seconds, width, height) per clip when known. A clip is one encode whose
    # cost is its tokens, as an image's.
    num_videos: int = 0
    video_tokens: int = 0
    clips: tuple[tuple[float, int, int], ...] = ()

    def __post_init__(self) -> None:
        # A list from JSON or a caller becomes a tuple, so entries stay hashable.
        object.__setattr__(self, "image_sizes", tuple((int(w), int(h)) for w, h in self.image_sizes))
        object.__setattr__(self, "clips", tuple((float(t), int(w), int(h)) for t, w, h in self.clips))
        if not (math.isfinite(self.arrival) and self.arrival >= 0):
            raise ValueError(f"arrival must be a finite number >= 0, got {self.arrival}")
        for name in (
            "prompt_tokens",
            "num_images",
            "image_tokens",
            "output_tokens",
            "encoded_images",
            "cached_tokens",
            "num_videos",
            "video_tokens",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.image_tokens + self.video_tokens > self.prompt_tokens:
            clips = f" + video_tokens {self.video_tokens}" if self.video_tokens else ""
            raise ValueError(f"image_tokens {self.image_tokens}{clips} > prompt_tokens {self.prompt_tokens}")
        if len(self.clips) not in (0, self.num_videos):
            raise ValueError(f"{len(self.clips)} clips for {self.num_videos} videos")
        if any(not (math.isfinite(t) and t > 0) or w <= 0 or h <= 0 for t, w, h in self.clips):
            raise ValueError(f"clips must have positive seconds, width and height, got {list(self.clips)}")
        if self.encoded_images > self.num_images:
            raise ValueError(f"encoded_images {self.encoded_images} > num_images {self.num_images}")
        if self.cached_tokens > self.prompt_tokens:
            raise ValueError(f"cached_tokens {self.cached_tokens} > prompt_tokens {self.prompt_tokens}")
        if len(self.image_sizes) not in (0, self.num_images):
            raise ValueError(f"{len(self.image_sizes)} image_sizes for {self.num_images} images")
        if any(w <= 0 or h <= 0 for w, h in self.image_sizes):
            raise ValueError(f"image sizes must be positive, got {list(self.image_sizes)}")
        for name in ("ttft", "tbt_p90"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")

    @property
    def text_tokens(self) -> int:
        return self.prompt_tokens - self.image_tokens - self.video_tokens


@dataclass
class Trace:
    """A trace file's contents: the entries in file order and the header's other fields."""

    entries: list[TraceEntry]
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[TraceEntry]:
        return iter(self.entries)


class TraceError(ValueError):
    """A trace file that cannot be read, with where and why."""

    def __init__(self, path: str | Path, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = str(path), line, reason


# ---- the JSONL file ----

_REQUIRED = ("arrival", "prompt_tokens", "output_tokens")


def write_trace(path: str | Path, entries: Iterable[TraceEntry], meta: dict | None = None) -> None:
    """Write a header line (format, version and `meta`) and one line per entry, in the given order."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(trace_lines(entries, meta))


def trace_lines(entries: Iterable[TraceEntry], meta: dict | None = None) -> Iterator[str]:
    """The lines of a trace file: the header (format, version and `meta`), then one per entry."""
    meta = dict(meta or {})
    if clash := {"format", "version"} & meta.keys():
        raise ValueError(f"meta may not set {sorted(clash)}: the header owns them")
    yield json.dumps({"format": FORMAT, "version": VERSION, **meta}) + "\n"
    for entry in entries:
        yield json.dumps(entry_json(entry)) + "\n"


def read_trace(path: str | Path) -> Trace:
    """Read a trace file, with or without its header. Unknown fields are ignored; anything else
    wrong raises `TraceError` naming the line."""
    entries: list[TraceEntry] = []
    meta: dict[str, Any] = {}
    first = True
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
                if "format" not in obj:
                    entries.append(entry_from_json(obj))
                elif first:
                    meta = _header(obj)
                else:
                    raise ValueError("a header is only allowed on the first line")
            except ValueError as e:  # json.JSONDecodeError is a ValueError too
                raise TraceError(path, lineno, str(e)) from e
            first = False
    return Trace(entries, meta)


def _header(obj: dict) -> dict:
    if obj["format"] != FORMAT:
        raise ValueError(f"format is {obj['format']!r}, expected {FORMAT!r}")
    version = obj.get("version", VERSION)
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= VERSION:
        raise ValueError(f"unsupported version {version!r} (this reader knows up to {VERSION})")
    return {k: v for k, v in obj.items() if k not in ("format", "version")}


def entry_json(e: TraceEntry) -> dict:
    obj: dict[str, Any] = {
        "arrival": e.arrival,
        "prompt_tokens": e.prompt_tokens,
        "num_images": e.num_images,
        "image_tokens": e.image_tokens,
        "output_tokens": e.output_tokens,
    }
    if e.image_sizes:
        obj["image_sizes"] = [list(s) for s in e.image_sizes]
    for name in ("request_id", "dataset", "encoded_images", "cached_tokens", "num_videos", "video_tokens"):
        if getattr(e, name):
            obj[name] = getattr(e, name)
    if e.clips:
        obj["clips"] = [list(c) for c in e.clips]
    for name in ("ttft", "tbt_p90", "slo_met"):
        if getattr(e, name) is not None:
            obj[name] = getattr(e, name)
    return obj


def entry_from_json(obj: dict) -> TraceEntry:
    if missing := [k for k in _REQUIRED if k not in obj]:
        raise ValueError(f"missing field(s): {', '.join(missing)}")
    return TraceEntry(
        arrival=_number(obj, "arrival"),
        prompt_tokens=_int(obj, "prompt_tokens"),
        num_images=_int(obj, "num_images", 0),
        image_tokens=_int(obj, "image_tokens", 0),
        output_tokens=_int(obj, "output_tokens"),
        image_sizes=tuple(_size(s) for s in _list(obj, "image_sizes", "[width, height]")),
        request_id=str(obj.get("request_id", "")),
        dataset=str(obj.get("dataset", "")),
        ttft=_optional_number(obj, "ttft"),
        tbt_p90=_optional_number(obj, "tbt_p90"),
        slo_met=_optional_bool(obj, "slo_met"),
        encoded_images=_int(obj, "encoded_images", 0),
        cached_tokens=_int(obj, "cached_tokens", 0),
        num_videos=_int(obj, "num_videos", 0),
        video_tokens=_int(obj, "video_tokens", 0),
        clips=tuple(_clip(c) for c in _list(obj, "clips", "[seconds, width, height]")),
    )


def _int(obj: dict, name: str, default: int | None = None) -> int:
    value = obj.get(name, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return value


def _size(value: Any) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2):
        raise ValueError(f"an image size must be [width, height], got {value!r}")
    return _int({"width": value[0]}, "width"), _int({"height": value[1]}, "height")


def _list(obj: dict, name: str, of: str) -> list:
    value = obj.get(name) or []
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list of {of}, got {value!r}")
    return value


def _clip(value: Any) -> tuple[float, int, int]:
    if not (isinstance(value, list) and len(value) == 3):
        raise ValueError(f"a clip must be [seconds, width, height], got {value!r}")
    seconds = _number({"seconds": value[0]}, "seconds")
    return seconds, _int({"width": value[1]}, "width"), _int({"height": value[2]}, "height")


def _number(obj: dict, name: str) -> float:
    value = obj[name]
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _optional_number(obj: dict, name: str) -> float | None:
    return None if obj.get(name) is None else _number(obj, name)


def _optional_bool(obj: dict, name: str) -> bool | None:
    value = obj.get(name)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name} must be true, false or null, got {value!r}")
    return value


# ---- from the live system ----


def from_records(records: Iterable[TraceRecord]) -> list[TraceEntry]:
    """Turn finished requests (the store's trace stream) into a trace: arrivals relative to the
    earliest, sorted. Outcome fields are taken when the record has them; TTFT otherwise comes from
    the `arrival` and `first_token` stage marks when both are there."""
    records = sorted(records, key=lambda r: r.arrival)
    if not records:
        return []
    start = records[0].arrival
    return [
        TraceEntry(
            arrival=r.arrival - start,
            prompt_tokens=r.prompt_tokens,
            num_images=r.num_images,
            image_tokens=r.image_tokens,
            output_tokens=r.output_tokens,
            request_id=r.request_id,
            ttft=_record_ttft(r),
            tbt_p90=getattr(r, "tbt_p90", None),
            slo_met=getattr(r, "slo_met", None),
            encoded_images=min(getattr(r, "encoded_images", 0), r.num_images),
            cached_tokens=min(getattr(r, "cached_tokens", 0), r.prompt_tokens),
        )
        for r in records
    ]


def _record_ttft(r: TraceRecord) -> float | None:
    if (ttft := getattr(r, "ttft", None)) is not None:
        return ttft
    if "first_token" in r.stages and "arrival" in r.stages:
        return max(0.0, r.stages["first_token"] - r.stages["arrival"])
    return None


# ---- rates and statistics ----


def rate(entries: Sequence[TraceEntry]) -> float:
    """Requests per second: the number of gaps over the span from first to last arrival (the mean
    inter-arrival rate); 0.0 when it is undefined (fewer than two requests, or all at once)."""
    if len(entries) < 2:
        return 0.0
    times = [e.arrival for e in entries]
    span = max(times) - min(times)
    return (len(entries) - 1) / span if span > 0 else 0.0


def rescale_times(times: Sequence[float], target: float) -> list[float]:
    """Sort `times`, start them at 0 and stretch the gaps by one factor so the mean rate is `target`;
    the shape (bursts, lulls) is kept."""
    if target <= 0:
        raise ValueError(f"rate must be > 0, got {target}")
    ordered = sorted(times)
    if len(ordered) < 2:
        return [0.0] * len(ordered)
    span = ordered[-1] - ordered[0]
    if not span > 0:
        raise ValueError("cannot rescale arrivals that all fall at the same instant")
    factor = (len(ordered) - 1) / span / target
    return [(t - ordered[0]) * factor for t in ordered]


def rescale(entries: Sequence[TraceEntry], target: float) -> list[TraceEntry]:
    """The same requests in arrival order, their gaps scaled so the mean rate is `target`."""
    ordered = sorted(entries, key=lambda e: e.arrival)
    times = rescale_times([e.arrival for e in ordered], target)
    return [replace(e, arrival=t) for e, t in zip(ordered, times, strict=True)]


def summary(entries: Sequence[TraceEntry]) -> dict[str, Any]:
    """What a trace asks of a deployment, for the planner to show: size, rate, token statistics,
    images per request, the text-only share and, for a measured trace, SLO attainment."""
    n = len(entries)
    times = [e.arrival for e in entries]
    met = [e.slo_met for e in entries if e.slo_met is not None]
    return {
        "count": n,
        "duration": max(times) - min(times) if n else 0.0,
        "rate": rate(entries),
        "prompt_tokens": _stats([e.prompt_tokens for e in entries]),
        "text_tokens": _stats([e.text_tokens for e in entries]),
        "image_tokens": _stats([e.image_tokens for e in entries]),
        "video_tokens": _stats([e.video_tokens for e in entries]),
        "output_tokens": _stats([e.output_tokens for e in entries]),
        "images_per_request": sum(e.num_images for e in entries) / n if n else 0.0,
        "videos_per_request": sum(e.num_videos for e in entries) / n if n else 0.0,
        "text_only": sum(e.num_images == 0 and e.num_videos == 0 for e in entries) / n if n else 0.0,
        "slo_attainment": sum(met) / len(met) if met else None,
    }


def _stats(values: list[int]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0}
    return {"mean": float(np.mean(values)), "p50": quantile(values, 0.5), "p90": quantile(values, 0.9)}
