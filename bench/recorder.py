"""The request recorder's write rate: a backlog of request-record writes (a record, two marks, an
end and the outcome for each request) made one at a time, as the recorder did, and as it does
now (each request's writes in order, WRITERS requests' at once; common/store/recorder.py).

    python bench/recorder.py [--requests 500] [--repeats 3]

A gateway whose recorder falls more than TRACE_GRACE behind has its requests traced without the
outcome the client saw. Prints a line per repeat and, last, one JSON object with the medians and
their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

from common.infra import RedisServer
from common.store import Store, StoreConfig
from common.store.recorder import BATCH, WRITERS, StageRecorder
from common.store.requests import Stage

WRITES_PER_REQUEST = 5


async def rate(url: str, requests: int, writers: int, batch: int, prefix: str) -> float:
    """Writes per second for a backlog of `requests` requests' writes."""
    store = await Store.connect(StoreConfig(url=url, prefix=prefix))
    rec = StageRecorder(store, trace_grace=600, writers=writers, batch=batch)
    for i in range(requests):
        rid = f"r{i}"
        rec.create(rid, arrival=time.time(), prompt_tokens=5, max_tokens=3)
        rec.mark(rid, Stage.PREFILL_QUEUED)
        rec.mark(rid, Stage.FIRST_TOKEN)
        rec.finish(rid, 3, "length")
        rec.outcome(rid, 0.1, 0.01, True)
    start = time.perf_counter()
    task = asyncio.create_task(rec.run())
    await rec.flush(timeout=300)
    took = time.perf_counter() - start
    task.cancel()
    traced = len(await store.requests.trace(count=requests + 1))
    await store.close()
    if traced != requests or rec.failures:
        raise SystemExit(f"{traced} of {requests} traced, {rec.failures} writes failed")
    return requests * WRITES_PER_REQUEST / took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    writers, batch = WRITERS, BATCH
    one, many = [], []
    with RedisServer() as redis_server:
        for k in range(args.repeats):
            one.append(asyncio.run(rate(redis_server.url, args.requests, 1, 1, f"one{k}")))
            many.append(asyncio.run(rate(redis_server.url, args.requests, writers, batch, f"many{k}")))
            print(
                f"repeat {k}: one at a time {one[-1]:.0f} writes/s, {writers} at once {many[-1]:.0f} writes/s"
            )
    summary = {
        "requests": args.requests,
        "writers": writers,
        "one_at_a_time_writes_per_s": round(statistics.median(one), 1),
        "concurrent_writes_per_s": round(statistics.median(many), 1),
        "spread": {
            "one_at_a_time": [round(min(one)), round(max(one))],
            "concurrent": [round(min(many)), round(max(many))],
        },
        "ratio": round(statistics.median(many) / statistics.median(one), 2),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
