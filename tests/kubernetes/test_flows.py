"""The rendered NetworkPolicies against every flow the services use, for every method, with and
without TLS, on CPUs and GPUs: each flow the code needs is allowed, every other connection between
the deployment's pods (and to or from outside) is denied (netpol.py evaluates the policies).

The flows are read off the rendered pods as the services will: each container's environment parsed
by the service's own settings class (the ports it binds, the NATS and Redis URLs it dials), the
Services those URLs name, the NATS config and Redis scripts (the ports the servers listen on), the
ServiceMonitors (what Prometheus scrapes). Who pulls tensors from whom is flows.PULLS_FROM, the one
place it is declared. An image request across policy-separated pods is run for real: the gateway's
and a worker's transfer endpoints, built by the services' own code from the rendered settings,
listen on the ports the policies open to the stages that pull from them."""

from __future__ import annotations

import asyncio
import itertools
import re

import pytest
from prometheus_client import Gauge

from common.planner.types import METHOD_KINDS
from common.roles import parse_roles
from common.store.connect import sentinel_target
from common.transfer import create_backend
from services.gateway.state import Links
from services.settings import GatewaySettings, WorkerSettings
from services.worker.instance import transfer_config
from tests.kubernetes.netpol import Endpoint, Policies
from tests.kubernetes.rendered import NS, pods, settings
from trident.kubernetes.flows import PULLS_FROM
from trident.kubernetes.render import Options, render

VARIANTS = [(m, tls, gpu) for m in METHOD_KINDS for tls in (True, False) for gpu in (False, True)]
MONITORING = "monitoring"
NAMESPACES = {
    n: {"kubernetes.io/metadata.name": n} for n in (NS, MONITORING, "kube-system", "ingress", "other")
}
OUTSIDE = {
    "prometheus": Endpoint("prometheus", MONITORING, {"app.kubernetes.io/name": "prometheus"}, "10.2.0.1"),
    "ingress": Endpoint("ingress", "ingress", {"app": "ingress"}, "10.2.0.2", {"http": 80}),
    "stranger": Endpoint("stranger", "other", {"app": "x"}, "10.2.0.3", {"web": 8080}),
    "kube-dns": Endpoint("kube-dns", "kube-system", {"k8s-app": "kube-dns"}, "10.2.0.4", {"dns": 53}),
    "client": Endpoint("client", None, ip="203.0.113.7"),
    "images": Endpoint("images", None, ip="198.51.100.7", ports={"https": 443, "http": 80}),
    "metadata": Endpoint("metadata", None, ip="169.254.169.254", ports={"http": 80}),
}
UDP = {("kube-dns", 53)}  # DNS answers on both


class Rendered:
    """A rendered deployment read as its processes will: their settings, the Services their URLs
    name, the ports the servers' configs listen on."""

    def __init__(self, objects: list[dict]) -> None:
        self.objects = objects
        self.found = pods(objects)
        self.services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
        script = {n: c["command"][-1] for n, (_, c) in self.found.items()}
        without_plain = re.sub(r"--port 0\b", "", script["redis"])  # with TLS the plain port is off
        self.redis_port = int(re.search(r"--(?:tls-)?port (\d+)", without_plain)[1])
        watch = re.sub(r"^port 0$", "", script["redis-sentinel"], flags=re.M)
        self.sentinel_port = int(re.search(r"^(?:tls-)?port (\d+)$", watch, re.M)[1])
        config = next(o for o in objects if o["metadata"]["name"] == "nats-config")["data"]["nats.conf"]
        self.route_port = int(re.search(r"cluster \{[^}]*?port: (\d+)", config, re.S)[1])

    def behind(self, host: str, port: int) -> list[tuple[str, int]]:
        """The pods (and target port) a Service name reaches; `a.b.ns.svc` is pod a of headless b."""
        parts = host.split(".")
        svc = self.services[parts[1] if len(parts) > 2 else parts[0]]
        target = next(p["targetPort"] for p in svc["spec"]["ports"] if p["port"] == port)
        sel = svc["spec"]["selector"]
        found = self.found.items()
        return [(n, target) for n, (e, _) in found if all(e.labels.get(k) == v for k, v in sel.items())]

    def needed(self) -> set[tuple[str, str, int, str]]:
        """(source, destination, port, protocol) of every connection the rendered services make."""
        out, services = set(), {}
        for name, (_, container) in self.found.items():
            if any(e["name"].startswith("TRIDENT_") for e in container.get("env", [])):
                services[name] = settings(container)
                out |= self.substrate(name, *services[name])
        out |= self.transfers_and_probes({n: s for n, (s, _) in services.items()})
        out |= self.scrapes()
        out.add(("nats", "nats", self.route_port, "TCP"))
        for src in ("redis", "redis-sentinel"):  # replication, a node asking whom to follow, the watch
            out |= {
                (src, "redis", self.redis_port, "TCP"),
                (src, "redis-sentinel", self.sentinel_port, "TCP"),
            }
        for name in self.found:
            out |= {(name, "kube-dns", 53, "UDP"), (name, "kube-dns", 53, "TCP")}
        if "trident-models" in self.found:  # the hub download
            out |= {("trident-models", "images", p, "TCP") for p in (443, 80)}
        return out

    def substrate(self, name: str, s, module: str) -> set:
        """A service's NATS and Redis (through the sentinels), and the gateway's own outside."""
        out = set()
        if "celery" not in module:  # the what-if jobs worker speaks to Redis alone (its broker)
            for url in s.nats_url.split(","):
                host, _, port = url.removeprefix("nats://").rpartition(":")
                out |= {(name, pod, p, "TCP") for pod, p in self.behind(host, int(port))}
        for host, port in sentinel_target(s.redis_url).sentinels:
            out |= {(name, pod, p, "TCP") for pod, p in self.behind(host, port)}
        out.add((name, "redis", self.redis_port, "TCP"))  # the primary the sentinels name
        if isinstance(s, GatewaySettings):
            out |= {(client, name, s.port, "TCP") for client in OUTSIDE}  # the API: the front door
            out |= {(name, "images", p, "TCP") for p in (443, 80)}  # image URLs
        return out

    def transfers_and_probes(self, services: dict) -> set:
        """Who pulls from whose transfer port (PULLS_FROM), and the failover watch's /health probes."""
        ((gw_name, gw),) = [(n, s) for n, s in services.items() if isinstance(s, GatewaySettings)]
        workers = {n: s for n, s in services.items() if isinstance(s, WorkerSettings)}
        out = set()
        for name, s in workers.items():
            for role, owners in PULLS_FROM.items():
                if role not in parse_roles(s.roles):
                    continue
                for owner in owners:
                    if owner == "gateway":
                        out.add((name, gw_name, gw.transfer_port, "TCP"))
                        continue
                    holders = [(w, ws) for w, ws in workers.items() if owner in parse_roles(ws.roles)]
                    out |= {(name, w, ws.transfer_port, "TCP") for w, ws in holders}
            out |= {(watcher, name, s.http_port, "TCP") for watcher in [gw_name, *workers]}
        return out

    def scrapes(self) -> set:
        """What Prometheus scrapes: each ServiceMonitor's endpoints, through the Services it selects."""
        out = set()
        for monitor in (o for o in self.objects if o["kind"] == "ServiceMonitor"):
            sel = monitor["spec"]["selector"]["matchLabels"]
            chosen = [
                v
                for v in self.services.values()
                if all(v["metadata"]["labels"].get(k) == x for k, x in sel.items())
            ]
            for endpoint in monitor["spec"]["endpoints"]:
                for svc in chosen:
                    port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == endpoint["port"])
                    out |= {
                        ("prometheus", pod, p, "TCP") for pod, p in self.behind(svc["metadata"]["name"], port)
                    }
        return out


def needed(objects: list[dict]) -> set[tuple[str, str, int, str]]:
    return Rendered(objects).needed()


def check(objects: list[dict]) -> tuple[list, list]:
    """The connections needed but denied, and those allowed but not needed."""
    found = {n: e for n, (e, _) in pods(objects).items()}
    everyone = {**found, **OUTSIDE}
    policies = Policies([o for o in objects if o["kind"] == "NetworkPolicy"], NAMESPACES)
    want = needed(objects)
    denied, extra = [], []
    for src, dst in itertools.product(everyone, everyone):
        if src not in found and dst not in found:
            continue  # no policy of ours is between them
        for port in set(everyone[dst].ports.values()):
            for proto in ("TCP", "UDP") if (dst, port) in UDP else ("TCP",):
                flow = (src, dst, port, proto)
                ok = policies.allowed(everyone[src], everyone[dst], port, proto)
                if flow in want and not ok:
                    denied.append(flow)
                elif ok and flow not in want:
                    extra.append(flow)
    assert not [f for f in want if f[1] not in everyone or f[2] not in everyone[f[1]].ports.values()], want
    return denied, extra


@pytest.mark.parametrize(
    ("method", "tls", "gpu"),
    VARIANTS,
    ids=[f"{m}-{'tls' if t else 'plain'}{'-gpu' if g else ''}" for m, t, g in VARIANTS],
)
def test_every_flow_the_code_uses_is_allowed_and_no_other(method: str, tls: bool, gpu: bool) -> None:
    objects = render(Options(method=method, tls=tls, gpu=gpu))
    denied, extra = check(objects)
    assert denied == [] and extra == [], (denied, extra)
    flows = needed(objects)
    # The image request's flows are among them: an encoder pulls pixels from the gateway's transfer
    # port, a prefill instance features from an encoder's, a decoder KV from a prefill instance's.
    assert ("trident-encode", "trident-gateway", 8001, "TCP") in flows
    assert ("trident-prefill", "trident-encode", 9001, "TCP") in flows
    assert ("trident-decode", "trident-prefill", 9001, "TCP") in flows


def test_a_hub_download_reaches_the_internet_and_nothing_else_does() -> None:
    objects = render(Options(model_source="hub:llava-hf/llava-1.5-7b-hf"))
    assert check(objects) == ([], [])
    flows = needed(objects)
    assert ("trident-models", "images", 443, "TCP") in flows
    assert not [
        f
        for f in flows
        if f[1] in ("images", "metadata") and f[0] not in ("trident-gateway", "trident-models")
    ]


def test_the_evaluator_denies_what_the_policies_do_not_name() -> None:
    """The check can fail: a gateway admitting only its API (main's policy) denies the pixels."""
    objects = render(Options(method="ep+d"))
    for o in objects:
        if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == "gateway-ingress":
            o["spec"]["ingress"] = [r for r in o["spec"]["ingress"] if r["ports"][0]["port"] == 8000]
    denied, _ = check(objects)
    assert ("trident-ep", "trident-gateway", 8001, "TCP") in denied


def test_an_image_request_crosses_the_policies_on_the_ports_the_code_binds(nats_server, redis_server) -> None:
    """Defect 1: the gateway served pixels from a port chosen at random, which its policy (the API
    port alone) shut out. The gateway's runtime and a worker's transfer endpoint are built here by
    the services' own code from the rendered settings; an encoder pod reaches the port the gateway
    listens on, and a prefill pod the encoder's."""
    objects = render(Options(method="e+p+d"))
    found = pods(objects)
    policies = Policies([o for o in objects if o["kind"] == "NetworkPolicy"], NAMESPACES)
    local = {"nats_url": nats_server.url, "redis_url": redis_server.url, "bind_host": "127.0.0.1",
             "nats_stream_replicas": 1}  # fmt: skip
    gw_settings = GatewaySettings(**{**settings(found["trident-gateway"][1])[0].model_dump(), **local})
    enc_settings = WorkerSettings(**{**settings(found["trident-encode"][1])[0].model_dump(), **local})

    async def bound() -> tuple[int, int]:
        links = await Links.connect(gw_settings, "gw-flows", Gauge("held", "", registry=None))
        encoder = create_backend(transfer_config(enc_settings))
        await encoder.start()
        try:
            return int(links.runtime.transfer.address.rpartition(":")[2]), int(
                encoder.address.rpartition(":")[2]
            )
        finally:
            await encoder.close()
            await links.runtime.close()

    gw_port, enc_port = asyncio.run(bound())
    gw, enc, pre = (found[n][0] for n in ("trident-gateway", "trident-encode", "trident-prefill"))
    assert policies.allowed(enc, gw, gw_port) and policies.allowed(pre, gw, gw_port)  # pixels
    assert policies.allowed(pre, enc, enc_port)  # features
    assert not policies.allowed(found["trident-decode"][0], gw, gw_port)  # decoders pull no pixels
