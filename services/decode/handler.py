"""The decode stage: pull a decode task only with KV blocks free for it (pull-based migration,
000 §4.3), pull its KV from the prefill instance by layer group (002 §3.3), tell that instance to
release it, and decode in continuous batches until the request ends.

Fallbacks: KV that cannot be pulled (prefill instance gone, KV expired) sends the request back to
prefill over its prompt and the tokens the client already has; so does a redelivered task whose
decoder died mid-generation, since its KV covers only the tokens before the task.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from common.bus import Task
from common.engine import AdmissionError, kv_quant
from common.engine.admission import check_fits, decode_room
from common.engine.spec_prompt import spec_prompt
from common.protocol import DecodeTask, PrefillTask, Release
from common.protocol.tensors import KvWire, torch_dtype
from common.roles import Role
from common.store import Stage
from common.transfer import TransferError
from services.worker.ledger import Held
from services.worker.stage import StageHandler

log = logging.getLogger(__name__)
BLOCKS_POLL = 0.02  # seconds between looks at the engine while a task waits for KV blocks


class DecodeHandler(StageHandler):
    role = Role.DECODE
    pull_rule = staticmethod(decode_room)

    def finished(self, held: Held) -> None:
        """Decode's time, from its start here (or from the first token, for a request this
        instance also prefilled)."""
        began = Stage.DECODE_STARTED if Stage.DECODE_STARTED in held.marks else Stage.FIRST_TOKEN
        self.ctx.metrics.ran(self.role, held.marks, began)

    async def take(self, task: Task) -> None:
        ctx = self.ctx
        msg: DecodeTask = task.message
        spec = msg.request
        rid = spec.request_id
        engine = ctx.engine.engine
        # Hold the task while blocks free up, rather than give it back: every nak counts as a
        # delivery, and a request that waits out its deliveries would be dead-lettered and never
        # answered. The keep-alive loop extends a held task's ack deadline meanwhile.
        held = ctx.ledger.begin(spec, self.role, task)
        need = len(spec.prompt_token_ids) + spec.sampling.max_tokens
        try:
            check_fits(len(spec.prompt_token_ids), spec.sampling.max_tokens,
                       max_model_len=engine.max_model_len, kv_tokens=engine.handoff.kv_tokens)  # fmt: skip
        except AdmissionError as exc:
            await ctx.fail(rid, "service_unavailable", str(exc))
            return
        if task.redelivered:
            # The decoder that had it may have died mid-generation: the KV this task points to
            # covers only the tokens before the task (and the first token, when it streamed), and
            # the client has seen more. Resume from those.
            streamed = await ctx.streamed(rid, spec.output_token_ids)
            if len(streamed) > len(spec.output_token_ids) + bool(msg.kv.tail):
                await self._release_at_owner(msg)
                await self._back_to_prefill(held, streamed)
                return
        while not await ctx.engine.call(lambda: engine.handoff.can_admit(need)):
            if ctx.draining.is_set():
                await ctx.ledger.give_back(rid)  # another replica takes it
                return
            await asyncio.sleep(BLOCKS_POLL)
            ctx.ledger.check_live(held)
        ctx.ledger.mark(held, Stage.PD_TRANSFER_STARTED, decode_instance=ctx.instance_id)
        ctx.metrics.taken(self.role, task.stored, at=held.marks[Stage.PD_TRANSFER_STARTED])
        try:
            buffers, outcome = await self._pull_kv(held, msg)
        except TransferError as exc:
            # The prefill instance is gone or dropped the KV (or released it to a decoder that
            # died): prefill the request again over its prompt and the tokens the client has seen.
            # Unless the request was cancelled meanwhile: its owner then dropped the KV on purpose.
            ctx.ledger.check_live(held)
            log.warning("KV of %s unavailable (%s); sending it back to prefill", rid, exc)
            ctx.counters.kv_pull_failures += 1
            await self._back_to_prefill(held, await ctx.streamed(rid, spec.output_token_ids))
            return
        ctx.ledger.mark(held, Stage.PD_TRANSFER_ENDED)
        seconds = held.marks[Stage.PD_TRANSFER_ENDED] - held.marks[Stage.PD_TRANSFER_STARTED]
        ctx.metrics.transferred("pd", seconds, sum(b.numel() * b.element_size() for b in buffers))
        outputs = list(spec.output_token_ids)
        if outcome is not None:  # streamed: the prefill's outcome comes last
            ended, outputs = bool(outcome[0]), outcome[1:].tolist()
            if ended:  # its first token ended it; the prefill instance said so to the client
                await self._release_at_owner(msg)
                await ctx.ledger.settle(rid)
                return
            held.sent, held.sent_logprobs = list(outputs), [None] * len(outputs)
            held.spec = spec = spec.with_outputs(tuple(outputs))
        try:
            if msg.kv.wire == KvWire.INT8:  # back into the cache's dtype (kv_quant.py)
                dtype = torch_dtype(msg.kv.dtype)
                groups = msg.kv.groups
                buffers = [kv_quant.unpack(b, g.shape, dtype) for b, g in zip(buffers, groups, strict=True)]
            # Its images' identities too: its blocks are then keyed as the prefill instance keyed
            # them, and stay cached here for the conversation's next turn.
            none = [None] * len(spec.images)
            prompt = spec_prompt(spec, engine.processor.placeholder_ids, none, none)

            def admit(e):
                return e.handoff.add_prefilled(
                    rid, prompt.token_ids, outputs, spec.sampling, buffers, msg.kv.rope_delta,
                    msg.cached_tokens, prompt.images, prompt.image_positions,
                )  # fmt: skip

            await ctx.ledger.enter(held, admit)
        except (AdmissionError, ValueError) as exc:
            await ctx.fail(rid, "invalid_request_error", str(exc))
            return
        await self._release_at_owner(msg)
        ctx.ledger.mark(held, Stage.DECODE_STARTED)
        ctx.counters.decodes_admitted += 1

    async def _pull_kv(self, held: Held, msg: DecodeTask) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Every group's buffer, pulled all at once (002 §3.3), and for streamed KV the prefill's
        outcome too (int64 [ended, *outputs]); the first failure raises once all have ended."""
        ctx, kv = self.ctx, msg.kv
        refs = kv.refs() + ([kv.tail_ref(len(msg.request.output_token_ids))] if kv.tail else [])
        pulled = await asyncio.gather(*(ctx.pull(held, ref) for ref in refs), return_exceptions=True)
        for result in pulled:
            if isinstance(result, BaseException):
                raise result
        by_handle = iter(pulled)
        buffers = [g.inline.to_tensor() if g.inline else next(by_handle) for g in kv.groups]
        return buffers, next(by_handle) if kv.tail else None

    async def _release_at_owner(self, msg: DecodeTask) -> None:
        """Tell the prefill instance that holds the request's KV to free it."""
        handles = tuple(r.handle for r in msg.kv.refs())
        release = Release(request_id=msg.request.request_id, owner=msg.kv.owner, handles=handles)
        await self.ctx.bus.events.release(release)

    async def _back_to_prefill(self, held: Held, outputs: tuple[int, ...]) -> None:
        """Queue the request for prefill again, over its prompt and `outputs` (the tokens the client has)."""
        again = held.spec.with_outputs(outputs)
        await self.ctx.dispatch.send(PrefillTask(request=again), held.source)
        await self.ctx.ledger.settle(held.request_id)
