"""A worker's monotonic figures, read by /metrics and tests."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Counters:
    """Monotonic figures for /metrics and tests."""

    images_to_encode: int = 0  # taken with pixels (the engine may find their features cached)
    prefills: int = 0
    decodes_admitted: int = 0
    tokens_generated: int = 0
    finished: int = 0
    errors: int = 0
    feature_fetch_failures: int = 0
    kv_pull_failures: int = 0
    resumed_tokens: int = 0
    cancelled_unrun: int = 0  # tasks of cancelled requests dropped when pulled
    mailbox_taken: int = 0  # tasks sent to this instance alone (routing by prefix) that it ran
    taken_back: int = 0  # of those sent to it, the ones their sender had moved to the shared queue
    started_at: float = field(default_factory=time.time)
