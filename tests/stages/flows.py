"""Requests as the gateway sends them to stage rigs (tests/stages/rig.py), rigs pulling their tasks as
workers do, and what a test reads back: the answer's tokens in order, a cancel as the gateway
broadcasts it, an empty queue."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from common.bus import EventStream, Task
from common.engine.processor import ProcessedPrompt
from common.protocol import (
    Cancel,
    EncodeTask,
    FinalOutput,
    ImageSpec,
    PrefillTask,
    RequestSpec,
    SamplingParams,
    TensorRef,
    TokenDelta,
    dtype_name,
)
from common.roles import Role
from services.worker.worker import StageWorker
from tests.helpers.images import make_image
from tests.stages.rig import ServingThread, StageRig

E, P, D = (frozenset({r}) for r in Role)
QUESTION = "What is in the picture? Describe it"


def spec_of(
    processed: ProcessedPrompt, gateway: ServingThread, rid: str, sampling: SamplingParams
) -> RequestSpec:
    """The request the gateway would send for `processed`: each image's (or clip's) pixels served by
    `gateway` by handle, with what its family's positions need (grid, size, seconds per patch)."""
    specs = []
    for img in processed.images:
        handle = gateway.backend.publish(img.pixel_values.contiguous())
        pixels = TensorRef(
            owner="gateway", address=gateway.backend.address, handle=handle,
            shape=tuple(img.pixel_values.shape), dtype=dtype_name(img.pixel_values.dtype),
        )  # fmt: skip
        specs.append(
            ImageSpec(
                content_hash=img.content_hash, num_tokens=img.num_tokens, pixels=pixels,
                grid_thw=img.grid_thw, image_size=img.image_size, video=img.video,
                seconds_per_patch=img.seconds_per_patch,
            )
        )  # fmt: skip
    return RequestSpec(
        request_id=rid, prompt_token_ids=tuple(processed.token_ids), images=tuple(specs),
        sampling=sampling, arrival_time=time.time(),
    )  # fmt: skip


def request(rig: StageRig, gateway: ServingThread, rid: str, num_images: int, max_tokens: int = 12):
    """A request as the gateway sends it: processed prompt, pixels served by the gateway by handle."""
    images = [make_image(i) for i in range(num_images)]
    prompt = rig.engine.chat_prompt(QUESTION, num_images)
    processed = rig.engine.processor.process(prompt, images)
    return spec_of(processed, gateway, rid, SamplingParams(max_tokens=max_tokens)), prompt, images


async def prefilled(p: StageRig, d: StageRig, owner: ServingThread, rid: str) -> tuple[RequestSpec, Task]:
    """A text request prefilled by `p`, and the decode task `d` fetched for it (not yet taken)."""
    spec, _, _ = request(p, owner, rid, num_images=0)
    await p.ctx.dispatch.send(PrefillTask(request=spec), "test")
    await p.take(Role.PREFILL)
    return spec, await d.fetch(Role.DECODE)


async def answer(stream: EventStream, timeout: float = 30.0) -> list[int]:
    """The output tokens in index order, up to the final message."""
    tokens: dict[int, int] = {}
    expected = None
    async with asyncio.timeout(timeout):
        while expected is None or len(tokens) < expected:
            msg = await stream.get()
            if isinstance(msg, TokenDelta):
                tokens.update({msg.index + k: t for k, t in enumerate(msg.token_ids)})
            elif isinstance(msg, FinalOutput):
                expected = msg.num_outputs
            else:
                raise AssertionError(f"unexpected {msg}")
    return [tokens[i] for i in range(expected)]


async def cancel(rid: str, *rigs: StageRig) -> None:
    """Cancel as the gateway does (a broadcast), and wait until every rig named has dropped it."""
    await rigs[0].ctx.bus.events.cancel(Cancel(request_id=rid, reason="client went away"))
    for rig in rigs:
        await rig.until(lambda rig=rig: rid not in rig.ledger, what=f"{rid} dropped by {rig.ctx.instance_id}")


async def nothing_queued(rig: StageRig, role: Role) -> None:
    consumer = await rig.ctx.bus.consumer(role)
    assert await consumer.fetch(1, timeout=0.3) == [], f"a {role} task was queued for a cancelled request"


@contextlib.asynccontextmanager
async def serving(*rigs: StageRig) -> AsyncIterator[None]:
    """Each rig pulling its roles' shared queues through a worker's own intake (StageWorker: room by
    the stage's pull rule, tombstones, a hybrid's next stage waiting for its earlier one) until the
    block ends: the rigs then serve requests as the deployment's workers would."""
    pulls = []
    for rig in rigs:
        intake = StageWorker(rig.ctx, rig.handlers, set(), lambda: None, drain_timeout=5)
        pulls += [asyncio.create_task(intake.pull(h)) for h in rig.handlers.values() if h.shared_queue]
    try:
        yield
    finally:
        for pull in pulls:
            pull.cancel()
        await asyncio.gather(*pulls, return_exceptions=True)


async def ask(
    rig: StageRig, gateway: ServingThread, processed: ProcessedPrompt, rid: str, max_tokens: int
) -> list[int]:
    """Send a request as the gateway routes it (to encode when it has images, else to prefill) and
    wait for its answer's tokens."""
    spec = spec_of(processed, gateway, rid, SamplingParams(max_tokens=max_tokens))
    stream = await rig.ctx.bus.events.outputs(rid)
    try:
        await rig.ctx.dispatch.send(
            EncodeTask(request=spec) if spec.images else PrefillTask(request=spec), "gateway"
        )
        return await answer(stream, timeout=60)
    finally:
        await stream.close()
