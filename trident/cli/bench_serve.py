"""`trident bench serve`: SLO attainment and goodput of any OpenAI-compatible server under an
open-loop workload (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from trident.bench.progress import progress_reporter
from trident.bench.workload import ARRIVALS
from trident.cli import bench_repeats as opt

# The command's flags, one alias each where the declaration is long, so its signature reads as a table.
Url = Annotated[str, typer.Option(help="The server's base URL, e.g. http://127.0.0.1:8000.")]
TtftSlo = Annotated[float, typer.Option(help="TTFT SLO, seconds.")]
TbtSlo = Annotated[float, typer.Option(help="p90 TBT SLO, seconds.")]
Duration = Annotated[float, typer.Option(help="Seconds of arrivals per rate.")]
Workload = Annotated[
    str | None, typer.Option(help="A workload shape (docs/workloads.md): mix, textcaps, pope, ...")
]
Trace = Annotated[
    Path | None, typer.Option(exists=True, dir_okay=False, help="A trace file (JSONL) to replay.")
]
Rate = Annotated[float | None, typer.Option(help="One request rate, requests/s.")]
Sweep = Annotated[str | None, typer.Option(help="Rates A:B:STEP, requests/s.")]
Arrivals = Annotated[
    str, typer.Option(help=f"Arrival times for a workload: {', '.join(ARRIVALS)} or a trace file.")
]
Model = Annotated[str | None, typer.Option(help="Model name to request; default: the first listed.")]
Out = Annotated[Path, typer.Option(help="Directory for results.json, per-request JSONL and plots.")]
Attainment = Annotated[float, typer.Option(min=0.0, max=1.0, help="Attainment goodput needs.")]
MaxOutputTokens = Annotated[int | None, typer.Option(min=1, help="Cap on each output.")]
MaxPromptTokens = Annotated[int | None, typer.Option(min=1, help="Cap on each prompt.")]
ImageSize = Annotated[
    str | None, typer.Option(help="WxH for every image; default: each image's size from the workload.")
]
IgnoreEos = Annotated[
    bool, typer.Option("--ignore-eos/--no-ignore-eos", help="Ask for exactly the trace's output length.")
]
Seed = Annotated[int, typer.Option(help="Requests and arrival times depend only on the seed.")]
ApiKey = Annotated[str, typer.Option(envvar="OPENAI_API_KEY", help="Bearer key, if the server wants one.")]
Name = Annotated[str, typer.Option(help="Label for this system in tables and plots.")]
EveryRate = Annotated[
    bool, typer.Option("--every-rate", help="Run every rate; default: stop after one misses the SLO.")
]
Checkpoint = Annotated[
    Path | None,
    typer.Option(
        exists=True,
        file_okay=False,
        help="The served checkpoint's directory: with it, each rate also reports the prompt tokens an "
        "unbounded prefix cache would compute (the ideal its reuse is judged by).",
    ),
]
BlockSize = Annotated[
    int, typer.Option(min=1, help="The server's KV block size, for the ideal (Trident's default: 16).")
]


@dataclass(frozen=True)
class ServeFlags:
    """`trident bench serve`'s flags, as typer parsed them."""

    url: str
    ttft_slo: float
    tbt_slo: float
    duration: float
    workload: str | None
    trace: Path | None
    rate: float | None
    sweep: str | None
    arrivals: str
    model: str | None
    out: Path
    attainment: float
    max_output_tokens: int | None
    max_prompt_tokens: int | None
    image_size: str | None
    ignore_eos: bool
    seed: int
    system_prompt_tokens: int
    image_pool: int
    pool_share: float
    turns: int
    think_time: float
    image_prob: float
    image_window: int
    api_key: str
    name: str
    every_rate: bool
    checkpoint: Path | None
    block_size: int


def serve(
    url: Url,
    ttft_slo: TtftSlo,
    tbt_slo: TbtSlo,
    duration: Duration,
    workload: Workload = None,
    trace: Trace = None,
    rate: Rate = None,
    sweep: Sweep = None,
    arrivals: Arrivals = "poisson",
    model: Model = None,
    out: Out = Path(".trident/bench"),
    attainment: Attainment = 0.9,
    max_output_tokens: MaxOutputTokens = None,
    max_prompt_tokens: MaxPromptTokens = None,
    image_size: ImageSize = None,
    ignore_eos: IgnoreEos = True,
    seed: Seed = 0,
    system_prompt_tokens: opt.SystemTokens = 0,
    image_pool: opt.ImagePool = 0,
    pool_share: opt.PoolShare = 0.8,
    turns: opt.Turns = 1,
    think_time: opt.ThinkTime = 0.0,
    image_prob: opt.ImageProb = 0.0,
    image_window: opt.ImageWindow = 0,
    api_key: ApiKey = "",
    name: Name = "server",
    every_rate: EveryRate = False,
    checkpoint: Checkpoint = None,
    block_size: BlockSize = 16,
) -> None:
    """Open-loop streaming load at each rate; per-request TTFT, TBTs and end-to-end latency; SLO
    attainment per rate and goodput over the sweep."""
    flags = ServeFlags(**locals())  # first: locals() holds the flags alone
    from trident.bench.sweep import Target, run_sweep

    load, slo, options = _load(flags)
    meter = reuse_meter(url, api_key, checkpoint, block_size)
    target = Target(name, url, options.model, out, api_key=api_key, options=options, meter=meter)
    with progress_reporter(name) as hooks:
        result = run_sweep(target, load, slo, hooks, every_rate=every_rate)
    typer.echo(
        f"goodput: {result.goodput:g} req/s at {100 * slo.attainment:g} % attainment; results in {out}"
    )
    typer.echo(json.dumps({**result.to_dict(), "out": str(out)}))


def _load(flags: ServeFlags):
    """What to send, the SLOs, and how each request is made (the model the server lists first,
    unless --model names one); a usage error for anything the flags get wrong."""
    from common.stats import SLO
    from trident.bench import client
    from trident.bench.sweep import LoadSpec, parse_rates
    from trident.bench.workload import WorkloadError

    try:
        slo = SLO(flags.ttft_slo, flags.tbt_slo, flags.attainment)
        load = LoadSpec(
            rates=parse_rates(flags.rate, flags.sweep),
            duration=flags.duration,
            workload=None if flags.trace is not None else "mix" if flags.workload is None else flags.workload,
            trace=flags.trace,
            arrivals=flags.arrivals,
            seed=flags.seed,
            max_prompt_tokens=flags.max_prompt_tokens,
            max_output_tokens=flags.max_output_tokens,
            repeats=opt.repeats(flags),
        )
        size = parse_size(flags.image_size) if flags.image_size else None
        load.entries(load.rates[0])  # a bad workload or trace fails now, before any load is sent
    except (ValueError, WorkloadError) as exc:
        raise typer.BadParameter(str(exc)) from None
    try:
        model = flags.model or asyncio.run(client.served_model(flags.url, flags.api_key))
    except Exception as exc:
        typer.echo(f"error: cannot list models at {flags.url}/v1/models: {exc}", err=True)
        raise typer.Exit(2) from None
    options = client.RequestOptions(
        model=model, ignore_eos=flags.ignore_eos, image_size=size, seed=flags.seed
    )
    return load, slo, options


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
