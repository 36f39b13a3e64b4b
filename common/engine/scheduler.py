"""The stage-level batcher (seed 000, Algorithm 1) and the two policies it is compared against.

Each iteration is built in three named steps, within an image budget τe and a token budget τt:

1. running decodes — all of them, one token each (preempting the newest request if KV runs out);
2. continuing work — prefill chunks and encodes of requests already started;
3. new work — waiting requests, prefill-ready ones into τt (chunked), image ones into τe.

Where decodes share a step with other work, long work — a long prompt's chunks, a clip's encode —
is paced (pacing.py): it goes into a step only while the time such work added to steps with
decodes is within a share of those steps, so a long clip leaves most tokens of the requests
decoding beside it at the pace they had without it.

τe and τt are each the most one iteration can hold within the instance's latency limit, so on an
instance that runs the vision tower and the LLM in one iteration (EP, ED, EPD) they share it:
images/τe + tokens/τt ≤ 1. Filling both (as Algorithm 1 reads) ran small-llava EPD iterations
that held an encode and a prefill chunk at 218 ms p50, against a 200 ms TBT limit
(bench/step_limits.py).

`prefill-first` (vLLM v0) runs whole prefills, their images encoded in the same iteration, and
decodes only when no prefill waits. `decode-first` (Sarathi) takes all decodes, then fills τt with
prefill chunks whose images are encoded inline, with no image budget.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.engine.block_manager import BlockManager
from common.engine.config import EngineConfig, Policy
from common.engine.pacing import Pacer
from common.engine.prefix import block_hashes
from common.engine.request import Request, Status
from common.roles import Role, StepKind


@dataclass
class Batch:
    """One iteration's work: the contract between the scheduler and the model runner."""

    encodes: list[tuple[Request, list[int]]] = field(default_factory=list)  # (request, image indices)
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)
    decodes: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + self.prefill_tokens

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefills)

    @property
    def decode_context(self) -> float:
        """The decodes' mean context (tokens each attends over); 0 without decodes."""
        return sum(r.num_tokens for r in self.decodes) / len(self.decodes) if self.decodes else 0.0

    @property
    def num_images(self) -> int:
        return sum(len(idx) for _, idx in self.encodes)

    @property
    def image_tokens(self) -> int:
        return sum(req.images[i].num_tokens for req, idx in self.encodes for i in idx)

    def image_cost(self, unit: int | None) -> int:
        """What the encodes take of τe, in 1/unit parts of an image (see Scheduler.image_unit)."""
        return self.image_tokens if unit else self.num_images

    @property
    def empty(self) -> bool:
        return not (self.encodes or self.prefills or self.decodes)

    @property
    def kind(self) -> StepKind:
        """The one stage whose work the batch holds, else mixed (read for every step the planner's
        simulator replays: a table lookup)."""
        return _KINDS[bool(self.encodes), bool(self.prefills), bool(self.decodes)]

    def scheduled(self, req: Request) -> bool:
        return any(r is req for r in self.decodes) or any(r is req for r, _ in self.prefills + self.encodes)


# Batch.kind by (encodes?, prefills?, decodes?): StepKind.of the stages with work.
_KINDS = {
    (e, p, d): StepKind.of(r for r, held in zip(Role, (e, p, d), strict=True) if held)
    for e in (False, True)
    for p in (False, True)
    for d in (False, True)
}


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.token_budget = config.token_budget
        self.image_budget = config.image_budget
        # What τe counts. None: images, each one (LLaVA-1.5: all images are one size). Otherwise the
        # tokens of the reference image the encode curve was profiled on: an image then costs
        # num_tokens / image_unit of τe, so a Qwen-VL image twice the reference's area costs two.
        self.image_unit: int | None = None
        # Encodes and LLM tokens in one iteration share its latency limit (module docstring).
        self.shared_limit = (
            config.policy == Policy.STAGE
            and Role.ENCODE in config.roles
            and bool(config.roles & {Role.PREFILL, Role.DECODE})
        )
        # Long work beside decodes (module docstring), where one step does both.
        self.pacer = (
            Pacer(config.tbt_stretch)
            if config.tbt_stretch is not None
            and config.policy == Policy.STAGE
            and Role.DECODE in config.roles
            and bool(config.roles & {Role.PREFILL, Role.ENCODE})
            else None
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def add_running(self, req: Request) -> None:
        """A request that arrives mid-way (imported KV): it joins the running set directly."""
        req.status = Status.RUNNING
        self.running.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        batch = Batch()
        if self.config.policy == Policy.PREFILL_FIRST:
            self._whole_prefills(batch)
            if not batch.prefills:
                self._running_decodes(batch)
        elif self.config.policy == Policy.DECODE_FIRST:
            self._running_decodes(batch)
            self._chunked_prefills_inline_encode(batch)
        else:
            self._running_decodes(batch)
            self._continuing_work(batch)
            self._new_work(batch)
        self._encode_only(batch)
        return batch

    def observe(self, batch: Batch, seconds: float) -> None:
        """How long `batch` took to run: what the pacer learns from (the engine's steps, and the
        planner's simulated ones alike)."""
        if self.pacer is None:
            return
        paced = any(self.is_long(r) for r, _ in batch.prefills) or any(
            r.images[i].video for r, taken in batch.encodes for i in taken
        )
        decode_only = not (batch.prefills or batch.encodes)
        self.pacer.observe(len(batch.decodes), seconds, decode_only=decode_only, paced=paced)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues (finished, handed off or aborted); blocks are the caller's."""
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)

    # -- step 1: running decodes -------------------------------------------------------------------

    def _running_decodes(self, batch: Batch) -> None:
        if Role.DECODE not in self.config.roles:
            return
        for req in list(self.running):
            if req.status != Status.RUNNING or not req.is_decoding:
                continue
            if self._grow_or_preempt(req, req.num_tokens, batch):
                batch.decodes.append(req)

    def _grow_or_preempt(self, req: Request, num_tokens: int, batch: Batch) -> bool:
        """Make KV room for `req`, preempting the newest other running requests if needed."""
        while self.blocks.allocate(req.request_id, num_tokens) is None:
            # Never one that could not be computed again here (its KV imported with its images'
            # features consumed elsewhere): it reserved its whole length when it arrived.
            victim = next((r for r in reversed(self.running) if r is not req and r.recomputable), None)
            if victim is None:
                self._preempt(req, batch)
                return False
            self._preempt(victim, batch)
        return True

    def _preempt(self, req: Request, batch: Batch) -> None:
        """Preemption by recompute: drop its KV; it prefills prompt + outputs again later."""
        self.blocks.free(req.request_id)
        self.running.remove(req)
        req.num_computed_tokens = req.num_remembered = 0  # its full blocks stay cached, to be found again
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        batch.preempted.append(req)
        if req in batch.decodes:
            batch.decodes.remove(req)

    # -- step 2: continuing work -------------------------------------------------------------------

    def _continuing_work(self, batch: Batch) -> None:
        started = [r for r in self.running if not batch.scheduled(r)]
        for req in started:
            if req.is_prefilling:
                self._take_chunk(req, batch)
        if self._encodes_allowed(batch):
            for req in started:
                if req.needs_encode:
                    self._take_encode(req, batch)

    # -- step 3: new work --------------------------------------------------------------------------

    def _new_work(self, batch: Batch) -> None:
        for req in [r for r in self.waiting if not r.needs_encode]:
            if self._chunk_waits(req, batch):
                continue  # a long prompt waits for a step with credit for it; shorter ones need not
            if self._full() or not self._take_chunk(req, batch):
                break  # out of τt or KV blocks: keep arrival order, admit nothing newer
            self._start(req)
        if not self._encodes_allowed(batch):
            return
        for req in [r for r in self.waiting if r.needs_encode]:
            if self._encode_waits(req, batch):
                continue  # a clip waits for a step with credit for it; pictures need not
            if self._full() or not self._take_encode(req, batch):
                break
            self._start(req)

    def _encodes_allowed(self, batch: Batch) -> bool:
        # 001's variant keeps encode latency off iterations that carry prefill chunks.
        return self.config.encode_with_prefill or not batch.prefills

    def _full(self) -> bool:
        return len(self.running) >= self.config.max_num_seqs

    def _take_encode(self, req: Request, batch: Batch) -> bool:
        room = self._images_left(batch)  # in cost units
        if Role.ENCODE not in self.config.roles:
            return False
        todo, taken = req.images_to_encode(), []
        for i in todo:
            if req.images[i].video and self._paced_out(batch):
                break  # a clip beside decodes, without credit: a later step
            cost = req.images[i].num_tokens if self.image_unit else 1
            if cost > room:
                # An image larger than all of τe runs as the first encode of an iteration (as a
                # prompt larger than τt does), else it could never run.
                if not (taken or batch.encodes) and cost > self.image_budget * (self.image_unit or 1):
                    taken.append(i)
                break
            taken.append(i)
            room -= cost
        if not taken:
            return False
        batch.encodes.append((req, taken))
        return True

    def _take_chunk(self, req: Request, batch: Batch) -> bool:
        room = self._tokens_left(batch)
        if Role.PREFILL not in self.config.roles or room <= 0 or self._chunk_waits(req, batch):
            return False
        looked = self._reuse_prefix(req)
        chunk = min(req.num_uncomputed, room)
        if self.blocks.allocate(req.request_id, req.num_computed_tokens + chunk) is None:
            self._give_back_prefix(req)
            return False
        self._count_lookup(req, looked)
        batch.prefills.append((req, chunk))
        return True

    def _chunk_waits(self, req: Request, batch: Batch) -> bool:
        """Whether `req` is a long prompt that must sit this step out beside the decodes (pacing.py)."""
        return self.is_long(req) and self._paced_out(batch)

    def _encode_waits(self, req: Request, batch: Batch) -> bool:
        """Whether `req`'s next encode is a clip that must sit this step out beside the decodes."""
        todo = req.images_to_encode()
        return bool(todo) and req.images[todo[0]].video and self._paced_out(batch)

    def _paced_out(self, batch: Batch) -> bool:
        """Whether long work (a long prompt's chunk, a clip's encode) sits this step out: decodes
        are in it and the pacer has no credit left."""
        return self.pacer is not None and bool(batch.decodes) and not self.pacer.allows()

    def is_long(self, req: Request) -> bool:
        """A prompt long enough to be paced beside decodes."""
        return len(req.prompt_token_ids) > self.config.long_prefill

    def _reuse_prefix(self, req: Request) -> tuple[int, int]:
        """A request about to compute its first tokens starts from its longest cached prefix, and
        computes at least its last token (whose logits it samples from). Returns (tokens looked up,
        tokens found), for the hit rate once the request is admitted ((0, 0): no lookup)."""
        if (
            not self.blocks.caching
            or not req.cacheable
            or req.num_computed_tokens
            or self.blocks.table(req.request_id)
        ):
            return 0, 0
        size = self.blocks.block_size
        hashes = block_hashes(req, (req.num_tokens - 1) // size, size)
        found = self.blocks.longest_prefix(hashes)
        self.blocks.attach(req.request_id, found)
        req.num_remembered = len(found)  # its attached blocks are findable already
        req.num_computed_tokens = len(found) * size
        return req.num_tokens, req.num_computed_tokens

    def _count_lookup(self, req: Request, looked: tuple[int, int]) -> None:
        """Admitted after a lookup (`_reuse_prefix`): count it, and what it found is the request's."""
        if looked[0]:
            self.blocks.count_lookup(*looked)
            req.num_cached_tokens = looked[1]

    def _give_back_prefix(self, req: Request) -> None:
        """Not admitted after all: a request that computed nothing holds no blocks while it waits."""
        if req.num_computed_tokens and all(req is not r for r in self.running):
            self.blocks.free(req.request_id)
            req.num_computed_tokens = req.num_remembered = 0

    def _tokens_left(self, batch: Batch) -> int:
        if self.shared_limit:  # what the images leave of the limit, in tokens (exact integer floor)
            tau_t, tau_e = self.token_budget, self.image_budget * (self.image_unit or 1)
            return tau_t * max(0, tau_e - batch.image_cost(self.image_unit)) // tau_e - batch.num_tokens
        return self.token_budget - batch.num_tokens

    def _images_left(self, batch: Batch) -> int:
        """Room left in τe, in cost units (images, or image tokens when image_unit is set)."""
        tau_e = self.image_budget * (self.image_unit or 1)
        if self.shared_limit:
            tau_t = self.token_budget
            return tau_e * max(0, tau_t - batch.num_tokens) // tau_t - batch.image_cost(self.image_unit)
        return tau_e - batch.image_cost(self.image_unit)

    def _start(self, req: Request) -> None:
        self.waiting.remove(req)
        req.status = Status.RUNNING
        self.running.append(req)

    # -- the comparison policies -------------------------------------------------------------------

    def _pending_prefills(self) -> list[Request]:
        """Started requests first, then waiting ones in arrival order."""
        started = [r for r in self.running if r.needs_encode or r.is_prefilling]
        return started + list(self.waiting)

    def _whole_prefills(self, batch: Batch) -> None:
        """vLLM v0: whole prompts (no chunking) up to τt; a prompt larger than τt runs alone."""
        if Role.PREFILL not in self.config.roles:
            return
        for req in self._pending_prefills():
            looked = self._reuse_prefix(req)
            need = req.num_uncomputed
            if (batch.prefills and need > self._tokens_left(batch)) or not self._admit_inline(
                req, need, batch, looked
            ):
                self._give_back_prefix(req)
                break

    def _chunked_prefills_inline_encode(self, batch: Batch) -> None:
        """Sarathi: chunks fill what the decodes left of τt; images are encoded when prefill starts."""
        if Role.PREFILL not in self.config.roles:
            return
        for req in self._pending_prefills():
            room = self._tokens_left(batch)
            if room <= 0:
                break
            looked = self._reuse_prefix(req)
            if not self._admit_inline(req, min(req.num_uncomputed, room), batch, looked):
                self._give_back_prefix(req)
                break

    def _admit_inline(self, req: Request, chunk: int, batch: Batch, looked: tuple[int, int]) -> bool:
        if req.needs_encode and Role.ENCODE not in self.config.roles:
            return True  # cannot encode here; leave it (the engine rejects such requests at admission)
        if self.blocks.allocate(req.request_id, req.num_computed_tokens + chunk) is None:
            return False
        self._count_lookup(req, looked)
        if req.needs_encode:
            batch.encodes.append((req, req.images_to_encode()))
        batch.prefills.append((req, chunk))
        if req.status == Status.WAITING:
            self._start(req)
        return True

    def _encode_only(self, batch: Batch) -> None:
        """An instance without the prefill role encodes under τe whatever its policy."""
        if Role.PREFILL in self.config.roles or self.config.policy == Policy.STAGE:
            return
        self._continuing_work(batch)
        self._new_work(batch)
