"""Turning each engine step's outputs into messages: token deltas and finals to the gateway, and
hand-offs to the handler of the stage that queues the request's next one.

Outputs go over core NATS, which loses what is in flight when the broker dies or a subscriber is
away. The one way they are recovered (docs/architecture.md, "Lost outputs"): the gateway asks, with
a Resend, and whoever has the request says its outputs again from the index asked. What a worker
can say again is what its ledger holds: each running request's tokens (`Held.sent`), and the
tokens and final of requests that ended here within the finals window (`Ledger.finals`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

from common.engine import RequestOutput
from common.protocol import FinalOutput, Message, Resend, TokenDelta, Usage
from common.roles import Role
from services.worker.context import StageContext
from services.worker.ledger import Cancelled, Held, known_logprobs
from services.worker.stage import StageHandler

log = logging.getLogger(__name__)
HandOn = Callable[[Held], Awaitable[None]]


class OutputPublisher:
    def __init__(
        self, ctx: StageContext, hand_on: Mapping[Role, HandOn], handlers: Iterable[StageHandler] = ()
    ) -> None:
        self.ctx = ctx
        self.hand_on = hand_on  # the next stage -> whoever queues it (the handler of the stage before)
        self.handlers = tuple(handlers)  # told of a first token and of an end: their marks and metrics
        self.me = ctx.instance_id
        self.said_again = 0  # Resends answered with something

    @classmethod
    def for_handlers(cls, ctx: StageContext, handlers: Iterable[StageHandler]) -> OutputPublisher:
        """Each hand-off goes to the handler whose stage queues the next one."""
        handlers = tuple(handlers)
        return cls(ctx, {h.hands_on_to: h.hand_on for h in handlers if h.hands_on_to is not None}, handlers)

    async def publish(self, outputs: list[RequestOutput]) -> None:
        if self.ctx.fenced.is_set():
            return  # taken for dead: its requests go on elsewhere
        self._adopt_forks(outputs)
        for out in outputs:
            held = self.ctx.ledger.get(out.request_id)
            if held is None or held.cancelled:
                continue  # aborted meanwhile: its engine entry is already being released
            try:
                await self._publish_one(held, out)
            except Cancelled:
                pass
            except Exception as exc:  # one request's failure must not stop the others' outputs
                log.exception("output of %s failed", out.request_id)
                await self.ctx.fail(out.request_id, "server_error", f"internal error: {exc}")

    def _adopt_forks(self, outputs: list[RequestOutput]) -> None:
        """The choices a step forked requests into (common/engine/forks.py) get their records, all
        of a request's at once, before any of their outputs; those of a request no longer held
        here (cancelled meanwhile), or cancelled themselves, leave the engine."""
        forked: dict[str, list[tuple[str, int]]] = {}
        for out in outputs:
            if out.forked_from is not None:
                forked.setdefault(out.forked_from, []).append((out.request_id, out.choice))
        ledger, engine = self.ctx.ledger, self.ctx.engine
        for parent_id, choices in forked.items():
            parent = ledger.get(parent_id)
            live = parent is not None and ledger.live(parent)
            adopted = {h.request_id for h in ledger.adopt(parent, choices)} if live else set()
            for rid, _ in choices:
                if rid in adopted:
                    engine.post(lambda rid=rid: engine.engine.handoff.claim(rid))
                else:
                    engine.post(lambda rid=rid: engine.engine.abort(rid))

    async def watch(self) -> None:
        """Answer every gateway's Resend for the requests this instance has or ended lately."""
        async with await self.ctx.bus.events.resends() as stream:
            async for ask in stream:
                await self.say_again(ask)

    async def say_again(self, ask: Resend) -> None:
        """Publish the request's outputs from `ask.index` on, and its final or error once it ended;
        nothing when it is neither held here nor among the finals (another instance answers)."""
        if self.ctx.fenced.is_set():
            return
        rid = ask.request_id
        held = self.ctx.ledger.get(rid)
        last: Message | None = None
        # An ended request's finals first: one forked into choices keeps its record (and task)
        # after it ended, until they have left too (ledger.py), but no longer its outputs.
        if (ended := self.ctx.ledger.finals.get(rid)) is not None:
            tokens, last = ended.tokens, ended.last
            logprobs = known_logprobs(ended.logprobs, len(tokens), ask.index)
        elif held is not None and not held.cancelled:
            tokens, logprobs = held.sent, held.logprobs_from(ask.index)
        else:
            return
        if len(tokens) <= ask.index and last is None:
            return
        self.said_again += 1
        events = self.ctx.bus.events
        if len(tokens) > ask.index:
            again = TokenDelta(
                request_id=rid, index=ask.index, token_ids=tokens[ask.index :], source=self.me,
                logprobs=logprobs,
            )  # fmt: skip
            await events.publish_output(again)
        if last is not None:
            await events.publish_output(last)
        log.info("%s: said %s again from output %d, as a gateway asked", self.me, rid, ask.index)

    async def _publish_one(self, held: Held, out: RequestOutput) -> None:
        ctx, rid = self.ctx, out.request_id
        if out.new_token_ids:
            index = out.num_output_tokens - len(out.new_token_ids)
            held.keep_sent(index, out.new_token_ids, out.logprobs)
            delta = TokenDelta(
                request_id=rid, index=index, token_ids=out.new_token_ids, source=self.me,
                logprobs=tuple(out.logprobs),
            )  # fmt: skip
            await ctx.bus.events.publish_output(delta)
            if index == 0:
                for handler in self.handlers:
                    handler.first_token(held)
            ctx.counters.tokens_generated += len(out.new_token_ids)
        if out.finished:
            usage = Usage(
                prompt_tokens=out.num_prompt_tokens,
                completion_tokens=out.num_output_tokens,
                cached_tokens=out.num_cached_tokens,
            )
            final = FinalOutput(
                request_id=rid,
                finish_reason=out.finish_reason,
                usage=usage,
                num_outputs=out.num_output_tokens,
                source=self.me,
            )
            await ctx.bus.events.publish_output(final)
            ctx.ledger.finals.keep(rid, held.sent, final, held.sent_logprobs)
            if ctx.ledger.record is not None:
                ctx.ledger.record.finish(rid, out.num_output_tokens, out.finish_reason, out.num_cached_tokens)
            ctx.counters.finished += 1
            for handler in self.handlers:
                handler.finished(held)
            await ctx.ledger.settle(rid)
        elif out.next_stage is not None:
            await self.hand_on[out.next_stage](held)
