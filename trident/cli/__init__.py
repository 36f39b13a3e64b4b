"""The `trident` command line (`trident --help`); the command group is `trident.cli.app:app`.

Nothing is imported here: `trident.cli.up`, which the launcher's tests run on its own, must not pull
in torch and transformers through the other commands."""
