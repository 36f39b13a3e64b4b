"""The substrate's settings, written once: what NATS and Redis run with under `trident up`
(common/infra), the compose files and the Kubernetes manifests (trident/kubernetes) alike.
tests/substrate/test_settings_agree.py holds compose.yaml and compose.ha.yaml to these values, and
the manifests are rendered from them."""

from __future__ import annotations

from dataclasses import dataclass

# Clusters run images by exact tag: each node pulls on its own schedule, so a floating tag
# (`redis:7-alpine`) can run two versions side by side. The compose files name the release line
# the exact tag belongs to: one machine pulls it once, taking the line's latest patch.
NATS_IMAGE = "nats:2.11.16-alpine"
REDIS_IMAGE = "redis:7.4.11-alpine"
NATS_COMPOSE_IMAGE = "nats:2.11-alpine"
REDIS_COMPOSE_IMAGE = "redis:7-alpine"


def release_line(exact: str) -> str:
    """The floating tag an exact one belongs to: nats:2.11.16-alpine -> nats:2.11-alpine,
    redis:7.4.11-alpine -> redis:7-alpine (Redis's images float on the major version)."""
    name, tag = exact.split(":")
    version, _, variant = tag.partition("-")
    keep = 1 if name == "redis" else 2
    return f"{name}:{'.'.join(version.split('.')[:keep])}-{variant}"


@dataclass(frozen=True)
class NatsSettings:
    # NATS's default is 1 MB; an inline image (3x336x336 fp32 = 1.35 MB) must fit in a task.
    max_payload: int = 8 * 1024 * 1024
    cluster_nodes: int = 3  # a cluster (`--ha`, compose.ha.yaml, Kubernetes)
    stream_replicas: int = 3  # copies of the task stream on a cluster: losing a node loses no task
    # Lame duck: a stopping node stops taking clients and hands the ones it has to its peers over
    # `lame_duck_s`, after waiting `lame_duck_grace_s` for the others to notice. Both must end
    # inside a pod's termination grace period (nats-server's defaults, 2 min, do not).
    lame_duck_s: int = 30
    lame_duck_grace_s: int = 10
    # Light: answers while the server runs, whatever its peers do. A partitioned node's full
    # /healthz fails, and a liveness probe on it would restart the very nodes that survived.
    live_path: str = "/healthz?js-enabled-only=true"
    # Ready once this server's JetStream is up and current (not its streams' health cluster-wide).
    ready_path: str = "/healthz?js-server-only=true"

    def config_lines(self) -> list[str]:
        """The lines every NATS config carries, single server or cluster node."""
        return [
            f"max_payload: {self.max_payload}",
            f"lame_duck_duration: {self.lame_duck_s}s",
            f"lame_duck_grace_period: {self.lame_duck_grace_s}s",
        ]


@dataclass(frozen=True)
class SentinelSettings:
    # How long a primary may be silent before a sentinel calls it down. 1 s invited false failovers
    # (a busy node, a slow network, a GC pause in a client's path); Redis's default (30 s) is for
    # wide-area links and stalls every request that long when a primary really dies.
    down_after_ms: int = 3000
    # How long a failover may take before another sentinel tries again.
    failover_timeout_ms: int = 10000
    parallel_syncs: int = 1
    quorum: int = 2  # of three sentinels

    def lines(self, service: str) -> list[str]:
        """The sentinel config lines for monitoring `service` (after its `sentinel monitor` line)."""
        return [
            f"sentinel down-after-milliseconds {service} {self.down_after_ms}",
            f"sentinel failover-timeout {service} {self.failover_timeout_ms}",
            f"sentinel parallel-syncs {service} {self.parallel_syncs}",
        ]


NATS = NatsSettings()
SENTINEL = SentinelSettings()
