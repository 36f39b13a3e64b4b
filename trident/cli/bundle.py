"""`trident bundle`: the offline bundle for a GPU machine without network (trident/bundle/)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from trident.bundle import DEFAULT_DIR, GPU_PYTHON


def bundle(
    folder: Annotated[
        Path,
        typer.Option("--dir", help="Where the bundle goes (replaced); default: the checkout's .bundle/."),
    ] = DEFAULT_DIR,
    python: Annotated[
        str, typer.Option(help="The GPU machine's Python, major.minor.micro (wheels and markers follow it).")
    ] = GPU_PYTHON,
) -> None:
    """Download what a GPU machine without network needs beside its PyTorch and transformers (the
    services' wheels, nats-server, redis-server) for its Python, into one folder of at most 45 MiB;
    there, `python3 -m trident.bundle install --target DIR` installs it (docs/running.md)."""
    from trident.bundle.__main__ import describe
    from trident.bundle.build import BundleError, build

    try:
        manifest = build(folder, python)
    except BundleError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(describe(manifest, folder))
