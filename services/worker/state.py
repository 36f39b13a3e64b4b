"""What a worker holds: JetStream tasks to settle when their request leaves, and KV kept for decode."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from common.bus import Task


@dataclass
class Held:
    """A request inside this instance. Its task is acked only when the request leaves (finished or
    handed on), so a crash before then gets the task redelivered to another replica."""

    request_id: str
    task: Task | None


@dataclass
class KeptKV:
    """KV blocks of a prefilled request, exported for decode to pull; freed on Release or expiry."""

    request_id: str
    handles: list[str]
    expires: float


@dataclass
class Counters:
    """Monotonic figures for /metrics and tests."""

    images_encoded: int = 0
    prefills: int = 0
    decodes_admitted: int = 0
    tokens_generated: int = 0
    finished: int = 0
    errors: int = 0
    feature_fetch_failures: int = 0
    kv_pull_failures: int = 0
    resumed_tokens: int = 0
    started_at: float = field(default_factory=time.time)
