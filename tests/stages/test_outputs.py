"""What a worker can say again, and for how long: the one output recovery rule (a gateway that
missed outputs asks with a Resend; whoever has the request answers from its ledger) against a real
engine, NATS, Redis and transfer. A prefill instance that handed a request on answers nothing for
it, a decoder answers for the whole request (the first token too), and an ended request's tokens
and final are kept only for the finals window."""

from __future__ import annotations

import asyncio

import pytest

from common.bus import EventStream
from common.protocol import ErrorOutput, FinalOutput, Message, PrefillTask, Resend, TokenDelta, Usage
from common.roles import Role
from services.worker.finals import Finals
from tests.stages.flows import answer, prefilled, request
from tests.stages.rig import StageRig, stage_rig

P, D = frozenset({Role.PREFILL}), frozenset({Role.DECODE})
WINDOW = 1.0  # seconds the decoder keeps a finished request's outputs here


async def said_again(rig: StageRig, stream: EventStream, ask: Resend) -> list[Message]:
    """Ask over the bus, as a gateway does, and gather what comes back until the final (or, when
    nothing is owed, a short quiet)."""
    await rig.ctx.bus.events.resend(ask)
    got: list[Message] = []
    while True:
        try:
            got.append(await stream.get(timeout=2.0))
        except TimeoutError:
            return got
        if isinstance(got[-1], FinalOutput | ErrorOutput):
            return got


@pytest.mark.parametrize("kv_stream", [False, True], ids=["after-prefill", "streamed"])
async def test_the_decoder_says_a_request_again_until_its_window_has_passed(
    tiny_model_dir, nats_server, redis_server, owner, kv_stream
):
    async with (
        stage_rig(P, tiny_model_dir, nats_server, redis_server) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server, finals_window=WINDOW) as d,
    ):
        p.handlers[Role.PREFILL].kv_stream = kv_stream
        rid = "r-said-again"
        stream = await p.ctx.bus.events.outputs(rid)
        _, decode = await prefilled(p, d, owner, rid)
        first = decode.message.request.output_token_ids
        (kept,) = list(p.ledger)  # handed on: it keeps the KV for decode, and no outputs
        # Streamed, the task settles as the step begins and the outputs go once the step is over.
        await p.until(lambda: not kept.holds_task and not kept.sent, what="the request handed on")
        assert kept.kv_handles and kept.sent == []
        await p.outputs.say_again(Resend(request_id=rid))
        assert p.outputs.said_again == 0

        await d.handlers[Role.DECODE].take(decode)
        tokens = await answer(stream)
        assert tuple(tokens[: len(first)]) == first
        await d.idle()
        assert len(d.ledger.finals) == 1 and len(p.ledger.finals) == 0

        # Ended: the tokens from the index asked, then the final, from the finals window.
        again = await said_again(d, stream, Resend(request_id=rid, index=3))
        delta, final = again
        assert isinstance(delta, TokenDelta) and delta.index == 3 and list(delta.token_ids) == tokens[3:]
        assert isinstance(final, FinalOutput) and final.num_outputs == len(tokens)
        assert delta.source == final.source == d.ctx.instance_id

        # Past the window the timer has dropped it, with nothing else happening in the instance.
        await d.until(lambda: len(d.ledger.finals) == 0, timeout=WINDOW + 5, what="the finals window")
        assert await said_again(d, stream, Resend(request_id=rid)) == []
        await stream.close()


@pytest.mark.parametrize("kv_stream", [False, True], ids=["after-prefill", "streamed"])
async def test_a_running_request_is_said_again_from_the_first_token_by_its_decoder(
    tiny_model_dir, nats_server, redis_server, owner, kv_stream
):
    """Decode no longer restates the first token when it starts: had prefill's been lost, the
    gateway's ask reaches the decoder, whose record begins with the tokens the task brought — or,
    when the KV streamed and the task went out before the first token, with the prefill's outcome."""
    async with (
        stage_rig(P, tiny_model_dir, nats_server, redis_server) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server) as d,
    ):
        p.handlers[Role.PREFILL].kv_stream = kv_stream
        rid = "r-first-again"
        spec, _, _ = request(p, owner, rid, num_images=0, max_tokens=200)
        spec = spec.model_copy(update={"sampling": spec.sampling.model_copy(update={"ignore_eos": True})})
        stream = await d.ctx.bus.events.outputs(rid)
        await p.ctx.dispatch.send(PrefillTask(request=spec), "test")
        await p.take(Role.PREFILL)
        decode = await d.fetch(Role.DECODE)
        assert bool(decode.message.kv.tail) == kv_stream
        await d.handlers[Role.DECODE].take(decode)
        await d.ctx.bus.events.resend(Resend(request_id=rid))  # while it decodes
        got: list[Message] = []
        async with asyncio.timeout(60):
            while not got or not isinstance(got[-1], FinalOutput):
                got.append(await stream.get())
        from_prefill = [m for m in got if m.source == p.ctx.instance_id]
        assert [(m.index, len(m.token_ids)) for m in from_prefill] == [(0, 1)]  # its first token, once
        first = from_prefill[0].token_ids
        again = [
            m for m in got if isinstance(m, TokenDelta) and m.index == 0 and m.source == d.ctx.instance_id
        ]
        assert again and again[0].token_ids[: len(first)] == first
        assert got[-1].num_outputs == 200
        for rig in (p, d):
            await rig.idle()
        await stream.close()


async def test_a_failed_request_says_its_error_again(tiny_model_dir, nats_server, redis_server):
    async with stage_rig(D, tiny_model_dir, nats_server, redis_server, finals_window=WINDOW) as d:
        rid = "r-failed"
        stream = await d.ctx.bus.events.outputs(rid)
        await d.ctx.fail(rid, "service_unavailable", "features and pixels are both gone")
        first = await stream.get(timeout=5)
        (again,) = await said_again(d, stream, Resend(request_id=rid))
        assert isinstance(again, ErrorOutput) and again == first
        await d.until(lambda: len(d.ledger.finals) == 0, timeout=WINDOW + 5, what="the finals window")
        await stream.close()


def test_finals_leave_oldest_first_once_their_window_has_passed() -> None:
    now = [0.0]
    finals = Finals(window=10.0, clock=lambda: now[0])
    usage = Usage(prompt_tokens=1, completion_tokens=1)
    final = FinalOutput(request_id="a", finish_reason="length", usage=usage, num_outputs=1)
    for rid in "abc":
        finals.keep(rid, [7], final)
        now[0] += 4.0
    finals.keep("a", [7, 8], final)  # ended again (a retry): it goes to the back, with its new tokens
    assert len(finals) == 3
    now[0] = 14.5  # b (ended at 4.0) is past the window; c (8.0) and a (12.0) are not
    assert finals.get("b") is None and len(finals) == 2
    now[0] = 18.0
    assert finals.get("c") is None and finals.get("a").tokens == (7, 8)
    now[0] = 22.0
    assert finals.get("a") is None and len(finals) == 0
