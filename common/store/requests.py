"""Request records with per-stage timestamps, and the trace stream of finished requests."""

from __future__ import annotations

import time
from collections.abc import Iterable
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
    DECODE_QUEUED = "decode_queued"  # prefill handed the request on; its KV waits to be pulled
    PD_TRANSFER_STARTED = "pd_transfer_started"  # decode starts pulling KV
    PD_TRANSFER_ENDED = "pd_transfer_ended"
    DECODE_STARTED = "decode_started"
    FIRST_TOKEN = "first_token"
    END = "end"


# Integer facts about a request, kept beside the timestamps in the same hash.
_SIZE_FIELDS = (
    "prompt_tokens", "num_images", "image_tokens", "max_tokens", "output_tokens",
    "encoded_images",  # of its images, those whose features were stored already (no encoder run)
    "cached_tokens",  # of its prompt, found in the prefix cache of the instance that prefilled it
)  # fmt: skip
# What the client saw, as the gateway measured it (seconds; slo_met 0 or 1).
_OUTCOME_FIELDS = ("ttft", "tbt_p90", "slo_met")

# The end and the sizes that come with it, set together and only once (a redelivered final step
# changes nothing): -1 if already ended, else whether the gateway's outcome is in (1) or not (0).
_FINISH_ONCE = """
if redis.call('HSETNX', KEYS[1], 'end', ARGV[1]) == 0 then
    return -1
end
redis.call('HSET', KEYS[1], 'output_tokens', ARGV[2], 'finish_reason', ARGV[3], 'cached_tokens', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return redis.call('HEXISTS', KEYS[1], 'ttft')
"""


@dataclass
class RequestRecord:
    request_id: str
    stages: dict[str, float] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    info: dict[str, str] = field(default_factory=dict)  # finish_reason, instance ids per stage
    outcome: dict[str, float] = field(default_factory=dict)  # ttft, tbt_p90, slo_met (gateway)
    traced: bool = False  # its trace entry was appended


class RequestLog:
    """Per-request timestamps written by whichever service reaches a stage; read by tools and tests."""

    def __init__(self, redis: Redis, keys: Keys, ttl: float, trace_maxlen: int) -> None:
        self._r = redis
        self._keys = keys
        self._ttl = int(ttl)
        self._trace_maxlen = trace_maxlen
        self._finish_once = redis.register_script(_FINISH_ONCE)

    async def create(
        self,
        request_id: str,
        *,
        arrival: float,
        prompt_tokens: int,
        num_images: int = 0,
        image_tokens: int = 0,
        max_tokens: int = 0,
        encoded_images: int = 0,
    ) -> None:
        """Record a request at the gateway (its arrival time and sizes)."""
        key = self._keys.request(request_id)
        fields = {
            Stage.ARRIVAL.value: repr(arrival),
            "prompt_tokens": prompt_tokens,
            "num_images": num_images,
            "image_tokens": image_tokens,
            "max_tokens": max_tokens,
            "encoded_images": encoded_images,
        }
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.expire(key, self._ttl)
            await pipe.execute()

    async def mark(self, request_id: str, stage: Stage, at: float | None = None, **info: str) -> None:
        """Set a stage's timestamp (a redelivered task overwrites it: the last attempt counts),
        plus optional string facts such as `prefill_instance="p-1"`."""
        key = self._keys.request(request_id)
        last_needed = stage is Stage.FIRST_TOKEN  # the trace entry waits for it (append_trace)
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={stage.value: repr(time.time() if at is None else at), **info})
            pipe.expire(key, self._ttl)
            if last_needed:
                pipe.hexists(key, Stage.END.value)
                pipe.hexists(key, "ttft")
            done = await pipe.execute()
        if last_needed and all(done[-2:]):  # the end and the outcome came first: this mark appends
            await self.append_trace(request_id, whole=True)

    async def finish(
        self,
        request_id: str,
        *,
        output_tokens: int,
        finish_reason: str,
        at: float | None = None,
        cached_tokens: int = 0,
    ) -> bool:
        """Mark the end (the worker that produced the last token). Only the first call counts: a
        redelivered final step changes nothing and returns False. The trace entry is appended here
        if the gateway's outcome is already in, else by `outcome()` or prefill's first-token `mark()`
        (whichever comes last) or, failing those, `append_trace()`."""
        end = time.time() if at is None else at
        args = [repr(end), output_tokens, finish_reason, self._ttl, cached_tokens]
        state = await self._finish_once(keys=[self._keys.request(request_id)], args=args)
        if state == 1:
            await self.append_trace(request_id, whole=True)
        return state >= 0

    async def outcome(self, request_id: str, *, ttft: float, tbt_p90: float | None, slo_met: bool) -> bool:
        """Record what the client saw (the gateway, once the request ended there), and append the
        trace entry if the end is already marked. Returns whether this call appended it."""
        key = self._keys.request(request_id)
        fields = {"ttft": repr(ttft), "slo_met": int(slo_met)}
        if tbt_p90 is not None:
            fields["tbt_p90"] = repr(tbt_p90)
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.expire(key, self._ttl)
            pipe.hexists(key, Stage.END.value)
            *_, ended = await pipe.execute()
        return bool(ended) and await self.append_trace(request_id, whole=True)

    async def append_trace(self, request_id: str, whole: bool = False) -> bool:
        """Append the request's trace entry with whatever the record holds now, unless it was
        appended already (the worker and the gateway may both get here; one wins the flag). With
        `whole`, only once prefill's first-token mark is in too, where the request made tokens:
        prefill's recorder queues its writes, so the decoder's end and the gateway's outcome can
        both come first, and then the mark appends it (`mark`)."""
        record = await self.get(request_id)
        if record is None or Stage.END.value not in record.stages:
            return False
        made_tokens = record.sizes.get("output_tokens", 0) > 0
        if whole and made_tokens and Stage.FIRST_TOKEN.value not in record.stages:
            return False
        if not await self._r.hsetnx(self._keys.request(request_id), "traced", 1):
            return False
        await self._r.xadd(
            self._keys.trace, {"r": _to_trace(record).to_bytes()}, maxlen=self._trace_maxlen, approximate=True
        )
        return True

    async def journal_outputs(self, streamed: dict[str, list[int]], ended: Iterable[str], ttl: float) -> None:
        """Append each request's newly streamed output token ids to its journal, and drop the
        journals of requests that ended (their tokens are needed only while they run). A journal
        lives `ttl` seconds past its last append."""
        async with self._r.pipeline(transaction=False) as pipe:
            for rid, ids in streamed.items():
                key = self._keys.outputs(rid)
                pipe.rpush(key, *ids)
                pipe.expire(key, int(ttl))
            for rid in ended:
                pipe.delete(self._keys.outputs(rid))
            await pipe.execute()

    async def cancel(self, request_id: str, ttl: float) -> None:
        """A tombstone: the request was cancelled, so its queued tasks are dropped unrun. It lasts
        `ttl` seconds, as long as any task of the request can still be queued."""
        await self._r.set(self._keys.cancelled(request_id), 1, ex=max(1, int(ttl)))

    async def cancelled(self, request_ids: Iterable[str]) -> set[str]:
        """Those of `request_ids` that have a tombstone."""
        ids = list(request_ids)
        if not ids:
            return set()
        found = await self._r.mget([self._keys.cancelled(rid) for rid in ids])
        return {rid for rid, mark in zip(ids, found, strict=True) if mark is not None}

    async def streamed_outputs(self, request_id: str) -> list[int]:
        """The output token ids journaled for a running request, in order (empty if none)."""
        return [int(t) for t in await self._r.lrange(self._keys.outputs(request_id), 0, -1)]

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
            elif name in _OUTCOME_FIELDS:
                record.outcome[name] = float(value)
            elif name == "traced":
                record.traced = True
            else:
                record.info[name] = value
        return record

    async def trace(self, after: str = "-", count: int = 1000) -> list[tuple[str, TraceRecord]]:
        """Trace entries after stream id `after` ("-" for the start), oldest first, with their ids
        (pass the last id back to read on)."""
        start = after if after == "-" else f"({after}"
        rows = await self._r.xrange(self._keys.trace, min=start, max="+", count=count)
        return [(rid.decode(), decode(fields[b"r"], expect=TraceRecord)) for rid, fields in rows]


def _to_trace(record: RequestRecord) -> TraceRecord:
    sizes, outcome = record.sizes, record.outcome
    met = outcome.get("slo_met")
    return TraceRecord(
        request_id=record.request_id,
        arrival=record.stages.get(Stage.ARRIVAL.value, record.stages[Stage.END.value]),
        prompt_tokens=sizes.get("prompt_tokens", 0),
        num_images=sizes.get("num_images", 0),
        image_tokens=sizes.get("image_tokens", 0),
        output_tokens=sizes.get("output_tokens", 0),
        encoded_images=sizes.get("encoded_images", 0),
        cached_tokens=sizes.get("cached_tokens", 0),
        finish_reason=record.info.get("finish_reason", ""),
        stages=record.stages,
        ttft=outcome.get("ttft"),
        tbt_p90=outcome.get("tbt_p90"),
        slo_met=None if met is None else bool(met),
    )
