"""Deployments as the tests run them: the launcher's clusters (trident/launcher/cluster.py), small
and checking themselves, their service processes forked from one warm parent (warm.py), as `trident
up` starts them by default, so that none imports torch and transformers anew. The Docker tests run
compose's plain `python -m services.*` command lines, under the same test settings."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from tests.tiers import count_deployment
from trident.launcher.cluster import Cluster
from trident.launcher.cluster import running_cluster as launcher_cluster
from trident.launcher.warm import WarmStarter

WARM = WarmStarter()

# Over compose.yaml's environment in every process a test starts (and in the Docker tests' containers:
# tests/docker/stack.py writes it into a compose override).
TEST_ENV = {
    "TRIDENT_NUM_THREADS": "1",
    "TRIDENT_ALLOW_PRIVATE_IMAGE_URLS": "0",
    "TRIDENT_KV_CACHE_BYTES": str(16 << 20),
    "TRIDENT_HEARTBEAT_TTL": "3",
    "TRIDENT_PROFILE_REPEATS": "1",  # start-up profiling of the tiny model: well under a second
    "TRIDENT_CHECK_INTEGRITY": "1",  # every worker checks its ledger against its engine
}


@contextmanager
def running_cluster(
    model: Path,
    workdir: Path,
    method: str,
    scale: Mapping[str, int] | None = None,
    env: Mapping[str, str] | None = None,
    ready_timeout: float = 90.0,
) -> Iterator[Cluster]:
    env = {**TEST_ENV, "TRIDENT_TRANSFER": os.environ.get("TRIDENT_TRANSFER", "auto"), **(env or {})}
    count_deployment("cluster")
    with launcher_cluster(model, workdir, method, scale, env, ready_timeout, WARM) as cluster:
        yield cluster
