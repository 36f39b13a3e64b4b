"""The decode stage: pull a decode task only with KV blocks free for it (pull-based migration,
000 §4.3), reserve them, pull its KV from the prefill instance by layer group (002 §3.3) straight
into them (kv_sinks.py), tell that instance to release it, and decode in continuous batches until
the request ends.

Fallbacks: KV that cannot be pulled (prefill instance gone, KV expired) sends the request back to
prefill over its prompt and the tokens the client already has; so does a redelivered task whose
decoder died mid-generation, since its KV covers only the tokens before the task.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from common.bus import Task
from common.engine import AdmissionError
from common.engine.admission import check_fits, decode_room
from common.engine.kv_landing import KvLanding
from common.engine.spec_prompt import spec_prompt
from common.protocol import DecodeTask, PrefillTask, Release, RequestSpec
from common.roles import Role
from common.store import Stage
from common.transfer import SizeMismatch, TransferError
from common.transfer.errors import SinkRefused
from services.decode import kv_sinks
from services.worker.ledger import Held
from services.worker.stage import StageHandler
from services.worker.stage_metrics import path_label

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
        self.ctx.spans.record(held, "decode", began, output_tokens=len(held.sent))

    async def take(self, task: Task) -> None:
        ctx = self.ctx
        msg: DecodeTask = task.message
        spec = msg.request
        engine = ctx.engine.engine
        # Hold the task while blocks free up, rather than give it back: every nak counts as a
        # delivery, and a request that waits out its deliveries would be dead-lettered and never
        # answered. The keep-alive loop extends a held task's ack deadline meanwhile.
        held = ctx.ledger.begin(spec, self.role, task)
        try:
            check_fits(
                len(spec.prompt_token_ids),
                spec.sampling.max_tokens,
                max_model_len=engine.max_model_len,
                kv_tokens=engine.handoff.kv_tokens,
            )
        except AdmissionError as exc:
            await ctx.fail(spec.request_id, "service_unavailable", str(exc))
            return
        if task.redelivered and await self._sent_back_after_a_dead_decoder(held, msg):
            return
        landing = await self._land(held, msg, len(spec.prompt_token_ids) + spec.sampling.max_tokens)
        if landing is None:
            return
        try:
            ctx.ledger.mark(held, Stage.PD_TRANSFER_STARTED, decode_instance=ctx.instance_id)
            ctx.metrics.taken(self.role, task.stored, at=held.marks[Stage.PD_TRANSFER_STARTED])
            pulled = await self._pull_or_send_back(held, msg, landing)
            if pulled is None:
                return
            (outcome,) = pulled
            outputs = list(spec.output_token_ids)
            if outcome is not None:  # streamed: the prefill's outcome comes last
                ended, outputs = bool(outcome[0]), outcome[1:].tolist()
                if ended:  # its first token ended it; the prefill instance said so to the client
                    await self._release_at_owner(msg)
                    await ctx.ledger.settle(spec.request_id)
                    return
                held.sent, held.sent_logprobs = list(outputs), [None] * len(outputs)
                held.spec = spec = spec.with_outputs(tuple(outputs))
            await self._admit(held, msg, spec, outputs)
        finally:
            # Uncommitted, its blocks go back (once a write under way has ended); the commit took
            # the landing, admitted or not, and this then finds none.
            rid = spec.request_id
            ctx.engine.post(lambda: engine.handoff.drop(rid))

    async def _sent_back_after_a_dead_decoder(self, held: Held, msg: DecodeTask) -> bool:
        """For a redelivered task: the decoder that had it may have died mid-generation. The KV this
        task points to covers only the tokens before the task (and the first token, when it
        streamed), and the client has seen more: resume from those, at prefill. True if so."""
        streamed = await self.ctx.streamed(held.request_id, msg.request.output_token_ids)
        if len(streamed) > len(msg.request.output_token_ids) + bool(msg.kv.tail):
            await self._release_at_owner(msg)
            await self._back_to_prefill(held, streamed)
            return True
        return False

    async def _land(self, held: Held, msg: DecodeTask, need: int) -> KvLanding | None:
        """Blocks for the KV to be written into as it is pulled (kv_sinks.py), reserved once the
        engine has room for `need` tokens — asked and reserved in one engine call, so that tasks
        taken side by side never count the same free blocks. None if the instance drains
        meanwhile (the task is given back: another replica takes it) or the KV cannot land here
        (the request failed)."""
        ctx, rid, engine = self.ctx, held.request_id, self.ctx.engine.engine
        blocks = kv_sinks.num_blocks(msg.kv)

        def land() -> KvLanding | None:
            return engine.handoff.land(rid, blocks) if engine.handoff.can_admit(need) else None

        while True:
            try:
                landing = await ctx.engine.call(land)
            except AdmissionError as exc:
                await ctx.fail(rid, "invalid_request_error", str(exc))
                return None
            if landing is not None:
                return landing
            if ctx.draining.is_set():
                await ctx.ledger.give_back(held.request_id)
                return None
            await asyncio.sleep(BLOCKS_POLL)
            ctx.ledger.check_live(held)

    async def _pull_or_send_back(
        self, held: Held, msg: DecodeTask, landing: KvLanding
    ) -> tuple[torch.Tensor | None] | None:
        """The KV, pulled into the landing and timed, and (streamed) the prefill's outcome; None
        when it could not be pulled and the request went back to prefill, or did not fit here."""
        ctx, rid = self.ctx, held.request_id
        try:
            outcome, path, nbytes = await self._pull_kv(held, msg, landing)
        except (SinkRefused, SizeMismatch) as exc:  # it came, and does not fit this engine's cache
            ctx.ledger.check_live(held)
            await ctx.fail(rid, "invalid_request_error", f"the prefilled KV does not fit this decoder: {exc}")
            await self._release_at_owner(msg)
            return None
        except TransferError as exc:
            # The prefill instance is gone or dropped the KV (or released it to a decoder that
            # died): prefill the request again over its prompt and the tokens the client has seen.
            # Unless the request was cancelled meanwhile: its owner then dropped the KV on purpose.
            ctx.ledger.check_live(held)
            log.warning("KV of %s unavailable (%s); sending it back to prefill", rid, exc)
            ctx.counters.kv_pull_failures += 1
            await self._back_to_prefill(held, await ctx.streamed(rid, msg.request.output_token_ids))
            return None
        ctx.ledger.mark(held, Stage.PD_TRANSFER_ENDED, pd_path=path, pd_bytes=str(nbytes))
        seconds = held.marks[Stage.PD_TRANSFER_ENDED] - held.marks[Stage.PD_TRANSFER_STARTED]
        ctx.metrics.transferred("pd", seconds, nbytes, path)
        ctx.spans.record(
            held, "transfer", Stage.PD_TRANSFER_STARTED, Stage.PD_TRANSFER_ENDED, hop="pd", bytes=nbytes
        )
        return (outcome,)

    async def _admit(self, held: Held, msg: DecodeTask, spec: RequestSpec, outputs: list[int]) -> None:
        """Into the engine with its KV in the landing's blocks, then release it at its owner."""
        ctx, rid = self.ctx, held.request_id
        try:
            # Its images' identities too: its blocks are then keyed as the prefill instance keyed
            # them, and stay cached here for the conversation's next turn.
            none = [None] * len(spec.images)
            prompt = spec_prompt(spec, ctx.engine.engine.processor.placeholder_ids, none, none)

            def admit(e):
                return e.handoff.commit(
                    rid,
                    prompt.token_ids,
                    outputs,
                    spec.sampling,
                    msg.kv.rope_delta,
                    msg.cached_tokens,
                    prompt.images,
                    prompt.image_positions,
                )

            await ctx.ledger.enter(held, admit)
        except (AdmissionError, ValueError) as exc:
            await ctx.fail(rid, "invalid_request_error", str(exc))
            await self._release_at_owner(msg)
            return
        await self._release_at_owner(msg)
        ctx.ledger.mark(held, Stage.DECODE_STARTED)
        ctx.counters.decodes_admitted += 1

    async def _pull_kv(
        self, held: Held, msg: DecodeTask, landing: KvLanding
    ) -> tuple[torch.Tensor | None, str, int]:
        """Every group, pulled all at once (002 §3.3) straight into the landing's blocks — from a
        prefill on this host, out of its memory (GPU to GPU by CUDA IPC) —; for streamed KV the
        prefill's outcome too (int64 [ended, *outputs]); the path the groups took and their bytes.
        The first failure raises once all have ended (so no write is under way after)."""
        ctx, kv = self.ctx, msg.kv
        refs = iter(kv.refs())
        group_sinks = kv_sinks.sinks(landing, kv)
        pulls = [
            ctx.pull_into(held, g.inline if g.inline else next(refs), sink)
            for g, sink in zip(kv.groups, group_sinks, strict=True)
        ]
        if kv.tail:
            pulls.append(ctx.pull_with_path(held, kv.tail_ref(len(msg.request.output_token_ids))))
        pulled = await asyncio.gather(*pulls, return_exceptions=True)
        for result in pulled:
            if isinstance(result, BaseException):
                raise result
        outcome = pulled.pop()[0] if kv.tail else None
        return outcome, path_label(pulled), sum(sink.nbytes for sink in group_sinks)

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
