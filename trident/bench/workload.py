"""What a benchmark sends, and when: requests drawn from the planner's workload shapes or read from
a trace file, at arrival times from a process (Poisson, gamma) or replayed from a production trace.

Production traces give only the *times*, as seed 000 §5.1 uses Mooncake's: the inter-arrival
pattern of real traffic (bursts and lulls), scaled to the rate asked for, with request contents
from the multimodal workload shape. Known traces (their files in the traces directory):

- `mooncake-conversation`, `mooncake-synthetic`: Mooncake (FAST'25), JSONL with `timestamp` in ms;
- `azure-code`, `azure-conv`: Azure LLM inference 2023, CSV with a `TIMESTAMP` column.
"""

from __future__ import annotations

import csv
import json
import os
from datetime import datetime
from pathlib import Path

import numpy as np

from common.planner.trace import TraceEntry, read_trace, rescale
from common.planner.workloads import SHAPES, generate, llava15_tokens

TRACE_FILES = {
    "mooncake-conversation": "mooncake_conversation.jsonl",
    "mooncake-synthetic": "mooncake_synthetic.jsonl",
    "azure-code": "azure_llm_2023_code.csv",
    "azure-conv": "azure_llm_2023_conv.csv",
}
ARRIVALS = ("poisson", "gamma", *TRACE_FILES)


class WorkloadError(ValueError):
    """A workload, trace or arrival process that cannot be used; the message says why."""


def traces_dir() -> Path:
    """$TRIDENT_TRACES_DIR, else the traces shipped in the repository (data/traces, data/README.md)."""
    if env := os.environ.get("TRIDENT_TRACES_DIR"):
        return Path(env)
    return Path(__file__).resolve().parents[2] / "data" / "traces"


def trace_timestamps(name_or_path: str) -> list[float]:
    """Arrival times in seconds from a known production trace's name, or from a file path of
    either format (.jsonl with `timestamp` in ms, .csv with `TIMESTAMP`)."""
    path = Path(name_or_path)
    if name_or_path in TRACE_FILES:
        path = traces_dir() / TRACE_FILES[name_or_path]
        if not path.is_file():
            raise WorkloadError(
                f"trace {name_or_path!r} needs {path}; set TRIDENT_TRACES_DIR to the directory holding "
                f"{TRACE_FILES[name_or_path]}"
            )
    elif not path.is_file():
        known = ", ".join(TRACE_FILES)
        raise WorkloadError(f"no such arrival trace {name_or_path!r}: give a file or one of {known}")
    try:
        if path.suffix == ".csv":
            with path.open(newline="") as f:
                rows = csv.DictReader(f)
                times = [datetime.fromisoformat(row["TIMESTAMP"][:26]).timestamp() for row in rows]
        else:
            with path.open() as f:
                times = [json.loads(line)["timestamp"] / 1000 for line in f if line.strip()]
    except (KeyError, ValueError, TypeError) as exc:
        raise WorkloadError(f"{path}: not a Mooncake JSONL or Azure CSV trace ({exc})") from None
    if len(times) < 2:
        raise WorkloadError(f"{path}: fewer than two arrivals")
    return times


def build(
    *,
    rate: float,
    duration: float,
    workload: str | None = None,
    trace: Path | None = None,
    arrivals: str = "poisson",
    cv: float = 2.0,
    seed: int = 0,
    image_tokens: int | None = None,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> list[TraceEntry]:
    """The requests of one run at `rate` requests/s for `duration` seconds.

    `workload`: a planner shape (docs/workloads.md); `trace`: a trace file (its requests, their
    arrival pattern rescaled to `rate`, cut at `duration`). `arrivals` applies to a workload:
    poisson, gamma (with `cv`) or a production trace's times. `image_tokens` fixes the tokens per
    image (the served model's); None: LLaVA-1.5's count from each image's size.
    """
    if (workload is None) == (trace is None):
        raise WorkloadError("give a workload name or a trace file, not both and not neither")
    if not rate > 0 or not duration > 0:
        raise WorkloadError(f"rate and duration must be > 0, got {rate} req/s for {duration} s")
    if trace is not None:
        try:
            entries = read_trace(trace).entries
        except (OSError, ValueError) as exc:
            raise WorkloadError(str(exc)) from None
        if len(entries) < 2:
            raise WorkloadError(f"{trace}: a trace needs at least two requests to scale to a rate")
        return [e for e in rescale(entries, rate) if e.arrival < duration]
    if workload not in SHAPES:
        raise WorkloadError(f"unknown workload {workload!r}; known: {', '.join(SHAPES)}")
    if arrivals not in ARRIVALS and not Path(arrivals).is_file():
        raise WorkloadError(f"unknown arrivals {arrivals!r}; known: {', '.join(ARRIVALS)} or a trace file")
    process = arrivals if arrivals in ("poisson", "gamma") else "replay"
    timestamps, count = None, None
    if process == "replay":
        # A window of the recording holding as many arrivals as the run needs, scaled so its mean
        # rate is exactly `rate`; the seed picks where the window starts.
        count = max(2, round(rate * duration))
        recorded = sorted(trace_timestamps(arrivals))
        if count > len(recorded):
            raise WorkloadError(f"{arrivals} holds {len(recorded)} arrivals; the run needs {count}")
        start = int(np.random.default_rng(seed).integers(0, len(recorded) - count + 1))
        timestamps = recorded[start : start + count]
    return generate(
        workload,
        rate=rate,
        num_requests=count,
        duration=None if count else duration,
        arrival=process,
        cv=cv,
        timestamps=timestamps,
        seed=seed,
        image_tokens=llava15_tokens if image_tokens is None else image_tokens,
        max_prompt_tokens=max_prompt_tokens,
        max_output_tokens=max_output_tokens,
    )


__all__ = ["ARRIVALS", "TRACE_FILES", "TraceEntry", "WorkloadError", "build", "trace_timestamps"]
