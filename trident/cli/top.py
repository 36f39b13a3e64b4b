"""`trident top`: the live view of trident/cli/top_view.py, refreshed until Ctrl-C (or once, with --once)."""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Annotated

import typer
from rich.console import Console
from rich.live import Live
from rich.text import Text

from trident.cli.top_view import Frame, TopError, read_frame, render
from trident.launcher.state import STATE


def default_url() -> str:
    """The gateway `trident up` started from this directory, else TRIDENT_PORT's (compose's) on loopback."""
    try:
        return json.loads(STATE.read_text())["gateway"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"http://127.0.0.1:{os.environ.get('TRIDENT_PORT') or '8000'}"


def top(
    url: Annotated[
        str | None,
        typer.Option(help="The gateway; default: the one `trident up` started here, else $TRIDENT_PORT's."),
    ] = None,
    interval: Annotated[float, typer.Option(min=0.2, help="Seconds between refreshes.")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
    api_key: Annotated[
        str, typer.Option(envvar="TRIDENT_API_KEY", help="Bearer key, if the API asks for one.")
    ] = "",
) -> None:
    """A live view of a running deployment: its instances with roles, load and budgets, each stage's queue,
    TTFT and TBT p50/p90, and the planner's current plan with its predicted goodput. Ctrl-C quits."""
    url = (url or default_url()).rstrip("/")
    console = Console()
    if once:
        try:
            console.print(render(url, read_frame(url, api_key), None))
        except TopError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        return
    earlier: Frame | None = None
    # Ctrl-C quits, even where SIGINT came ignored: a shell starts a background command, or one
    # under nohup, with it ignored, and Python then never raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with Live(Text(f"reading {url} ..."), console=console, auto_refresh=False, screen=False) as live:
        try:
            while True:
                try:
                    frame = read_frame(url, api_key)
                    live.update(render(url, frame, earlier), refresh=True)
                    earlier = frame
                except TopError as exc:
                    why = f"trident top {url}: cannot read the gateway ({exc}); retrying"
                    live.update(Text(why), refresh=True)
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
