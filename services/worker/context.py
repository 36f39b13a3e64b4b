"""What a stage handler works with: the parts of a worker it needs, and the steps every stage shares
(pulling a tensor, admitting into the engine, resuming from the streamed tokens, failing a request).

A handler gets a StageContext, never the worker: tests build one from a real engine, NATS and Redis
without the rest of a worker, and a handler cannot reach into the pull loop or the drain.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import torch

from common.bus import Bus, Task
from common.dispatch import Dispatcher
from common.engine import AdmissionError
from common.engine.processor import InputError
from common.engine.spec_prompt import spec_prompt
from common.protocol import ErrorOutput, InlineTensor, RequestSpec, TensorRef
from common.protocol.sampling import choice_id
from common.roles import Role
from common.store import Store
from common.transfer import Sink, TransferBackend, TransferError, TransferPath, fetch
from services.worker.counters import Counters
from services.worker.engine_loop import EngineLoop
from services.worker.ledger import Held, Ledger
from services.worker.stage_metrics import StageMetrics
from services.worker.stage_spans import StageSpans

log = logging.getLogger(__name__)


@dataclass
class StageContext:
    instance_id: str
    roles: frozenset[Role]
    engine: EngineLoop  # .engine for fixed facts (config, processor, sizes); .call for anything live
    ledger: Ledger
    bus: Bus
    store: Store
    transfer: TransferBackend
    dispatch: Dispatcher
    counters: Counters
    draining: asyncio.Event = field(default_factory=asyncio.Event)  # set when the worker drains
    fenced: asyncio.Event = field(default_factory=asyncio.Event)  # set once taken for dead: do nothing
    metrics: StageMetrics = field(default_factory=StageMetrics.unregistered)
    spans: StageSpans = field(default_factory=StageSpans.off)  # each stage's span, when tracing is on

    async def pull(self, held: Held, ref: InlineTensor | TensorRef | None) -> torch.Tensor:
        """A tensor a task points to, copied out of the transfer pool. Raises TransferError when it
        cannot be had, and Cancelled when the request was cancelled while it came."""
        return (await self.pull_with_path(held, ref))[0]

    async def pull_with_path(
        self, held: Held, ref: InlineTensor | TensorRef | None
    ) -> tuple[torch.Tensor, TransferPath]:
        """`pull`, and how the tensor came (host-local, stream, inline): the transfer metrics say it.
        A GPU tensor copied host-local lands on this instance's GPU, no copy more."""
        if ref is None:
            raise TransferError("nothing to pull")
        pulled = await fetch(self.transfer, ref)
        tensor = pulled.take()  # out of the pool buffer, which goes back for reuse
        self.ledger.check_live(held)
        return tensor, pulled.path

    async def pull_into(self, held: Held, ref: InlineTensor | TensorRef, sink: Sink) -> TransferPath:
        """`pull`, written into `sink` where the puller keeps it (common/transfer/sink.py); how it
        came."""
        pulled = await fetch(self.transfer, ref, into=sink)
        self.ledger.check_live(held)
        return pulled.path

    async def admit(
        self, held: Held, pixels: list[torch.Tensor | None], features: list[torch.Tensor | None]
    ) -> None:
        """Start the request in the engine with each image's pixels or features; a request the
        engine can never run fails here with the engine's reason."""
        spec = held.spec
        try:
            prompt = spec_prompt(spec, self.engine.engine.processor.placeholder_ids, pixels, features)
            outputs = list(spec.output_token_ids)
            await self.ledger.enter(
                held,
                lambda e: e.add_request(
                    prompt, params=spec.sampling, request_id=spec.request_id, output_token_ids=outputs
                ),
            )
        except (AdmissionError, InputError, ValueError) as exc:
            await self.fail(spec.request_id, "invalid_request_error", str(exc))

    async def resumed(self, task: Task) -> RequestSpec | None:
        """The task's request, resuming from the tokens already streamed if this is a redelivery: the
        instance that had it may have died while generating (a hybrid holds its task until the end).

        A request of n choices that had been forked (some choice streamed a token) resumes as its
        choices, each from its own tokens: one task each, queued now, and this one settled (None)."""
        spec = task.message.request
        if not task.redelivered:
            return spec
        if spec.sampling.n > 1:
            ids = [choice_id(spec.request_id, i) for i in range(spec.sampling.n)]
            streamed = [await self.streamed(rid, ()) for rid in ids]
            if not any(streamed):
                return spec  # never forked, or nothing reached the client: it runs afresh
            for index, (rid, outputs) in enumerate(zip(ids, streamed, strict=True)):
                choice = spec.model_copy(
                    update={"request_id": rid, "sampling": spec.sampling.for_choice(index)}
                )
                again = task.message.model_copy(update={"request": choice.with_outputs(outputs)})
                await self.dispatch.send(again, task.stream_seq)
            await task.ack()
            return None
        return spec.with_outputs(await self.streamed(spec.request_id, spec.output_token_ids))

    async def streamed(self, request_id: str, known: tuple[int, ...]) -> tuple[int, ...]:
        """The output tokens a request resumes from: the gateway's journal of what it streamed, when
        that extends what the task knows (`known`: tokens generated before the task was queued)."""
        try:
            journal = tuple(await self.store.requests.streamed_outputs(request_id))
        except Exception as exc:  # no journal: resume from what the task knows, still correct
            log.warning("output journal of %s unreadable: %r", request_id, exc)
            return known
        if len(journal) > len(known) and journal[: len(known)] == known:
            self.counters.resumed_tokens += len(journal) - len(known)
            return journal
        return known

    async def watch_cancels(self) -> None:
        """A request cancelled anywhere (its client left, or it failed) ends here too."""
        async with await self.bus.events.cancels() as stream:
            async for cancel in stream:
                await self.ledger.abort(cancel.request_id)

    async def fail(self, request_id: str, code: str, message: str) -> None:
        """Tell the gateway the request failed, and end it here (its task is settled: no retry). The
        error stays among the finals for the window, to be said again should it be lost."""
        self.counters.errors += 1
        error = ErrorOutput(request_id=request_id, code=code, message=message, source=self.instance_id)
        held = self.ledger.get(request_id)
        self.ledger.finals.keep(request_id, held.sent if held is not None else [], error)
        try:
            await self.bus.events.publish_output(error)
        finally:
            await self.ledger.abort(request_id)
