"""What a benchmark run measured, judged as common/stats.py judges every request.

A request's TBTs are the gaps between consecutive streamed chunks that carry text. Attainment is
the share of the requests sent that met their SLOs (a failed request is a miss). Goodput is the
highest request rate whose attainment reaches the target (0.9) with every lower measured rate
reaching it too: one lucky rate above a failing one does not count.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields

from common.stats import SLO, quantile, request_tbt, slo_met
from common.stats import attainment as share_met

DEFAULT_ATTAINMENT = 0.9

__all__ = ["RateSummary", "RequestResult", "attainment", "goodput", "summarise"]


@dataclass
class RequestResult:
    """One request as the client saw it. Times in seconds from the run's start (`scheduled`, `sent`)
    or from the request being sent (`ttft`, `e2e`); `tbts` are the gaps between text chunks."""

    index: int
    scheduled: float
    sent: float = math.nan
    ok: bool = False
    ttft: float = math.nan
    e2e: float = math.nan
    tbts: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, the server found cached (its usage's prompt_tokens_details)
    num_images: int = 0
    error: str = ""
    turn: int = 0  # of its conversation, from 0 (a multi-turn workload; 0 for single requests)
    request_id: str = ""  # the server's id for it (its chunks' `id`)
    images: list[str] = field(default_factory=list)  # each image sent, by digest (client.image_digest)
    body: dict | None = field(default=None, repr=False)  # what was sent, until reuse is measured; not saved

    @property
    def tbt_p90(self) -> float:
        """The request's TBT as its SLO judges it; 0 with fewer than two text chunks."""
        return request_tbt(self.tbts) or 0.0

    def meets(self, slo: SLO) -> bool:
        return self.ok and slo_met(self.ttft, request_tbt(self.tbts), slo)

    def to_dict(self) -> dict:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "body"}
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in values.items()}

    @classmethod
    def from_dict(cls, d: dict) -> RequestResult:
        return cls(**{k: (math.nan if v is None else v) for k, v in d.items()})


def _pct(values: Sequence[float], q: float) -> float | None:
    return round(quantile(values, q / 100), 6) if len(values) else None


@dataclass
class RateSummary:
    """One rate's run, summarised."""

    rate: float  # offered, requests/s
    duration: float  # from the first send to the last answer, s
    sent: int
    completed: int
    failed: int
    attainment: float
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    tbt_p50: float | None  # over every gap of every request
    tbt_p90: float | None
    request_tbt_p90_p50: float | None  # the median of the per-request p90s (what the SLO judges)
    e2e_p50: float | None
    e2e_p90: float | None
    throughput: float  # completed requests/s
    output_tokens_per_s: float
    errors: dict[str, int]
    # Multi-turn workloads: the TTFT p50 of first turns and of the turns after them (which resend a
    # history a prefix cache holds); None when the run has no such turns.
    ttft_p50_first_turns: float | None = None
    ttft_p50_later_turns: float | None = None
    # Over the completed requests: prompt tokens sent, and those the server reported as cached.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # What was reused against what could have been (trident/bench/reuse.py); None if not measured.
    reuse: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def summarise(rate: float, results: Sequence[RequestResult], slo: SLO) -> RateSummary:
    done = [r for r in results if r.ok]
    gaps = [g for r in done for g in r.tbts]
    sent = [r.sent for r in results if not math.isnan(r.sent)]
    ends = [r.sent + r.e2e for r in done]
    span = (max(ends) - min(sent)) if ends and sent else 0.0
    multi = any(r.turn for r in results)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error.split(":", 1)[0] or "unknown"
            errors[key] = errors.get(key, 0) + 1
    return RateSummary(
        rate=rate,
        duration=round(span, 3),
        sent=len(results),
        completed=len(done),
        failed=len(results) - len(done),
        attainment=attainment(results, slo),
        ttft_p50=_pct([r.ttft for r in done], 50),
        ttft_p90=_pct([r.ttft for r in done], 90),
        ttft_p99=_pct([r.ttft for r in done], 99),
        tbt_p50=_pct(gaps, 50),
        tbt_p90=_pct(gaps, 90),
        request_tbt_p90_p50=_pct([r.tbt_p90 for r in done if r.tbts], 50),
        e2e_p50=_pct([r.e2e for r in done], 50),
        e2e_p90=_pct([r.e2e for r in done], 90),
        throughput=round(len(done) / span, 4) if span > 0 else 0.0,
        output_tokens_per_s=round(sum(r.output_tokens for r in done) / span, 2) if span > 0 else 0.0,
        errors=errors,
        ttft_p50_first_turns=_pct([r.ttft for r in done if r.turn == 0], 50) if multi else None,
        ttft_p50_later_turns=_pct([r.ttft for r in done if r.turn > 0], 50) if multi else None,
        prompt_tokens=sum(r.prompt_tokens for r in done),
        cached_tokens=sum(r.cached_tokens for r in done),
    )


def attainment(results: Sequence[RequestResult], slo: SLO) -> float:
    """The share of requests sent that met both SLOs; 0.0 for no requests."""
    return share_met(r.meets(slo) for r in results)


def goodput(points: Sequence[tuple[float, float]], target: float = DEFAULT_ATTAINMENT) -> float:
    """The highest rate of (rate, attainment) `points` below which every measured rate, itself
    included, reaches `target`; 0.0 when even the lowest rate misses it."""
    best = 0.0
    for rate, reached in sorted(points):
        if reached < target:
            break
        best = rate
    return best
