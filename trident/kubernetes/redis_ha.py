"""Redis for a Trident deployment on Kubernetes: a primary and a replica (StatefulSet `redis`) and
three sentinels (StatefulSet `redis-sentinel`) that promote the replica once the primary has been
silent for the down-after time `trident up --ha` and compose.ha.yaml use (common/infra/settings.py).
No two of a kind share a Kubernetes node (hard anti-affinity); nothing persists (no volume claim:
Redis holds what its owners rewrite); a replica is ready only once its copy is in sync, so a rolling
update waits for it before it takes the primary down. The services reach the primary through the sentinels
(TRIDENT_REDIS_URL=redis+sentinel://..., common/store/connect.py).

Every pod decides whom to follow when it starts, by asking the sentinels:
- a Redis pod replicates the primary they name. With no sentinel answering (the first start),
  redis-0 is the primary and redis-1 its replica. If they still name the pod itself, it died as
  the primary and they have not noticed yet: it waits (up to 10 s) for them to promote the
  replica, rather than come back as an empty primary (no persistence) the replica would copy.
- a sentinel watches the primary the others name (redis-0 when none answers); what it learns
  later it writes into its own config, kept while the pod lives.
Everyone is named by its stable DNS name (`redis-1.redis.<ns>.svc`), announced as such, so an
address survives a pod's restart on another IP. With TLS every port speaks TLS only, asks every
client (services, replicas, sentinels, redis-cli in the scripts and probes) for the deployment's
certificate, and replication runs over it.
"""

from __future__ import annotations

from pathlib import Path

from common.infra.redis_server import listen_settings
from common.infra.settings import REDIS_IMAGE, SENTINEL
from common.tls import Tls
from trident.kubernetes.certificates import pod_tls
from trident.kubernetes.objects import (
    SECRET,
    TLS_DIR,
    apart,
    container_security,
    disruption_budget,
    field_env,
    labels,
    port,
    secret_env,
    service,
    stateful_set,
)

DATA_NODES = 2  # a primary and a replica
SENTINELS = 3
QUORUM = SENTINEL.quorum
MONITORED = "trident"  # the name the sentinels know the primary by, and the URL's service
RESOURCES = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}
SENTINEL_RESOURCES = {
    "requests": {"cpu": "50m", "memory": "32Mi"},
    "limits": {"cpu": "250m", "memory": "128Mi"},
}


def dns(pod: str, headless: str, namespace: str) -> str:
    return f"{pod}.{headless}.{namespace}.svc"


def redis_url(namespace: str) -> str:
    """The services' TRIDENT_REDIS_URL: the sentinels, and the primary's name among them."""
    hosts = ",".join(
        f"{dns(f'redis-sentinel-{i}', 'redis-sentinel', namespace)}:26379" for i in range(SENTINELS)
    )
    return f"redis+sentinel://{hosts}/{MONITORED}/0"


def cli_tls(tls: bool) -> str:
    """redis-cli's options: the deployment's certificate, when the servers ask for it."""
    return (
        f"--tls --cert {TLS_DIR}/cert.pem --key {TLS_DIR}/key.pem --cacert {TLS_DIR}/ca.pem " if tls else ""
    )


def listen(port: int, tls: bool) -> list[tuple[str, str]]:
    """Where a pod's server listens (common/infra's settings, the TLS files where the Secret is
    mounted)."""
    return listen_settings(port, Tls(Path(TLS_DIR)) if tls else None)


def _ask(namespace: str, tls: bool) -> str:
    """A shell function printing the primary's host as the first sentinel that answers names it."""
    hosts = " ".join(dns(f"redis-sentinel-{i}", "redis-sentinel", namespace) for i in range(SENTINELS))
    cli = f"redis-cli {cli_tls(tls)}"
    return (
        f'ask() {{ for s in {hosts}; do REDISCLI_AUTH="$REDIS_PASSWORD" timeout 2 {cli}-h "$s" '
        f"-p 26379 --raw SENTINEL get-master-addr-by-name {MONITORED} 2>/dev/null | head -1 | grep . "
        "&& return; done; }\n"
    )


def node_script(namespace: str, tls: bool = False) -> str:
    first = dns("redis-0", "redis", namespace)
    flags = " ".join(f"--{key} {value}" for key, value in listen(6379, tls))
    return (
        _ask(namespace, tls)
        + f"""SELF="$POD_NAME.redis.{namespace}.svc"
M="$(ask)"
if [ -n "$M" ]; then
  for i in $(seq 50); do [ "$M" != "$SELF" ] && break; sleep 0.2; M="$(ask)"; done
  [ "$M" = "$SELF" ] && M=""
elif [ "$POD_NAME" != "redis-0" ]; then
  M="{first}"
fi
rm -f /data/dump.rdb
set -- {flags} --save "" --appendonly no --requirepass "$REDIS_PASSWORD" --masterauth "$REDIS_PASSWORD" \\
  --replica-announce-ip "$SELF" --repl-diskless-sync-delay 0 --repl-diskless-load swapdb
[ -n "$M" ] && set -- "$@" --replicaof "$M" 6379
exec redis-server "$@"
"""
    )


def sentinel_script(namespace: str, tls: bool = False) -> str:
    first = dns("redis-0", "redis", namespace)
    name = MONITORED
    listen_lines = "\n".join(f"{key} {value}" for key, value in listen(26379, tls))
    timeouts = "\n".join(SENTINEL.lines(name))
    return (
        _ask(namespace, tls)
        + f"""CONF=/data/sentinel.conf
if [ ! -f "$CONF" ]; then
  M="$(ask)"
  [ -n "$M" ] || M="{first}"
  cat > "$CONF" <<EOF
{listen_lines}
sentinel resolve-hostnames yes
sentinel announce-hostnames yes
sentinel announce-ip $POD_NAME.redis-sentinel.{namespace}.svc
sentinel monitor {name} $M 6379 {QUORUM}
{timeouts}
sentinel auth-pass {name} $REDIS_PASSWORD
sentinel sentinel-pass $REDIS_PASSWORD
requirepass $REDIS_PASSWORD
EOF
fi
exec redis-server "$CONF" --sentinel
"""
    )


def ping(number: int, tls: bool) -> str:
    """A sentinel's readiness: it answers."""
    return f'REDISCLI_AUTH="$REDIS_PASSWORD" redis-cli {cli_tls(tls)}-p {number} ping | grep -q PONG'


def in_sync(number: int, tls: bool) -> str:
    """A Redis server's readiness: the primary, or a replica whose link to its primary is up and
    whose first copy is done (a bare PING would let a rolling update take the primary down while
    the only replica is still empty)."""
    info = f'REDISCLI_AUTH="$REDIS_PASSWORD" redis-cli {cli_tls(tls)}-p {number} info replication'
    return (
        f'I="$({info})" && {{ echo "$I" | grep -q "^role:master" || '
        '{ echo "$I" | grep -q "^master_link_status:up" && '
        'echo "$I" | grep -q "^master_sync_in_progress:0"; }; }'
    )


def _container(
    name: str, port_name: str, script: str, number: int, resources: dict, secret: str, tls: bool, ready: str
) -> dict:
    return {
        "name": name,
        "image": REDIS_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", script],
        "env": [
            field_env("POD_NAME", "metadata.name"),
            secret_env("REDIS_PASSWORD", secret, "redis-password"),
        ],
        "ports": [{"name": port_name, "containerPort": number}],
        "readinessProbe": {"exec": {"command": ["sh", "-c", ready]}, "periodSeconds": 5, "timeoutSeconds": 3},
        "livenessProbe": {"tcpSocket": {"port": port_name}, "periodSeconds": 10, "failureThreshold": 3},
        "resources": resources,
        "securityContext": container_security(),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}, *([pod_tls()[1]] if tls else [])],
    }


def redis(namespace: str, secret: str = SECRET, tls: bool = False) -> list[dict]:
    """The Redis pods, the sentinels, their Services, disruption budgets and NetworkPolicies."""
    nodes, sentinels = labels("redis"), labels("redis-sentinel")
    node = _container(
        "redis", "redis", node_script(namespace, tls), 6379, RESOURCES, secret, tls, in_sync(6379, tls)
    )
    watch = _container(
        "redis-sentinel", "sentinel", sentinel_script(namespace, tls), 26379, SENTINEL_RESOURCES, secret, tls,
        ping(26379, tls),
    )  # fmt: skip

    # Scratch only: Redis persists nothing, and what a sentinel learned is asked again on a new pod.
    def scratch(headless: str) -> list[dict]:
        return [{"name": "data", "emptyDir": {}}, *([pod_tls(headless)[0]] if tls else [])]

    return [
        stateful_set("redis", namespace, "redis", DATA_NODES, node, None, parallel=True,
                     affinity=apart(nodes), volumes=scratch("redis")),
        stateful_set("redis-sentinel", namespace, "redis-sentinel", SENTINELS, watch, None, parallel=True,
                     affinity=apart(sentinels), volumes=scratch("redis-sentinel")),
        service("redis", namespace, "redis", nodes, [port("redis", 6379)], headless=True),
        service("redis-sentinel", namespace, "redis-sentinel", sentinels, [port("sentinel", 26379)],
                headless=True),
        disruption_budget("redis", namespace, "redis", nodes, max_unavailable=1),
        disruption_budget("redis-sentinel", namespace, "redis-sentinel", sentinels, max_unavailable=1),
    ]  # fmt: skip
