"""A cancel that lands while a handler awaits — pixels or features being pulled, KV being pulled —
or after a request was handed off with its KV kept, leaves nothing held: no request in the engine,
no KV block in use, no tensor served, no task to redeliver, and nothing queued for a later stage.

Each owner is a transfer server on a thread of its own, frozen while the cancel lands, so the
handler is inside its pull when it does."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.protocol import Cancel, EncodeTask, ImageSpec, PrefillTask, TensorRef, dtype_name
from common.roles import Role
from common.store import Stage
from services.worker.ledger import Cancelled
from tests.stages.rig import ServingThread, StageRig, stage_rig
from tests.stages.test_handlers import D, E, P, request


async def cancel(rid: str, *rigs: StageRig) -> None:
    """Cancel as the gateway does (a broadcast), and wait until every rig named has dropped it."""
    await rigs[0].ctx.bus.events.cancel(Cancel(request_id=rid, reason="client went away"))
    for rig in rigs:
        await rig.until(lambda rig=rig: rid not in rig.ledger, what=f"{rid} dropped by {rig.ctx.instance_id}")


async def nothing_queued(rig: StageRig, role: Role) -> None:
    consumer = await rig.ctx.bus.consumer(role)
    assert await consumer.fetch(1, timeout=0.3) == [], f"a {role} task was queued for a cancelled request"


def pulling(rig: StageRig, rid: str, mark: Stage):
    """True once the request's handler has marked the start of its pull."""
    return lambda: (held := rig.ledger.get(rid)) is not None and mark in held.marks


@pytest.fixture
async def owner():
    """The far side of a pull: the gateway (pixels), an encoder (features) or a prefill instance."""
    serving = ServingThread()
    serving.start()
    yield serving
    serving.close()


async def test_a_cancel_during_the_pixel_pull_encodes_nothing(
    tiny_model_dir, nats_server, redis_server, owner
):
    async with stage_rig(E, tiny_model_dir, nats_server, redis_server) as e:
        spec, _, _ = request(e, owner, "r-pixels", num_images=1)
        await e.ctx.dispatch.send(EncodeTask(request=spec), "test")
        task = await e.fetch(Role.ENCODE)
        owner.freeze()
        taking = asyncio.create_task(e.handlers[Role.ENCODE].take(task))
        await e.until(pulling(e, spec.request_id, Stage.ENCODE_STARTED))
        await cancel(spec.request_id, e)
        owner.thaw()
        with pytest.raises(Cancelled):
            await taking
        assert task.settled
        await e.idle()
        assert len(e.ctx.transfer.handles) == 0, "features were published for a cancelled request"
        assert e.engine.features.hits + e.engine.features.misses == 0, "the vision tower ran"
        await nothing_queued(e, Role.PREFILL)


async def test_a_cancel_during_the_feature_pull_prefills_nothing(
    tiny_model_dir, nats_server, redis_server, owner
):
    async with stage_rig(P, tiny_model_dir, nats_server, redis_server) as p:
        spec, _, _ = request(p, owner, "r-features", num_images=1)
        (image,) = spec.images
        hidden = p.engine.model.config.text_config.hidden_size
        features = torch.randn(image.num_tokens, hidden)
        handle = owner.backend.publish(features)
        ref = TensorRef(owner="encoder", address=owner.backend.address, handle=handle,
                        shape=tuple(features.shape), dtype=dtype_name(features.dtype))  # fmt: skip
        encoded = spec.model_copy(update={"images": (ImageSpec(**{**image.model_dump(), "features": ref}),)})
        await p.ctx.dispatch.send(PrefillTask(request=encoded), "test")
        task = await p.fetch(Role.PREFILL)
        owner.freeze()
        taking = asyncio.create_task(p.handlers[Role.PREFILL].take(task))
        await p.until(pulling(p, spec.request_id, Stage.EP_TRANSFER_STARTED))
        await cancel(spec.request_id, p)
        owner.thaw()
        with pytest.raises(Cancelled):
            await taking
        assert task.settled and p.ctx.counters.prefills == 0
        await p.idle()
        await nothing_queued(p, Role.ENCODE)  # not "recomputed" either
        await nothing_queued(p, Role.DECODE)


async def test_a_cancel_during_the_kv_pull_decodes_nothing_and_frees_the_kv_at_both_ends(
    tiny_model_dir, nats_server, redis_server, owner
):
    async with (
        stage_rig(P, tiny_model_dir, nats_server, redis_server) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server) as d,
    ):
        spec, _, _ = request(p, owner, "r-kv", num_images=0)
        await p.ctx.dispatch.send(PrefillTask(request=spec), "test")
        await p.take(Role.PREFILL)
        task = await d.fetch(Role.DECODE)
        p.serving.freeze()  # the prefill instance stops answering pulls
        taking = asyncio.create_task(d.handlers[Role.DECODE].take(task))
        await d.until(pulling(d, spec.request_id, Stage.PD_TRANSFER_STARTED))
        await cancel(spec.request_id, d, p)
        p.serving.thaw()  # the pull now finds its handle released
        with pytest.raises(Cancelled):
            await taking
        assert task.settled and d.ctx.counters.decodes_admitted == 0
        for rig in (p, d):
            await rig.idle()
        assert len(p.ctx.transfer.handles) == 0
        await nothing_queued(d, Role.PREFILL)  # a cancelled request is not prefilled again


async def test_a_cancel_after_the_hand_off_frees_the_kept_kv(
    tiny_model_dir, nats_server, redis_server, owner
):
    async with stage_rig(P, tiny_model_dir, nats_server, redis_server) as p:
        spec, _, _ = request(p, owner, "r-kept", num_images=0)
        await p.ctx.dispatch.send(PrefillTask(request=spec), "test")
        await p.take(Role.PREFILL)
        await p.until(lambda: (h := p.ledger.get(spec.request_id)) is not None and bool(h.kv_handles))
        assert len(p.ctx.transfer.handles) > 0 and p.engine.blocks.num_free < p.engine.blocks.num_blocks
        await cancel(spec.request_id, p)
        await p.idle()
        assert len(p.ctx.transfer.handles) == 0
