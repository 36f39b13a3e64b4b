"""The batching policies, one small class each: how an iteration's batch is filled (Scheduler.schedule).

`StageBatching` is seed 000's Algorithm 1 in its three named steps; `PrefillFirst` (vLLM v0) and
`DecodeFirst` (Sarathi) exist for comparison (scheduler.py's docstring says how each differs). An
instance without the prefill role batches by Algorithm 1 whatever its policy: it only encodes and
decodes, and τe bounds its encodes.

A policy reads and moves the scheduler's state through `Steps`, what scheduler.py provides: the
queues, step 1 (running decodes), the room left in a batch, and the pacing gate.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from common.engine.batch import Batch
from common.engine.block_manager import BlockManager
from common.engine.config import EngineConfig, Policy
from common.engine.prefix import PrefixReuse
from common.engine.request import Request, Status
from common.roles import Role


class Steps(Protocol):
    """What a policy builds a batch with (the Scheduler)."""

    config: EngineConfig
    blocks: BlockManager
    prefixes: PrefixReuse
    waiting: deque[Request]
    running: list[Request]
    image_budget: int
    image_unit: int | None

    def start(self, req: Request) -> None: ...
    def running_decodes(self, batch: Batch) -> None: ...
    def tokens_left(self, batch: Batch) -> int: ...
    def images_left(self, batch: Batch) -> int: ...
    def is_long(self, req: Request) -> bool: ...
    def paced_out(self, batch: Batch) -> bool: ...


class BatchPolicy(Protocol):
    def fill(self, batch: Batch) -> None: ...


def policy_for(steps: Steps) -> BatchPolicy:
    """The configured policy; Algorithm 1 on an instance that does not prefill (module docstring)."""
    if Role.PREFILL not in steps.config.roles:
        return StageBatching(steps)
    return _POLICIES[steps.config.policy](steps)


class StageBatching:
    """Seed 000's Algorithm 1: running decodes, continuing work, new work."""

    def __init__(self, steps: Steps) -> None:
        self.s = steps

    def fill(self, batch: Batch) -> None:
        self.s.running_decodes(batch)
        self.continuing_work(batch)
        self.new_work(batch)

    def continuing_work(self, batch: Batch) -> None:
        """Prefill chunks, then encodes, of requests already started."""
        started = [r for r in self.s.running if not batch.scheduled(r)]
        for req in started:
            if req.is_prefilling:
                self._take_chunk(req, batch)
        if self._encodes_allowed(batch):
            for req in started:
                if req.needs_encode:
                    self._take_encode(req, batch)

    def new_work(self, batch: Batch) -> None:
        """Waiting requests in arrival order: prefill-ready ones into τt, then image ones into τe."""
        s = self.s
        for req in [r for r in s.waiting if not r.needs_encode]:
            if self._chunk_waits(req, batch):
                continue  # a long prompt waits for a step with credit for it; shorter ones need not
            if self._full() or not self._take_chunk(req, batch):
                break  # out of τt or KV blocks: keep arrival order, admit nothing newer
            s.start(req)
        if not self._encodes_allowed(batch):
            return
        for req in [r for r in s.waiting if r.needs_encode]:
            if self._encode_waits(req, batch):
                continue  # a clip waits for a step with credit for it; pictures need not
            if self._full() or not self._take_encode(req, batch):
                break
            s.start(req)

    def _encodes_allowed(self, batch: Batch) -> bool:
        # 001's variant keeps encode latency off iterations that carry prefill chunks.
        return self.s.config.encode_with_prefill or not batch.prefills

    def _full(self) -> bool:
        return len(self.s.running) >= self.s.config.max_num_seqs

    def _take_encode(self, req: Request, batch: Batch) -> bool:
        s = self.s
        room = s.images_left(batch)  # in cost units
        if Role.ENCODE not in s.config.roles:
            return False
        taken = []
        for i in req.images_to_encode():
            if req.images[i].video and s.paced_out(batch):
                break  # a clip beside decodes, without credit: a later step
            cost = req.images[i].num_tokens if s.image_unit else 1
            if cost > room:
                # An image larger than all of τe runs as the first encode of an iteration (as a
                # prompt larger than τt does), else it could never run.
                if not (taken or batch.encodes) and cost > s.image_budget * (s.image_unit or 1):
                    taken.append(i)
                break
            taken.append(i)
            room -= cost
        if not taken:
            return False
        batch.encodes.append((req, taken))
        return True

    def _take_chunk(self, req: Request, batch: Batch) -> bool:
        s = self.s
        room = s.tokens_left(batch)
        if Role.PREFILL not in s.config.roles or room <= 0 or self._chunk_waits(req, batch):
            return False
        looked = s.prefixes.lookup(req)
        chunk = min(req.num_uncomputed, room)
        if s.blocks.allocate(req.request_id, req.num_computed_tokens + chunk) is None:
            s.prefixes.give_back(req, s.running)
            return False
        s.prefixes.admitted(req, looked)
        batch.prefills.append((req, chunk))
        return True

    def _chunk_waits(self, req: Request, batch: Batch) -> bool:
        """Whether `req` is a long prompt that must sit this step out beside the decodes (pacing.py)."""
        return self.s.is_long(req) and self.s.paced_out(batch)

    def _encode_waits(self, req: Request, batch: Batch) -> bool:
        """Whether `req`'s next encode is a clip that must sit this step out beside the decodes."""
        todo = req.images_to_encode()
        return bool(todo) and req.images[todo[0]].video and self.s.paced_out(batch)


class _InlineEncodes:
    """The comparison policies' shared part: a request's images are encoded in the iteration that
    starts its prefill, with no image budget."""

    def __init__(self, steps: Steps) -> None:
        self.s = steps

    def _pending(self) -> list[Request]:
        """Started requests first, then waiting ones in arrival order."""
        started = [r for r in self.s.running if r.needs_encode or r.is_prefilling]
        return started + list(self.s.waiting)

    def _admit(self, req: Request, chunk: int, batch: Batch, looked: tuple[int, int]) -> bool:
        """Into the batch with a prefill chunk and the encodes of its images, if any; False when KV
        is short. `looked`: its prefix lookup (PrefixReuse.lookup), counted once it is admitted."""
        s = self.s
        if req.needs_encode and Role.ENCODE not in s.config.roles:
            return True  # cannot encode here; leave it (the engine rejects such requests at admission)
        if s.blocks.allocate(req.request_id, req.num_computed_tokens + chunk) is None:
            return False
        s.prefixes.admitted(req, looked)
        if req.needs_encode:
            batch.encodes.append((req, req.images_to_encode()))
        batch.prefills.append((req, chunk))
        if req.status == Status.WAITING:
            s.start(req)
        return True


class PrefillFirst(_InlineEncodes):
    """vLLM v0: whole prompts (no chunking) up to τt, a prompt larger than τt alone; decodes only
    in an iteration no prompt was admitted to."""

    def fill(self, batch: Batch) -> None:
        s = self.s
        for req in self._pending():
            looked = s.prefixes.lookup(req)
            need = req.num_uncomputed
            too_long = bool(batch.prefills) and need > s.tokens_left(batch)
            if too_long or not self._admit(req, need, batch, looked):
                s.prefixes.give_back(req, s.running)
                break
        if not batch.prefills:
            s.running_decodes(batch)


class DecodeFirst(_InlineEncodes):
    """Sarathi: every decode, then prefill chunks in what the decodes left of τt."""

    def fill(self, batch: Batch) -> None:
        s = self.s
        s.running_decodes(batch)
        for req in self._pending():
            room = s.tokens_left(batch)
            if room <= 0:
                break
            looked = s.prefixes.lookup(req)
            if not self._admit(req, min(req.num_uncomputed, room), batch, looked):
                s.prefixes.give_back(req, s.running)
                break


_POLICIES: dict[Policy, type[StageBatching | PrefillFirst | DecodeFirst]] = {
    Policy.STAGE: StageBatching,
    Policy.PREFILL_FIRST: PrefillFirst,
    Policy.DECODE_FIRST: DecodeFirst,
}
