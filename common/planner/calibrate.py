"""The fixed costs of a running deployment, read from the stage marks its requests leave in the trace.

Compute latency comes from the instances' profiles; what they cannot see is the path between them:
the gateway's processing, a task's hop through the broker, a pull's fixed cost. Each is an interval
between two stage marks (common/store/requests.py `Stage`) and is taken at a low quantile over
many requests, which is what it costs when nothing queues — so the estimate holds under load too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common.planner.host_cpu import HostCpu
from common.planner.profiles import ProfileSet, StageCurves, TransferModel, scale_profiles
from common.planner.simulator import cores_left, simulate
from common.roles import InstanceKind, Role, StepKind
from common.stats import quantile


def quantile_of(values: Sequence[float], percent: float) -> float:
    return quantile(values, percent / 100)


QUANTILE = 10  # percent: the unloaded cost of an interval that queueing can only lengthen
MIN_SAMPLES = 5


def _interval(records: Sequence, start: str | tuple[str, ...], end: str, quantile: float) -> float | None:
    """A quantile of `end - start` over the records that have both; a tuple `start` is the latest
    of its marks (a P→D pull that began while its KV still streamed is exposed from the prefill's end)."""
    starts = (start,) if isinstance(start, str) else start
    values = [
        r.stages[end] - max(r.stages[s] for s in starts)
        for r in records
        if end in r.stages and all(s in r.stages for s in starts)
    ]
    values = [v for v in values if v >= 0]
    return quantile_of(values, quantile) if len(values) >= MIN_SAMPLES else None


def transfer_model(
    records: Sequence, base: TransferModel | None = None, quantile: float = QUANTILE
) -> TransferModel:
    """A TransferModel whose fixed costs are measured from trace records (TraceRecord: `stages`
    wall-clock marks, optional gateway-measured `ttft`); costs with too few samples keep `base`'s.
    Records of requests sent one at a time may use the median (`quantile=50`)."""
    base = base or TransferModel()
    queued = [_first_queued(r) for r in records]
    to_queue = [
        (q - r.stages["arrival"], r.num_images)
        for r, q in zip(records, queued, strict=True)
        if q and "arrival" in r.stages
    ]
    # The first token's way back: what the gateway measured beyond the instance's first-token mark.
    back = [
        r.ttft - (r.stages["first_token"] - r.stages["arrival"])
        for r in records
        if getattr(r, "ttft", None) is not None and "first_token" in r.stages and "arrival" in r.stages
    ]
    dispatch, per_image = base.dispatch, base.dispatch_per_image
    text = [t for t, n in to_queue if n == 0]
    images = [(t, n) for t, n in to_queue if n > 0]
    if len(to_queue) >= MIN_SAMPLES:
        dispatch = float(
            quantile_of(text if len(text) >= MIN_SAMPLES else [t for t, _ in to_queue], quantile)
        )
        if len(images) >= MIN_SAMPLES:
            extra = quantile_of([t - dispatch for t, _ in images], quantile)
            per_image = max(0.0, extra / float(np.mean([n for _, n in images])))
        if len(back) >= MIN_SAMPLES:
            dispatch += max(0.0, quantile_of(back, quantile))
    hops = [
        h
        for h in (
            _interval(records, "encode_queued", "encode_started", quantile),
            _interval(records, "prefill_queued", "prefill_started", quantile),
        )
        if h is not None
    ]
    pulls = [
        p
        for p in (
            _interval(records, "ep_transfer_started", "ep_transfer_ended", quantile),
            _interval(records, ("pd_transfer_started", "prefill_ended"), "pd_transfer_ended", quantile),
        )
        if p is not None
    ]
    return TransferModel(
        latency=float(np.mean(pulls)) if pulls else base.latency,
        bandwidth=base.bandwidth,
        hop=float(np.mean(hops)) if hops else base.hop,
        dispatch=dispatch,
        dispatch_per_image=per_image,
    )


def _first_queued(record) -> float | None:
    marks = [record.stages[k] for k in ("encode_queued", "prefill_queued") if k in record.stages]
    return min(marks) if marks else None


# A start-up profile taken while the other workers profile beside it on the same cores can be a
# few times slower than the same steps in service (small-llava's decode on 2 cores: 0.3-0.5x).
FACTOR_RANGE = (0.2, 10.0)


def stage_factors(records: Sequence, curves: StageCurves) -> dict[Role, float]:
    """How much longer each stage took in the deployed processes than the profile says, from
    requests sent one at a time: median observed/predicted of encode, prefill and decode steps.

    A profile times the model alone at start-up; deployed, the same step also pays for the
    worker's Python around it and shares the cores with the other services on the machine."""
    ratios: dict[Role, list[float]] = {role: [] for role in Role}
    for r in records:
        st = r.stages
        if r.num_images and "encode_started" in st and "encode_ended" in st and curves.encode:
            ratios[Role.ENCODE].append(
                (st["encode_ended"] - st["encode_started"]) / curves.encode_time(r.num_images)
            )
        if "prefill_started" in st and "prefill_ended" in st:
            ratios[Role.PREFILL].append(
                (st["prefill_ended"] - st["prefill_started"]) / curves.prefill_time(r.prompt_tokens)
            )
        start = st.get("decode_started", st.get("first_token"))
        if start is not None and "end" in st and r.output_tokens > 1:
            step = (st["end"] - start) / (r.output_tokens - 1)
            ratios[Role.DECODE].append(step / curves.decode_time(1, r.prompt_tokens + r.output_tokens / 2))
    low, high = FACTOR_RANGE
    return {
        stage: round(min(high, max(low, float(np.median(v)))), 4) if len(v) >= MIN_SAMPLES else 1.0
        for stage, v in ratios.items()
    }


def jitter(records: Sequence) -> float:
    """σ of a mean-preserving log-normal spread of step times, from requests sent one at a time:
    each one's TBT p90 (the gateway's) against its mean step (its marks). For such a factor
    p90/mean = exp(1.2816·σ − σ²/2); the median ratio is solved for σ."""
    ratios = []
    for r in records:
        start = r.stages.get("decode_started", r.stages.get("first_token"))
        p90 = getattr(r, "tbt_p90", None)
        if start is None or "end" not in r.stages or r.output_tokens < 4 or not p90:
            continue
        mean_step = (r.stages["end"] - start) / (r.output_tokens - 1)
        if mean_step > 0:
            ratios.append(p90 / mean_step)
    if len(ratios) < MIN_SAMPLES:
        return 0.0
    target = float(np.log(max(1.0, np.median(ratios))))
    # exp(z·σ − σ²/2) rises with σ up to σ = z: solve z·σ − σ²/2 = target there.
    z = 1.2816
    if target >= z * z / 2:
        return z
    return round(z - float(np.sqrt(z * z - 2 * target)), 4)


def fit_dispatch(entries: Sequence, deployment, profiles: ProfileSet, slo) -> TransferModel:
    """The gateway's share of TTFT, from requests sent one at a time (TraceEntry with a measured
    `ttft`): what the measurement has beyond a replay without any dispatch cost — its median over
    text-only requests, and per image over the others."""
    measured = [e for e in entries if e.ttft is not None]
    if len(measured) < MIN_SAMPLES:
        return profiles.transfer
    bare = dataclasses.replace(profiles.transfer, dispatch=0.0, dispatch_per_image=0.0)
    replay = simulate(measured, deployment, dataclasses.replace(profiles, transfer=bare), slo)
    residual = [(e.ttft - float(p), e.num_images) for e, p in zip(measured, replay.ttft, strict=True)]
    text = [r for r, n in residual if n == 0]
    dispatch = max(0.0, float(np.median(text if len(text) >= MIN_SAMPLES // 2 else [r for r, _ in residual])))
    images = [(r - dispatch) / n for r, n in residual if n > 0]
    per_image = max(0.0, float(np.median(images))) if images else 0.0
    return dataclasses.replace(profiles.transfer, dispatch=dispatch, dispatch_per_image=per_image)


def fit_step_gap(entries: Sequence, deployment, profiles: ProfileSet, slo, rounds: int = 3) -> ProfileSet:
    """The time between an instance's steps that holds no core (`TransferModel.step_gap`), such
    that a replay of measured requests, as they were sent, gives the TBT p90 the gateway measured
    for them (TraceEntry with a measured `tbt_p90`): the median over requests of measured minus
    replayed, added until it settles. A token's gap as the client sees it holds more than the
    step: the worker publishing it, its loop, the broker, the gateway; unlike a slower step, that
    time leaves the cores to the other instances."""
    measured = [e for e in entries if e.tbt_p90 and e.output_tokens > 2]
    if len(measured) < MIN_SAMPLES:
        return profiles

    def with_gap(gap: float) -> ProfileSet:
        return dataclasses.replace(profiles, transfer=dataclasses.replace(profiles.transfer, step_gap=gap))

    gap = profiles.transfer.step_gap
    for _ in range(rounds):
        replay = simulate(measured, deployment, with_gap(gap), slo)
        residual = float(
            np.median([e.tbt_p90 - float(p) for e, p in zip(measured, replay.tbt_p90, strict=True)])
        )
        gap = max(0.0, gap + residual)
    return with_gap(round(gap, 6))


def calibrate_from_service(
    stats: Sequence,
    profiles: ProfileSet,
    served: Sequence = (),
    deployment=None,
    slo=None,
    host_cpu: HostCpu | None = None,
) -> ServiceCalibration:
    """How a deployment's planner calibrates `profiles`: the stage curves and jitter fitted to the
    steps its instances ran in service (`service_factors`); and, given the requests it served
    (TraceEntry with the measured `tbt_p90`) and the deployment that served them, two things more:

    - what sharing the host's cores added to those steps. A step's time in service holds the other
      instances' steps beside it, and the simulator shares the cores out on its own (processor
      sharing, `ProfileSet.host_cores`): counted in the curves too, the contention is counted
      twice. So the steps are fitted again, each less the stretch a replay of the same requests
      gives steps of its kind (`SimResult.sharing`);
    - the time between steps that holds no core (`fit_step_gap`, on the profiles so fitted).

    With `host_cpu` (measure_host_cpu), what requests cost on the shared cores outside the
    instances is taken out of the steps' times and charged by the simulator at each rate instead."""
    background, per_request = (host_cpu.busy, host_cpu.per_request) if host_cpu else (0.0, 0.0)
    if host_cpu is not None:
        transfer = dataclasses.replace(profiles.transfer, host_cpu=per_request)
        profiles = dataclasses.replace(profiles, transfer=transfer)
    calibration = service_factors(stats, profiles, background=background)
    if deployment is None or not served:
        return dataclasses.replace(calibration, host_cpu=per_request)
    sharing: dict[str, float] = {}
    # Steps that say their threads and neighbours are each taken to their own share of the cores
    # (`service_factors`); a replay's stretch is for older records.
    known = all(step.overlap >= 0 for record in stats for step in record.steps)
    for _ in range(SHARING_ROUNDS if profiles.host_cores and not (known and profiles.threads) else 0):
        found = simulate(served, deployment, calibration.apply(profiles), slo).sharing
        # Slower steps overlap more, so the stretch is fitted again until it settles; halfway (in
        # log) each round, as near the cores' capacity the whole way overshoots and oscillates.
        step = {k: float(np.sqrt(sharing.get(k, 1.0) * found.get(k, 1.0))) for k in {*found, *sharing}}
        if all(abs(v - sharing.get(k, 1.0)) < 0.005 for k, v in step.items()):
            break
        sharing = step
        calibration = service_factors(stats, profiles, sharing, background)
    fitted = fit_step_gap(served, deployment, calibration.apply(profiles), slo)
    return dataclasses.replace(calibration, step_gap=fitted.transfer.step_gap, host_cpu=per_request)


SERVICE_MIN_STEPS = 20  # steps of a stage before its factor is trusted
SHARING_ROUNDS = 12  # replays to take the cores' sharing out of the steps' times
SHAPE_MIN_STEPS = 3  # steps of one shape before their spread counts
THREAD_MIN_STEPS = 10  # steps at other threads than the rest of their shape before an exponent is fitted


def _shape(kind: StepKind, images: float, prefill_tokens: int, decodes: int) -> tuple:
    return kind, round(images, 2), int(prefill_tokens).bit_length(), int(decodes).bit_length()


@dataclass(frozen=True)
class ServiceCalibration:
    """Each stage's curve scaled to what its steps took in service (`factors`), the spread of
    single steps of one shape (`jitter`, σ of a log-normal factor), the time between steps that
    holds no core (`step_gap`, from the gaps between tokens the gateway measured), and what it
    was fitted on: step counts by kind, and each instance's budgets as its governor set them."""

    factors: dict[str, float]
    jitter: float
    steps: dict[str, int]
    budgets: dict[str, dict[str, float]]
    step_gap: float = 0.0  # fitted to the measured TBT (`fit_step_gap`), where there is one
    # By step kind: the stretch from sharing cores taken out of the steps' times (1.0: none).
    sharing: dict[str, float] = dataclasses.field(default_factory=dict)
    # By step kind: how a step's time falls with its threads (`fit_host_effects`; none where not
    # fitted), and rises with other steps beside it (not fitted in service: `service_factors`; a
    # calibration recorded before may carry it).
    thread_exponent: dict[str, float] = dataclasses.field(default_factory=dict)
    interference: dict[str, float] = dataclasses.field(default_factory=dict)
    host_cpu: float = 0.0  # CPU s per request outside the instances (measure_host_cpu; 0: none)

    def apply(self, profiles: ProfileSet) -> ProfileSet:
        transfer = profiles.transfer
        if self.step_gap:
            transfer = dataclasses.replace(transfer, step_gap=self.step_gap)
        if self.host_cpu:
            transfer = dataclasses.replace(transfer, host_cpu=self.host_cpu)
        return scale_profiles(
            profiles,
            self.factors,
            transfer,
            jitter=max(profiles.jitter, self.jitter),
            thread_exponent=self.thread_exponent or None,
            interference=self.interference or None,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def service_factors(
    stats: Sequence, profiles: ProfileSet, sharing: dict[str, float] | None = None, background: float = 0.0
) -> ServiceCalibration:
    """Fit the profile's stage curves to the steps instances ran in service (StepStats records):
    each stage's factor is the time its steps took over the time the curve predicts for the same
    batches, summed (so the big steps, which set throughput, weigh most). Steps of one stage only
    fit that stage; mixed steps (prefill chunks beside decodes, an image beside them) fit every
    stage that lacks SERVICE_MIN_STEPS pure ones. A factor left unfitted is 1.

    Times in service hold what the profile cannot see: the other processes on the same cores, the
    worker's Python around a step, a GPU shared with another tenant. They are the times under the
    load that was served, so a plan for a much heavier or lighter load extrapolates from them.
    `sharing` (by step kind) divides each step's time: what sharing the cores added to it, where
    the simulator adds that itself (`calibrate_from_service`). Where steps say the threads they
    ran with and how many other steps ran beside them, and the profile the threads it was measured
    with, each step's time is first brought to its own share of the cores and to the profile's
    threads, by the exponent fitted on them (`fit_host_effects`), which the simulator then applies
    to the threads its instances have (`ProfileSet.thread_exponent`). `background`: the host's
    cores busy outside the instances meanwhile (`HostCpu.busy`), not theirs to share."""
    sharing = {k: round(v, 4) for k, v in (sharing or {}).items()}
    steps, budgets = _service_steps(stats, profiles, sharing, background)
    # The exponent is fitted beside the neighbours' slowdown λ, so that it is a step's own threads'
    # effect with its neighbours held fixed, but λ is not applied: a greedy worker has every core
    # only while no other worker steps, so within a shape its threads and its neighbours move
    # together, and the split between the two moved from run to run. On the validation's run 10
    # (90 calibration requests) it put λ 0.74 on EP+D's encode-and-prefill steps, and EP+D's
    # predicted goodput went 33 % under the measured. Left in the factors, the neighbours' average
    # effect at the load served is what the simulator scales (docs/planner.md, runs 8–10).
    exponents, _ = fit_host_effects(
        [(k, shape, float(np.log(s / p)), r, o) for k, shape, s, p, r, o in steps if r and o is not None]
    )
    at_profiled_threads = [
        (kind, shape, seconds * (relative or 1.0) ** exponents.get(kind, 0.0), predicted)
        for kind, shape, seconds, predicted, relative, _ in steps
    ]
    factors, counts = _stage_factors(at_profiled_threads)
    return ServiceCalibration(
        factors,
        _jitter(at_profiled_threads),
        counts,
        budgets,
        sharing=sharing,
        thread_exponent=exponents,
    )


def _service_steps(
    stats: Sequence, profiles: ProfileSet, sharing: dict[str, float], background: float
) -> tuple[list[tuple], dict[str, dict[str, float]]]:
    """Every step the records hold that a curve predicts, as (kind, shape, seconds, predicted,
    threads / profiled threads, overlap or None), its time brought to its own share of the cores
    (or divided by `sharing`); and each instance's budgets."""
    budgets = {}
    steps = []
    for record in stats:
        kind = InstanceKind.of(record.roles)
        curves = profiles.for_kind(kind) if kind else profiles.curves
        budgets[record.instance_id] = {
            "image_budget": record.image_budget,
            "token_budget": record.token_budget,
            "scale": record.budget_scale,
        }
        for step in record.steps:
            if step.images and not curves.encode:
                continue
            shape = (step.images, step.prefill_tokens, step.decodes)
            predicted = curves.iteration_time(*shape, step.decode_context)
            seconds, threads, overlap = step.seconds, step.threads, step.overlap
            if predicted <= 0 or seconds <= 0:
                continue
            relative = threads / profiles.threads if threads > 0 and profiles.threads else None
            shape = _shape(step.kind, *shape)
            known = overlap >= 0 and relative and profiles.host_cores
            if known:
                # Its own share of the cores, as the simulator shares them out: the threads running
                # (the others' at a share each) over the cores.
                cores = cores_left(profiles.host_cores, background)
                seconds /= max(1.0, (threads + overlap * profiles.threads) / cores)
            else:
                seconds /= sharing.get(step.kind, 1.0)
            steps.append((step.kind, shape, seconds, predicted, relative, overlap if known else None))
    return steps, budgets


def _stage_factors(steps: list[tuple]) -> tuple[dict[str, float], dict[str, int]]:
    """Each stage's factor from (kind, shape, seconds, predicted) steps: its steps' time over the
    curve's, where it has SERVICE_MIN_STEPS, else the mixed steps' (else none); and the steps by kind."""
    sums: dict[str, list[float]] = {kind: [0.0, 0.0] for kind in StepKind}
    counts = dict.fromkeys(sums, 0)
    for kind, _, seconds, predicted in steps:
        sums[kind][0] += seconds
        sums[kind][1] += predicted
        counts[kind] += 1
    low, high = FACTOR_RANGE
    observed, predicted = sums[StepKind.MIXED]
    mixed = observed / predicted if counts[StepKind.MIXED] >= SERVICE_MIN_STEPS else None
    factors = {}
    for stage in (StepKind.ENCODE, StepKind.PREFILL, StepKind.DECODE):
        observed, predicted = sums[stage]
        factor = observed / predicted if counts[stage] >= SERVICE_MIN_STEPS else mixed
        if factor is not None:
            factors[stage] = round(min(high, max(low, float(factor))), 4)
    return factors, counts


def _jitter(steps: list[tuple]) -> float:
    """How much a step varies: its spread around the steps of the same shape (kind, images and
    powers of two of prefill tokens and decodes), not around the stage's one factor, which would
    count where the curve's shape is off (consistently, for every step of that shape) as noise.
    Noise it is not: the simulator draws it afresh for each step, and a TBT p90 over 15 gaps or a
    TTFT over two steps takes its tail from it."""
    shapes: dict[tuple, list[float]] = {}  # log(observed / predicted) by step shape
    for _, shape, seconds, predicted in steps:
        shapes.setdefault(shape, []).append(float(np.log(seconds / predicted)))
    residuals = [v - float(np.median(g)) for g in shapes.values() if len(g) >= SHAPE_MIN_STEPS for v in g]
    return round(float(np.std(residuals)), 4) if len(residuals) >= SERVICE_MIN_STEPS else 0.0


def fit_host_effects(
    steps: Sequence[tuple[str, tuple, float, float, float]],
) -> tuple[dict[str, float], dict[str, float]]:
    """How steps in service ran faster or slower for their host, from steps with (kind, shape,
    log(observed / predicted), threads / profiled threads, overlap), each step's time already less
    its share of the cores: per step kind, time ∝ threads^−exponent (the cores a greedy worker
    took, services/worker/cores.py) × e^(λ·overlap) (the other workers' steps beside it, on cores
    of their own: caches, memory bandwidth, the host's other processes). Least squares on the
    steps' deviations from the means of their shape (kind, images, powers of two of prefill tokens
    and decodes), so that where a curve is off for a shape does not count. An effect is fitted
    where at least THREAD_MIN_STEPS of the kind's steps vary in it from their shape's mean, and
    kept within bounds: more threads never slow a step nor speed it more than in proportion
    (0–1), others' steps never speed it (λ ≥ 0). Returns (exponent by kind, λ by kind)."""
    by_shape: dict[tuple, list[tuple[float, float, float]]] = {}
    for _, shape, log_ratio, relative, overlap in steps:
        by_shape.setdefault(shape, []).append((log_ratio, float(np.log(relative)), overlap))
    rows: dict[str, list[tuple[float, float, float]]] = {}  # by kind: (dy, d log threads, d overlap)
    for shape, group in by_shape.items():
        if len(group) < SHAPE_MIN_STEPS:
            continue
        mean = np.mean(np.array(group), axis=0)
        rows.setdefault(shape[0], []).extend((y - mean[0], x - mean[1], o - mean[2]) for y, x, o in group)
    exponents: dict[str, float] = {}
    interference: dict[str, float] = {}
    for kind, kind_rows in sorted(rows.items()):
        dy, dx, do = (np.array(column) for column in zip(*kind_rows, strict=True))
        columns = {name: c for name, c in (("threads", dx), ("overlap", do)) if _varied(c)}
        if not columns:
            continue
        coef = np.linalg.lstsq(np.column_stack(list(columns.values())), dy, rcond=None)[0]
        fitted = dict(zip(columns, coef.tolist(), strict=True))
        if "threads" in fitted:
            exponents[kind] = round(min(1.0, max(0.0, -fitted["threads"])), 4)
        if "overlap" in fitted:
            interference[kind] = round(max(0.0, fitted["overlap"]), 4)
    return exponents, interference


def _varied(deviations: Sequence[float]) -> bool:
    return int(np.sum(np.abs(np.asarray(deviations)) > 1e-3)) >= THREAD_MIN_STEPS
