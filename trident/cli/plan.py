"""`trident plan`: offline planning of a trace file — which method and split of N instances serves the
most requests per second within the SLOs, or (`--rate`) how many instances a load needs."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

DEFAULT_PROFILE = "paper:llava-1.5-7b"

# The command's flags, one alias each, so its signature reads as the table of them.
TraceFile = Annotated[
    Path,
    typer.Option(
        exists=True,
        dir_okay=False,
        help="Trace file (JSONL, docs/workloads.md), e.g. GET /plan/trace from a deployment's planner.",
    ),
]
TtftSlo = Annotated[float, typer.Option(help="Time-to-first-token SLO, seconds.")]
TbtSlo = Annotated[float, typer.Option(help="Time-between-tokens SLO, seconds.")]
Instances = Annotated[int | None, typer.Option(min=3, help="Instances to partition among the three stages.")]
Rate = Annotated[
    float | None,
    typer.Option(
        min=0.0, help="Instead of --instances: the load (req/s) to serve; plans the fewest instances that do."
    ),
]
MaxInstances = Annotated[int, typer.Option(min=3, help="With --rate: the most instances to consider.")]
Budget = Annotated[
    float | None,
    typer.Option(
        min=0.0, help="With --rate: cores (or GPUs) all instances may take together; 0 or unset: no budget."
    ),
]
InstanceCost = Annotated[
    float, typer.Option(help="With --rate: cores (or GPUs) one instance takes of the budget; above 0.")
]
MinReplicas = Annotated[
    str, typer.Option(help="With --rate: per-kind minimum, e.g. d=1,ep=1 (kinds: e p d ep ed epd).")
]
MaxReplicas = Annotated[str, typer.Option(help="With --rate: per-kind maximum, e.g. e=2,d=8.")]
Profile = Annotated[
    str | None,
    typer.Option(
        help="Stage profiles: a ProfileSet JSON file, or paper:<model> (the papers' GPU figures). "
        f"Default: the profiles the trace's header carries, else {DEFAULT_PROFILE}.",
        show_default=False,
    ),
]
Calibration = Annotated[
    bool,
    typer.Option(
        "--calibration/--no-calibration",
        help="Fit the header's profiles to the steps its deployment ran in service, as its planner did.",
    ),
]
Attainment = Annotated[float, typer.Option(help="Share of requests that must meet both SLOs, in (0, 1].")]
Exhaustive = Annotated[
    bool | None,
    typer.Option(
        "--exhaustive/--neighbours",
        help="Simulate every split, or the partition and its neighbours; default: every split up to 16.",
        show_default=False,
    ),
]
AsJson = Annotated[
    bool, typer.Option("--json", help="Print one JSON object (the whole result) instead of the table.")
]


@dataclass(frozen=True)
class PlanFlags:
    """`trident plan`'s flags, as typer parsed them."""

    trace: Path
    ttft_slo: float
    tbt_slo: float
    instances: int | None
    rate: float | None
    max_instances: int
    budget: float | None
    instance_cost: float
    min_replicas: str
    max_replicas: str
    profile: str | None
    calibration: bool
    attainment: float
    exhaustive: bool | None
    as_json: bool


def plan(
    trace: TraceFile,
    ttft_slo: TtftSlo,
    tbt_slo: TbtSlo,
    instances: Instances = None,
    rate: Rate = None,
    max_instances: MaxInstances = 64,
    budget: Budget = None,
    instance_cost: InstanceCost = 1.0,
    min_replicas: MinReplicas = "",
    max_replicas: MaxReplicas = "",
    profile: Profile = None,
    calibration: Calibration = True,
    attainment: Attainment = 0.9,
    exhaustive: Exhaustive = None,
    as_json: AsJson = False,
) -> None:
    """Plan a deployment for a trace: simulate E+P+D, EP+D and ED+P splits and report each one's goodput;
    with --rate, first find how many instances serve that load."""
    flags = PlanFlags(**locals())  # first: locals() holds the flags alone
    inputs = _inputs(flags)
    with _progress_bar() as progress:
        result, capacity = _plan(flags, inputs, progress)
    result.inputs["profiles"] = inputs.source
    if as_json:
        body = (
            result.to_dict()
            if capacity is None
            else {**capacity.sizing.to_dict(), "capacity": capacity.to_dict()}
        )
        typer.echo(json.dumps(body, default=_plain))
        return
    _print_table(result, len(inputs.entries), inputs.source)
    if capacity is not None:
        tried = ", ".join(f"{n}: {g:.3f}" for n, g in sorted(capacity.sizing.tried.items()))
        typer.echo(
            f"instances: {capacity.sizing.instances}, the fewest whose best split serves {rate:g} req/s"
        )
        typer.echo(f"best goodput (req/s) by instance count: {tried}")


@dataclass(frozen=True)
class PlanInputs:
    """What the flags name, read and checked: the trace's requests, the profiles (and a line saying
    which), the SLOs and, with --rate, the limits on the instances."""

    entries: list
    profiles: Any
    source: str
    slo: Any
    limits: Any


def _inputs(flags: PlanFlags) -> PlanInputs:
    """The inputs the flags name; a usage error (exit 2) for anything they get wrong."""
    from common.planner.limits import Limits, parse_counts
    from common.planner.profiles import ProfileError
    from common.planner.trace import TraceError, read_trace
    from common.stats import SLO

    if flags.instance_cost <= 0:
        raise typer.BadParameter(
            f"{flags.instance_cost:g}: one instance takes more than 0", param_hint="--instance-cost"
        )
    try:
        recorded = read_trace(flags.trace)
        profiles, source = trace_profiles(recorded.meta, flags.profile, flags.calibration)
        slo = SLO(flags.ttft_slo, flags.tbt_slo, flags.attainment)
        limits = Limits(
            minimum=parse_counts(flags.min_replicas, "--min-replicas"),
            maximum=parse_counts(flags.max_replicas, "--max-replicas"),
            budget=flags.budget or None,
            cost=flags.instance_cost,
            max_instances=flags.max_instances,
        )
    except (TraceError, ProfileError, ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)  # one line, not wrapped to the terminal
        raise typer.Exit(2) from None
    if (flags.instances is None) == (flags.rate is None):
        typer.echo(
            "error: give --instances (split them) or --rate (how many a load needs), not both", err=True
        )
        raise typer.Exit(2)
    entries = recorded.entries
    if len(entries) < 2:
        typer.echo(f"error: {flags.trace} holds {len(entries)} request(s); a plan needs at least 2", err=True)
        raise typer.Exit(2)
    return PlanInputs(entries, profiles, source, slo, limits)


@contextmanager
def _progress_bar() -> Iterator[Callable[[float, str], None]]:
    """A bar on stderr (stdout keeps the table or the JSON line) and the callback that moves it."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"))
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("planning", total=1.0)

        def progress(fraction: float, message: str) -> None:
            bar.update(task, completed=fraction, description=message)

        yield progress


def _plan(flags: PlanFlags, inputs: PlanInputs, progress: Callable[[float, str], None]):
    """The plan at --instances; or, at --rate, the continuous planner's sizing (services/planner/
    capacity.py) and the plan of the count it picks. Exit 1 when no count serves the rate."""
    from common.planner.algorithm import plan as make_plan
    from common.planner.capacity import recommend
    from common.planner.sizing import OutOfReach

    if flags.rate is None:
        result = make_plan(
            inputs.entries,
            inputs.profiles,
            inputs.slo,
            flags.instances,
            exhaustive=flags.exhaustive,
            progress=progress,
        )
        return result, None
    try:
        capacity = recommend(
            inputs.entries,
            inputs.profiles,
            inputs.slo,
            flags.rate,
            inputs.limits,
            exhaustive=flags.exhaustive,
            progress=progress,
        )
    except (OutOfReach, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if capacity.short:
        typer.echo(f"error: {capacity.short}", err=True)
        raise typer.Exit(1)
    return capacity.sizing.result, capacity


def trace_profiles(header: dict, profile: str | None, calibrate: bool):
    """The profiles to plan with and a line saying which: `profile` when given; else the ones a
    trace's header carries (GET /plan/trace, bench/planner_validation.py), fitted to the header's
    service calibration unless `calibrate` is off; else DEFAULT_PROFILE."""
    from common.planner.calibrate import ServiceCalibration
    from common.planner.paper_profiles import profiles_from
    from common.planner.profiles import ProfileError, ProfileSet

    if profile is not None or not header.get("profiles"):
        profiles = profiles_from(profile or DEFAULT_PROFILE)
        return profiles, profiles.source or profile or DEFAULT_PROFILE
    try:
        profiles = ProfileSet.from_dict(header["profiles"])
        fitted = (
            ServiceCalibration(**header["calibration"]) if calibrate and header.get("calibration") else None
        )
    except (TypeError, KeyError, ValueError) as exc:
        raise ProfileError(f"the trace header's profiles or calibration are malformed: {exc}") from None
    if fitted is None:
        return profiles, "the trace's header"
    factors = ", ".join(f"{stage} ×{f:g}" for stage, f in sorted(fitted.factors.items())) or "none fitted"
    if fitted.step_gap:
        factors += f"; {fitted.step_gap * 1000:.1f} ms between steps"
    return fitted.apply(profiles), f"the trace's header, calibrated from service ({factors})"


def _plain(obj: object) -> object:
    """numpy scalars as plain numbers."""
    return obj.item() if hasattr(obj, "item") else str(obj)


def _print_table(result, requests: int, source: str) -> None:
    from rich.console import Console
    from rich.table import Table

    slo = result.inputs.get("slo", {})
    table = Table(title=f"{requests} requests, {result.inputs.get('instances')} instances, profiles {source}")
    for name in ("", "deployment", "method", "goodput (req/s)", "attainment", "TTFT p90 (s)", "TBT p90 (s)"):
        table.add_column(name, justify="left" if name in ("", "deployment", "method") else "right")
    for c in result.candidates:
        chosen = c.deployment == result.deployment
        table.add_row(
            "*" if chosen else "",
            c.deployment.label,
            c.deployment.method,
            f"≤ {c.bound:.3f}" if c.pruned else f"{c.goodput:.3f}",
            "pruned" if c.pruned else f"{c.attainment:.1%}",
            _maybe(c.ttft_p90),
            _maybe(c.tbt_p90),
            style="bold" if chosen else None,
        )
    out = Console()
    out.print(table)
    out.print(
        f"plan: {result.deployment.label} ({result.deployment.method}), {result.goodput:.3f} req/s with "
        f"{result.attainment:.1%} of requests within TTFT {slo.get('ttft')} s and TBT {slo.get('tbt')} s",
        highlight=False,
    )
    if (runner := result.runner_up) is not None:
        out.print(
            f"runner-up: {runner.deployment.label} ({runner.deployment.method}), {runner.goodput:.3f} req/s, "
            f"{result.margin:.1%} below the pick",
            highlight=False,
        )


def _maybe(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
