"""`trident bench compare`: Trident's methods, the planner's pick and `transformers serve` on one
checkpoint under one sweep, one after another (docs/benchmarks.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from trident.bench.workload import ARRIVALS
from trident.cli import bench_repeats as opt

DEFAULT_SYSTEMS = "e+p+d,ep+d,ed+p,epd,planner,transformers-serve"


# The command's flags, one alias each where the declaration is long, so its signature reads as a table.
Model = Annotated[
    str,
    typer.Option(
        help="A checkpoint directory, or a preset name (tiny-llava, small-llava, ...; `trident "
        "make-model --help` lists them) written to .trident/models/<preset> on first use."
    ),
]
TtftSlo = Annotated[float, typer.Option(help="TTFT SLO, seconds.")]
TbtSlo = Annotated[float, typer.Option(help="p90 TBT SLO, seconds.")]
Duration = Annotated[float, typer.Option(help="Seconds of arrivals per rate.")]
Sweep = Annotated[str, typer.Option(help="Rates A:B:STEP, requests/s.")]
Systems = Annotated[
    str,
    typer.Option(
        help="Comma-separated: e+p+d, ep+d, ed+p, epd, planner, transformers-serve[-cb], llama.cpp."
    ),
]
Workload = Annotated[str, typer.Option(help="A workload shape (docs/workloads.md).")]
Arrivals = Annotated[str, typer.Option(help=f"Arrival times: {', '.join(ARRIVALS)} or a file.")]
Out = Annotated[Path, typer.Option(help="Directory for the results, table, plots and logs.")]
Attainment = Annotated[float, typer.Option(min=0.0, max=1.0, help="Attainment goodput needs.")]
MaxOutputTokens = Annotated[int | None, typer.Option(min=1, help="Cap on each output.")]
ImageSize = Annotated[str | None, typer.Option(help="WxH for every image.")]
Seed = Annotated[int, typer.Option(help="Requests and arrival times depend only on the seed.")]


@dataclass(frozen=True)
class CompareFlags:
    """`trident bench compare`'s flags, as typer parsed them."""

    model: str
    ttft_slo: float
    tbt_slo: float
    duration: float
    sweep: str
    systems: str
    workload: str
    arrivals: str
    out: Path
    attainment: float
    max_output_tokens: int | None
    image_size: str | None
    seed: int
    system_prompt_tokens: int
    image_pool: int
    pool_share: float
    turns: int
    think_time: float
    image_prob: float
    image_window: int


def compare(
    model: Model,
    ttft_slo: TtftSlo,
    tbt_slo: TbtSlo,
    duration: Duration,
    sweep: Sweep,
    systems: Systems = DEFAULT_SYSTEMS,
    workload: Workload = "mix",
    arrivals: Arrivals = "poisson",
    out: Out = Path(".trident/compare"),
    attainment: Attainment = 0.9,
    max_output_tokens: MaxOutputTokens = None,
    image_size: ImageSize = None,
    seed: Seed = 0,
    system_prompt_tokens: opt.SystemTokens = 0,
    image_pool: opt.ImagePool = 0,
    pool_share: opt.PoolShare = 0.8,
    turns: opt.Turns = 1,
    think_time: opt.ThinkTime = 0.0,
    image_prob: opt.ImageProb = 0.0,
    image_window: opt.ImageWindow = 0,
) -> None:
    """Start each system in turn, run the sweep against it, stop it; one table, one plot."""
    flags = CompareFlags(**locals())  # first: locals() holds the flags alone
    from trident.bench.compare import compare as run_compare
    from trident.bench.machine import single_thread_gflops
    from trident.bench.progress import progress_reporter

    chosen, bench = _bench(flags)
    model_dir = _model_dir(model)
    before = single_thread_gflops()  # this machine's speed varies from run to run: read the ratio beside it
    result = run_compare(chosen, model_dir, bench, progress_reporter)
    after = single_thread_gflops()
    machine = {"matmul_gflops_before": round(before, 1), "matmul_gflops_after": round(after, 1)}
    typer.echo((out / "compare.md").read_text())
    typer.echo(
        f"machine: single-thread fp32 matmul {machine['matmul_gflops_before']} GFLOP/s before, "
        f"{machine['matmul_gflops_after']} after"
    )
    typer.echo(json.dumps({**result.to_dict(), "machine": machine, "out": str(out)}))


def _bench(flags: CompareFlags):
    """The systems to start and what they are measured under; a usage error for anything the flags
    get wrong."""
    from common.stats import SLO
    from trident.bench.compare import Bench, System
    from trident.bench.sweep import LoadSpec, parse_rates
    from trident.bench.workload import WorkloadError
    from trident.cli.bench_serve import parse_size

    try:
        slo = SLO(flags.ttft_slo, flags.tbt_slo, flags.attainment)
        chosen = [System.parse(s.strip()) for s in flags.systems.split(",") if s.strip()]
        load = LoadSpec(
            rates=parse_rates(None, flags.sweep),
            duration=flags.duration,
            workload=flags.workload,
            arrivals=flags.arrivals,
            seed=flags.seed,
            max_output_tokens=flags.max_output_tokens,
            repeats=opt.repeats(flags),
        )
        load.entries(load.rates[0])
        size = parse_size(flags.image_size) if flags.image_size else None
    except (ValueError, WorkloadError) as exc:
        raise typer.BadParameter(str(exc)) from None
    return chosen, Bench(load, slo, flags.out, image_size=size)


def _model_dir(model: str) -> Path:
    from common.models import ModelError, resolve_model

    try:
        return resolve_model(model, say=typer.echo)
    except ModelError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from None
