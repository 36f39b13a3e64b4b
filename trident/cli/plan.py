"""`trident plan`: offline planning of a trace file — which method and split of N instances serves the
most requests per second within the SLOs, or (`--rate`) how many instances a load needs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

DEFAULT_PROFILE = "paper:llava-1.5-7b"


def plan(
    trace: Annotated[
        Path,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="Trace file (JSONL, docs/workloads.md), e.g. GET /plan/trace from a deployment's planner.",
        ),
    ],
    ttft_slo: Annotated[float, typer.Option(help="Time-to-first-token SLO, seconds.")],
    tbt_slo: Annotated[float, typer.Option(help="Time-between-tokens SLO, seconds.")],
    instances: Annotated[
        int | None, typer.Option(min=3, help="Instances to partition among the three stages.")
    ] = None,
    rate: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Instead of --instances: the load (req/s) to serve; plans the fewest instances that do.",
        ),
    ] = None,
    max_instances: Annotated[
        int, typer.Option(min=3, help="With --rate: the most instances to consider.")
    ] = 64,
    budget: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="With --rate: cores (or GPUs) all instances may take together; 0 or unset: no budget.",
        ),
    ] = None,
    instance_cost: Annotated[
        float,
        typer.Option(help="With --rate: cores (or GPUs) one instance takes of the budget; above 0."),
    ] = 1.0,
    min_replicas: Annotated[
        str, typer.Option(help="With --rate: per-kind minimum, e.g. d=1,ep=1 (kinds: e p d ep ed epd).")
    ] = "",
    max_replicas: Annotated[str, typer.Option(help="With --rate: per-kind maximum, e.g. e=2,d=8.")] = "",
    profile: Annotated[
        str | None,
        typer.Option(
            help="Stage profiles: a ProfileSet JSON file, or paper:<model> (the papers' GPU figures). "
            f"Default: the profiles the trace's header carries, else {DEFAULT_PROFILE}.",
            show_default=False,
        ),
    ] = None,
    calibration: Annotated[
        bool,
        typer.Option(
            "--calibration/--no-calibration",
            help="Fit the header's profiles to the steps its deployment ran in service, as its planner did.",
        ),
    ] = True,
    attainment: Annotated[
        float, typer.Option(help="Share of requests that must meet both SLOs, in (0, 1].")
    ] = 0.9,
    exhaustive: Annotated[
        bool | None,
        typer.Option(
            "--exhaustive/--neighbours",
            help="Simulate every split, or the partition and its neighbours; default: every split up to 16.",
            show_default=False,
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (the whole result) instead of the table.")
    ] = False,
) -> None:
    """Plan a deployment for a trace: simulate E+P+D, EP+D and ED+P splits and report each one's goodput;
    with --rate, first find how many instances serve that load."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from common.planner.algorithm import plan as make_plan
    from common.planner.capacity import recommend
    from common.planner.limits import Limits, parse_counts
    from common.planner.profiles import ProfileError
    from common.planner.sizing import OutOfReach
    from common.planner.trace import TraceError, read_trace
    from common.stats import SLO

    if instance_cost <= 0:
        raise typer.BadParameter(
            f"{instance_cost:g}: one instance takes more than 0", param_hint="--instance-cost"
        )
    try:
        recorded = read_trace(trace)
        entries = recorded.entries
        profiles, source = trace_profiles(recorded.meta, profile, calibration)
        slo = SLO(ttft_slo, tbt_slo, attainment)
        limits = Limits(
            minimum=parse_counts(min_replicas, "--min-replicas"),
            maximum=parse_counts(max_replicas, "--max-replicas"),
            budget=budget or None,
            cost=instance_cost,
            max_instances=max_instances,
        )
    except (TraceError, ProfileError, ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)  # one line, not wrapped to the terminal
        raise typer.Exit(2) from None
    if (instances is None) == (rate is None):
        typer.echo(
            "error: give --instances (split them) or --rate (how many a load needs), not both", err=True
        )
        raise typer.Exit(2)
    if len(entries) < 2:
        typer.echo(f"error: {trace} holds {len(entries)} request(s); a plan needs at least 2", err=True)
        raise typer.Exit(2)
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"))
    with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("planning", total=1.0)

        def progress(fraction: float, message: str) -> None:
            bar.update(task, completed=fraction, description=message)

        capacity = None
        if rate is None:
            result = make_plan(entries, profiles, slo, instances, exhaustive=exhaustive, progress=progress)
        else:  # the continuous planner's code path (services/planner/capacity.py), at a given rate
            try:
                capacity = recommend(
                    entries, profiles, slo, rate, limits, exhaustive=exhaustive, progress=progress
                )
            except (OutOfReach, ValueError) as exc:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(1) from None
            if capacity.short:
                typer.echo(f"error: {capacity.short}", err=True)
                raise typer.Exit(1)
            result = capacity.sizing.result
    result.inputs["profiles"] = source
    if as_json:
        body = (
            result.to_dict()
            if capacity is None
            else {**capacity.sizing.to_dict(), "capacity": capacity.to_dict()}
        )
        typer.echo(json.dumps(body, default=_plain))
        return
    _print_table(result, len(entries), source)
    if capacity is not None:
        tried = ", ".join(f"{n}: {g:.3f}" for n, g in sorted(capacity.sizing.tried.items()))
        typer.echo(
            f"instances: {capacity.sizing.instances}, the fewest whose best split serves {rate:g} req/s"
        )
        typer.echo(f"best goodput (req/s) by instance count: {tried}")


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
