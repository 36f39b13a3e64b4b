"""The `trident` command line (`trident --help`)."""

from trident.cli.app import app

__all__ = ["app"]
