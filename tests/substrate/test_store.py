"""The Redis store against a real redis-server: records, feature index, registry, plans, dead letters."""

from __future__ import annotations

import asyncio
import time

import pytest

from common.infra import RedisServer
from common.protocol import DeadLetter, FeatureEntry, Heartbeat, StageProfile, TensorRef
from common.store import Heartbeater, Stage, Store, StoreConfig
from common.store.recorder import StageRecorder
from tests.substrate.helpers import eventually, run

pytestmark = pytest.mark.timeout(60)


def _heartbeat(instance_id: str, roles: tuple[str, ...] = ("prefill",), depth: int = 0) -> Heartbeat:
    return Heartbeat(instance_id=instance_id, roles=roles, queue_depth=depth, time=time.time())  # type: ignore[arg-type]


def _entry(content_hash: str, owner: str) -> FeatureEntry:
    ref = TensorRef(
        owner=owner, address="tcp://127.0.0.1:1", handle="h-" + content_hash, shape=(576, 64), dtype="float16"
    )
    return FeatureEntry(content_hash=content_hash, ref=ref, created=time.time())


def test_request_record_collects_stage_times_and_finishes_into_the_trace(redis_server: RedisServer) -> None:
    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        log = store.requests
        sizes = {
            "prompt_tokens": 700,
            "num_images": 1,
            "image_tokens": 576,
            "max_tokens": 64,
            "encoded_images": 1,
        }
        await log.create("r1", arrival=100.0, **sizes)
        stages = [Stage.ENCODE_QUEUED, Stage.ENCODE_STARTED, Stage.ENCODE_ENDED, Stage.FIRST_TOKEN]
        for i, stage in enumerate(stages):
            await log.mark("r1", stage, at=101.0 + i)
        await log.mark("r1", Stage.PREFILL_STARTED, at=102.5, prefill_instance="p-1")
        assert await log.finish("r1", output_tokens=64, finish_reason="length", at=110.0, cached_tokens=640)
        # A redelivered final step finishes again: it changes nothing.
        assert not await log.finish("r1", output_tokens=63, finish_reason="stop")
        assert await log.trace() == []  # the trace entry waits for the gateway's outcome
        assert await log.outcome("r1", ttft=4.2, tbt_p90=0.05, slo_met=True)
        record = await log.get("r1")
        assert record is not None
        assert record.stages["arrival"] == 100.0 and record.stages["end"] == 110.0
        assert record.sizes == {**sizes, "output_tokens": 64, "cached_tokens": 640}
        assert record.info == {"prefill_instance": "p-1", "finish_reason": "length"}
        assert record.outcome == {"ttft": 4.2, "tbt_p90": 0.05, "slo_met": 1.0} and record.traced
        ((entry_id, trace),) = await log.trace()
        assert (trace.request_id, trace.prompt_tokens, trace.image_tokens) == ("r1", 700, 576)
        assert (trace.output_tokens, trace.finish_reason) == (64, "length")
        assert (trace.encoded_images, trace.cached_tokens) == (1, 640)
        assert (trace.ttft, trace.tbt_p90, trace.slo_met) == (4.2, 0.05, True)
        assert trace.stages["first_token"] == 104.0
        assert await log.trace(after=entry_id) == []
        assert await log.get("missing") is None
        await store.close()

    run(main())


def test_each_request_is_traced_once_whoever_reports_last(redis_server: RedisServer) -> None:
    """The worker's end, the gateway's outcome and prefill's first-token mark come in any order;
    the last appends the entry. Without an outcome the fallback appends it alone, and nothing
    appends it twice."""

    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        log = store.requests
        for rid in ("early", "late", "silent", "lagging"):
            await log.create(rid, arrival=100.0, prompt_tokens=10, max_tokens=2)
        for rid in ("early", "late", "silent"):
            await log.mark(rid, Stage.FIRST_TOKEN, at=100.5)
        # The gateway's outcome first (a single token: no TBT), then the worker's end.
        assert not await log.outcome("early", ttft=6.0, tbt_p90=None, slo_met=False)
        assert await log.finish("early", output_tokens=1, finish_reason="length", at=106.0)
        # The end first, then the outcome; the fallback after it finds the entry written.
        assert await log.finish("late", output_tokens=2, finish_reason="stop", at=101.0)
        assert await log.outcome("late", ttft=0.5, tbt_p90=0.1, slo_met=True)
        assert not await log.append_trace("late")
        # No gateway report at all: the fallback traces without an outcome, once.
        assert await log.finish("silent", output_tokens=2, finish_reason="stop", at=102.0)
        assert await log.append_trace("silent")
        assert not await log.append_trace("silent")
        assert not await log.outcome("silent", ttft=9.0, tbt_p90=0.2, slo_met=False)  # too late
        assert not await log.append_trace("missing")
        # Prefill's recorder fell behind: its first-token mark lands after the end and the outcome.
        assert await log.finish("lagging", output_tokens=2, finish_reason="stop", at=103.0)
        assert not await log.outcome("lagging", ttft=0.7, tbt_p90=0.1, slo_met=True)
        await log.mark("lagging", Stage.FIRST_TOKEN, at=100.7)
        assert not await log.append_trace("lagging")  # the mark appended it
        traces = {t.request_id: t for _, t in await log.trace()}
        assert sorted(traces) == ["early", "lagging", "late", "silent"]
        assert traces["lagging"].stages["first_token"] == 100.7 and traces["lagging"].ttft == 0.7
        assert (traces["early"].ttft, traces["early"].tbt_p90, traces["early"].slo_met) == (6.0, None, False)
        assert traces["early"].output_tokens == 1
        assert (traces["late"].ttft, traces["late"].tbt_p90, traces["late"].slo_met) == (0.5, 0.1, True)
        assert (traces["silent"].ttft, traces["silent"].slo_met, traces["silent"].output_tokens) == (
            None,
            None,
            2,
        )
        await store.close()

    run(main())


def test_recorders_trace_with_the_outcome_or_after_the_grace_without(redis_server: RedisServer) -> None:
    """The worker's and the gateway's recorders write off the request path; a request the gateway
    never reports on is traced by the worker's recorder once the grace period is over."""

    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        worker, gateway = StageRecorder(store, trace_grace=0.3), StageRecorder(store)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(worker.run()), tg.create_task(gateway.run())]
            for rid in ("reported", "orphan"):
                await store.requests.create(rid, arrival=time.time(), prompt_tokens=5, max_tokens=3)
                worker.finish(rid, 3, "length")
            gateway.outcome("reported", 0.2, 0.01, True)

            async def both_traced() -> bool:
                return len(await store.requests.trace()) == 2

            assert await eventually(both_traced, timeout=5)
            await asyncio.sleep(0.5)  # past the grace: the fallback must not add a second entry
            for task in tasks:
                task.cancel()
        traces = {t.request_id: t for _, t in await store.requests.trace()}
        assert len(await store.requests.trace()) == 2
        assert traces["reported"].slo_met is True and traces["orphan"].slo_met is None
        assert worker.failures == gateway.failures == 0
        await store.close()

    run(main())


def test_a_backlog_of_writes_keeps_each_requests_order(redis_server: RedisServer) -> None:
    """Writes queued for many requests at once are made several requests at a time; each
    request's own still land in the order queued: its record before its marks, its end before the
    outcome that traces it. Every request is traced once, with its outcome."""

    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        recorder = StageRecorder(store, trace_grace=60)
        rids = [f"r{i}" for i in range(300)]
        for i, rid in enumerate(rids):  # all queued before the recorder runs: one backlog
            recorder.create(rid, arrival=time.time(), prompt_tokens=5, max_tokens=3)
            recorder.mark(rid, Stage.FIRST_TOKEN, at=1000.0 + i)
            recorder.finish(rid, 3, "length")
            recorder.outcome(rid, 0.1, 0.01, True)
            recorder.mark(rid, Stage.FIRST_TOKEN, at=2000.0 + i)  # a later write of the same field wins
        task = asyncio.create_task(recorder.run())
        await recorder.flush(timeout=30)
        task.cancel()
        traces = {t.request_id: t for _, t in await store.requests.trace(count=1000)}
        assert sorted(traces) == sorted(rids) and recorder.failures == 0
        assert all(t.ttft == 0.1 and t.slo_met is True for t in traces.values())
        for i, rid in enumerate(rids):
            record = await store.requests.get(rid)
            assert record is not None and record.stages[Stage.FIRST_TOKEN.value] == 2000.0 + i
        await store.close()

    run(main())


def test_the_recorder_stops_on_a_cancel_that_lands_as_a_write_arrives(redis_server: RedisServer) -> None:
    """A task group stops its children with one cancel each. One that lands in the same loop turn
    as a queued write must still end the recorder, or the group (and a draining worker) waits forever."""

    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        recorder = StageRecorder(store, trace_grace=60)
        await store.requests.create("r1", arrival=time.time(), prompt_tokens=5, max_tokens=3)
        recorder.finish("r1", 3, "length")  # awaiting its outcome: the recorder waits with a deadline
        task = asyncio.create_task(recorder.run())

        async def finish_written() -> bool:
            return bool(recorder._unreported)

        assert await eventually(finish_written, timeout=5)
        await asyncio.sleep(0)  # the finish is written; the recorder waits for the next item
        recorder.mark("r1", Stage.FIRST_TOKEN)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2)
        assert done and task.cancelled()
        await store.close()

    run(main())


def test_the_recorder_stops_on_a_cancel_that_redis_swallows(redis_server: RedisServer) -> None:
    """Cancelled while a write is in flight: redis-py awaits asyncio.wait_for inside, which on Python
    3.11 drops a cancel that lands as its reply arrives. The write then returns normally; the
    recorder must still see it was cancelled (common/aio.py), or it waits for the next item forever."""

    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        for attempt in range(20):  # the cancel must land inside the write; it does on the first try here
            recorder = StageRecorder(store)
            recorder.mark(f"r{attempt}", Stage.FIRST_TOKEN)
            task = asyncio.create_task(recorder.run())
            await asyncio.sleep(0)  # the write is under way
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=2)
            assert done and task.cancelled(), f"attempt {attempt}: the recorder outlived its cancel"
        await store.close()

    run(main())


def test_one_instance_measures_a_profile_while_the_others_wait(redis_server: RedisServer) -> None:
    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        planning = store.planning
        assert await planning.claim_profile("tiny-p-1", "p-a", ttl=1)
        assert not await planning.claim_profile("tiny-p-1", "p-b", ttl=1)
        assert await planning.claim_profile("tiny-p-1", "p-a", ttl=1)  # the owner renews

        async def taken_over() -> bool:
            return await planning.claim_profile("tiny-p-1", "p-b", ttl=1)

        assert await eventually(taken_over, timeout=5)  # the owner died: its claim lapses
        await planning.release_profile_claim("tiny-p-1")
        assert await planning.claim_profile("tiny-p-1", "p-c", ttl=1)
        await store.close()

    run(main())


def test_feature_index_put_get_expire_and_owner_checked_remove(redis_server: RedisServer) -> None:
    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        index = store.features
        await index.put(_entry("h1", "enc-1"), ttl=30)
        await index.put(_entry("h2", "enc-2"), ttl=0.3)
        got = await index.get("h1")
        assert got is not None and got.ref.owner == "enc-1" and got.nbytes == 576 * 64 * 2
        assert set(await index.get_many(["h1", "h2", "h3"])) == {"h1", "h2"}

        async def expired() -> bool:
            return await index.get("h2") is None

        assert await eventually(expired, timeout=2)  # with its TTL of 0.3 s
        await index.put(_entry("h1", "enc-3"), ttl=30)  # re-encoded elsewhere: a newer owner
        assert not await index.remove("h1", owner="enc-1")  # the old owner's eviction must not remove it
        assert (await index.get("h1")).ref.owner == "enc-3"  # type: ignore[union-attr]
        assert await index.remove("h1", owner="enc-3")
        assert await index.get("h1") is None
        await store.close()

    run(main())


def test_a_lookup_that_finds_an_image_extends_its_entry(redis_server: RedisServer) -> None:
    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        index = store.features
        await index.put(_entry("hot", "enc-1"), ttl=5)
        found = await index.get_many_touched(["hot", "missing"], ttl=600)
        assert set(found) == {"hot"}
        ttl_ms = await store.redis.pttl(store.keys.feature("hot"))
        assert 590_000 < ttl_ms <= 600_000, ttl_ms
        assert await store.redis.pttl(store.keys.feature("missing")) == -2  # nothing made for a miss
        await store.close()

    run(main())


def test_registry_lists_live_instances_and_forgets_dead_ones_by_ttl(redis_server: RedisServer) -> None:
    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        registry = store.registry
        await registry.register(_heartbeat("p-1", ("prefill",)), ttl=30)
        await registry.register(_heartbeat("ep-1", ("encode", "prefill")), ttl=30)
        await registry.register(_heartbeat("d-1", ("decode",)), ttl=0.5)  # stops beating: "dies"
        assert [h.instance_id for h in await registry.instances()] == ["d-1", "ep-1", "p-1"]
        assert [h.instance_id for h in await registry.instances("prefill")] == ["ep-1", "p-1"]

        async def d1_gone() -> bool:
            return "d-1" not in [h.instance_id for h in await registry.instances()]

        assert await eventually(d1_gone, timeout=3.0)
        assert await registry.get("d-1") is None
        await registry.deregister("p-1")
        assert [h.instance_id for h in await registry.instances()] == ["ep-1"]
        await store.close()

    run(main())


def test_a_fenced_instance_cannot_register_again(redis_server: RedisServer) -> None:
    # A frozen worker that wakes beats before it hears of its fence: routing must not see it live.
    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        registry = store.registry
        assert await registry.register(_heartbeat("d-1", ("decode",)), ttl=30)
        await registry.fence("d-1")
        assert await registry.instances() == []
        assert not await registry.register(_heartbeat("d-1", ("decode",)), ttl=30)
        assert await registry.instances() == [] and await registry.get("d-1") is None
        assert await registry.register(_heartbeat("d-2", ("decode",)), ttl=30)  # its restart, renamed
        assert [h.instance_id for h in await registry.instances()] == ["d-2"]
        await store.close()

    run(main())


def test_heartbeats_re_register_after_a_redis_restart(redis_server: RedisServer) -> None:
    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url, socket_timeout=0.5, retries=0))
        depth = iter(range(1_000_000))
        beats = Heartbeater(store.registry, lambda: _heartbeat("p-1", depth=next(depth)), interval=0.2)
        beats.start()

        async def registered() -> bool:
            try:
                return await store.registry.get("p-1") is not None
            except Exception:
                return False

        assert await eventually(registered, timeout=3.0)
        await asyncio.to_thread(redis_server.stop)

        async def failing() -> bool:
            return beats.failures >= 1

        assert await eventually(failing, timeout=5)  # beats fail meanwhile; the service must not die of it
        await asyncio.to_thread(redis_server.start)  # persistence is off: Redis comes back empty
        assert not list(redis_server.workdir.glob("*.rdb"))
        assert await eventually(registered, timeout=5.0)
        await beats.stop()  # deregisters
        assert await store.registry.get("p-1") is None
        await store.close()

    run(main())


def test_plans_get_rising_decision_ids_and_profiles_round_trip(redis_server: RedisServer) -> None:
    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        assert await store.planning.current_plan() is None
        first = await store.planning.put_plan("e+p+d", {"e": 1, "p": 1, "d": 2})
        second = await store.planning.put_plan("ep+d", {"ep": 2, "d": 2}, goodput=3.5, reason="image-heavy")
        assert second.decision_id == first.decision_id + 1
        assert await store.planning.current_plan() == second
        profile = StageProfile(profile_id="tiny-cpu-p", roles=("prefill",), latency_limit=0.5, image_budget=0,
                               token_budget=512, prefill=((128, 0.01), (512, 0.04)))  # fmt: skip
        await store.planning.put_profile(profile)
        assert await store.planning.get_profile("tiny-cpu-p") == profile
        assert await store.planning.profiles() == [profile]
        await store.close()

    run(main())


def test_dead_letters_are_recorded_once_per_task(redis_server: RedisServer) -> None:
    async def main() -> None:
        store = await Store.connect(StoreConfig(url=redis_server.url))
        letter = DeadLetter(
            stream="S", subject="t.task.prefill", stream_seq=4, deliveries=5, reason="max_deliver", time=1.0
        )
        assert await store.put_dead_letter(letter)
        assert not await store.put_dead_letter(letter)  # a second watcher's copy
        assert await store.put_dead_letter(letter.model_copy(update={"stream_seq": 5}))
        assert [d.stream_seq for d in await store.dead_letters.list()] == [4, 5]
        await store.close()

    run(main())


def test_password_protected_redis(tmp_path_factory: pytest.TempPathFactory) -> None:
    with RedisServer(
        workdir=tmp_path_factory.mktemp("redis-auth"), password="s3cret", appendonly=True
    ) as server:

        async def main() -> None:
            store = await Store.connect(StoreConfig(url=server.url))
            await store.registry.register(_heartbeat("p-1"), ttl=5)
            assert await store.registry.get("p-1") is not None
            await store.close()
            with pytest.raises(Exception, match=r"(?i)auth"):
                await Store.connect(StoreConfig(url=server.url.replace(":s3cret@", ""), retries=0))

        run(main())
        assert (server.workdir / "appendonlydir").exists() or (server.workdir / "appendonly.aof").exists()
