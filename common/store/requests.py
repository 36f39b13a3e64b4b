"""Request records with per-stage timestamps, and the trace stream of finished requests."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum

from redis.asyncio import Redis

from common.protocol import TraceRecord, decode
from common.store.keys import Keys


class Stage(StrEnum):
    """The moments a request passes through, in path order (wall-clock seconds in Redis)."""

    ARRIVAL = "arrival"
    ENCODE_QUEUED = "encode_queued"
    ENCODE_STARTED = "encode_started"
    ENCODE_ENDED = "encode_ended"
    EP_TRANSFER_STARTED = "ep_transfer_started"  # prefill starts pulling features
    EP_TRANSFER_ENDED = "ep_transfer_ended"
    PREFILL_QUEUED = "prefill_queued"
    PREFILL_STARTED = "prefill_started"
    PREFILL_ENDED = "prefill_ended"
    PD_TRANSFER_STARTED = "pd_transfer_started"  # decode starts pulling KV
    PD_TRANSFER_ENDED = "pd_transfer_ended"
    DECODE_STARTED = "decode_started"
    FIRST_TOKEN = "first_token"
    END = "end"


# Integer facts about a request, kept beside the timestamps in the same hash.
_SIZE_FIELDS = ("prompt_tokens", "num_images", "image_tokens", "max_tokens", "output_tokens")


@dataclass
class RequestRecord:
    request_id: str
    stages: dict[str, float] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)  # finish_reason, instance ids per stage


class RequestLog:
    """Per-request timestamps written by whichever service reaches a stage; read by tools and tests."""

    def __init__(self, redis: Redis, keys: Keys, ttl: float, trace_maxlen: int) -> None:
        self._r = redis
        self._keys = keys
        self._ttl = int(ttl)
        self._trace_maxlen = trace_maxlen

    async def create(
        self, request_id: str, *, arrival: float, prompt_tokens: int, num_images: int = 0,
        image_tokens: int = 0, max_tokens: int = 0,
    ) -> None:  # fmt: skip
        """Record a request at the gateway (its arrival time and sizes)."""
        key = self._keys.request(request_id)
        fields = {
            Stage.ARRIVAL.value: repr(arrival), "prompt_tokens": prompt_tokens, "num_images": num_images,
            "image_tokens": image_tokens, "max_tokens": max_tokens,
        }  # fmt: skip
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.expire(key, self._ttl)
            await pipe.execute()

    async def mark(self, request_id: str, stage: Stage, at: float | None = None, **info: str) -> None:
        """Set a stage's timestamp (a redelivered task overwrites it: the last attempt counts),
        plus optional string facts such as `prefill_instance="p-1"`."""
        key = self._keys.request(request_id)
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={stage.value: repr(time.time() if at is None else at), **info})
            pipe.expire(key, self._ttl)
            await pipe.execute()

    async def finish(
        self, request_id: str, *, output_tokens: int, finish_reason: str, at: float | None = None
    ) -> bool:
        """Mark the end and append the request to the trace. Only the first call for a request
        writes the trace (a redelivered final step would otherwise count it twice)."""
        key = self._keys.request(request_id)
        end = time.time() if at is None else at
        if not await self._r.hsetnx(key, Stage.END.value, repr(end)):
            return False
        await self._r.hset(key, mapping={"output_tokens": output_tokens, "finish_reason": finish_reason})
        record = await self.get(request_id)
        if record is None:
            return False
        trace = TraceRecord(
            request_id=request_id, arrival=record.stages.get(Stage.ARRIVAL.value, end),
            prompt_tokens=record.sizes.get("prompt_tokens", 0), num_images=record.sizes.get("num_images", 0),
            image_tokens=record.sizes.get("image_tokens", 0), output_tokens=output_tokens,
            finish_reason=finish_reason, stages=record.stages,
        )  # fmt: skip
        await self._r.xadd(
            self._keys.trace, {"r": trace.to_bytes()}, maxlen=self._trace_maxlen, approximate=True
        )
        return True

    async def get(self, request_id: str) -> RequestRecord | None:
        raw = await self._r.hgetall(self._keys.request(request_id))
        if not raw:
            return None
        record = RequestRecord(request_id)
        stages = {s.value for s in Stage}
        for k, v in raw.items():
            name, value = k.decode(), v.decode()
            if name in stages:
                record.stages[name] = float(value)
            elif name in _SIZE_FIELDS:
                record.sizes[name] = int(value)
            else:
                record.info[name] = value
        return record

    async def trace(self, after: str = "-", count: int = 1000) -> list[tuple[str, TraceRecord]]:
        """Trace entries after stream id `after` ("-" for the start), oldest first, with their ids
        (pass the last id back to read on)."""
        start = after if after == "-" else f"({after}"
        rows = await self._r.xrange(self._keys.trace, min=start, max="+", count=count)
        return [(rid.decode(), decode(fields[b"r"], expect=TraceRecord)) for rid, fields in rows]
