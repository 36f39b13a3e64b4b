"""The collector puts a request's outputs back in order, whatever the network did to them: out of
order, repeated, overlapping, or lost — a lost output is asked for again (a Resend), and what the
holder then says again arrives on the same subscription."""

from __future__ import annotations

import asyncio
import time

import pytest
from transformers import AutoTokenizer

from common.bus import EventStream
from common.errors import APIError
from common.protocol import OUTPUT_KINDS, ErrorOutput, FinalOutput, TokenDelta, Usage
from services.gateway.collector import GAP_WAIT, SILENCE_FIRST, OutputCollector

TOKENS = [101, 202, 303, 404, 505, 606]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def delta(index: int, *ids: int) -> TokenDelta:
    return TokenDelta(request_id="r", index=index, token_ids=ids)


def final(n: int = len(TOKENS)) -> FinalOutput:
    usage = Usage(prompt_tokens=3, completion_tokens=n)
    return FinalOutput(request_id="r", finish_reason="length", usage=usage, num_outputs=n)


def collector(tokenizer, held=(), reconnects=None, deadline=10.0, keepalive=None):
    """A collector whose asks are answered the way a worker answers a Resend: the tokens `held`
    has from the index asked, then its final. `asked` lists the indices asked from."""
    stream = EventStream(OUTPUT_KINDS, None)
    asked: list[int] = []

    async def ask(index: int) -> None:
        asked.append(index)
        tokens = [m for m in held if isinstance(m, TokenDelta)]
        ids = [t for m in sorted(tokens, key=lambda m: m.index) for t in m.token_ids][index:]
        if ids:
            stream.deliver(delta(index, *ids))
        for m in held:
            if isinstance(m, FinalOutput):
                stream.deliver(m)

    made = OutputCollector(
        stream, tokenizer, (), deadline=time.perf_counter() + deadline, arrival=time.perf_counter(),
        keepalive=keepalive, ask=ask, reconnects=reconnects,
    )  # fmt: skip
    made.asked = asked
    return made, stream


async def drain(made: OutputCollector) -> list[int]:
    ids = []
    async for piece in made.pieces():
        ids += piece.token_ids
    return ids


async def test_out_of_order_repeated_and_overlapping_outputs_come_out_once_in_order(tokenizer):
    made, stream = collector(tokenizer)
    for msg in [
        delta(2, 303),
        delta(0, 101),
        delta(0, 101),
        delta(1, 202, 303, 404),
        final(),
        delta(4, 505, 606),
    ]:
        stream.deliver(msg)
    assert await drain(made) == TOKENS
    assert made.asks == 0 and made.complete
    assert made.outcome.completion_tokens == len(TOKENS)


async def test_a_lost_output_is_asked_for_again_once_the_hole_has_stayed_open(tokenizer):
    held = [delta(i, t) for i, t in enumerate(TOKENS)] + [final()]
    made, stream = collector(tokenizer, held)
    for msg in [delta(0, 101), delta(1, 202), delta(3, 404), delta(4, 505), delta(5, 606), final()]:
        stream.deliver(msg)  # index 2 lost on the way
    started = time.perf_counter()
    assert await drain(made) == TOKENS
    assert made.asks == 1 and GAP_WAIT <= time.perf_counter() - started < GAP_WAIT + 1
    assert made.asked == [2]  # from the first token not released


async def test_a_lost_final_is_asked_for_again_after_a_silence(tokenizer):
    held = [delta(i, t) for i, t in enumerate(TOKENS)] + [final()]
    made, stream = collector(tokenizer, held)
    for i, t in enumerate(TOKENS):
        stream.deliver(delta(i, t))  # every token, but the final never comes
    started = time.perf_counter()
    assert await drain(made) == TOKENS
    assert made.asks == 1 and SILENCE_FIRST <= time.perf_counter() - started < SILENCE_FIRST + 1
    assert made.asked == [len(TOKENS)]


async def test_a_reconnect_asks_again_at_once(tokenizer):
    reconnects = [0]
    held = [delta(i, t) for i, t in enumerate(TOKENS)] + [final()]
    made, stream = collector(tokenizer, held, reconnects=lambda: reconnects[0])
    stream.deliver(delta(0, 101))
    reconnects[0] += 1  # NATS came back: whatever was in flight may be gone
    started = time.perf_counter()
    assert await drain(made) == TOKENS
    assert made.asks == 1 and time.perf_counter() - started < GAP_WAIT
    assert made.asked == [0]  # asked before the queued delta was taken


async def test_an_error_output_or_the_deadline_ends_it_with_an_api_error(tokenizer):
    made, stream = collector(tokenizer)
    stream.deliver(ErrorOutput(request_id="r", code="service_unavailable", message="features gone"))
    with pytest.raises(APIError) as err:
        await drain(made)
    assert err.value.status == 503
    made, _ = collector(tokenizer, deadline=0.3)
    with pytest.raises(APIError) as err:
        await drain(made)
    assert err.value.status == 504


async def test_silence_yields_keep_alive_pieces(tokenizer):
    made, stream = collector(tokenizer, keepalive=0.1)
    pieces = made.pieces()
    first = await anext(pieces)
    assert first.keepalive and not first.token_ids
    stream.deliver(delta(0, 101))
    assert (await anext(pieces)).token_ids == [101]
    await asyncio.sleep(0)
