"""Turning each engine step's outputs into messages: token deltas and finals to the gateway, and
hand-offs to the handler of the stage that queues the request's next one.

Outputs go over core NATS, which loses what is in flight when the broker dies: the messages a
worker wrote before it noticed are gone. So the publisher remembers each held request's outputs,
and a worker whose connection comes back says them again (`catch_up`), with the finals of requests
that ended in the last RECENT seconds; the gateway drops what it already has by index.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping

from common.engine import RequestOutput
from common.protocol import FinalOutput, TokenDelta, Usage
from common.roles import Role
from services.worker.context import StageContext
from services.worker.ledger import Cancelled, Held
from services.worker.stage import StageHandler

log = logging.getLogger(__name__)
RECENT = 120.0  # seconds a finished request's outputs are kept, to be said again after an outage
HandOn = Callable[[Held], Awaitable[None]]


class OutputPublisher:
    def __init__(
        self, ctx: StageContext, hand_on: Mapping[Role, HandOn], handlers: Iterable[StageHandler] = ()
    ) -> None:
        self.ctx = ctx
        self.hand_on = hand_on  # the next stage -> whoever queues it (the handler of the stage before)
        self.handlers = tuple(handlers)  # told of a first token and of an end: their marks and metrics
        self.me = ctx.instance_id
        self._sent: dict[str, list[int]] = {}  # held request -> every output token it has so far
        self._recent: OrderedDict[str, tuple[float, list[int], FinalOutput]] = OrderedDict()

    @classmethod
    def for_handlers(cls, ctx: StageContext, handlers: Iterable[StageHandler]) -> OutputPublisher:
        """Each hand-off goes to the handler whose stage queues the next one."""
        handlers = tuple(handlers)
        return cls(ctx, {h.hands_on_to: h.hand_on for h in handlers if h.hands_on_to is not None}, handlers)

    async def publish(self, outputs: list[RequestOutput]) -> None:
        if self.ctx.fenced.is_set():
            return  # taken for dead: its requests go on elsewhere
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

    async def catch_up(self) -> None:
        """Say again every output of the requests held here, and the finals of those that ended in
        the last RECENT seconds: what was in flight when NATS went away may be lost."""
        now = time.monotonic()
        while self._recent and next(iter(self._recent.values()))[0] < now - RECENT:
            self._recent.popitem(last=False)
        for rid in [r for r in self._sent if r not in self.ctx.ledger]:
            del self._sent[rid]
        events = self.ctx.bus.events
        for held in self.ctx.ledger:
            tokens = self._sent.get(held.request_id) or list(held.spec.output_token_ids)
            if tokens:
                again = TokenDelta(request_id=held.request_id, index=0, token_ids=tokens, source=self.me)
                await events.publish_output(again)
        for rid, (_, tokens, final) in list(self._recent.items()):
            if tokens:
                await events.publish_output(
                    TokenDelta(request_id=rid, index=0, token_ids=tokens, source=self.me)
                )
            await events.publish_output(final)
        log.info(
            "said again the outputs of %d held and %d ended requests", len(self.ctx.ledger), len(self._recent)
        )

    async def _publish_one(self, held: Held, out: RequestOutput) -> None:
        ctx, rid = self.ctx, out.request_id
        if out.new_token_ids:
            index = out.num_output_tokens - len(out.new_token_ids)
            sent = self._sent.setdefault(rid, list(held.spec.output_token_ids))
            sent[index:] = out.new_token_ids
            await ctx.bus.events.publish_output(
                TokenDelta(request_id=rid, index=index, token_ids=out.new_token_ids, source=self.me)
            )
            if index == 0:
                for handler in self.handlers:
                    handler.first_token(held)
            ctx.counters.tokens_generated += len(out.new_token_ids)
        if out.finished:
            usage = Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens)
            final = FinalOutput(
                request_id=rid,
                finish_reason=out.finish_reason,
                usage=usage,
                num_outputs=out.num_output_tokens,
                source=self.me,
            )
            await ctx.bus.events.publish_output(final)
            self._recent[rid] = (time.monotonic(), self._sent.pop(rid, []), final)
            if ctx.ledger.record is not None:
                ctx.ledger.record.finish(rid, out.num_output_tokens, out.finish_reason)
            ctx.counters.finished += 1
            for handler in self.handlers:
                handler.finished(held)
            await ctx.ledger.settle(rid)
        elif out.next_stage is not None:
            await self.hand_on[out.next_stage](held)
