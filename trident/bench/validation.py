"""Checking the simulator against the real thing: run a deployment, send it a workload at a rate
(as many times over as asked), take each request's TTFT and TBT p90 as the gateway measured them
(the trace), then replay the same requests (same arrival times, prompt and output lengths) in the
simulator, calibrated as the planner service calibrates itself: the profiles the instances
published, fitted to the steps they ran in service (a calibration load first) — plus the fixed
costs from unloaded requests' stage marks.

The gateway's numbers are per token; the client's are per non-empty text chunk, and a random-weight
model often emits part of a UTF-8 character, which merges two tokens into one chunk.

Compared: TTFT p50 and p90 over requests, the median over requests of each one's TBT p90 (the
quantity the TBT SLO judges), and the share of requests within both SLOs, from which `goodput`
reads the highest rate served. The run against the live deployment is validation_run.py; both are
used by bench/planner_validation.py and tests/planner/test_validation.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.planner.calibrate import calibrate_from_service, fit_dispatch
from common.planner.host_cpu import HostCpu
from common.planner.profiles import ProfileSet, TransferModel, scale_profiles
from common.planner.simulator import simulate
from common.planner.trace import (
    TraceEntry,
    entry_from_json,
    entry_json,
    read_trace,
    write_trace,
)
from common.planner.types import Deployment
from common.protocol import StepStats
from common.stats import SLO, slo_met

METRICS = ("ttft_p50", "ttft_p90", "tbt_p90")  # latencies compared, each a median over repeats


@dataclass
class Comparison:
    """One rate: each repeat's measurement (the same requests sent again), their median and spread,
    and the simulator's prediction for the same requests (the median over the repeats' replays,
    which differ only in the arrival times as actually sent)."""

    rate: float
    measured: dict[str, float]  # median over repeats: METRICS and attainment
    predicted: dict[str, float]
    spread: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # [min, max] over repeats
    repeats: list[dict[str, float]] = dataclasses.field(default_factory=list)  # each repeat's measurement
    # Each repeat's requests as sent, with the TTFT and TBT p90 the gateway measured: enough to replay
    # them in a changed simulator without running the deployment again.
    runs: list[list[TraceEntry]] = dataclasses.field(default_factory=list)
    # Each repeat's requests' stage marks (common/store/requests.py `Stage`), in the order of `runs`:
    # where a request's time went, to tell which stage a prediction misses.
    marks: list[list[dict[str, float]]] = dataclasses.field(default_factory=list)

    @property
    def errors(self) -> dict[str, float]:
        return {
            k: (self.predicted[k] - self.measured[k]) / self.measured[k]
            for k in METRICS
            if self.measured[k] > 0
        }

    def to_dict(self) -> dict:
        return {
            "rate": self.rate,
            "measured": self.measured,
            "spread": self.spread,
            "predicted": self.predicted,
            "errors": {k: round(v, 4) for k, v in self.errors.items()},
            "repeats": self.repeats,
        }


def goodput(rates: Sequence[float], attainments: Sequence[float], target: float) -> float:
    """The highest rate whose attainment reaches `target`, read between the swept rates: past the
    last rate that reaches it, linearly toward the first that does not (0 if none does; the top
    rate if all do). Measured and predicted goodput are read the same way."""
    points = sorted(zip(rates, attainments, strict=True))
    best = 0.0
    for (rate, att), after in zip(points, [*points[1:], None], strict=True):
        if att < target:
            break
        best = rate
        if after is not None and after[1] < target:
            next_rate, next_att = after
            best = rate + (next_rate - rate) * (att - target) / (att - next_att)
            break
    return round(best, 4)


def summarise(entries: Sequence[TraceEntry], slo: SLO) -> dict[str, float]:
    """TTFT p50/p90 over requests, the median of their TBT p90s, and the share that met both SLOs."""
    ttft = np.asarray([e.ttft for e in entries if e.ttft is not None and np.isfinite(e.ttft)])
    tbt = [e.tbt_p90 for e in entries if e.tbt_p90]
    met = [slo_met(e.ttft, e.tbt_p90 or None, slo) for e in entries]
    return {
        "ttft_p50": round(float(np.percentile(ttft, 50)), 5) if len(ttft) else float("nan"),
        "ttft_p90": round(float(np.percentile(ttft, 90)), 5) if len(ttft) else float("nan"),
        "tbt_p90": round(float(np.median(tbt)), 5) if tbt else 0.0,
        "attainment": round(float(np.mean(met)), 4) if met else 1.0,
    }


PREDICTION_SEEDS = 5  # simulations of each repeat, each with its own draws of the steps' jitter


def predict(entries: Sequence[TraceEntry], deployment: Deployment, profiles: ProfileSet, slo: SLO) -> dict:
    """The simulator's figures for `entries`: the median over PREDICTION_SEEDS simulations. One
    draw of the jitter is as noisy as one measured run: a p90 over 30 requests is their third
    slowest, and one slow step moves it."""
    rows = []
    for seed in range(PREDICTION_SEEDS):
        result = simulate(entries, deployment, profiles, slo, seed=seed)
        replayed = [
            dataclasses.replace(e, ttft=float(t), tbt_p90=float(g) or None)
            for e, t, g in zip(entries, result.ttft, result.tbt_p90, strict=True)
        ]
        rows.append(summarise(replayed, slo))
    return _median(rows)


def _median(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    return {k: round(float(np.median([r[k] for r in rows])), 5) for k in rows[0]}


def compare(
    rate: float, runs: Sequence[Sequence[TraceEntry]], deployment: Deployment, profiles: ProfileSet, slo: SLO
) -> Comparison:
    """Each repeat's measured requests summarised and replayed; medians, spreads and the repeats."""
    observed = [summarise(run, slo) for run in runs]
    predicted = [predict(run, deployment, profiles, slo) for run in runs]
    spread = {k: [min(r[k] for r in observed), max(r[k] for r in observed)] for k in observed[0]}
    return Comparison(rate, _median(observed), _median(predicted), spread, observed, [list(r) for r in runs])


def replay(
    rate: float, runs: Sequence[Sequence[TraceEntry]], deployment: Deployment, profiles: ProfileSet, slo: SLO
) -> Comparison:
    """A saved comparison predicted again (a changed simulator or calibration, the same measurement)."""
    return compare(rate, runs, deployment, profiles, slo)


@dataclass(frozen=True)
class Measurements:
    """What a calibration is found from: the instances' profiles as published (`base`), their steps
    in service, the fixed costs from the unloaded requests' stage marks (hops and pulls, medians),
    the requests sent one at a time (`quiet`) and under the calibration load (`loaded`), and what
    that load cost outside the instances (`host_cpu`; None: not charged)."""

    base: ProfileSet
    step_records: Sequence[StepStats]
    transfer: TransferModel
    quiet: Sequence[TraceEntry]
    loaded: Sequence[TraceEntry]
    host_cpu: HostCpu | None = None

    def to_dict(self) -> dict:
        """Kept with a run, to calibrate it again offline (`recalibrate`)."""
        return {
            "base_profiles": self.base.to_dict(),
            "marks_transfer": dataclasses.asdict(self.transfer),
            "step_stats": [st.model_dump(mode="json") for st in self.step_records],
            "quiet": [entry_json(e) for e in self.quiet],
            "loaded": [entry_json(e) for e in self.loaded],
            "host_cpu": self.host_cpu.to_dict() if self.host_cpu else None,
        }

    @classmethod
    def from_dict(cls, kept: dict) -> Measurements:
        return cls(
            ProfileSet.from_dict(kept["base_profiles"]),
            [StepStats(**s) for s in kept["step_stats"]],
            TransferModel(**kept["marks_transfer"]),
            [entry_from_json(e) for e in kept["quiet"]],
            [entry_from_json(e) for e in kept["loaded"]],
            HostCpu(**kept["host_cpu"]) if kept.get("host_cpu") else None,  # runs before: none
        )


def calibrate(
    measured: Measurements, deployment: Deployment, slo: SLO, host_cores: int | None = None
) -> tuple[ProfileSet, dict]:
    """What the planner service does, plus the fixed costs its stage curves cannot see: the curves
    fitted to the steps the instances ran in service and the spread of steps of one shape
    (`service_factors`, as the planner's TRIDENT_PLANNER_CALIBRATE); the time between two steps
    that holds no core, from the gaps between tokens the client saw under the calibration load
    (`fit_step_gap` on `loaded`, as the planner fits it on its window); then the gateway's
    dispatch, from what the unloaded requests' TTFT has beyond a replay with all of that
    (`fit_dispatch` on `quiet`); the instances share `host_cores` (default: this machine's), less
    what requests cost outside them (`host_cpu`, as the planner measures it)."""
    base = dataclasses.replace(
        measured.base, transfer=measured.transfer, host_cores=host_cores or os.cpu_count() or 1
    )
    service = calibrate_from_service(
        measured.step_records, base, measured.loaded, deployment, slo, measured.host_cpu
    )
    profiles = service.apply(base)
    profiles = dataclasses.replace(profiles, transfer=fit_dispatch(measured.quiet, deployment, profiles, slo))
    found = {
        "service": service.to_dict(),
        "transfer": dataclasses.asdict(profiles.transfer),
        "host_cores": profiles.host_cores,
        "slo": dataclasses.asdict(slo),
        "profiles": profiles.to_dict(),  # to replay offline
    }
    return profiles, found


def recalibrate(calibration: dict, method: str) -> tuple[ProfileSet, dict]:
    """`calibrate` again on what a recorded run kept (`Measurements.to_dict`): the calibration as
    the code now does it, on the same data."""
    slo = SLO(**calibration["slo"])
    # The recorded machine's cores.
    return calibrate(Measurements.from_dict(calibration), DEPLOYMENTS[method], slo, calibration["host_cores"])


GOAL = 0.20  # the bound on every prediction error
Run = tuple[str, str, dict, list[Comparison]]  # preset, method, calibration, one comparison per rate

DEPLOYMENTS = {
    "e+p+d": Deployment.of("e+p+d", e=1, p=1, d=1),
    "ep+d": Deployment.of("ep+d", ep=1, d=1),
    "ed+p": Deployment.of("ed+p", ed=1, p=1),
    "epd": Deployment.of("epd", epd=1),
}


def summary(runs: list[Run], slo: SLO) -> dict:
    """Every comparison, each system's goodput, the pick, the largest errors and the goals.

    The latency goals are judged at the rates a deployment is run at: those whose measured median
    attainment meets the SLOs (`in_range`). Past its goodput a deployment's queue grows for as long
    as requests keep coming, so its TTFT there says how long the run lasted more than how good the
    model is; those errors are reported too (`max_abs_error_all_rates`)."""
    report: dict = {"calibration": [], "runs": [], "goodput": {}}
    errors: dict[str, list[float]] = {"ttft_p90": [], "tbt_p90": [], "goodput": []}
    everywhere: dict[str, list[float]] = {"ttft_p90": [], "tbt_p90": []}
    measured_by_repeat: dict[str, list[float]] = {}
    step = 0.0
    for preset, method, calibration, comparisons in runs:
        name = f"{preset} {method}"
        kept = ("profiles", "base_profiles", "marks_transfer", "step_stats", "quiet", "loaded")  # data
        brief = {k: v for k, v in calibration.items() if k not in kept}
        report["calibration"].append({"preset": preset, "method": method, **brief})
        rates = [c.rate for c in comparisons]
        step = max(step, min((b - a for a, b in itertools.pairwise(rates)), default=0.0))
        for c in comparisons:
            in_range = c.measured["attainment"] >= slo.attainment
            report["runs"].append({"preset": preset, "method": method, **c.to_dict(), "in_range": in_range})
            for metric in everywhere:
                everywhere[metric].append(c.errors.get(metric, 0.0))
                if in_range:
                    errors[metric].append(c.errors.get(metric, 0.0))
        per_repeat, error, row = _goodputs(rates, comparisons, slo)
        measured_by_repeat[name] = per_repeat
        errors["goodput"].append(error)
        report["goodput"][name] = row
    report["pick"] = _pick(report["goodput"], measured_by_repeat, step)
    picked, within = report["pick"], report["pick"]["within_one_step"]
    worst = {k: round(max((abs(e) for e in v), default=0.0), 4) for k, v in errors.items()}
    report["max_abs_error"] = worst
    report["max_abs_error_all_rates"] = {k: round(max(abs(e) for e in v), 4) for k, v in everywhere.items()}
    report["goals_met"] = {
        "ttft_p90_within_20pct": worst["ttft_p90"] <= GOAL,
        "tbt_p90_within_20pct": worst["tbt_p90"] <= GOAL,
        "goodput_within_20pct": worst["goodput"] <= GOAL,
        "pick_goodput_within_20pct": abs(picked["error"]) <= GOAL,
        "pick_within_one_step_every_repeat": all(within),
    }
    return report


def _goodputs(rates: list[float], comparisons: list[Comparison], slo: SLO) -> tuple[list[float], float, dict]:
    """A system's goodput measured in each repeat and predicted; the prediction's error against the
    measured median; the report's row."""
    repeats = len(comparisons[0].repeats)
    per_repeat = [
        goodput(rates, [c.repeats[k]["attainment"] for c in comparisons], slo.attainment)
        for k in range(repeats)
    ]
    median = sorted(per_repeat)[len(per_repeat) // 2]
    predicted = goodput(rates, [c.predicted["attainment"] for c in comparisons], slo.attainment)
    error = (predicted - median) / median if median else (0.0 if predicted == 0 else float("inf"))
    row = {
        "measured": per_repeat,
        "measured_median": median,
        "predicted": predicted,
        "error": round(error, 4),
    }
    return per_repeat, error, row


def _pick(goodputs: dict[str, dict], measured_by_repeat: dict[str, list[float]], step: float) -> dict:
    """The system with the highest predicted goodput, and in each repeat whether its measured
    goodput was within one rate step of the best measured."""
    chosen = max(goodputs, key=lambda n: goodputs[n]["predicted"])
    picked = goodputs[chosen]
    repeats = len(measured_by_repeat[chosen])
    best = [max(measured_by_repeat, key=lambda n: measured_by_repeat[n][k]) for k in range(repeats)]
    within = [
        measured_by_repeat[chosen][k] >= measured_by_repeat[best[k]][k] - step - 1e-9 for k in range(repeats)
    ]
    return {
        "system": chosen,
        "predicted": picked["predicted"],
        "measured_median": picked["measured_median"],
        "error": picked["error"],
        "best_by_repeat": best,
        "within_one_step": within,
        "step": step,
    }


def save(folder: Path, preset: str, method: str, calibration: dict, comparisons: list[Comparison]) -> None:
    """calibration.json, and per rate and repeat the requests with their measurements (a trace
    whose header carries the calibrated profiles, so `trident plan --trace` plans it with them) and
    their stage marks, line by line in the trace's order."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "calibration.json").write_text(json.dumps({"preset": preset, "method": method, **calibration}))
    for c in comparisons:
        for k, run in enumerate(c.runs):
            meta = {"rate": c.rate, "repeat": k, "profiles": calibration["profiles"]}
            write_trace(folder / f"rate-{c.rate:g}-repeat-{k}.jsonl", run, meta=meta)
        for k, marks in enumerate(c.marks):
            lines = "".join(json.dumps(m, sort_keys=True) + "\n" for m in marks)
            (folder / f"marks-rate-{c.rate:g}-repeat-{k}.jsonl").write_text(lines)


def replay_folder(
    folder: Path, slo: SLO | None = None, *, recalibrated: bool = False, slower: float = 1.0
) -> Run:
    """What `save` kept, predicted again by today's simulator at the SLOs it was measured with (or
    `slo`): with the calibration then found, or `recalibrated` from the data it was found from;
    every stage's steps `slower` times as long (how much a calibration's error moves a figure)."""
    calibration = json.loads((folder / "calibration.json").read_text())
    preset, method = calibration.pop("preset"), calibration.pop("method")
    slo = slo or SLO(**calibration["slo"])
    if recalibrated:
        profiles, found = recalibrate(calibration, method)
        calibration = {**calibration, **found}
    else:
        profiles = ProfileSet.from_dict(calibration["profiles"])
    if slower != 1.0:
        profiles = scale_profiles(profiles, dict.fromkeys(("encode", "prefill", "decode"), slower))
    by_rate: dict[float, list] = {}
    for path in sorted(folder.glob("rate-*-repeat-*.jsonl")):
        trace = read_trace(path)
        by_rate.setdefault(float(trace.meta["rate"]), []).append((int(trace.meta["repeat"]), trace.entries))
    comparisons = [
        replay(rate, [entries for _, entries in sorted(runs)], DEPLOYMENTS[method], profiles, slo)
        for rate, runs in sorted(by_rate.items())
    ]
    return preset, method, calibration, comparisons
