"""`trident bench serve`: SLO attainment and goodput of any OpenAI-compatible server under an
open-loop workload (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Annotated

import typer

from trident.bench.progress import progress_reporter
from trident.bench.workload import ARRIVALS
from trident.cli import bench_repeats as opt


def serve(
    url: Annotated[str, typer.Option(help="The server's base URL, e.g. http://127.0.0.1:8000.")],
    ttft_slo: Annotated[float, typer.Option(help="TTFT SLO, seconds.")],
    tbt_slo: Annotated[float, typer.Option(help="p90 TBT SLO, seconds.")],
    duration: Annotated[float, typer.Option(help="Seconds of arrivals per rate.")],
    workload: Annotated[
        str | None, typer.Option(help="A workload shape (docs/workloads.md): mix, textcaps, pope, ...")
    ] = None,
    trace: Annotated[
        Path | None, typer.Option(exists=True, dir_okay=False, help="A trace file (JSONL) to replay.")
    ] = None,
    rate: Annotated[float | None, typer.Option(help="One request rate, requests/s.")] = None,
    sweep: Annotated[str | None, typer.Option(help="Rates A:B:STEP, requests/s.")] = None,
    arrivals: Annotated[
        str, typer.Option(help=f"Arrival times for a workload: {', '.join(ARRIVALS)} or a trace file.")
    ] = "poisson",
    model: Annotated[
        str | None, typer.Option(help="Model name to request; default: the first listed.")
    ] = None,
    out: Annotated[
        Path, typer.Option(help="Directory for results.json, per-request JSONL and plots.")
    ] = Path(".trident/bench"),
    attainment: Annotated[float, typer.Option(min=0.0, max=1.0, help="Attainment goodput needs.")] = 0.9,
    max_output_tokens: Annotated[int | None, typer.Option(min=1, help="Cap on each output.")] = None,
    max_prompt_tokens: Annotated[int | None, typer.Option(min=1, help="Cap on each prompt.")] = None,
    image_size: Annotated[
        str | None, typer.Option(help="WxH for every image; default: each image's size from the workload.")
    ] = None,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos/--no-ignore-eos", help="Ask for exactly the trace's output length.")
    ] = True,
    seed: Annotated[int, typer.Option(help="Requests and arrival times depend only on the seed.")] = 0,
    system_prompt_tokens: opt.SystemTokens = 0,
    image_pool: opt.ImagePool = 0,
    pool_share: opt.PoolShare = 0.8,
    turns: opt.Turns = 1,
    think_time: opt.ThinkTime = 0.0,
    image_prob: opt.ImageProb = 0.0,
    image_window: opt.ImageWindow = 0,
    api_key: Annotated[
        str, typer.Option(envvar="OPENAI_API_KEY", help="Bearer key, if the server wants one.")
    ] = "",
    name: Annotated[str, typer.Option(help="Label for this system in tables and plots.")] = "server",
    every_rate: Annotated[
        bool, typer.Option("--every-rate", help="Run every rate; default: stop after one misses the SLO.")
    ] = False,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            file_okay=False,
            help="The served checkpoint's directory: with it, each rate also reports the prompt tokens an "
            "unbounded prefix cache would compute (the ideal its reuse is judged by).",
        ),
    ] = None,
    block_size: Annotated[
        int, typer.Option(min=1, help="The server's KV block size, for the ideal (Trident's default: 16).")
    ] = 16,
) -> None:
    """Open-loop streaming load at each rate; per-request TTFT, TBTs and end-to-end latency; SLO
    attainment per rate and goodput over the sweep."""
    from common.stats import SLO
    from trident.bench import client
    from trident.bench.sweep import LoadSpec, parse_rates, run_sweep
    from trident.bench.workload import WorkloadError

    try:
        slo = SLO(ttft_slo, tbt_slo, attainment)
        if workload is None and trace is None:
            workload = "mix"
        load = LoadSpec(
            rates=parse_rates(rate, sweep),
            duration=duration,
            workload=workload if trace is None else None,
            trace=trace,
            arrivals=arrivals,
            seed=seed,
            max_prompt_tokens=max_prompt_tokens,
            max_output_tokens=max_output_tokens,
            repeats=opt.repeats(
                seed,
                system_prompt_tokens,
                image_pool,
                pool_share,
                turns,
                think_time,
                image_prob,
                image_window,
            ),
        )
        size = parse_size(image_size) if image_size else None
        load.entries(load.rates[0])  # a bad workload or trace fails now, before any load is sent
    except (ValueError, WorkloadError) as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        model = model or asyncio.run(client.served_model(url, api_key))
    except Exception as exc:
        typer.echo(f"error: cannot list models at {url}/v1/models: {exc}", err=True)
        raise typer.Exit(2) from None
    opts = client.RequestOptions(model=model, ignore_eos=ignore_eos, image_size=size, seed=seed)
    meter = reuse_meter(url, api_key, checkpoint, block_size)
    with progress_reporter(name) as (on_start, on_done, on_rate):
        result = run_sweep(
            name, url, model, load, slo, out,
            options=opts, api_key=api_key, on_start=on_start, on_done=on_done, on_rate=on_rate,
            every_rate=every_rate, meter=meter,
        )  # fmt: skip
    typer.echo(
        f"goodput: {result.goodput:g} req/s at {100 * slo.attainment:g} % attainment; results in {out}"
    )
    typer.echo(json.dumps({**result.to_dict(), "out": str(out)}))


def reuse_meter(url: str, api_key: str, checkpoint: Path | None, block_size: int):
    """What measures each rate's reuse (trident/bench/reuse.py): a Trident deployment's own counts
    when the server is one (it answers /v1/cluster), the ideal when the checkpoint is given."""
    from trident.bench.reuse import IdealCache, ReuseMeter, cluster_counts

    try:
        cluster_counts(url, api_key)
        trident = url
    except Exception:  # not Trident, or not telling: the client's own figures only
        trident = None
    try:
        ideal = IdealCache(checkpoint, block_size) if checkpoint else None
    except Exception as exc:
        raise typer.BadParameter(f"--checkpoint {checkpoint}: {exc}") from None
    return ReuseMeter(trident, api_key, ideal)


def parse_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--image-size takes WxH, e.g. 336x336; got {text!r}") from None
    if w < 1 or h < 1:
        raise ValueError(f"--image-size must be positive, got {text!r}")
    return w, h
