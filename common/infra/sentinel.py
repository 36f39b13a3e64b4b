"""redis-server in Sentinel mode: it watches a primary, and with its peers promotes a replica when
the primary stops answering (common/infra/ha.py runs three of them beside a primary and a replica)."""

from __future__ import annotations

import json
from pathlib import Path

import redis

from common.infra.process import LocalServer
from common.infra.redis_server import listen_settings, probe_client, redis_server_binary
from common.infra.settings import SENTINEL
from common.tls import Tls

# How long a primary may be silent before a sentinel calls it down, and how long a failover may take
# before another sentinel tries again: common/infra/settings.py, shared with compose and Kubernetes.
DOWN_AFTER_MS = SENTINEL.down_after_ms
FAILOVER_TIMEOUT_MS = SENTINEL.failover_timeout_ms


class RedisSentinel(LocalServer):
    """One sentinel monitoring `service` at `primary`; `quorum` of them must agree it is down.

    The config file is the sentinel's own: it records there the primary it follows after a failover
    and the peers it has met, so a restarted sentinel keeps what it learned. It is written once.
    """

    name = "sentinel"

    def __init__(
        self,
        primary: tuple[str, int],
        workdir: str | Path | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        password: str | None = None,
        service: str = "trident",
        quorum: int = 2,
        tls: Tls | None = None,
    ) -> None:
        super().__init__(workdir, port, host)
        self.primary = primary
        self.password = password
        self.service = service
        self.quorum = quorum
        self.tls = tls

    def argv(self) -> list[str]:
        conf = self.workdir / "sentinel.conf"
        if not conf.exists():
            conf.touch(mode=0o600)  # it holds the password
            conf.write_text(self._config())
        return [redis_server_binary(), str(conf), "--sentinel"]

    def _config(self) -> str:
        name = self.service
        # With TLS, TLS only: to its clients, its peers and the servers it watches.
        listen = [
            f"{key} {json.dumps(value) if key.endswith('-file') else value}"
            for key, value in listen_settings(self.port, self.tls)
        ]
        lines = [
            *listen,
            f"bind {self.host}",
            "daemonize no",
            'logfile ""',
            f"dir {json.dumps(str(self.workdir))}",
            f"sentinel monitor {name} {self.primary[0]} {self.primary[1]} {self.quorum}",
            *SENTINEL.lines(name),
        ]
        if self.password:
            secret = json.dumps(self.password)
            # The primary's password, this sentinel's own, and the one it gives its peers.
            lines += [f"sentinel auth-pass {name} {secret}", f"requirepass {secret}"]
            lines.append(f"sentinel sentinel-pass {secret}")
        return "\n".join(lines) + "\n"

    def client(self) -> redis.Redis:
        return probe_client(self.host, self.port, self.password, decode=True, tls=self.tls)

    def state(self) -> dict | None:
        """What this sentinel knows of its primary (SENTINEL MASTER), or None if it does not answer."""
        client = self.client()
        try:
            return client.sentinel_master(self.service)
        except redis.RedisError:
            return None
        finally:
            client.close()

    def ready(self) -> bool:
        return self.state() is not None
