"""The fast tier's guard (tests/tiers.py): what counts as starting a deployment, and that a test not
marked slow cannot start one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.tiers import starts_a_deployment

PY = sys.executable


@pytest.mark.parametrize(
    ("argv", "deployment"),
    [
        ([PY, "-m", "services.worker"], True),
        ([PY, "-m", "services.gateway"], True),
        ([PY, "-m", "celery", "--app=services.planner.jobs", "worker"], True),
        (["/venv/bin/trident", "up", "--model", "m"], True),
        ([PY, "-c", "from trident.cli.app import app; app(prog_name='trident')", "up", "--model", "m"], True),
        ([PY, "-c", "import typer; from trident.cli.up import up; typer.run(up)", "--model", "m"], True),
        (["docker", "compose", "-p", "x", "-f", "compose.yaml", "up", "-d"], True),
        ([PY, "-m", "transformers.cli.transformers", "serve", "m"], True),
        (["/venv/bin/trident", "top", "--once"], False),
        (["docker", "info"], False),
        (["nats-server", "-c", "nats.conf"], False),
        ([PY, "-c", "import time; time.sleep(60)"], False),
        ([], False),
    ],
)
def test_what_starts_a_deployment(argv: list[str], deployment: bool) -> None:
    assert starts_a_deployment(argv) is deployment


def test_a_test_not_marked_slow_cannot_start_a_deployment() -> None:
    with pytest.raises(RuntimeError, match="is not marked slow"):
        subprocess.Popen([PY, "-m", "services.worker"])
