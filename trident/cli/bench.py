"""`trident bench`: the commands."""

from __future__ import annotations

import typer

from trident.cli.bench_compare import compare
from trident.cli.bench_serve import serve

bench_app = typer.Typer(
    help="Measure SLO attainment and goodput of OpenAI-compatible servers (docs/benchmarks.md).",
    no_args_is_help=True,
)
bench_app.command("serve", epilog="The last line of output is one JSON object: the whole result.")(serve)
bench_app.command("compare", epilog="The last line of output is one JSON object: every system's results.")(
    compare
)
