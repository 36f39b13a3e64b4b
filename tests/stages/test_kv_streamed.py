"""KV streamed while prefill runs, when something goes wrong: the decode task is queued as the last
prefill step begins and the prefill task is settled then, so from that moment the decode task is the
request's one task. A prefill instance that dies before its outcome is served sends the request back
to prefill once (its own task is not redelivered); a cancel mid-step frees everything on both sides;
a request whose first token ends it ends at prefill, and its decoder lets go of it.

The prefill step is held inside its forward, after its last layer (its KV all streamed, its first
token not yet made), by a hook that waits for the test."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from common.protocol import DecodeTask, PrefillTask, SamplingParams
from common.roles import Role
from tests.stages.flows import D, P, answer, cancel, nothing_queued, request
from tests.stages.rig import StageRig, stage_rig


@contextlib.contextmanager
def held_after_forward(rig: StageRig):
    """While inside: the engine's next forward stops after its last layer until `release()`."""
    go, reached = threading.Event(), threading.Event()

    def wait(*_) -> None:
        reached.set()
        go.wait(30)

    hook = rig.engine.model.language_model.layers[-1].register_forward_hook(wait)
    try:
        yield reached, go.set
    finally:
        go.set()
        hook.remove()


async def streamed_task(p: StageRig, d: StageRig, spec) -> tuple:
    p.handlers[Role.PREFILL].kv_stream = True  # the default; said here, as the tests rely on it
    await p.ctx.dispatch.send(PrefillTask(request=spec), "test")
    prefill = await p.fetch(Role.PREFILL)
    await p.handlers[Role.PREFILL].take(prefill)
    decode = await d.fetch(Role.DECODE)
    assert isinstance(decode.message, DecodeTask) and decode.message.kv.tail, "the KV did not stream"
    return prefill, decode


async def test_a_prefill_that_dies_while_its_kv_streams_sends_the_request_back_once(
    tiny_model_dir, nats_server, redis_server, owner, hf_generate
):
    async with (
        stage_rig(P, tiny_model_dir, nats_server, redis_server) as p,
        stage_rig(P, tiny_model_dir, nats_server, redis_server) as p2,
        stage_rig(D, tiny_model_dir, nats_server, redis_server) as d,
    ):
        spec, prompt, _ = request(p, owner, "r-died", num_images=0, max_tokens=10)
        stream = await d.ctx.bus.events.outputs(spec.request_id)
        with held_after_forward(p) as (reached, release):
            prefill, decode = await streamed_task(p, d, spec)
            # Settled while the step is still held: the decode task is the request's one task now.
            # (Queued first, then settled: a decoder may have the task a moment before the ack.)
            await p.until(lambda: prefill.settled, what="the prefill task settled")
            assert await asyncio.to_thread(reached.wait, 30)
            taking = asyncio.create_task(d.handlers[Role.DECODE].take(decode))
            await d.until(lambda: d.ctx.ledger.get(spec.request_id) is not None, what="decode took it")
            p.ctx.fenced.set()  # taken for dead: it says nothing more
            p.serving.crash()  # its transfer server dies with it, the outcome never served
            await asyncio.wait_for(taking, 20)
            release()
        assert d.ctx.counters.kv_pull_failures == 1
        again = await p2.take(Role.PREFILL)  # sent back to prefill, once
        assert isinstance(again.message, PrefillTask) and again.message.request.output_token_ids == ()
        await nothing_queued(p2, Role.PREFILL)
        await d.take(Role.DECODE)
        assert await answer(stream) == hf_generate(prompt, [], 10)
        for rig in (p2, d):
            await rig.idle()


async def test_a_cancel_while_the_kv_streams_frees_everything(
    tiny_model_dir, nats_server, redis_server, owner
):
    async with (
        stage_rig(P, tiny_model_dir, nats_server, redis_server) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server) as d,
    ):
        spec, _, _ = request(p, owner, "r-cancelled", num_images=0, max_tokens=10)
        with held_after_forward(p) as (reached, release):
            _, decode = await streamed_task(p, d, spec)
            assert await asyncio.to_thread(reached.wait, 30)
            taking = asyncio.create_task(d.handlers[Role.DECODE].take(decode))
            await d.until(lambda: d.ctx.ledger.get(spec.request_id) is not None, what="decode took it")
            await cancel(spec.request_id, p, d)
            release()
            await asyncio.wait_for(asyncio.gather(taking, return_exceptions=True), 20)
        for rig in (p, d):
            await rig.idle()
        assert len(p.ctx.transfer.handles) == 0
        await nothing_queued(p, Role.PREFILL)
        await nothing_queued(d, Role.DECODE)


async def test_a_request_whose_first_token_ends_it_ends_at_prefill(
    tiny_model_dir, nats_server, redis_server, owner, hf_generate
):
    async with (
        stage_rig(P, tiny_model_dir, nats_server, redis_server) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server) as d,
    ):
        spec, prompt, _ = request(p, owner, "r-one", num_images=0, max_tokens=10)
        first = hf_generate(prompt, [], 1)[0]
        stop = SamplingParams(max_tokens=10, stop_token_ids=(first,))  # its first token stops it
        spec = spec.model_copy(update={"sampling": stop})
        stream = await d.ctx.bus.events.outputs(spec.request_id)
        _, decode = await streamed_task(p, d, spec)
        await d.handlers[Role.DECODE].take(decode)
        assert await answer(stream) == [first]
        for rig in (p, d):
            await rig.idle()
        assert len(p.ctx.transfer.handles) == 0  # the decoder released what it pulled
        assert d.ctx.counters.decodes_admitted == 0
