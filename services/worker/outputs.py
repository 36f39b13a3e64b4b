"""Turning each engine step's outputs into messages: token deltas and finals to the gateway, and
hand-offs to the handler of the stage that queues the request's next one."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping

from common.engine import RequestOutput
from common.protocol import FinalOutput, TokenDelta, Usage
from common.roles import Role
from common.store import Stage
from services.worker.context import StageContext
from services.worker.ledger import Cancelled, Held
from services.worker.stage import StageHandler

log = logging.getLogger(__name__)
HandOn = Callable[[Held], Awaitable[None]]


class OutputPublisher:
    def __init__(self, ctx: StageContext, hand_on: Mapping[Role, HandOn]) -> None:
        self.ctx = ctx
        self.hand_on = hand_on  # the next stage -> whoever queues it (the handler of the stage before)

    @classmethod
    def for_handlers(cls, ctx: StageContext, handlers: Iterable[StageHandler]) -> OutputPublisher:
        """Each hand-off goes to the handler whose stage queues the next one."""
        return cls(ctx, {h.hands_on_to: h.hand_on for h in handlers if h.hands_on_to is not None})

    async def publish(self, outputs: list[RequestOutput]) -> None:
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

    async def _publish_one(self, held: Held, out: RequestOutput) -> None:
        ctx, rid = self.ctx, out.request_id
        if out.new_token_ids:
            index = out.num_output_tokens - len(out.new_token_ids)
            await ctx.bus.events.publish_output(
                TokenDelta(request_id=rid, index=index, token_ids=out.new_token_ids)
            )
            if index == 0:
                ctx.ledger.mark(held, Stage.PREFILL_ENDED)
                ctx.ledger.mark(held, Stage.FIRST_TOKEN)
            ctx.counters.tokens_generated += len(out.new_token_ids)
        if out.finished:
            usage = Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens)
            final = FinalOutput(
                request_id=rid,
                finish_reason=out.finish_reason,
                usage=usage,
                num_outputs=out.num_output_tokens,
            )
            await ctx.bus.events.publish_output(final)
            if ctx.ledger.record is not None:
                ctx.ledger.record.finish(rid, out.num_output_tokens, out.finish_reason)
            ctx.counters.finished += 1
            await ctx.ledger.settle(rid)
        elif out.next_stage is not None:
            await self.hand_on[out.next_stage](held)
