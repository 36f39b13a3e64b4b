"""The deployment's secrets are made so that every reader takes them as plain strings: nats-server
parses its token from the environment as a config value (a token that began "2025-" was read as a
date and NATS did not start, once in a Docker run)."""

from __future__ import annotations

import os
import re
import stat
import subprocess

from common.infra.nats_server import nats_server_binary
from common.secrets import DeploymentSecrets, new_secret


def test_each_secret_is_a_letter_then_hex_and_readable_by_its_owner_only(tmp_path):
    made = DeploymentSecrets.ensure(tmp_path / "secrets")
    values = [made.nats_token, made.redis_password, made.transfer_secret, made.planner_key]
    assert len(set(values)) == 4
    assert all(re.fullmatch(r"s[0-9a-f]{48}", v) for v in values)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in (tmp_path / "secrets").iterdir())
    assert DeploymentSecrets.ensure(tmp_path / "secrets") == made  # made once, then kept


def test_nats_takes_any_token_the_way_compose_gives_it(tmp_path):
    """compose.yaml's nats-server reads `token: $NATS_TOKEN` from its environment; `-t` checks the
    config as it would start. A date-like token fails so; every secret made here passes."""
    conf = tmp_path / "nats.conf"
    conf.write_text("authorization {\n  token: $NATS_TOKEN\n}\n")

    def valid(token: str) -> bool:
        env = {**os.environ, "NATS_TOKEN": token}
        done = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], env=env, capture_output=True)
        return done.returncode == 0

    assert not valid("2025-01-01abc")  # what token_urlsafe could make, and NATS refused
    assert all(valid(new_secret()) for _ in range(20))
