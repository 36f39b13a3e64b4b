"""redis-server from the system (Debian's package), persistence off unless asked for."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from common.infra.process import InfraError, LocalServer
from common.tls import Tls, redis_tls


def redis_server_binary() -> str:
    """Path of redis-server; `make system-deps` installs it with apt when missing."""
    found = shutil.which("redis-server")
    if not found:
        raise InfraError("redis-server not found: run `make system-deps` (apt-get install redis-server)")
    return found


def probe_client(
    host: str, port: int, password: str | None, decode: bool = False, tls: Tls | None = None
) -> redis.Redis:
    """A client for one probe: a second at most, no retries (the caller's loop is the retry, and
    must see each refusal at once)."""
    return redis.Redis(
        host=host,
        port=port,
        password=password,
        socket_timeout=1.0,
        socket_connect_timeout=1.0,
        retry=Retry(NoBackoff(), 0),
        decode_responses=decode,
        **redis_tls(tls, flag=True),
    )


def listen_settings(port: int, tls: Tls | None) -> list[tuple[str, str]]:
    """Where a Redis server or sentinel listens, as (setting, value) pairs for a command line or a
    config file: plain, or (with `tls`) TLS only, every client and replication link showing a
    certificate the deployment's CA signed."""
    if tls is None:
        return [("port", str(port))]
    return [
        ("port", "0"), ("tls-port", str(port)),
        ("tls-cert-file", tls.cert), ("tls-key-file", tls.key), ("tls-ca-cert-file", tls.ca),
        ("tls-auth-clients", "yes"), ("tls-replication", "yes"),
    ]  # fmt: skip


def listen_argv(port: int, tls: Tls | None) -> list[str]:
    """`listen_settings` as redis-server arguments."""
    return [arg for key, value in listen_settings(port, tls) for arg in (f"--{key}", value)]


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
        tls: Tls | None = None,
    ) -> None:
        super().__init__(workdir, port, host)
        self.password = password
        self.tls = tls
        self.appendonly = appendonly
        # Asked at each start: the primary to replicate, or None to start as a primary. A replica
        # group (common/infra/ha.py) answers from its sentinels, so a restarted primary comes back
        # as a replica of the one they promoted instead of an empty primary its replicas copy.
        self.primary: Callable[[], tuple[str, int] | None] = lambda: None

    @property
    def address(self) -> str:
        """The URL without the password: what may be printed or logged."""
        return f"{self.scheme}://{self.host}:{self.port}/0"

    @property
    def scheme(self) -> str:
        return "redis" if self.tls is None else "rediss"

    @property
    def url(self) -> str:
        """Client URL with the password in it, as `redis.asyncio.from_url` takes it."""
        auth = f":{self.password}@" if self.password else ""
        return f"{self.scheme}://{auth}{self.host}:{self.port}/0"

    def argv(self) -> list[str]:
        argv = [
            redis_server_binary(),
            *listen_argv(self.port, self.tls),
            "--bind", self.host,
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--daemonize", "no",
            "--logfile", "",
        ]  # fmt: skip
        primary = self.primary()
        if primary is not None:
            argv += ["--replicaof", *map(str, primary)]
        # A replica's first copy starts at once (Redis waits 5 s for more replicas to share it);
        # a primary lost in those 5 s would leave replicas with nothing.
        argv += ["--repl-diskless-sync-delay", "0"]
        if not self.appendonly:
            # No file, ever: a replica loads its copy straight from the socket, and a copy written by
            # an older version is removed. One left behind was loaded by the next deployment in
            # this folder, with the last one's task claims in it: tasks taken for claimed were dropped.
            argv += ["--repl-diskless-load", "swapdb"]
            (self.workdir / "dump.rdb").unlink(missing_ok=True)
        if self.password:  # from a file only its owner reads, not the command line `ps` shows
            conf = self.workdir / "auth.conf"
            conf.touch(mode=0o600)
            secret = json.dumps(self.password)
            # masterauth too: a replica, or a primary demoted to one, authenticates to its primary.
            conf.write_text(f"requirepass {secret}\nmasterauth {secret}\n")
            argv.insert(1, str(conf))
        return argv

    def replicating(self) -> bool:
        """True if this server is a replica whose copy of its primary is complete and current."""
        client = self._client()
        try:
            found = client.info("replication")
        except redis.RedisError:
            return False
        finally:
            client.close()
        return found.get("role") == "slave" and found.get("master_link_status") == "up"

    def _client(self) -> redis.Redis:
        return probe_client(self.host, self.port, self.password, tls=self.tls)

    def ready(self) -> bool:
        client = self._client()
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()
