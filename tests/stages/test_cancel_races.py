"""A cancel that lands while a handler awaits — pixels or features being pulled, KV being pulled —
or after a request was handed off with its KV kept, leaves nothing held: no request in the engine,
no KV block in use, no tensor served, no task to redeliver, and nothing queued for a later stage.

Each owner is a transfer server on a thread of its own, frozen while the cancel lands, so the
handler is inside its pull when it does."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.bus import Task
from common.protocol import EncodeTask, ImageSpec, PrefillTask, TensorRef, dtype_name
from common.roles import Role
from common.store import Stage
from services.worker.ledger import Cancelled
from tests.stages.flows import D, E, P, cancel, nothing_queued, prefilled, request
from tests.stages.rig import ServingThread, StageRig, stage_rig


async def cancel_inside_the_pull(
    rig: StageRig, task: Task, frozen: ServingThread, mark: Stage, *also: StageRig
):
    """Run the handler on `task` while `frozen` does not answer; once the handler has marked `mark`
    (its pull is under way) cancel the request, then let the pull finish. The handler must stop."""
    rid = task.message.request.request_id
    frozen.freeze()
    taking = asyncio.create_task(rig.handlers[task.message.ROLE].take(task))
    await rig.until(lambda: (held := rig.ledger.get(rid)) is not None and mark in held.marks, what=str(mark))
    await cancel(rid, rig, *also)
    frozen.thaw()
    with pytest.raises(Cancelled):
        await taking


async def test_a_cancel_during_the_pixel_pull_encodes_nothing(
    tiny_model_dir, nats_server, redis_server, owner
):
    async with stage_rig(E, tiny_model_dir, nats_server, redis_server) as e:
        spec, _, _ = request(e, owner, "r-pixels", num_images=1)
        await e.ctx.dispatch.send(EncodeTask(request=spec), "test")
        task = await e.fetch(Role.ENCODE)
        await cancel_inside_the_pull(e, task, owner, Stage.ENCODE_STARTED)
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
        await cancel_inside_the_pull(p, task, owner, Stage.EP_TRANSFER_STARTED)
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
        _, task = await prefilled(p, d, owner, "r-kv")
        # The prefill instance stops answering; once thawed, the pull finds its handle released.
        await cancel_inside_the_pull(d, task, p.serving, Stage.PD_TRANSFER_STARTED, p)
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
        # Handed on: the KV is kept in served handles for the decoder. Whether the engine's blocks
        # hold it too depends on the moment: a streamed request's blocks go once its step ends
        # (PrefillHandler.hand_on: the handles hold copies), so they are no precondition here.
        await p.until(lambda: (h := p.ledger.get(spec.request_id)) is not None and bool(h.kv_handles))
        assert len(p.ctx.transfer.handles) > 0
        await cancel(spec.request_id, p)
        await p.idle()
        assert len(p.ctx.transfer.handles) == 0
        assert p.engine.blocks.num_free == p.engine.blocks.num_blocks  # and the engine holds none of it
