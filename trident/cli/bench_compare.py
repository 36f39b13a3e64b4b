"""`trident bench compare`: Trident's methods, the planner's pick and `transformers serve` on one
checkpoint under one sweep, one after another (docs/benchmarks.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from trident.bench.workload import ARRIVALS
from trident.cli import bench_repeats as opt

DEFAULT_SYSTEMS = "e+p+d,ep+d,ed+p,epd,planner,transformers-serve"


def compare(
    model: Annotated[
        str,
        typer.Option(
            help="A checkpoint directory, or a preset name (tiny-llava, small-llava, ...; `trident "
            "make-model --help` lists them) written to .trident/models/<preset> on first use."
        ),
    ],
    ttft_slo: Annotated[float, typer.Option(help="TTFT SLO, seconds.")],
    tbt_slo: Annotated[float, typer.Option(help="p90 TBT SLO, seconds.")],
    duration: Annotated[float, typer.Option(help="Seconds of arrivals per rate.")],
    sweep: Annotated[str, typer.Option(help="Rates A:B:STEP, requests/s.")],
    systems: Annotated[
        str,
        typer.Option(
            help="Comma-separated: e+p+d, ep+d, ed+p, epd, planner, transformers-serve[-cb], llama.cpp."
        ),
    ] = DEFAULT_SYSTEMS,
    workload: Annotated[str, typer.Option(help="A workload shape (docs/workloads.md).")] = "mix",
    arrivals: Annotated[
        str, typer.Option(help=f"Arrival times: {', '.join(ARRIVALS)} or a file.")
    ] = "poisson",
    out: Annotated[Path, typer.Option(help="Directory for the results, table, plots and logs.")] = Path(
        ".trident/compare"
    ),
    attainment: Annotated[float, typer.Option(min=0.0, max=1.0, help="Attainment goodput needs.")] = 0.9,
    max_output_tokens: Annotated[int | None, typer.Option(min=1, help="Cap on each output.")] = None,
    image_size: Annotated[str | None, typer.Option(help="WxH for every image.")] = None,
    seed: Annotated[int, typer.Option(help="Requests and arrival times depend only on the seed.")] = 0,
    system_prompt_tokens: opt.SystemTokens = 0,
    image_pool: opt.ImagePool = 0,
    pool_share: opt.PoolShare = 0.8,
    turns: opt.Turns = 1,
    think_time: opt.ThinkTime = 0.0,
    image_prob: opt.ImageProb = 0.0,
    image_window: opt.ImageWindow = 0,
) -> None:
    """Start each system in turn, run the sweep against it, stop it; one table, one plot."""
    from common.stats import SLO
    from trident.bench.compare import System
    from trident.bench.compare import compare as run_compare
    from trident.bench.progress import progress_reporter
    from trident.bench.sweep import LoadSpec, parse_rates
    from trident.bench.workload import WorkloadError
    from trident.cli.bench_serve import parse_size

    try:
        slo = SLO(ttft_slo, tbt_slo, attainment)
        chosen = [System.parse(s.strip()) for s in systems.split(",") if s.strip()]
        load = LoadSpec(
            rates=parse_rates(None, sweep), duration=duration, workload=workload, arrivals=arrivals,
            seed=seed, max_output_tokens=max_output_tokens,
            repeats=opt.repeats(seed, system_prompt_tokens, image_pool, pool_share, turns, think_time,
                                image_prob, image_window),
        )  # fmt: skip
        load.entries(load.rates[0])
        size = parse_size(image_size) if image_size else None
    except (ValueError, WorkloadError) as exc:
        raise typer.BadParameter(str(exc)) from None
    from common.models import ModelError, resolve_model

    try:
        model_dir = resolve_model(model, say=typer.echo)
    except ModelError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from None
    from trident.bench.machine import single_thread_gflops

    before = single_thread_gflops()  # this machine's speed varies from run to run: read the ratio beside it
    result = run_compare(chosen, model_dir, load, slo, out, image_size=size, reporter=progress_reporter)
    after = single_thread_gflops()
    machine = {"matmul_gflops_before": round(before, 1), "matmul_gflops_after": round(after, 1)}
    typer.echo((out / "compare.md").read_text())
    typer.echo(f"machine: single-thread fp32 matmul {machine['matmul_gflops_before']} GFLOP/s before, "
               f"{machine['matmul_gflops_after']} after")  # fmt: skip
    typer.echo(json.dumps({**result.to_dict(), "machine": machine, "out": str(out)}))
