"""NATS and Redis for a Trident deployment on Kubernetes.

NATS runs as a three-node cluster with JetStream; Trident's task stream keeps three copies
(TRIDENT_NATS_STREAM_REPLICAS=3), so losing a node loses no task. Clients dial the `nats` Service
and learn the other nodes from the server. The token comes from the deployment's Secret through the
environment (nats-server reads `$NATS_TOKEN` in its config), and the monitoring port (8222) is
reachable by the kubelet's probes only: the NetworkPolicies admit no pod to it.

Redis runs as one StatefulSet replica. A replica with automatic failover is not rendered yet
(docs/running.md, "Kubernetes", says what losing it costs).
"""

from __future__ import annotations

from trident.kubernetes.objects import (
    allow,
    container_security,
    disruption_budget,
    field_env,
    from_trident,
    http_probe,
    labels,
    meta,
    network_policy,
    pod_security,
    port,
    secret_env,
    service,
)

NATS_IMAGE = "nats:2.11-alpine"
REDIS_IMAGE = "redis:7-alpine"
NATS_NODES = 3
SECRET = "trident-secrets"
SERVER_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}


def nats_config(namespace: str) -> str:
    routes = ", ".join(f"nats://nats-{i}.nats-cluster.{namespace}.svc:6222" for i in range(NATS_NODES))
    return f"""server_name: $POD_NAME
port: 4222
http_port: 8222
authorization {{ token: $NATS_TOKEN }}
jetstream {{ store_dir: /data }}
cluster {{
  name: trident
  port: 6222
  routes: [{routes}]
}}
"""


def nats(namespace: str, storage: str) -> list[dict]:
    select = labels("nats")
    container = {
        "name": "nats",
        "image": NATS_IMAGE,
        "imagePullPolicy": "Always",
        "command": ["nats-server", "-c", "/etc/nats/nats.conf"],
        "env": [field_env("POD_NAME", "metadata.name"), secret_env("NATS_TOKEN", SECRET, "nats-token")],
        "ports": [
            {"name": "client", "containerPort": 4222},
            {"name": "cluster", "containerPort": 6222},
            {"name": "monitor", "containerPort": 8222},
        ],
        # 200 only once JetStream has loaded its store.
        "readinessProbe": http_probe("/healthz?js-enabled-only=true", "monitor", 5, 3),
        "livenessProbe": http_probe("/healthz", "monitor", 10, 3),
        "startupProbe": http_probe("/healthz", "monitor", 2, 60),
        # Lame-duck mode hands the clients to the other nodes before this one stops.
        "lifecycle": {"preStop": {"exec": {"command": ["nats-server", "--signal", "ldm=/tmp/nats.pid"]}}},
        "resources": SERVER_RESOURCES,
        "securityContext": container_security(),
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/nats", "readOnly": True},
            {"name": "data", "mountPath": "/data"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta("nats-config", namespace, "nats"),
        "data": {"nats.conf": nats_config(namespace) + "pid_file: /tmp/nats.pid\n"},
    }
    statefulset = stateful_set(
        "nats", namespace, "nats-cluster", NATS_NODES, container, storage,
        parallel=True,  # the routes form the cluster whichever starts first
        terminationGracePeriodSeconds=60,
        topologySpreadConstraints=[spread(select)],
        volumes=[{"name": "config", "configMap": {"name": "nats-config"}}, {"name": "tmp", "emptyDir": {}}],
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
        network_policy(
            "nats",
            namespace,
            select,
            [allow(from_trident(), 4222), allow({"podSelector": {"matchLabels": select}}, 6222)],
        ),
    ]


def redis(namespace: str, storage: str) -> list[dict]:
    select = labels("redis")
    script = 'exec redis-server --save "" --appendonly no --requirepass "$REDIS_PASSWORD"'
    container = {
        "name": "redis",
        "image": REDIS_IMAGE,
        "imagePullPolicy": "Always",
        "command": ["sh", "-c", script],
        "env": [secret_env("REDIS_PASSWORD", SECRET, "redis-password")],
        "ports": [{"name": "redis", "containerPort": 6379}],
        "readinessProbe": {
            "exec": {"command": ["sh", "-c", 'REDISCLI_AUTH="$REDIS_PASSWORD" redis-cli ping']},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
        },
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 10, "failureThreshold": 3},
        "resources": SERVER_RESOURCES,
        "securityContext": container_security(),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    statefulset = stateful_set("redis", namespace, "redis", 1, container, storage)
    return [
        statefulset,
        service("redis", namespace, "redis", select, [port("redis", 6379)]),
        network_policy("redis", namespace, select, [allow(from_trident(), 6379)]),
    ]


def stateful_set(
    name: str, namespace: str, service_name: str, replicas: int, container: dict, storage: str, *,
    parallel: bool = False, **pod: object,
) -> dict:  # fmt: skip
    """A server's StatefulSet: non-root, no service-account token, its `data` on a volume of its own
    per replica; `pod` adds to the pod's spec; `parallel` starts the replicas all at once."""
    select = labels(name)
    spec = {
        "serviceName": service_name,
        "replicas": replicas,
        "selector": {"matchLabels": select},
        "template": {
            "metadata": {"labels": select},
            "spec": {
                "automountServiceAccountToken": False,
                "securityContext": pod_security(),
                "containers": [container],
                **pod,
            },
        },
        "volumeClaimTemplates": [claim("data", storage, name)],
    }
    if parallel:
        spec["podManagementPolicy"] = "Parallel"
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(name, namespace, name),
        "spec": spec,
    }


def claim(name: str, size: str, component: str) -> dict:
    return {
        "metadata": {"name": name, "labels": labels(component)},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}},
    }


def spread(select: dict) -> dict:
    """One of each per node where the nodes allow: losing a node loses one NATS node, not two."""
    return {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": select},
    }


__all__ = ["NATS_NODES", "SECRET", "nats", "redis", "spread"]
