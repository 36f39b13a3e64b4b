"""redis-server from the system (Debian's package), persistence off unless asked for."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from common.infra.process import InfraError, LocalServer


def redis_server_binary() -> str:
    """Path of redis-server; `make system-deps` installs it with apt when missing."""
    found = shutil.which("redis-server")
    if not found:
        raise InfraError("redis-server not found: run `make system-deps` (apt-get install redis-server)")
    return found


class RedisServer(LocalServer):
    """redis-server on a loopback port with an optional password.

    Redis holds metadata that services rewrite on their own (heartbeats, feature index), so
    persistence is off by default and a restart starts empty; `appendonly=True` turns AOF on.
    """

    name = "redis"

    def __init__(
        self,
        workdir: str | Path | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        password: str | None = None,
        appendonly: bool = False,
    ) -> None:
        super().__init__(workdir, port, host)
        self.password = password
        self.appendonly = appendonly

    @property
    def address(self) -> str:
        """The URL without the password: what may be printed or logged."""
        return f"redis://{self.host}:{self.port}/0"

    @property
    def url(self) -> str:
        """Client URL with the password in it, as `redis.asyncio.from_url` takes it."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def argv(self) -> list[str]:
        argv = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--daemonize", "no",
            "--logfile", "",
        ]  # fmt: skip
        if self.password:  # from a file only its owner reads, not the command line `ps` shows
            conf = self.workdir / "auth.conf"
            conf.touch(mode=0o600)
            conf.write_text(f"requirepass {json.dumps(self.password)}\n")
            argv.insert(1, str(conf))
        return argv

    def ready(self) -> bool:
        # No client-side retries: the readiness loop is the retry, and it must see each refusal at once.
        client = redis.Redis(
            host=self.host,
            port=self.port,
            password=self.password,
            socket_timeout=1.0,
            retry=Retry(NoBackoff(), 0),
        )
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()
