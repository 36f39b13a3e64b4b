"""Structured output through the stages, with images, under every method: the grammar masks the
first token where prefill samples it and every decode step after, on whichever instance runs it,
and is rebuilt from the emitted tokens when a request moves — to the decoder after prefill, and to
a live decoder after the one streaming it died mid-answer. Every answer parses and validates.

Real engines, NATS, Redis and transfer (tests/stages/rig.py), a small pull loop per role standing
in for the worker's, and the gateway's own output journal for the resume."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import pytest

from common.bus import EventStream, keep_alive
from common.protocol import (
    EncodeTask,
    FinalOutput,
    ImageSpec,
    RequestSpec,
    SamplingParams,
    TensorRef,
    TokenDelta,
    dtype_name,
)
from common.roles import Role
from services.gateway.journal import OutputJournal
from services.worker.ledger import AlreadyHeld
from tests.helpers.images import make_image
from tests.helpers.schemas import MAX_TOKENS, SCHEMAS, grammar, valid
from tests.stages.rig import ACK_WAIT, ServingThread, StageRig, stage_rig

E, P, D = (frozenset({r}) for r in Role)
METHODS = {"e+p+d": (E, P, D), "ep+d": (E | P, D), "ed+p": (E | D, P), "epd": (E | P | D,)}
QUESTION = "Fill in the form from the picture, as JSON"


class Pulling:
    """Each rig's roles fetch their tasks and take them, as a worker's pull loops would."""

    def __init__(self, rigs: list[StageRig]) -> None:
        self.rigs = rigs
        self.failures: list[BaseException] = []
        self._taking: set[asyncio.Task] = set()
        self.loops = {id(rig): self._loops(rig) for rig in rigs}

    def _loops(self, rig: StageRig, roles: tuple[Role, ...] | None = None) -> list[asyncio.Task]:
        """A pull loop per role, and the keep-alive of the tasks the rig holds (the worker's)."""
        pulls = [asyncio.create_task(self._pull(rig, role)) for role in roles or rig.handlers]
        return [*pulls, asyncio.create_task(keep_alive(rig.ledger.tasks, 1.0))]

    def start(self, rig: StageRig) -> None:
        self.loops[id(rig)] = self._loops(rig)

    async def _pull(self, rig: StageRig, role: Role) -> None:
        consumer, handler = await rig.ctx.bus.consumer(role), rig.handlers[role]
        while True:
            room = 0 if rig.ctx.fenced.is_set() else handler.room(rig.ctx.engine.stats.load())
            if room <= 0:  # only as many as the engine has room for, as the worker pulls
                await asyncio.sleep(0.02)
                continue
            for task in await consumer.fetch(room, timeout=0.2):
                taking = asyncio.create_task(self._take(rig, role, task))
                self._taking.add(taking)
                taking.add_done_callback(self._done)

    @staticmethod
    async def _take(rig: StageRig, role: Role, task) -> None:
        """As the worker does: a request whose next stage is this instance's too (ED+P's decode)
        is taken once its earlier stage here has let go of it."""
        deadline = time.monotonic() + 10
        while True:
            try:
                return await rig.handlers[role].take(task)
            except AlreadyHeld:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.02)

    def _done(self, taking: asyncio.Task) -> None:
        self._taking.discard(taking)
        if not taking.cancelled() and taking.exception() is not None:
            self.failures.append(taking.exception())

    async def stop(self, rig: StageRig | None = None) -> None:
        """Stop pulling for `rig` (all of them when None)."""
        loops = (
            self.loops.pop(id(rig), []) if rig is not None else [t for ts in self.loops.values() for t in ts]
        )
        if rig is None:
            self.loops.clear()
            loops += list(self._taking)
        for loop in loops:
            loop.cancel()
        await asyncio.gather(*loops, return_exceptions=True)


@contextlib.asynccontextmanager
async def deployed(
    roles: tuple[frozenset[Role], ...], model, nats, redis, ack_wait: float = ACK_WAIT
) -> AsyncIterator[Pulling]:
    async with contextlib.AsyncExitStack() as stack:
        rigs = [
            await stack.enter_async_context(stage_rig(r, model, nats, redis, ack_wait=ack_wait))
            for r in roles
        ]
        pulling = Pulling(rigs)
        try:
            yield pulling
        finally:
            await pulling.stop()
        assert not pulling.failures, pulling.failures


def spec_of(rig: StageRig, gateway: ServingThread, rid: str, schema: dict, seed: int | None, image: int):
    """A request as the gateway sends it: its image's pixels served by handle, its grammar in."""
    processed = rig.engine.processor.process(rig.engine.chat_prompt(QUESTION, 1), [make_image(image)])
    (img,) = processed.images
    handle = gateway.backend.publish(img.pixel_values.contiguous())
    pixels = TensorRef(
        owner="gateway", address=gateway.backend.address, handle=handle,
        shape=tuple(img.pixel_values.shape), dtype=dtype_name(img.pixel_values.dtype),
    )  # fmt: skip
    sampling = SamplingParams(
        max_tokens=MAX_TOKENS, grammar=grammar(schema), temperature=0.0 if seed is None else 1.0, seed=seed
    )
    image = ImageSpec(content_hash=img.content_hash, num_tokens=img.num_tokens, pixels=pixels)
    return RequestSpec(
        request_id=rid, prompt_token_ids=tuple(processed.token_ids), sampling=sampling,
        arrival_time=time.time(), images=(image,),
    )  # fmt: skip


async def collected(stream: EventStream, journal: OutputJournal | None = None, timeout: float = 120.0):
    """(output tokens in index order, finish reason); each token journaled as the gateway does."""
    tokens: dict[int, int] = {}
    final, released = None, 0
    async with asyncio.timeout(timeout):
        while final is None or len(tokens) < final.num_outputs:
            msg = await stream.get()
            if isinstance(msg, TokenDelta):
                tokens.update({msg.index + k: t for k, t in enumerate(msg.token_ids)})
                fresh = []
                while released in tokens:
                    fresh.append(tokens[released])
                    released += 1
                if journal is not None and fresh:
                    journal.add(msg.request_id, fresh)
                    await journal.write()
            elif isinstance(msg, FinalOutput):
                final = msg
            else:
                raise AssertionError(f"unexpected {msg}")
    return [tokens[i] for i in range(final.num_outputs)], final.finish_reason


async def run_all(
    pulling: Pulling, owner: ServingThread, asked: list[tuple[str, dict, int | None]], tag: str
):
    """Send every (name, schema, seed) request at once; their answers, in order. `tag` makes the
    request ids new (a task sent again under an id JetStream saw lately is dropped as a duplicate)."""
    first = pulling.rigs[0]
    specs = [
        spec_of(first, owner, f"{tag}-{name}-{i}", schema, seed, i % 3)
        for i, (name, schema, seed) in enumerate(asked)
    ]
    streams = [await first.ctx.bus.events.outputs(s.request_id) for s in specs]
    for spec in specs:
        await first.ctx.dispatch.send(EncodeTask(request=spec), "test")
    try:
        return await asyncio.gather(*(collected(s) for s in streams))
    finally:
        for stream in streams:
            await stream.close()


def check(tokenizer, asked, results) -> None:
    for (name, schema, seed), (tokens, reason) in zip(asked, results, strict=True):
        assert reason == "stop", (name, seed, reason)
        valid(schema, json.loads(tokenizer.decode(tokens)))


def requests(per_schema: int) -> list[tuple[str, dict, int | None]]:
    """Each schema `per_schema` times: greedy first, then seeded samples."""
    return [(n, s, None if k == 0 else k) for n, s in SCHEMAS.items() for k in range(per_schema)]


@pytest.mark.slow  # a sweep of hundreds of answers through four rigs: `make test`, not the fast tier
async def test_two_hundred_answers_of_ten_schemas_validate_under_the_four_methods(
    tiny_model_dir, nats_server, redis_server, owner
):
    asked = requests(5)
    for method, roles in METHODS.items():
        async with deployed(roles, tiny_model_dir, nats_server, redis_server) as pulling:
            results = await run_all(pulling, owner, asked, method)
            check(pulling.rigs[0].engine.tokenizer, asked, results)
        assert len(results) == 50, method


async def test_a_decoder_killed_mid_answer_is_replaced_and_the_answer_still_validates(
    tiny_model_dir, nats_server, redis_server, owner
):
    """The decoder dies after some tokens reached the client: its task comes back (its ack lapses),
    a live decoder sends the request to prefill over the journaled tokens, and prefill and the new
    decoder rebuild the grammar from them. The answer is the one an undisturbed run gives."""
    schema = SCHEMAS["line_items"]
    # A short ack wait: the dead decoder's task comes back two seconds after its last beat.
    async with deployed((E | P, D, D), tiny_model_dir, nats_server, redis_server, ack_wait=2.0) as pulling:
        ep, d1, d2 = pulling.rigs
        await pulling.stop(d2)  # the spare decoder waits until the first one dies
        undisturbed, _ = (await run_all(pulling, owner, [("whole", schema, None)], "undisturbed"))[0]

        spec = spec_of(ep, owner, "r-killed", schema, None, 0)
        journal = OutputJournal(ep.ctx.store)
        stream = await ep.ctx.bus.events.outputs(spec.request_id)
        answer = asyncio.create_task(collected(stream, journal))
        await ep.ctx.dispatch.send(EncodeTask(request=spec), "test")
        await d1.until(
            lambda: len(getattr(d1.ledger.get(spec.request_id), "sent", ())) >= 6, 60, "six tokens"
        )
        d1.ctx.fenced.set()  # taken for dead: it says nothing more and pulls nothing more
        await pulling.stop(d1)
        pulling.start(d2)
        tokens, reason = await answer
        await stream.close()
        assert d2.ctx.counters.resumed_tokens >= 6  # resumed from the journal, not from the start
        assert reason == "stop" and tokens == undisturbed
        valid(schema, json.loads(ep.engine.tokenizer.decode(tokens)))
        await d1.ctx.engine.call(lambda: d1.engine.abort(spec.request_id))  # the dead one's leftovers
