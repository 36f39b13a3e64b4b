"""Each stage's handler on its own, against a real engine, NATS, Redis and transfer: encode hands
features on, prefill emits the first token and keeps the KV until decode has pulled it, decode
finishes the answer — equal to HF's — and each fallback sends the request where it can go on."""

from __future__ import annotations

import asyncio

import pytest

from common.protocol import (
    OUTPUT_KINDS,
    DecodeTask,
    EncodeTask,
    ErrorOutput,
    PrefillTask,
    TensorRef,
    TokenDelta,
)
from common.protocol.tensors import int8_kv_nbytes, nbytes_of
from common.roles import Role
from common.store import Stage
from common.transfer import TransferPath
from services.worker.ledger import AlreadyHeld
from services.worker.worker import StageWorker
from tests.stages.flows import D, E, P, answer, prefilled, request
from tests.stages.rig import stage_rig


@pytest.mark.parametrize("kv_stream", [True, False], ids=["streamed", "after-prefill"])
@pytest.mark.parametrize("path", [TransferPath.STREAM, TransferPath.HOST_LOCAL])
async def test_encode_prefill_decode_hand_on_in_turn_and_answer_as_hf(
    tiny_model_dir, nats_server, redis_server, owner, hf_generate, kv_stream, path
):
    # The tiny model's features and KV are small: host-local at any size, or never.
    min_bytes = 0 if path is TransferPath.HOST_LOCAL else 1 << 40
    async with (
        stage_rig(E, tiny_model_dir, nats_server, redis_server, host_local_min_bytes=min_bytes) as e,
        stage_rig(P, tiny_model_dir, nats_server, redis_server, host_local_min_bytes=min_bytes) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server, host_local_min_bytes=min_bytes) as d,
    ):
        p.handlers[Role.PREFILL].kv_stream = kv_stream
        spec, prompt, images = request(e, owner, "r-chain", num_images=2, max_tokens=12)
        stream = await e.ctx.bus.events.outputs(spec.request_id)
        await e.ctx.dispatch.send(EncodeTask(request=spec), "test")

        encoded = await e.take(Role.ENCODE)
        await e.idle()  # features published and indexed, the prefill task queued, nothing held
        assert encoded.settled and e.ctx.counters.images_to_encode == 2
        assert e.ctx.engine.engine.runner.images_encoded == 2  # the vision tower ran on both
        for img in spec.images:
            entry = await e.ctx.store.features.get(img.content_hash)
            assert entry is not None and entry.ref.owner == e.ctx.instance_id

        prefill = await p.fetch(Role.PREFILL)
        assert isinstance(prefill.message, PrefillTask)
        assert all(isinstance(img.features, TensorRef) for img in prefill.message.request.images)
        await p.handlers[Role.PREFILL].take(prefill)
        # Prefilled and handed on: the task is settled, the KV served until decode has it.
        await p.until(lambda: prefill.settled, what="the prefill task settled")
        (kept,) = list(p.ledger)
        assert kept.kv_handles and not kept.holds_task
        assert all(h in p.ctx.transfer.handles for h in kept.kv_handles)

        decode = await d.take(Role.DECODE)
        assert isinstance(decode.message, DecodeTask) and decode.message.kv.owner == p.ctx.instance_id
        # Streamed: the task went out as the last prefill step began, before the first token.
        assert bool(decode.message.kv.tail) == kv_stream
        assert len(decode.message.request.output_token_ids) == (0 if kv_stream else 1)
        assert await answer(stream) == hf_generate(prompt, images, 12)
        for rig in (e, p, d):
            await rig.idle()
        assert len(p.ctx.transfer.handles) == 0  # decode's release freed the KV it pulled
        for rig in (e, p, d):  # each wrote its marks through its own recorder
            await rig.ctx.ledger.record.flush()
        marks = (await e.ctx.store.requests.get(spec.request_id)).stages
        stages = [
            Stage.ENCODE_QUEUED, Stage.ENCODE_STARTED, Stage.ENCODE_ENDED, Stage.PREFILL_QUEUED,
            Stage.EP_TRANSFER_STARTED, Stage.EP_TRANSFER_ENDED, Stage.PREFILL_STARTED, Stage.FIRST_TOKEN,
            Stage.DECODE_QUEUED, Stage.PD_TRANSFER_STARTED, Stage.PD_TRANSFER_ENDED, Stage.DECODE_STARTED,
        ]  # fmt: skip
        if kv_stream:  # queued for decode, and pulled from, while the prefill still ran
            stages.remove(Stage.FIRST_TOKEN)
            assert marks[Stage.DECODE_QUEUED] < marks[Stage.FIRST_TOKEN] <= marks[Stage.PD_TRANSFER_ENDED]

        assert [s for s in stages if s in marks] == stages
        assert [marks[s] for s in stages] == sorted(marks[s] for s in stages)
        # Each hop says how its tensors came, and how many bytes (the transfer metrics' label too).
        info = (await e.ctx.store.requests.get(spec.request_id)).info
        assert info["ep_path"] == info["pd_path"] == path.value
        assert int(info["ep_bytes"]) > 0 and int(info["pd_bytes"]) > 0


async def test_prefill_without_the_features_sends_the_request_back_to_encode(
    tiny_model_dir, nats_server, redis_server, owner
):
    async with stage_rig(P, tiny_model_dir, nats_server, redis_server) as p:
        spec, _, _ = request(p, owner, "r-lost-features", num_images=1)
        await p.ctx.dispatch.send(PrefillTask(request=spec), "test")  # no features, none indexed
        task = await p.take(Role.PREFILL)
        again = await p.fetch(Role.ENCODE)
        assert again.message.request.images[0].pixels == spec.images[0].pixels
        assert task.settled and p.ctx.counters.feature_fetch_failures == 1
        await p.idle()


async def test_decode_without_the_kv_sends_the_request_back_to_prefill(
    tiny_model_dir, nats_server, redis_server, owner
):
    async with (
        stage_rig(P, tiny_model_dir, nats_server, redis_server) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server) as d,
    ):
        _, decode = await prefilled(p, d, owner, "r-lost-kv")
        (kept,) = list(p.ledger)
        await p.ledger.release_kv(kept.request_id)  # the KV is gone before decode pulls it
        await d.handlers[Role.DECODE].take(decode)
        again = await p.fetch(Role.PREFILL)
        assert again.message.request.output_token_ids == decode.message.request.output_token_ids
        assert d.ctx.counters.kv_pull_failures == 1
        for rig in (p, d):
            await rig.idle()


@pytest.mark.parametrize("path", [TransferPath.STREAM, TransferPath.HOST_LOCAL])
async def test_kv_that_does_not_fit_the_decoder_fails_the_request_and_frees_its_blocks(
    tiny_model_dir, nats_server, redis_server, owner, path
):
    """Decode writes the KV into blocks it reserved as it arrives (services/decode/kv_sinks.py). A
    task whose KV names layers this model lacks — bytes the owner serves, which cannot go where
    the task says — ends with a clear error, not a trip back to prefill that would fail the same
    way; the reserved blocks are given back and the decoder serves on."""
    min_bytes = 0 if path is TransferPath.HOST_LOCAL else 1 << 40
    async with (
        stage_rig(P, tiny_model_dir, nats_server, redis_server, host_local_min_bytes=min_bytes) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server, host_local_min_bytes=min_bytes) as d,
    ):
        spec, decode = await prefilled(p, d, owner, "r-misfit")
        stream = await d.ctx.bus.events.outputs(spec.request_id)
        kv = decode.message.kv
        shifted = tuple(
            g.model_copy(update={"layer_start": g.layer_start + 8, "layer_end": g.layer_end + 8})
            for g in kv.groups
        )
        decode.message = decode.message.model_copy(update={"kv": kv.model_copy(update={"groups": shifted})})
        free = d.engine.blocks.num_free
        await d.handlers[Role.DECODE].take(decode)
        error = await stream.get(timeout=10)
        while isinstance(error, TokenDelta):  # the first token, which prefill sent
            error = await stream.get(timeout=10)
        assert isinstance(error, ErrorOutput) and error.code == "invalid_request_error"
        assert "does not fit this decoder" in error.message and "this model has 4" in error.message
        assert d.ctx.counters.kv_pull_failures == 0  # not sent back to prefill
        landed = d.engine.handoff
        await d.until(lambda: d.engine.blocks.num_free == free and not landed.landings, what="blocks back")
        # It serves on: the next request's KV lands and is answered.
        spec, _, _ = request(p, owner, "r-after-misfit", num_images=0, max_tokens=10)
        stream = await p.ctx.bus.events.outputs(spec.request_id)
        await p.ctx.dispatch.send(PrefillTask(request=spec), "test")
        await p.take(Role.PREFILL)
        await d.take(Role.DECODE)
        assert len(await answer(stream)) == 10
        for rig in (p, d):
            await rig.idle()


async def test_decode_tasks_taken_side_by_side_never_count_the_same_free_blocks(
    tiny_model_dir, nats_server, redis_server, owner
):
    """A decoder with room for one request's KV at a time takes two decode tasks at once, as its
    pull loop does. Room is asked and the blocks reserved in one engine call, so the second waits
    for the first to end instead of both counting the same free blocks and the second failing for
    want of them once its KV is pulled."""
    per_block = 4 * 2 * 16 * 2 * 16 * 4  # tiny-llava: 4 layers, K and V, 16 slots, 2 heads of 16, fp32
    async with (
        stage_rig(P, tiny_model_dir, nats_server, redis_server) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server, kv_cache_bytes=3 * per_block) as d,
    ):
        streams, tasks = [], []
        for rid in ("r-first", "r-second"):
            spec, _, _ = request(p, owner, rid, num_images=0, max_tokens=12)
            streams.append(await p.ctx.bus.events.outputs(spec.request_id))
            await p.ctx.dispatch.send(PrefillTask(request=spec), "test")
            await p.take(Role.PREFILL)
            tasks.append(await d.fetch(Role.DECODE))
        assert d.engine.blocks.num_blocks == 3  # one request's prompt and answer: 2 blocks
        await asyncio.gather(*(d.handlers[Role.DECODE].take(t) for t in tasks))
        assert [len(await answer(s)) for s in streams] == [12, 12]
        for rig in (p, d):
            await rig.idle()


@pytest.mark.parametrize("kv_stream", [True, False], ids=["streamed", "after-prefill"])
async def test_a_late_second_delivery_of_a_handed_on_prefill_task_is_a_duplicate(
    tiny_model_dir, nats_server, redis_server, owner, kv_stream
):
    """NATS delivers a task again when its ack is late; the second delivery can be fetched before the
    first is acked and taken after. It is the same task, not the request coming back: it must not
    replace the record that keeps the KV for decode (that released the KV and aborted the engine
    entry the first delivery's step still used)."""
    async with (  # a short ack wait: the second delivery comes a second after the first
        stage_rig(P, tiny_model_dir, nats_server, redis_server, ack_wait=1.0) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server, ack_wait=1.0) as d,
    ):
        p.handlers[Role.PREFILL].kv_stream = kv_stream
        spec, _, _ = request(p, owner, "r-late-ack", num_images=0)
        outputs = await p.ctx.bus.events.subscribe(p.ctx.bus.subjects.output(spec.request_id), OUTPUT_KINDS)
        await p.ctx.dispatch.send(PrefillTask(request=spec), "test")
        first = await p.fetch(Role.PREFILL)
        second = await p.fetch(Role.PREFILL, timeout=30)  # redelivered once the ack wait passed
        assert (second.stream_seq, second.deliveries) == (first.stream_seq, 2)
        await p.handlers[Role.PREFILL].take(first)
        decode = await d.fetch(Role.DECODE)  # handed on: the prefill task is settled, its KV kept
        with pytest.raises(AlreadyHeld):
            await p.handlers[Role.PREFILL].take(second)
        await second.ack()  # as the worker does with a duplicate
        await d.handlers[Role.DECODE].take(decode)
        assert len(await answer(outputs)) == spec.sampling.max_tokens
        assert d.ctx.counters.kv_pull_failures == 0
        for rig in (p, d):
            await rig.idle()
        await outputs.close()


async def test_a_hybrid_takes_a_requests_next_stage_once_its_earlier_one_lets_go(
    tiny_model_dir, nats_server, redis_server, owner, hf_generate
):
    """ED+P: encode on the ED instance, prefill elsewhere, decode back on the ED instance — whose
    decode task can arrive before the encode's hold is settled (the prefill instance was quick).
    That is the request's next stage, not a duplicate delivery: it is taken once the encode lets go
    (it was dropped, and its request hung)."""
    ed_roles = frozenset({Role.ENCODE, Role.DECODE})
    async with (
        stage_rig(ed_roles, tiny_model_dir, nats_server, redis_server) as ed,
        stage_rig(P, tiny_model_dir, nats_server, redis_server) as p,
    ):
        spec, prompt, _ = request(p, owner, "r-ed", num_images=0, max_tokens=6)
        stream = await ed.ctx.bus.events.outputs(spec.request_id)
        await ed.ctx.dispatch.send(PrefillTask(request=spec), "encode-stand-in")
        encoding = ed.ledger.begin(spec, Role.ENCODE, await ed.fetch(Role.PREFILL))  # still settling
        await p.ctx.dispatch.send(PrefillTask(request=spec), "encoded")
        await p.take(Role.PREFILL)
        decode = await ed.fetch(Role.DECODE)
        intake = StageWorker(ed.ctx, ed.handlers, set(), lambda: None, drain_timeout=5)
        taking = asyncio.create_task(intake._handle(ed.handlers[Role.DECODE], decode))
        await asyncio.sleep(0.5)  # the decode task meets the encode's hold (a delay, not a sync point)
        assert encoding.holds_task and not decode.settled, "the decode task was dropped as a duplicate"
        await ed.ledger.settle(spec.request_id)  # the encode's hand-on completes
        await taking
        assert await answer(stream) == hf_generate(prompt, [], 6)
        for rig in (ed, p):
            await rig.idle()


async def test_prefill_sends_int8_kv_and_decode_answers_from_it(
    tiny_model_dir, nats_server, redis_server, owner
):
    """`kv_wire=int8`: the decode task's KV travels packed — about a quarter of the float32 cache's
    bytes — and the decoder turns it back into its cache's dtype and answers in full."""
    async with (
        stage_rig(P, tiny_model_dir, nats_server, redis_server) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server) as d,
    ):
        p.handlers[Role.PREFILL].kv_wire = "int8"
        spec, _, _ = request(p, owner, "r-int8", num_images=0, max_tokens=10)
        stream = await p.ctx.bus.events.outputs(spec.request_id)
        await p.ctx.dispatch.send(PrefillTask(request=spec), "test")
        await p.take(Role.PREFILL)
        decode = await d.take(Role.DECODE)
        kv = decode.message.kv
        assert kv.wire == "int8" and kv.dtype == "float32"
        native = sum(nbytes_of(g.shape, kv.dtype) for g in kv.groups)
        sent = sum(nbytes_of(r.shape, r.dtype) for r in kv.refs())
        sent += sum(len(g.inline.data) for g in kv.groups if g.inline is not None)
        assert sum(int8_kv_nbytes(g.shape) for g in kv.groups) == sent < 0.3 * native
        assert len(await answer(stream)) == 10
        for rig in (p, d):
            await rig.idle()
        assert len(p.ctx.transfer.handles) == 0  # decode's release freed what it pulled
