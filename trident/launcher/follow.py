"""`trident up --follow-plan`: run the deployment the planner asks for.

The planner's `launcher` actuator writes the plan it wants applied to Redis (`<p>:plan:apply`, a
`Plan` like the recommendation at `<p>:plan`). `trident up` reads that key once a second and
moves its worker processes to the plan in two steps, so no role is left without an instance:

    plan 7: 1E1P1D -> 2EP1D      start worker-ep-1, worker-ep-2        (now: encoder, prefill, decode, 2 EP)
                                 ... once both are in the registry (or after --ready-timeout) ...
                                 SIGTERM encoder-1, prefill-1          (they drain: finish what they hold)

A new replica counts as up once the instance registry lists an instance with its pid (a worker's
default instance id ends with its pid).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import redis

from common.compose import ComposeFile, Method, plan_scale
from common.protocol import Plan, ProtocolError, decode
from common.store.connect import sync_client
from common.store.keys import Keys
from common.tls import Tls
from trident.launcher.processes import Child

log = logging.getLogger(__name__)


class PlanSource:
    """The plan to apply and the live instances, read from Redis with a short-timeout sync client."""

    def __init__(self, redis_url: str, namespace: str, tls: Tls | None = None) -> None:
        self._r = sync_client(redis_url, timeout=1.0, tls=tls)
        self._keys = Keys(namespace)
        self.error: str | None = None  # the last read failure, reported once per outage

    def latest(self) -> Plan | None:
        try:
            raw = self._r.get(self._keys.plan_apply)
            self.error = None
            return None if raw is None else decode(raw, expect=Plan)
        except (redis.RedisError, ProtocolError) as exc:
            self.error = str(exc)
            return None

    def live_pids(self) -> set[int]:
        """Pids of registered instances (instance ids `<roles>-<host>-<pid>`)."""
        try:
            ids = self._r.zrange(self._keys.instances, 0, -1)
        except redis.RedisError:
            return set()
        tails = (i.decode().rsplit("-", 1)[-1] for i in ids)
        return {int(t) for t in tails if t.isdigit()}

    def close(self) -> None:
        self._r.close()


@dataclass
class Change:
    """What a plan asks of the running workers: replicas to start, then replicas to drain."""

    method: Method
    counts: dict[str, int]  # worker service -> processes
    start: list[tuple[str, int]] = field(default_factory=list)  # (service, replica index)
    retire: list[Child] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.start and not self.retire


def change_for(
    compose: ComposeFile, plan: Plan, active: list[Child], used_indices: Mapping[str, set[int]]
) -> Change:
    """Diff the plan against the active worker processes. New replicas take the next unused index of
    their service; extra replicas drain from the highest index down; services of another method all go."""
    method = Method(plan.method)
    counts = plan_scale(compose, method, plan.replicas)
    change = Change(method, counts)
    by_service: dict[str, list[Child]] = {}
    for child in active:
        by_service.setdefault(child.spec.service, []).append(child)
    for service, children in by_service.items():
        children.sort(key=lambda c: int(c.name.rsplit("-", 1)[1]))
        change.retire += children[counts.get(service, 0) :]
    for service, want in counts.items():
        used = set(used_indices.get(service, set()))
        for _ in range(want - len(by_service.get(service, []))):
            index = next(i for i in range(1, len(used) + 2) if i not in used)
            used.add(index)
            change.start.append((service, index))
    return change
