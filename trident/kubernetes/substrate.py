"""NATS and Redis for a Trident deployment on Kubernetes.

NATS runs as a three-node cluster with JetStream, with the limits `trident up` and compose use
(common/infra/settings.py); Trident's task stream keeps three copies (TRIDENT_NATS_STREAM_REPLICAS),
so losing a node loses no task. No two nodes share a Kubernetes node (hard anti-affinity). Clients
dial the `nats` Service and learn the other nodes from the server. The token comes from the
deployment's Secret through the environment (nats-server reads `$NATS_TOKEN` in its config), and
the monitoring port (8222) is reachable by the kubelet's probes only: the NetworkPolicies admit no
pod to it.

Redis runs as a primary, a replica and three sentinels (redis_ha.py).
"""

from __future__ import annotations

from pathlib import Path

from common.infra.nats_server import tls_block
from common.infra.settings import NATS, NATS_IMAGE
from common.tls import Tls
from trident.kubernetes.certificates import pod_tls
from trident.kubernetes.objects import (
    SECRET,
    TLS_DIR,
    apart,
    container_security,
    disruption_budget,
    field_env,
    http_probe,
    labels,
    meta,
    port,
    secret_env,
    service,
    stateful_set,
)
from trident.kubernetes.redis_ha import redis

NATS_NODES = NATS.cluster_nodes
NATS_GRACE = NATS.lame_duck_s + NATS.lame_duck_grace_s + 20  # the lame duck ends inside it
LAME_DUCK = "nats-server --signal ldm=/tmp/nats.pid; while kill -0 1 2>/dev/null; do sleep 1; done"
SERVER_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}


def nats_config(tls: bool = False) -> str:
    """The config every node shares. Routes authenticate with the token too; since NATS expands
    no variable inside a URL, the node's start writes them (token and all) to routes.conf beside
    a copy of this file (`nats_start`). With `tls`, clients and routes alike show the deployment's
    certificate (mounted at TLS_DIR), clients before NATS says a word."""
    files = Tls(Path(TLS_DIR))
    client_tls = f"{tls_block(files)}\n" if tls else ""
    route_tls = f"  {tls_block(files, client=False)}\n" if tls else ""
    limits = "\n".join(NATS.config_lines())
    return f"""server_name: $POD_NAME
port: 4222
http_port: 8222
{limits}
authorization {{ token: $NATS_TOKEN }}
jetstream {{ store_dir: /data }}
{client_tls}cluster {{
  name: trident
  port: 6222
  authorization {{ user: route, password: $NATS_TOKEN }}
{route_tls}  include "routes.conf"
}}
"""


def nats_start(namespace: str) -> str:
    """The node's command: its config and routes in /tmp (mode 0600), then nats-server."""
    hosts = " ".join(f"nats-{i}.nats-cluster.{namespace}.svc" for i in range(NATS_NODES))
    each = f"""for h in {hosts}; do printf '"nats-route://route:%s@%s:6222"\\n' "$NATS_TOKEN" "$h"; done"""
    return (
        "umask 077 && cp /etc/nats/nats.conf /tmp/nats.conf && "
        f"""printf 'routes: [\\n%s]\\n' "$({each})" > /tmp/routes.conf && """
        "exec nats-server -c /tmp/nats.conf"
    )


def nats(namespace: str, storage: str, tls: bool = False) -> list[dict]:
    select = labels("nats")
    container = {
        "name": "nats",
        "image": NATS_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", nats_start(namespace)],
        "env": [field_env("POD_NAME", "metadata.name"), secret_env("NATS_TOKEN", SECRET, "nats-token")],
        "ports": [
            {"name": "client", "containerPort": 4222},
            {"name": "cluster", "containerPort": 6222},
            {"name": "monitor", "containerPort": 8222},
        ],
        # Ready once this node's JetStream is up and current; alive while the server answers at all
        # (a node cut off from its peers fails the full /healthz: it must not be restarted for it).
        "readinessProbe": http_probe(NATS.ready_path, "monitor", 5, 3),
        "livenessProbe": http_probe(NATS.live_path, "monitor", 10, 3),
        "startupProbe": http_probe(NATS.ready_path, "monitor", 2, 60),
        # Lame-duck mode hands the clients to the other nodes before this one stops; the hook
        # waits for the server to end, so the kubelet's SIGTERM does not cut it short.
        "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", LAME_DUCK]}}},
        "resources": SERVER_RESOURCES,
        "securityContext": container_security(),
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/nats", "readOnly": True},
            {"name": "data", "mountPath": "/data"},
            {"name": "tmp", "mountPath": "/tmp"},
            *([pod_tls("nats-cluster")[1]] if tls else []),
        ],
    }
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta("nats-config", namespace, "nats"),
        "data": {"nats.conf": nats_config(tls) + "pid_file: /tmp/nats.pid\n"},
    }
    statefulset = stateful_set(
        "nats", namespace, "nats-cluster", NATS_NODES, container, storage,
        parallel=True,  # the routes form the cluster whichever starts first
        terminationGracePeriodSeconds=NATS_GRACE,
        affinity=apart(select),
        volumes=[
            {"name": "config", "configMap": {"name": "nats-config"}}, {"name": "tmp", "emptyDir": {}},
            *([pod_tls("nats-cluster")[0]] if tls else []),
        ],
    )  # fmt: skip
    return [
        config,
        statefulset,
        service("nats", namespace, "nats", select, [port("client", 4222)]),
        service(
            "nats-cluster",
            namespace,
            "nats",
            select,
            [port("client", 4222), port("cluster", 6222)],
            headless=True,
        ),
        disruption_budget("nats", namespace, "nats", select, max_unavailable=1),
    ]


__all__ = ["NATS_NODES", "nats", "redis"]
