"""Seed 000's Algorithm 2, made continuous: from a trace and stage profiles, which method and split of
N instances serves the most requests per second with ≥ 90 % of them inside their SLOs.

1. Workloads: W_e image tokens, W_p prompt tokens (text + image), W_d output tokens (lines 1-5).
2. Budgets per kind from the SLOs (lines 6-8, the engine's own search), decode concurrency capped by
   KV memory (line 9), full-load throughput of each stage (line 10).
3. Stage times t = W / throughput; N is split in proportion to them, at least one each (lines 11-12).
4. Candidates: E+P+D (N_e, N_p, N_d), EP+D (N_e + N_p, N_d), ED+P (N_e + N_d, N_p), each with its
   neighbouring splits — or every split when N ≤ 16.
5. Each candidate's goodput: the highest rate, on a search over a rate scale, at which a simulated
   replay of the trace meets the SLOs for ≥ 90 % of requests (lines 13-22). A candidate whose
   throughput bound cannot beat the best goodput found so far is not simulated.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from common.planner.profiles import ProfileSet, StageCurves
from common.planner.simulator import Correction, simulate
from common.planner.trace import rescale
from common.planner.types import KIND_ROLES, CandidateScore, Deployment, PlanResult
from common.stats import SLO

EXHAUSTIVE_UP_TO = 16  # every split is simulated at or below this many instances
GAMMA = 0.9  # share of KV memory decode may fill (000 §4.4)
MAX_REPLAY = 400  # requests replayed per simulation: the most recent ones
RATE_TOLERANCE = 0.03  # relative precision of the goodput search

Progress = Callable[[float, str], None]


class NoSplit(ValueError):
    """No deployment of that many instances is allowed."""


@dataclass(frozen=True)
class Workload:
    """Per-request means of what each stage must do (Algorithm 2's W divided by N_r)."""

    requests: int
    images: float
    image_tokens: float
    prompt_tokens: float
    output_tokens: float

    @classmethod
    def of(cls, trace: Sequence) -> Workload:
        n = len(trace)
        if n == 0:
            raise ValueError("the trace is empty: nothing to plan for")
        return cls(
            n,
            sum(e.num_images for e in trace) / n,
            sum(e.image_tokens for e in trace) / n,
            sum(e.prompt_tokens for e in trace) / n,
            sum(e.output_tokens for e in trace) / n,
        )


@dataclass(frozen=True)
class StageCosts:
    """Seconds of one instance's time per request for each stage at full load."""

    encode: float
    prefill: float
    decode: float

    def of_kind(self, kind: str) -> float:
        roles = KIND_ROLES[kind]
        return sum(getattr(self, stage) for stage in roles)


def stage_costs(work: Workload, curves: StageCurves, slo: SLO) -> StageCosts:
    """Algorithm 2 lines 6-11 per request: each stage's full-load throughput within the batch its
    budget (and for decode, KV memory) allows, turned into seconds of one instance per request."""
    context = work.prompt_tokens + work.output_tokens / 2
    tau_e, _ = curves.budgets(KIND_ROLES["e"], slo)
    _, tau_p = curves.budgets(KIND_ROLES["p"], slo)
    _, tau_d = curves.budgets(KIND_ROLES["d"], slo, context)
    per_request_tokens = work.prompt_tokens + work.output_tokens
    by_memory = GAMMA * curves.num_kv_blocks * curves.block_size / max(per_request_tokens, 1)
    batch = max(1, int(min(tau_d, by_memory, curves.max_num_seqs)))
    encode = prefill = decode = 0.0
    if work.images:
        per_image = _best_unit_cost(curves.encode_time, tau_e, [n for n, _ in curves.encode])
        encode = per_image * curves.image_units(work.image_tokens, work.images)
    if work.prompt_tokens:
        per_token = _best_unit_cost(curves.prefill_time, tau_p, [t for t, _ in curves.prefill])
        prefill = per_token * work.prompt_tokens
    if work.output_tokens > 1:
        per_step = _best_unit_cost(
            lambda b: curves.decode_time(b, context), batch, [b for b, _, _ in curves.decode]
        )
        decode = per_step * (work.output_tokens - 1)
    return StageCosts(encode, prefill, decode)


def _best_unit_cost(latency: Callable[[int], float], limit: int, points: Sequence[int]) -> float:
    """The least seconds per unit (image, token, decode step) over batches up to `limit`."""
    sizes = {limit, *(n for n in points if 0 < n <= limit)}
    return min(latency(n) / n for n in sizes)


def throughput_bound(deployment: Deployment, costs: StageCosts) -> float:
    """Requests/s the deployment could finish if every instance were always busy at full-load
    efficiency: an upper bound on its goodput."""
    bound = math.inf
    for kind, n in deployment.replicas:
        per_request = costs.of_kind(kind)
        if per_request > 0:
            bound = min(bound, n / per_request)
    return bound


def partition(instances: int, costs: StageCosts) -> tuple[int, int, int]:
    """N split in proportion to stage times, at least one instance each (largest remainders)."""
    if instances < 3:
        raise ValueError("E+P+D needs at least 3 instances")
    times = [max(costs.encode, 1e-12), max(costs.prefill, 1e-12), max(costs.decode, 1e-12)]
    shares = [instances * t / sum(times) for t in times]
    counts = [max(1, int(s)) for s in shares]
    by_remainder = sorted(range(3), key=lambda i: shares[i] - counts[i], reverse=True)
    while sum(counts) < instances:
        counts[by_remainder[0]] += 1
        by_remainder = sorted(range(3), key=lambda i: shares[i] - counts[i], reverse=True)
    while sum(counts) > instances:  # a stage rounded up to one instance took from the others
        i = max((i for i in range(3) if counts[i] > 1), key=lambda i: counts[i] - shares[i])
        counts[i] -= 1
    return counts[0], counts[1], counts[2]


def every_split(instances: int) -> list[Deployment]:
    """All deployments of the planned methods on exactly `instances` instances."""
    out = []
    for n_e in range(1, instances - 1):
        for n_p in range(1, instances - n_e):
            out.append(Deployment.of("e+p+d", e=n_e, p=n_p, d=instances - n_e - n_p))
    for n in range(1, instances):
        out.append(Deployment.of("ep+d", ep=n, d=instances - n))
        out.append(Deployment.of("ed+p", ed=n, p=instances - n))
    return out


def neighbourhood(instances: int, split: tuple[int, int, int]) -> list[Deployment]:
    """The partition's deployments for each method and the splits near it: moves of one instance,
    and of an eighth of N (so that on large N a stage-time estimate that is off still finds the
    region of the best split)."""
    n_e, n_p, n_d = split
    out: dict[str, Deployment] = {}

    def add(d: Deployment) -> None:
        out.setdefault(d.label, d)

    steps = sorted({1, max(1, instances // 8)})
    moves = [(0, 0, 0)] + [
        tuple(step if k == a else -step if k == b else 0 for k in range(3))
        for step in steps
        for a in range(3)
        for b in range(3)
        if a != b
    ]
    for de, dp, dd in moves:
        e, p, d = n_e + de, n_p + dp, n_d + dd
        if min(e, p, d) >= 1:
            add(Deployment.of("e+p+d", e=e, p=p, d=d))
    deltas = sorted({0, *steps, *(-s for s in steps)})
    for delta in deltas:
        ep, d = n_e + n_p + delta, n_d - delta
        if min(ep, d) >= 1:
            add(Deployment.of("ep+d", ep=ep, d=d))
        ed, p = n_e + n_d + delta, n_p - delta
        if min(ed, p) >= 1:
            add(Deployment.of("ed+p", ed=ed, p=p))
    return list(out.values())


def at_rate(trace: Sequence, rate: float) -> list:
    """The trace with its inter-arrival times scaled so that it runs at `rate` requests/s (requests
    that all arrive at once are spaced evenly instead)."""
    entries = sorted(trace, key=lambda e: e.arrival)
    if len(entries) < 2 or entries[-1].arrival <= entries[0].arrival:
        return [dataclasses.replace(e, arrival=i / rate) for i, e in enumerate(entries)]
    return rescale(entries, rate)


def goodput(
    trace: Sequence,
    deployment: Deployment,
    profiles: ProfileSet,
    slo: SLO,
    *,
    bound: float | None = None,
    correction: Correction | None = None,
) -> CandidateScore:
    """The highest rate at which ≥ slo.attainment of the replayed trace meets both SLOs."""
    if bound is None:
        work = Workload.of(trace)
        bound = throughput_bound(deployment, stage_costs(work, profiles.curves, slo))
    bound = bound if math.isfinite(bound) else 1e6

    def run(rate: float):
        replay = at_rate(trace, rate)
        return simulate(replay, deployment, profiles, slo, correction=correction, stop_early=True)

    # Sustained goodput cannot exceed the throughput bound (a finite replay above it may still
    # look fine), so the search runs below it and a pass at the bound scores the bound.
    low = run(bound / 64)
    if low.attainment < slo.attainment:
        return CandidateScore(deployment, 0.0, round(low.attainment, 4), bound=round(bound, 4))
    lo, best_result = bound / 64, low
    top = run(bound)
    if top.attainment >= slo.attainment:
        lo, best_result = bound, top
    else:
        hi = bound
        while (hi - lo) / hi > RATE_TOLERANCE:
            mid = math.sqrt(lo * hi)
            result = run(mid)
            if result.attainment >= slo.attainment:
                lo, best_result = mid, result
            else:
                hi = mid
    best = lo
    return CandidateScore(
        deployment,
        round(best, 4),
        round(best_result.attainment, 4),
        round(best_result.ttft_percentile(90), 4),
        round(best_result.tbt_percentile(90), 4),
        bound=round(bound, 4),
    )


def plan(
    trace: Sequence,
    profiles: ProfileSet,
    slo: SLO,
    instances: int,
    *,
    correction: Correction | None = None,
    exhaustive: bool | None = None,
    progress: Progress | None = None,
    allowed: Callable[[Deployment], bool] | None = None,
) -> PlanResult:
    """Algorithm 2: the best method and split of `instances` for this trace, SLOs and profiles.
    `exhaustive` None means every split when instances ≤ 16, neighbouring splits otherwise.
    `allowed` keeps only the deployments it accepts (capacity.py's limits); NoSplit if none is."""
    started = time.monotonic()
    replay = sorted(trace, key=lambda e: e.arrival)[-MAX_REPLAY:]
    work = Workload.of(replay)
    costs = stage_costs(work, profiles.curves, slo)
    # Two instances split only as EP+D or ED+P (no E+P+D partition); one does not split at all.
    split = partition(instances, costs) if instances >= 3 else None
    if exhaustive is None:
        exhaustive = instances <= EXHAUSTIVE_UP_TO
    candidates = _candidates(instances, split, exhaustive, allowed)
    bounds = {c.label: throughput_bound(c, costs) for c in candidates}
    # Most promising first, so the bound prunes as many as it can.
    candidates.sort(key=lambda c: (-bounds[c.label], c.label))
    scores, best = _scores(candidates, bounds, _Replay(replay, profiles, slo, correction), progress)
    if progress is not None:
        progress(1.0, f"chose {best.deployment.label}")
    # Simulated ones best first, then the pruned ones by their bound.
    scores.sort(key=lambda s: (s.pruned, -(s.goodput if not s.pruned else s.bound), s.deployment.label))
    context = work.prompt_tokens + work.output_tokens / 2
    tau = {kind: profiles.for_kind(kind).budgets(KIND_ROLES[kind], slo, context) for kind in KIND_ROLES}
    inputs = {
        "requests": len(trace),
        "replayed": len(replay),
        "workload": dataclasses.asdict(work),
        "stage_seconds_per_request": dataclasses.asdict(costs),
        "partition": {"e": split[0], "p": split[1], "d": split[2]} if split else None,
        "budgets": {kind: {"image_budget": e, "token_budget": t} for kind, (e, t) in tau.items()},
        "slo": dataclasses.asdict(slo),
        "instances": instances,
        "search": "every split" if exhaustive else "partition and neighbouring splits",
        "candidates_simulated": sum(not s.pruned for s in scores),
        "candidates_pruned": sum(s.pruned for s in scores),
        "correction": dataclasses.asdict(correction or Correction()),
        "profiles": profiles.source,
        "seconds": round(time.monotonic() - started, 3),
    }
    return PlanResult(best.deployment, best.goodput, best.attainment, scores, inputs)


def _candidates(
    instances: int, split: tuple[int, int, int] | None, exhaustive: bool, allowed: Callable | None
) -> list[Deployment]:
    """The splits to score: every one, or the partition's neighbourhood; those `allowed` accepts."""
    candidates = every_split(instances) if exhaustive or split is None else neighbourhood(instances, split)
    if not candidates:
        raise NoSplit(f"{instances} instance cannot be split into stages: a plan needs at least 2")
    if allowed is not None:
        candidates = [c for c in candidates if allowed(c)]
        if not candidates and not exhaustive:  # the limits sit away from the partition: look wider
            candidates = [c for c in every_split(instances) if allowed(c)]
        if not candidates:
            raise NoSplit(f"no split of {instances} instances is within the limits")
    return candidates


@dataclass(frozen=True)
class _Replay:
    """What every candidate is scored on: the replayed requests, the profiles, the SLOs and the
    correction from service."""

    trace: list
    profiles: ProfileSet
    slo: SLO
    correction: Correction | None

    def goodput(self, deployment: Deployment, bound: float) -> CandidateScore:
        return goodput(
            self.trace, deployment, self.profiles, self.slo, bound=bound, correction=self.correction
        )


def _scores(
    candidates: list[Deployment], bounds: dict[str, float], replay: _Replay, progress: Progress | None
) -> tuple[list[CandidateScore], CandidateScore]:
    """Each candidate simulated, most promising first, unless its bound is below the best goodput
    found so far (then pruned); and the best, with its runner-up simulated too."""
    scores: list[CandidateScore] = []
    best: CandidateScore | None = None
    for i, candidate in enumerate(candidates):
        if progress is not None:
            progress(i / len(candidates), f"simulating {candidate.label}")
        bound = bounds[candidate.label]
        if best is not None and bound < best.goodput:
            scores.append(CandidateScore(candidate, None, None, bound=round(bound, 4), pruned=True))
            continue
        score = replay.goodput(candidate, bound)
        scores.append(score)
        if best is None or _better(score, best):
            best = score
    assert best is not None  # the first candidate is never pruned
    _simulate_runner_up(scores, best, replay)
    return scores, best


def _simulate_runner_up(scores: list[CandidateScore], best: CandidateScore, replay: _Replay) -> None:
    """Make the best candidate other than `best` a simulated one, so the plan can say how close it
    came: simulate pruned candidates, highest bound first, while one's bound beats every simulated
    runner-up (a bound is never below the goodput, so what is left pruned cannot be second)."""
    while True:
        others = [s for s in scores if s is not best]
        if not others:
            return
        top = max(others, key=lambda s: s.bound if s.pruned else s.goodput)
        if not top.pruned:
            return
        scores[scores.index(top)] = replay.goodput(top.deployment, top.bound)


def _better(a: CandidateScore, b: CandidateScore) -> bool:
    """Higher goodput wins; ties go to the lower predicted TTFT p90, then the label (deterministic)."""
    if a.goodput != b.goodput:
        return a.goodput > b.goodput
    return (a.ttft_p90 or 0.0, a.deployment.label) < (b.ttft_p90 or 0.0, b.deployment.label)
