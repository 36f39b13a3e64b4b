"""The cost of a request outside the engines: what the gateway, the broker, the store and whatever
else shares the workers' cores spend per request served. On a small model it is most of a
request's cost, and the stage curves cannot see it (they time the model alone).

Measured from service: every worker reports counters of its host's busy core-seconds and of its
own CPU seconds (StepStats `host_cpu_seconds`, `process_cpu_seconds`; services/worker/cpu_use.py).
Between two of its reports, what a host's cores did beyond its workers' processes, over the
requests that arrived meanwhile, is the CPU a request costs there. The simulator takes
`per_request` × the rate it replays off the cores its instances share (`TransferModel.host_cpu`),
so the cost grows with the load, as it does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MIN_REQUESTS = 10  # requests in the span before a figure is trusted
MIN_SPAN = 5.0  # seconds between two reports of one worker


@dataclass(frozen=True)
class HostCpu:
    per_request: float  # CPU seconds per request, outside the workers, on the workers' hosts
    busy: float  # cores that took over the span measured: the background the steps ran beside
    cores: int  # the cores the workers share where they run on one host (0: several hosts)
    requests: int  # requests arrived in the span
    span: float  # seconds measured over

    def to_dict(self) -> dict:
        return {
            "per_request": round(self.per_request, 6),
            "busy": round(self.busy, 4),
            "cores": self.cores,
            "requests": self.requests,
            "span": round(self.span, 3),
        }


def measure_host_cpu(
    earlier: Sequence, later: Sequence, records: Sequence, min_requests: int = MIN_REQUESTS
) -> HostCpu | None:
    """From two reads of the workers' StepStats (`earlier`, `later`: each instance's report then)
    and the trace's records (wall-clock `arrival`); None where no worker reported its host in both,
    or too few requests arrived in between to divide by."""
    before = {st.instance_id: st for st in earlier if st.host}
    by_host: dict[str, list[tuple[float, float, float, float, int]]] = {}
    for st in later:
        old = before.get(st.instance_id)
        if not st.host or old is None or old.host != st.host or st.time - old.time < MIN_SPAN:
            continue
        span = st.time - old.time
        host = (st.host_cpu_seconds - old.host_cpu_seconds) / span
        own = (st.process_cpu_seconds - old.process_cpu_seconds) / span
        if host >= 0 and own >= 0:  # counters that went back: a reboot, or another process
            by_host.setdefault(st.host, []).append((old.time, st.time, host, own, st.host_cores))
    if not by_host:
        return None
    intervals = [x for group in by_host.values() for x in group]
    start, end = float(np.median([x[0] for x in intervals])), float(np.median([x[1] for x in intervals]))
    arrived = sum(1 for r in records if start <= r.arrival <= end)
    if arrived < min_requests:
        return None
    # Every worker of a host saw the same host; its workers' own cores are theirs, the rest other.
    busy = sum(
        max(0.0, float(np.median([x[2] for x in group])) - sum(x[3] for x in group))
        for group in by_host.values()
    )
    cores = max(x[4] for x in intervals) if len(by_host) == 1 else 0
    return HostCpu(busy * (end - start) / arrived, busy, cores, arrived, end - start)
