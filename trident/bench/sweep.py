"""One system under a sweep of request rates: the same request shapes (same seed) at each rate,
with images and prompts of each rate's own, measured, summarised and saved, then goodput over the
sweep.

Files written to the output directory: `results.json` (the whole result, the same object as the
command's last line), `requests-<rate>.jsonl` (every request's measurements), `attainment.png` and
`latency_cdf.png`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from common.stats import SLO
from trident.bench import client, workload
from trident.bench.metrics import RateSummary, RequestResult, goodput, summarise
from trident.bench.repeat import Repeats, conversation_rate

if TYPE_CHECKING:
    from trident.bench.reuse import ReuseMeter


@dataclass(frozen=True)
class LoadSpec:
    """What to send: a workload shape or a trace, the arrival process, for how long, at what rates."""

    rates: tuple[float, ...]
    duration: float
    workload: str | None = "mix"
    trace: Path | None = None
    arrivals: str = "poisson"
    cv: float = 2.0
    seed: int = 0
    image_tokens: int | None = None
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    # What the requests share: a system prompt, an image pool, turns (trident/bench/repeat.py).
    repeats: Repeats = field(default_factory=Repeats)

    def entries(self, rate: float) -> list[workload.TraceEntry]:
        """The requests at `rate`; for a multi-turn workload, the conversations' first turns (at the
        rate that makes `rate` turns per second)."""
        return workload.build(
            rate=conversation_rate(rate, self.repeats),
            duration=self.duration,
            workload=self.workload if self.trace is None else None,
            trace=self.trace,
            arrivals=self.arrivals,
            cv=self.cv,
            seed=self.seed,
            image_tokens=self.image_tokens,
            max_prompt_tokens=self.max_prompt_tokens,
            max_output_tokens=self.max_output_tokens,
        )

    def describe(self) -> dict:
        return {
            "workload": self.workload if self.trace is None else None,
            "trace": str(self.trace) if self.trace else None,
            "arrivals": self.arrivals,
            "duration": self.duration,
            "seed": self.seed,
            "max_output_tokens": self.max_output_tokens,
            "repeats": self.repeats.describe(),
        }


def parse_rates(rate: float | None, sweep: str | None) -> tuple[float, ...]:
    """`--rate R` or `--sweep A:B:STEP` (A, A+STEP, ... up to B inclusive)."""
    if (rate is None) == (sweep is None):
        raise ValueError("give --rate or --sweep, not both and not neither")
    if rate is not None:
        if not rate > 0:
            raise ValueError(f"--rate must be > 0, got {rate}")
        return (rate,)
    try:
        a, b, step = (float(x) for x in sweep.split(":"))
    except ValueError:
        raise ValueError(f"--sweep takes A:B:STEP (e.g. 1:8:1), got {sweep!r}") from None
    if not (0 < a <= b and step > 0):
        raise ValueError(f"--sweep needs 0 < A <= B and STEP > 0, got {sweep!r}")
    count = int((b - a) / step + 1e-9) + 1
    return tuple(round(a + i * step, 6) for i in range(count))


@dataclass
class SweepResult:
    name: str
    url: str
    model: str
    slo: SLO
    load: dict
    summaries: list[RateSummary] = field(default_factory=list)
    requests: dict[float, list[RequestResult]] = field(default_factory=dict)

    @property
    def goodput(self) -> float:
        return goodput([(s.rate, s.attainment) for s in self.summaries], self.slo.attainment)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "url": self.url,
            "model": self.model,
            "slo": {"ttft": self.slo.ttft, "tbt": self.slo.tbt, "attainment": self.slo.attainment},
            "load": self.load,
            "goodput": self.goodput,
            "rates": [s.to_dict() for s in self.summaries],
        }


@dataclass(frozen=True)
class Target:
    """The server a sweep measures, how its requests are made, and where its results go. With a
    `meter`, each rate's summary says what it reused (trident/bench/reuse.py)."""

    name: str
    url: str
    model: str
    out: Path
    api_key: str = ""
    options: client.RequestOptions | None = None
    meter: ReuseMeter | None = None


@dataclass(frozen=True)
class Hooks:
    """What a sweep reports through: a rate starts (rate, requests), a request is done, a rate is
    summarised."""

    on_start: Callable[[float, int], None] | None = None
    on_done: Callable[[RequestResult], None] | None = None
    on_rate: Callable[[RateSummary], None] | None = None


def run_sweep(
    target: Target, load: LoadSpec, slo: SLO, hooks: Hooks | None = None, every_rate: bool = False
) -> SweepResult:
    """The rates of `load` against `target` in turn, lowest first, until one misses the SLO's
    attainment (no higher rate can count towards goodput; a server far past its capacity only
    takes long to drain) or, with `every_rate`, through all of them. Saves as it goes (module
    docstring)."""
    hooks = hooks or Hooks()
    target.out.mkdir(parents=True, exist_ok=True)
    result = SweepResult(target.name, target.url, target.model, slo, load.describe())
    for k, rate in enumerate(sorted(load.rates)):
        entries = load.entries(rate)
        if hooks.on_start is not None:
            hooks.on_start(rate, len(entries) * load.repeats.turns)
        measured = _measure(target, load, entries, k, hooks)
        result.requests[rate] = measured
        summary = summarise(rate, measured, slo)
        if target.meter is not None:
            summary.reuse = target.meter.measure(measured).to_dict()
        result.summaries.append(summary)
        with (target.out / f"requests-{rate:g}.jsonl").open("w") as f:
            for r in measured:
                f.write(json.dumps(r.to_dict()) + "\n")
        if hooks.on_rate is not None:
            hooks.on_rate(summary)
        if summary.attainment < slo.attainment and not every_rate:
            break
    save(result, target.out)
    return result


def _measure(
    target: Target, load: LoadSpec, entries: list[workload.TraceEntry], k: int, hooks: Hooks
) -> list[RequestResult]:
    """The `k`-th rate's requests sent and measured."""
    opts = target.options or client.RequestOptions(model=target.model, seed=load.seed)
    # The same request shapes at every rate, but images and prompts of their own: a server that
    # caches features or prompts (Trident's feature cache, llama.cpp's prompt cache) must not
    # find the last rate's requests again.
    # What the requests share (a system prompt, an image pool) stays the same across the rates.
    content = dataclasses.replace(
        opts,
        seed=opts.seed * 1009 + k,
        repeats=load.repeats,
        keep_bodies=target.meter is not None and target.meter.ideal is not None,
    )
    if target.meter is not None:
        target.meter.start()
    return asyncio.run(
        client.run(target.url, entries, content, api_key=target.api_key, on_done=hooks.on_done)
    )


def save(result: SweepResult, out: Path) -> None:
    from trident.bench import plots  # matplotlib: here, not when the CLI starts

    (out / "results.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    points = [(s.rate, s.attainment) for s in result.summaries]
    plots.attainment_plot({result.name: points}, result.slo, out / "attainment.png")
    runs = {f"{rate:g} req/s": rs for rate, rs in result.requests.items()}
    plots.cdf_plot(runs, result.slo, out / "latency_cdf.png")
