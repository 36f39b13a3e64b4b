"""`trident certs`: a private CA for one deployment and the certificate its processes share."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from common.certs import issue
from common.tls import FILES


def certs(
    out: Annotated[Path, typer.Argument(metavar="DIR", help="Where to write ca.pem, cert.pem and key.pem.")],
    host: Annotated[
        list[str] | None,
        typer.Option(
            help="A name or address the certificate also carries (repeat it). Trident's own processes "
            "check only that a certificate is the deployment CA's, so names matter only to other clients."
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace the files if DIR holds them.")] = False,
) -> None:
    """Write a deployment's TLS folder (TRIDENT_TLS_DIR). The CA's key is not kept: nothing more can
    be signed, so adding a host means a new folder, rolled out to every process."""
    found = [name for name in FILES if (out / name).exists()]
    if found and not force:
        raise typer.BadParameter(f"{out} holds {', '.join(found)} already; pass --force to replace them")
    tls = issue(out, host or [])
    typer.echo(f"wrote {tls.ca}, {tls.cert} and {tls.key} (the key readable by its owner only)")
    typer.echo(f"every process: TRIDENT_TLS_DIR={tls.folder}")
    typer.echo("Kubernetes: `trident kubernetes` gives every pod its own key from cert-manager instead")
