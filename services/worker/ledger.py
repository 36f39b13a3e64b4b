"""What a worker holds for each request, in one record, and the operations that release all of it.

A request inside an instance holds up to five things: its JetStream task (acked only when the
request leaves, so a crash redelivers it), an entry in the engine (scheduled, or handed off with
its blocks kept), KV buffers served for the next stage to pull, the request's spec (to hand it
on or send it back), and the output tokens it has here (to say them again when a gateway asks).
Each lives on one of two threads: the engine's entry on the engine thread, the rest on the event
loop. The ledger keeps them in one `Held` record and releases them together:

    begin ─▶ enter (engine) ─▶ settle ───────────────────────────▶ gone
                  │              └─ (KV kept for decode) ─ release_kv ─▶ gone
                  └─ abort (cancel) / give_back (drain) / forget (handler failed) ─▶ gone

A request that ends here leaves its tokens and final in `finals` for a bounded window (finals.py);
one handed on keeps no outputs here, only its KV until the next stage has pulled it.

Engine releases are queued to the engine thread in order (`EngineLoop.post`): a release queued
after an admission runs after it, so a request cancelled while it was being admitted cannot stay
in the engine. Every handler re-checks `cancelled` after each pull, before anything else is held.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from common.engine.request import Status
from common.protocol import RequestSpec, TokenLogprob
from common.roles import Role
from common.store import Stage
from services.worker.finals import FINALS_WINDOW, Finals

if TYPE_CHECKING:
    from common.bus import Task
    from common.engine import Engine
    from common.store.recorder import StageRecorder
    from common.transfer import TransferBackend
    from services.worker.engine_loop import EngineLoop

log = logging.getLogger(__name__)
T = TypeVar("T")
CANCEL_MEMORY = 600.0  # seconds a cancel of a request not held here is remembered
CANCELS_KEPT = 100_000


class AlreadyHeld(Exception):
    """A task arrived for a request this instance is already working on (a duplicate delivery)."""


class Cancelled(Exception):
    """The request was cancelled (or given back) while its handler awaited something: stop, holding
    nothing more; the ledger has released what it held and settled its task."""


@dataclass(eq=False)
class Held:
    """One request inside this instance and everything it holds here."""

    request_id: str
    role: Role  # the stage it came for
    spec: RequestSpec
    task: Task | None = None  # acked when the request leaves; None once settled
    task_seq: int | None = None  # the stream sequence of the task it came with, kept after settling
    in_engine: bool = False  # admitted into the engine: scheduled, or handed off with its blocks
    kv_handles: tuple[str, ...] = ()  # its KV, served for the next stage until released
    kv_expires: float = math.inf  # monotonic time after which nobody is coming for the KV
    # Set while and after its KV streams out of the prefill step (services/prefill/kv_stream.py):
    # the queueing of its decode task (its result: the stream, or None if not queued). The handles hold
    # copies: the engine's blocks are not kept for them.
    kv_stream: asyncio.Task | None = None
    cancelled: bool = False
    marks: dict[Stage, float] = field(default_factory=dict)  # the stage marks made here (wall clock)
    # Every output token the request has while it runs here: those it came with, then those made
    # here. What a gateway that missed some is sent again; emptied when the request is handed on.
    sent: list[int] = field(default_factory=list)
    # Their log-probabilities, one per token of `sent` (None where not known here: tokens resumed
    # from the gateway's journal, which it never asks for again), when the request asks for them.
    sent_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    # n choices (common/engine/forks.py): a choice forked here came with no task of its own, so the
    # task of the request it was forked from is acked only once every such choice has left too.
    forked_from: Held | None = None
    forks: set[str] = field(default_factory=set)  # the choices forked from this one still here
    awaits_forks: bool = False  # it left (settled) and its task waits for `forks`

    @property
    def holds_task(self) -> bool:
        return self.task is not None and not self.task.settled

    @property
    def source(self) -> int | str:
        """The step that hands this request on: its task's stream sequence (see common/dispatch.py),
        for a forked choice the task of the request it came from."""
        if self.task is not None:
            return self.task.stream_seq
        return self.task_seq if self.forked_from is not None and self.task_seq is not None else "local"

    def keep_sent(self, index: int, tokens: list[int], logprobs: list[TokenLogprob]) -> None:
        """Tokens made here from output `index` on (with their log-probabilities, if asked)."""
        self.sent[index:] = tokens
        if len(self.sent_logprobs) < index:
            self.sent_logprobs += [None] * (index - len(self.sent_logprobs))
        self.sent_logprobs[index:] = logprobs or [None] * len(tokens)

    def logprobs_from(self, index: int) -> tuple[TokenLogprob, ...]:
        """The log-probabilities of `sent[index:]`, or none unless every one of them is known."""
        return known_logprobs(self.sent_logprobs, len(self.sent), index)


def known_logprobs(logprobs: list | tuple, num_tokens: int, index: int) -> tuple[TokenLogprob, ...]:
    """`logprobs[index:num_tokens]` when every one is known, else none (a delta carries all or none)."""
    found = tuple(logprobs[index:num_tokens])
    if len(found) < num_tokens - index or any(lp is None for lp in found):
        return ()
    return found


@dataclass(eq=False)
class Ledger:
    engine: EngineLoop
    transfer: TransferBackend
    record: StageRecorder | None = None  # each request's stage times, into its trace
    clock: Callable[[], float] = time.monotonic
    on_begin: Callable[[], None] | None = None  # told when a request is taken on (a heartbeat says so)
    finals_window: float = FINALS_WINDOW  # seconds a request that ended here keeps its outputs
    _held: dict[str, Held] = field(default_factory=dict, init=False)
    finals: Finals = field(init=False)  # the last outputs of requests that ended here
    changes: int = field(default=0, init=False)  # records begun and dropped: has anything happened?
    # Requests cancelled while not held here (queued, or still on their way): their tasks are
    # dropped unrun when they come. Bounded in time and in number.
    _cancelled: OrderedDict[str, float] = field(default_factory=OrderedDict, init=False)

    def __post_init__(self) -> None:
        self.finals = Finals(self.finals_window, self.clock)

    # -- reading -----------------------------------------------------------------------------------

    def get(self, request_id: str) -> Held | None:
        return self._held.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[Held]:
        return iter(list(self._held.values()))

    def tasks(self) -> list[Task]:
        """The tasks still to settle, for the keep-alive loop."""
        return [h.task for h in self._held.values() if h.holds_task]

    def live(self, held: Held) -> bool:
        """`held` is still this request's record and not cancelled."""
        return not held.cancelled and self._held.get(held.request_id) is held

    def check_live(self, held: Held) -> None:
        """Raise Cancelled unless `held` is live: every handler asks after each await."""
        if not self.live(held):
            raise Cancelled(held.request_id)

    # -- the request's life ------------------------------------------------------------------------

    def begin(self, spec: RequestSpec, role: Role, task: Task | None = None) -> Held:
        """Record a request that arrived with `task`. A record that only keeps KV for a decoder is
        replaced: the request came back, so nobody will pull that KV — unless `task` is the very
        task that record came with, delivered again (NATS redelivers a task whose ack came late):
        that is a duplicate, AlreadyHeld, like a second delivery while the first still runs."""
        rid = spec.request_id
        if rid in self._cancelled:
            raise Cancelled(rid)
        seq = task.stream_seq if task is not None else None
        old = self._held.get(rid)
        if old is not None:
            if old.holds_task or (seq is not None and old.task_seq == seq):
                raise AlreadyHeld(rid)
            self._drop(old)
        held = self._held[rid] = Held(rid, role, spec, task, seq, sent=list(spec.output_token_ids))
        held.sent_logprobs = list(spec.output_logprobs) or [None] * len(held.sent)
        self.changes += 1
        if self.on_begin is not None:
            self.on_begin()
        return held

    def adopt(self, parent: Held, choices: list[tuple[str, int]]) -> list[Held]:
        """Record the choices the engine forked `parent` into, (id, choice index) each: requests of
        their own from now on, whose task is `parent`'s (common/engine/forks.py). A choice cancelled
        already (a gateway cancels every choice of a request) is not recorded: the caller drops it."""
        asked = parent.spec.sampling
        parent.spec = parent.spec.model_copy(update={"sampling": asked.for_choice(0)})
        adopted = []
        for rid, index in choices:
            if rid in self._cancelled or rid in self._held:
                continue
            spec = parent.spec.model_copy(update={"request_id": rid, "sampling": asked.for_choice(index)})
            held = Held(rid, parent.role, spec, None, parent.task_seq, in_engine=True, forked_from=parent)
            self._held[rid] = held
            parent.forks.add(rid)
            adopted.append(held)
            self.changes += 1
        return adopted

    def mark(self, held: Held, stage: Stage, **info: str) -> None:
        """A stage mark in the request's record (Redis, off the critical path) and in `held`."""
        at = held.marks[stage] = time.time()
        if self.record is not None:
            self.record.mark(held.request_id, stage, at=at, **info)

    async def enter(self, held: Held, admit: Callable[[Engine], T]) -> T:
        """Run `admit(engine)` on the engine thread, unless the request was cancelled while its
        inputs were pulled (Cancelled then). Checked and queued with no await between, so a cancel
        either comes first and is seen, or comes after and its release is queued behind this."""
        self.check_live(held)
        held.in_engine = True
        engine = self.engine.engine
        return await self.engine.call(lambda: admit(engine))

    def keep_kv(self, held: Held, handles: tuple[str, ...], ttl: float) -> None:
        """The request's KV is published for the next stage: kept until released or `ttl` passes."""
        held.kv_handles = handles
        held.kv_expires = self.clock() + ttl

    def withdraw_kv(self, held: Held) -> None:
        """Stop serving KV that no task points to (a streamed decode task was never queued); the
        request's engine entry stays."""
        for handle in held.kv_handles:
            self.transfer.release(handle)
        held.kv_handles = ()

    def leave_engine(self, held: Held) -> None:
        """Release the request's engine entry (and blocks) while its record stays: its KV was
        streamed out, so the handles kept for decode no longer need the blocks."""
        if held.in_engine:
            held.in_engine = False
            engine, rid = self.engine.engine, held.request_id
            self.engine.post(lambda: engine.abort(rid))

    async def settle(self, request_id: str, keep_outputs: bool = False) -> None:
        """The request left this instance (finished, failed, or handed on with its next task stored):
        ack its task and release what it holds, except KV kept for the next stage to pull. Its
        outputs go too: whoever has it now answers for them (a finished one's are in `finals`).
        `keep_outputs`: its next task went out before its step here is over (streamed KV), so this
        instance still makes and answers for its next token."""
        held = self._held.get(request_id)
        if held is None:
            return
        if not keep_outputs:
            held.sent, held.sent_logprobs = [], []
        if held.forks:  # its task waits for the choices forked from it, which have none of their own
            held.awaits_forks = True
            if not held.kv_handles:
                self.leave_engine(held)
            return
        task, held.task = held.task, None
        if not held.kv_handles:
            self._drop(held)
        if task is not None and not task.settled:
            await task.ack()
        await self._fork_left(held)

    async def _fork_left(self, held: Held) -> None:
        """A forked choice left (settled or cancelled): the task it came under is acked once the
        request it came from and all its other choices have left too."""
        parent = held.forked_from
        if parent is None:
            return
        parent.forks.discard(held.request_id)
        if not parent.forks and parent.awaits_forks and self._held.get(parent.request_id) is parent:
            await self.settle(parent.request_id)

    async def release_kv(self, request_id: str) -> None:
        """The next stage pulled the KV (or nobody came for it in time): free it."""
        held = self._held.get(request_id)
        if held is None or not held.kv_handles:
            return
        self._release_kv(held)
        if not held.holds_task:
            self._drop(held)

    async def abort(self, request_id: str) -> bool:
        """Cancel: release everything and ack the task (the request is over; a later task of it is
        dropped unrun). False if it was not held here."""
        self._remember_cancel(request_id)  # any task of it that comes later is dropped unrun
        held = self._held.get(request_id)
        if held is None:
            return False
        held.cancelled = True
        self._drop(held)
        if held.holds_task:
            await held.task.ack()
        await self._fork_left(held)
        return True

    def _remember_cancel(self, request_id: str) -> None:
        now = self.clock()
        self._cancelled[request_id] = now
        self._cancelled.move_to_end(request_id)
        while self._cancelled and (
            len(self._cancelled) > CANCELS_KEPT or next(iter(self._cancelled.values())) < now - CANCEL_MEMORY
        ):
            self._cancelled.popitem(last=False)

    async def give_back(self, request_id: str) -> None:
        """Draining ran out of time: release everything and hand the task back for another replica."""
        held = self._held.get(request_id)
        if held is None:
            return
        held.cancelled = True
        self._drop(held)
        if held.holds_task:
            try:
                await held.task.nak()
            except Exception as exc:  # NATS away: the task comes back after ack_wait all the same
                log.warning("could not hand %s back: %r", request_id, exc)

    def forget(self, request_id: str) -> Held | None:
        """Release everything the request holds but leave its task to the caller (a handler failed)."""
        held = self._held.get(request_id)
        if held is not None:
            held.cancelled = True
            self._drop(held)
        return held

    async def expire(self) -> None:
        """Free KV that no decoder came for within its time, and finals past their window."""
        self.finals.sweep()
        now = self.clock()
        for held in self:
            if held.kv_handles and held.kv_expires < now:
                log.warning("KV of %s was not pulled in time; freeing it", held.request_id)
                await self.release_kv(held.request_id)

    # -- integrity ---------------------------------------------------------------------------------

    async def check_integrity(self) -> None:
        """Raise AssertionError unless the ledger and the engine agree: the engine holds only requests
        recorded here, KV kept here is held (handed off) in the engine and still served, and the
        engine's own bookkeeping is whole. When nothing is recorded, the engine must be empty.

        What the ledger holds is read before the engine's view is queued: requests released since
        then have their engine release queued after it, so the engine may only hold fewer."""
        recorded = set(self._held)
        kept = {h.request_id for h in self._held.values() if h.kv_handles and h.kv_stream is None}
        for held in self._held.values():
            assert not held.cancelled, f"{held.request_id}: cancelled but still recorded"
            # (A forked choice runs under its parent's task: its outputs are its own until it settles.)
            assert (
                held.holds_task or held.kv_stream is not None or held.forked_from is not None or not held.sent
            ), f"{held.request_id}: handed on but keeps its outputs"
            missing = [h for h in held.kv_handles if h not in self.transfer.handles]
            assert not missing, f"{held.request_id}: kept KV handles {missing} are no longer served"
        in_engine, handed_off = await self.engine.call(lambda: engine_view(self.engine.engine))
        stray = in_engine - recorded
        assert not stray, f"the engine holds requests this instance no longer records: {sorted(stray)}"
        lost = kept - handed_off
        assert not lost, f"KV is kept for {sorted(lost)} but the engine does not hold it"

    # -- internals ---------------------------------------------------------------------------------

    def _drop(self, held: Held) -> None:
        del self._held[held.request_id]
        self.changes += 1
        self._release_kv(held)
        if held.in_engine:
            held.in_engine = False
            engine, rid = self.engine.engine, held.request_id
            self.engine.post(lambda: engine.abort(rid))

    def _release_kv(self, held: Held) -> None:
        if held.kv_handles:
            self.withdraw_kv(held)
            self.leave_engine(held)  # handed off: the engine's entry is only the kept blocks


def engine_view(engine: Engine) -> tuple[set[str], set[str]]:
    """On the engine thread: check its integrity, and say which requests it holds and which of
    those are handed off."""
    engine.check_integrity()
    # A choice forked in a step whose outputs the event loop has not yet published is the
    # engine's alone: the ledger records it as it publishes them (OutputPublisher._adopt_forks).
    held = {rid for rid, r in engine.requests.items() if not r.unclaimed}
    handed_off = {rid for rid in held if engine.requests[rid].status == Status.HANDED_OFF}
    return held, handed_off
