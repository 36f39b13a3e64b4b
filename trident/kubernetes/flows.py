"""Who dials whom in a deployment, declared once: each component's ports and the flows between
them. The NetworkPolicies are rendered from this table (network.py) and the environment that fixes
the ports from the same constants (render.py), so a port a process listens on is the port its
policy opens; tests/kubernetes/test_flows.py evaluates the rendered policies against the flows the
services' own settings imply, allowed where needed and denied otherwise.

Transfers pull by handle from the owner's transfer port: an encoder pulls pixels from the gateway,
a prefill instance features from an encoder (and pixels from the gateway when it recomputes them),
a decoder KV from a prefill instance. So a worker pod is labelled with each role it runs, and the
transfer flows are drawn by role. Transfers run over TCP on Kubernetes (TRIDENT_TRANSFER=tcp): UCX
listens on ports it picks, which no policy can name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.roles import Role
from trident.kubernetes.objects import PART_OF, labels


@dataclass(frozen=True)
class Port:
    name: str
    number: int
    protocol: str = "TCP"


# Every port a Trident pod listens on.
GATEWAY_HTTP = Port("http", 8000)  # the API, /health, /metrics
GATEWAY_TRANSFER = Port("transfer", 8001)  # pixels, pulled by encoders (and prefill recomputing them)
WORKER_HTTP = Port("http", 9000)  # /health (probed by the failover watch), /metrics
WORKER_TRANSFER = Port("transfer", 9001)  # features, KV
PLANNER_HTTP = Port("http", 8100)
NATS_CLIENT = Port("client", 4222)
NATS_CLUSTER = Port("cluster", 6222)
NATS_MONITOR = Port("monitor", 8222)  # the kubelet's probes only
REDIS = Port("redis", 6379)
SENTINEL = Port("sentinel", 26379)
DNS = (Port("dns", 53, "UDP"), Port("dns-tcp", 53, "TCP"))
WEB = (Port("https", 443), Port("http", 80))  # image URLs; the hub

ROLE_LABEL = "trident.dev/{}"  # "true" on a worker pod for each role it runs
# What a stage pulls, and from whom (services/{encoder,prefill,decode}/handler.py).
PULLS_FROM: dict[Role, tuple[Role | str, ...]] = {
    Role.ENCODE: ("gateway",),
    Role.PREFILL: (Role.ENCODE, "gateway"),
    Role.DECODE: (Role.PREFILL,),
}
# Addresses an image URL or the hub may not be at: the cluster's own and the cloud's metadata service
# (the gateway refuses private addresses too, services/gateway/images.py).
PRIVATE = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16", "100.64.0.0/10"]


@dataclass(frozen=True)
class Peer:
    """Pods a flow starts or ends at: Trident's own by labels, or another namespace's, or the
    internet by address."""

    name: str
    pods: dict = field(default_factory=dict)  # matchLabels, in the deployment's namespace
    namespace: dict | None = None  # matchLabels of the namespace (another one's pods)
    internet: bool = False

    @property
    def ours(self) -> bool:
        """One of the deployment's own pods (a policy selects it)."""
        return self.namespace is None and not self.internet

    def selector(self) -> dict:
        """As a NetworkPolicy peer (`from` / `to` entry)."""
        if self.internet:
            return {"ipBlock": {"cidr": "0.0.0.0/0", "except": PRIVATE}}
        peer: dict = {}
        if self.namespace is not None:
            peer["namespaceSelector"] = {"matchLabels": self.namespace}
        if self.pods or self.namespace is None:
            peer["podSelector"] = {"matchLabels": self.pods}
        return peer


@dataclass(frozen=True)
class Flow:
    source: Peer
    target: Peer
    port: Port
    why: str


def role_peer(role: Role) -> Peer:
    return Peer(
        f"{role.value}-role", {"app.kubernetes.io/part-of": PART_OF, ROLE_LABEL.format(role.value): "true"}
    )


def role_labels(roles: frozenset[Role]) -> dict[str, str]:
    return {ROLE_LABEL.format(r.value): "true" for r in Role if r in roles}


GATEWAY = Peer("gateway", labels("gateway"))
WORKER = Peer("worker", labels("worker"))
PLANNER = Peer("planner", labels("planner"))
PLANNER_JOBS = Peer("planner-jobs", labels("planner-jobs"))
MODELS = Peer("models", labels("models"))
NATS = Peer("nats", labels("nats"))
REDIS_NODES = Peer("redis", labels("redis"))
SENTINELS = Peer("redis-sentinel", labels("redis-sentinel"))
ANYONE = Peer("anyone", internet=True)  # anything that reaches the cluster: a rule with no `from`
DNS_SERVER = Peer("kube-dns", {"k8s-app": "kube-dns"}, {"kubernetes.io/metadata.name": "kube-system"})
INTERNET = Peer("internet", internet=True)


def monitoring(namespace: str) -> Peer:
    return Peer("prometheus", namespace={"kubernetes.io/metadata.name": namespace})


def flows(monitoring_namespace: str, hub: bool) -> list[Flow]:
    """Every flow of a deployment. `hub`: the models Job downloads the checkpoint from the internet."""
    services = [GATEWAY, WORKER, PLANNER, PLANNER_JOBS]
    out = [Flow(ANYONE, GATEWAY, GATEWAY_HTTP, "the API, through an ingress or a Service")]
    for s in services:
        if s is not PLANNER_JOBS:
            out.append(Flow(s, NATS, NATS_CLIENT, "tasks, events, outputs"))
        out += [
            Flow(s, SENTINELS, SENTINEL, "which Redis is the primary"),
            Flow(s, REDIS_NODES, REDIS, "the store (the jobs' broker)"),
        ]
    out += [
        Flow(NATS, NATS, NATS_CLUSTER, "routes between the nodes"),
        Flow(REDIS_NODES, REDIS_NODES, REDIS, "replication"),
        Flow(REDIS_NODES, SENTINELS, SENTINEL, "a starting node asks whom to follow"),
        Flow(SENTINELS, REDIS_NODES, REDIS, "sentinels watch the servers"),
        Flow(SENTINELS, SENTINELS, SENTINEL, "sentinels agree on a failover"),
    ]
    for watcher in (GATEWAY, WORKER):  # the failover watch asks a silent worker's /health
        out.append(Flow(watcher, WORKER, WORKER_HTTP, "is a silent instance dead (common/failover.py)"))
    for role, owners in PULLS_FROM.items():
        for owner in owners:
            target, port = (
                (GATEWAY, GATEWAY_TRANSFER) if owner == "gateway" else (role_peer(owner), WORKER_TRANSFER)
            )
            out.append(Flow(role_peer(role), target, port, f"{role.value} pulls from {target.name}"))
    prometheus = monitoring(monitoring_namespace)
    for target, port in ((GATEWAY, GATEWAY_HTTP), (WORKER, WORKER_HTTP), (PLANNER, PLANNER_HTTP)):
        out.append(Flow(prometheus, target, port, "metrics"))
    for source in (*services, NATS, REDIS_NODES, SENTINELS, MODELS):
        out += [Flow(source, DNS_SERVER, port, "names") for port in DNS]
    out += [Flow(GATEWAY, INTERNET, port, "image URLs") for port in WEB]
    if hub:
        out += [Flow(MODELS, INTERNET, port, "the checkpoint from the hub") for port in WEB]
    return out
