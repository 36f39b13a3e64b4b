"""A turn that resends a history image, routed as the gateway routes it (services/gateway/routing.py
over real NATS, Redis and transfer, its prefix index fed by the prefill instance's own announcer):
the image's KV is cached where the turn goes, so its pixels never pass through the encode stage and
its features are never pulled — under E+P+D and EP+D. A turn that adds an image encodes only that
one. When the prefix is evicted before the prefill instance takes the turn, the features come back
the way lost ones do. Every answer is HF's on the whole conversation."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import torch

from common.dispatch import Dispatcher
from common.engine.processor import ProcessedPrompt
from common.protocol import EncodeTask, Heartbeat, PrefillTask, SamplingParams
from common.roles import Role
from services.gateway.kv_routing import PrefixRouter
from services.gateway.routing import LiveRoles, route
from services.gateway.state import Metrics
from services.settings import GatewaySettings
from services.worker.kv_announce import PrefixAnnouncer
from tests.helpers.images import make_image
from tests.stages.flows import answer
from tests.stages.rig import ServingThread, StageRig, stage_rig

E, P, D = (frozenset({r}) for r in Role)
EP = frozenset({Role.ENCODE, Role.PREFILL})
TOKENS = 8


@contextlib.asynccontextmanager
async def gateway(rigs: list[StageRig], prefill: StageRig, pixels: ServingThread, model) -> AsyncIterator:
    """What `route` reaches the deployment through, each part real: the registry listing the rigs
    (as their heartbeats would), the feature index, the dispatcher with mailboxes, the gateway's
    pixel server, and a prefix index kept from `prefill`'s own announcements."""
    ctx = prefill.ctx
    for rig in rigs:
        beat = Heartbeat(instance_id=rig.ctx.instance_id, roles=tuple(rig.ctx.roles), time=time.time())
        await ctx.store.registry.register(beat, ttl=120)
    settings = GatewaySettings(model=model, hold_timeout=5.0)
    router = PrefixRouter(prefill.engine.processor.placeholder_ids, settings.kv_routing_min_tokens, 0)
    dispatch = Dispatcher(ctx.bus.tasks, ctx.ledger.record, ctx.bus, ctx.store.registry, sender="gateway-rig")
    gw = SimpleNamespace(
        instance_id="gateway-rig",
        settings=settings,
        store=ctx.store,
        transfer=pixels.backend,
        record=ctx.ledger.record,
        dispatch=dispatch,
        live_roles=LiveRoles(ctx.store),
        prefix_router=router,
        metrics=Metrics.create(),
    )
    announcer = PrefixAnnouncer(ctx.instance_id, ctx.engine, ctx.bus, interval=0.05, snapshot_every=0.2)

    async def index() -> None:
        async with await ctx.bus.events.prefix_blocks_all() as stream:
            async for msg in stream:
                router.index.apply(msg)

    jobs = [asyncio.create_task(announcer.run()), asyncio.create_task(index())]
    try:
        yield gw
    finally:
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)


def conversation(engine, turns: int, images_in: tuple[int, ...] = (0,)) -> str:
    """The prompt of turn `turns` + 1: an image in each user message of `images_in`, an answer after
    each earlier one."""
    messages = []
    for t in range(turns + 1):
        content = [{"type": "image"}] if t in images_in else []
        content.append({"type": "text", "text": f"Question {t}: what is in the picture, and why?"})
        messages.append({"role": "user", "content": content})
        if t < turns:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": f"Because of {t}."}]})
    return engine.processor.chat_prompt(messages)


async def send(gw, rig: StageRig, rid: str, prompt: str, images: list):
    """Route a request as the gateway does; returns its output stream."""
    stream = await rig.ctx.bus.events.outputs(rid)
    processed = rig.engine.processor.process(prompt, images)
    await route(gw, rid, processed, SamplingParams(max_tokens=TOKENS))
    return stream


async def send_tokens(gw, rig: StageRig, rid: str, token_ids: list[int]):
    """Route a text prompt given as token ids; returns its output stream."""
    stream = await rig.ctx.bus.events.outputs(rid)
    prompt = ProcessedPrompt(token_ids, [], torch.zeros(0, dtype=torch.long))
    await route(gw, rid, prompt, SamplingParams(max_tokens=TOKENS))
    return stream


async def from_mailbox(rig: StageRig, timeout: float = 20.0):
    """The next task sent to `rig` alone (routing by prefix)."""
    consumer = await rig.ctx.bus.mailbox(Role.PREFILL, rig.ctx.instance_id)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tasks := await consumer.fetch(1, timeout=0.5):
            return tasks[0]
    raise TimeoutError(f"nothing in {rig.ctx.instance_id}'s mailbox within {timeout}s")


async def nothing_queued(rig: StageRig, role: Role) -> None:
    consumer = await rig.ctx.bus.consumer(role)
    assert not await consumer.fetch(1, timeout=0.5), f"a {role} task was queued"


async def indexed(gw, prefill: StageRig) -> None:
    """Wait until the gateway's index holds every key the prefill instance caches."""
    engine = prefill.engine
    keys = await prefill.ctx.engine.call(engine.blocks.cached_hashes)
    index, me = gw.prefix_router.index, prefill.ctx.instance_id
    await prefill.until(lambda: index.matched(me, keys) == len(keys) > 0, what="the prefix announced")


async def test_epd_a_history_image_is_routed_around_the_encode_stage(
    tiny_model_dir, nats_server, redis_server, owner, hf_generate
):
    """E+P+D: turn 2 resends turn 1's image, whose features are gone from the feature store: it
    goes straight to the prefill instance holding the history (before, it went to encode), is
    neither encoded nor pulled there, and answers as HF. Turn 3 adds an image: only that one is
    encoded; the history image passes the encoder by."""
    async with (
        stage_rig(E, tiny_model_dir, nats_server, redis_server) as e,
        stage_rig(P, tiny_model_dir, nats_server, redis_server) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server) as d,
        gateway([e, p, d], p, owner, tiny_model_dir) as gw,
    ):
        pictures = [make_image(0), make_image(1)]
        first = conversation(p.engine, 0)
        stream = await send(gw, p, "t1", first, pictures[:1])
        await e.take(Role.ENCODE)
        await p.take(Role.PREFILL)
        await d.take(Role.DECODE)
        assert await answer(stream) == hf_generate(first, pictures[:1], TOKENS)
        for rig in (e, p, d):
            await rig.idle()
        image = p.engine.processor.process(first, pictures[:1]).images[0].content_hash
        assert await e.ctx.store.features.remove(image, e.ctx.instance_id)  # evicted: nothing to pull
        await indexed(gw, p)

        second = conversation(p.engine, 1)
        stream = await send(gw, p, "t2", second, pictures[:1])
        task = await from_mailbox(p)
        assert isinstance(task.message, PrefillTask), "the history image was sent to encode"
        await p.handlers[Role.PREFILL].take(task)
        await d.take(Role.DECODE)
        assert await answer(stream) == hf_generate(second, pictures[:1], TOKENS)
        await nothing_queued(e, Role.ENCODE)
        assert (e.engine.runner.images_encoded, e.ctx.counters.images_to_encode) == (1, 1)
        assert p.ctx.counters.feature_fetch_failures == 0  # not even tried
        assert gw.metrics.images_in_prefix._value.get() == 1

        third = conversation(p.engine, 2, images_in=(0, 2))
        stream = await send(gw, p, "t3", third, pictures)
        encode = await e.fetch(Role.ENCODE)
        assert [img.in_prefix for img in encode.message.request.images] == [True, False]
        assert encode.message.prefill_to == p.ctx.instance_id
        await e.handlers[Role.ENCODE].take(encode)
        await p.handlers[Role.PREFILL].take(await from_mailbox(p))
        await d.take(Role.DECODE)
        assert await answer(stream) == hf_generate(third, pictures, TOKENS)
        assert (e.engine.runner.images_encoded, e.ctx.counters.images_to_encode) == (2, 2)
        assert p.ctx.counters.feature_fetch_failures == 0
        for rig in (e, p, d):
            await rig.idle()


async def test_ep_d_history_images_are_reused_without_the_encode_stage(
    tiny_model_dir, nats_server, redis_server, owner, hf_generate
):
    """EP+D: turn 2 goes to the EP instance holding turn 1 as a prefill task (its image neither
    pulled nor encoded again); turn 3 adds an image and goes there too, which encodes that one
    alone (before, every turn went to the encode queue, any EP instance, all its pixels pulled)."""
    async with (
        stage_rig(EP, tiny_model_dir, nats_server, redis_server) as ep,
        stage_rig(D, tiny_model_dir, nats_server, redis_server) as d,
        gateway([ep, d], ep, owner, tiny_model_dir) as gw,
    ):
        pictures = [make_image(0), make_image(1)]
        first = conversation(ep.engine, 0)
        stream = await send(gw, ep, "t1", first, pictures[:1])
        await ep.take(Role.ENCODE)
        await d.take(Role.DECODE)
        assert await answer(stream) == hf_generate(first, pictures[:1], TOKENS)
        await ep.idle()
        await indexed(gw, ep)

        second = conversation(ep.engine, 1)
        stream = await send(gw, ep, "t2", second, pictures[:1])
        task = await from_mailbox(ep)
        assert isinstance(task.message, PrefillTask), "the history image was sent to encode"
        await ep.handlers[Role.PREFILL].take(task)
        await d.take(Role.DECODE)
        assert await answer(stream) == hf_generate(second, pictures[:1], TOKENS)
        assert (ep.engine.runner.images_encoded, ep.ctx.counters.images_to_encode) == (1, 1)

        third = conversation(ep.engine, 2, images_in=(0, 2))
        stream = await send(gw, ep, "t3", third, pictures)
        await nothing_queued(ep, Role.ENCODE)
        await ep.handlers[Role.PREFILL].take(await from_mailbox(ep))
        await d.take(Role.DECODE)
        assert await answer(stream) == hf_generate(third, pictures, TOKENS)
        assert (ep.engine.runner.images_encoded, ep.ctx.counters.images_to_encode) == (2, 2)
        assert ep.ctx.counters.feature_fetch_failures == 0
        for rig in (ep, d):
            await rig.idle()


async def test_a_prefix_evicted_after_routing_gets_its_features_back_through_encode(
    tiny_model_dir, nats_server, redis_server, owner, hf_generate
):
    """Routed for the history it caches, the prefill instance has given it up by the time it takes
    the turn (a long request took every block): it asks the feature store, finds nothing, and sends
    the turn back to encode, as for any lost features; the answer is still HF's."""
    blocks = 12  # of the prefill instance's KV cache: one turn's blocks and a few more
    per_block = 2 * 4 * 2 * 16 * 16 * 4
    async with (
        stage_rig(E, tiny_model_dir, nats_server, redis_server) as e,
        stage_rig(P, tiny_model_dir, nats_server, redis_server, kv_cache_bytes=blocks * per_block) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server) as d,
        gateway([e, p, d], p, owner, tiny_model_dir) as gw,
    ):
        picture = [make_image(0)]
        first = conversation(p.engine, 0)
        stream = await send(gw, p, "t1", first, picture)
        await e.take(Role.ENCODE)
        await p.take(Role.PREFILL)
        await d.take(Role.DECODE)
        await answer(stream)
        for rig in (e, p, d):
            await rig.idle()
        image = p.engine.processor.process(first, picture).images[0].content_hash
        await e.ctx.store.features.remove(image, e.ctx.instance_id)
        await indexed(gw, p)

        second = conversation(p.engine, 1)
        stream = await send(gw, p, "t2", second, picture)
        routed = await from_mailbox(p)
        assert isinstance(routed.message, PrefillTask)
        words = p.engine.processor.process(p.engine.chat_prompt("Count slowly to ten. " * 40), []).token_ids
        hog = await send_tokens(gw, p, "hog", words[: blocks * 16 - TOKENS])  # every block, cached ones too
        await p.take(Role.PREFILL)
        await d.take(Role.DECODE)
        await answer(hog)
        await p.idle()
        processed = p.engine.processor.process(second, picture)
        assert not await p.ctx.engine.call(lambda: p.engine.handoff.cached_images(processed))

        await p.handlers[Role.PREFILL].take(routed)
        again = await e.fetch(Role.ENCODE)
        assert isinstance(again.message, EncodeTask) and not again.message.request.images[0].in_prefix
        await e.handlers[Role.ENCODE].take(again)
        await p.take(Role.PREFILL)
        await d.take(Role.DECODE)
        assert await answer(stream) == hf_generate(second, picture, TOKENS)
        assert e.ctx.counters.images_to_encode == 2  # back through encode (its own feature cache had it)
        for rig in (e, p, d):
            await rig.idle()
