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

This module holds what every policy shares: the queues, step 1, the room a batch has left and the
pacing gate. Each policy is one small class in policies.py; prefix caching is prefix.py's.
"""

from __future__ import annotations

from collections import deque

from common.engine.batch import Batch
from common.engine.block_manager import BlockManager
from common.engine.config import EngineConfig, Policy
from common.engine.pacing import Pacer
from common.engine.policies import policy_for
from common.engine.prefix import PrefixReuse
from common.engine.request import Request, Status
from common.roles import Role

__all__ = ["Batch", "Scheduler"]


class Scheduler:
    """The waiting queue and the running set; `schedule` asks the policy for each iteration's batch."""

    def __init__(
        self, config: EngineConfig, blocks: BlockManager, prefixes: PrefixReuse | None = None
    ) -> None:
        self.config = config
        self.blocks = blocks
        self.prefixes = prefixes if prefixes is not None else PrefixReuse(blocks)
        self.token_budget = config.token_budget
        self.image_budget = config.image_budget
        # What τe counts. None: images, each one (LLaVA-1.5: all images are one size). Otherwise the
        # tokens of the reference image the encode curve was profiled on: an image then costs
        # num_tokens / image_unit of τe, so a Qwen-VL image twice the reference's area costs two.
        self.image_unit: int | None = None
        stage, roles = config.policy == Policy.STAGE, config.roles
        # Encodes and LLM tokens in one iteration share its latency limit (module docstring).
        self.shared_limit = stage and Role.ENCODE in roles and bool(roles & {Role.PREFILL, Role.DECODE})
        # Long work beside decodes (module docstring), where one step does both.
        paces = stage and Role.DECODE in roles and bool(roles & {Role.PREFILL, Role.ENCODE})
        self.pacer = Pacer(config.tbt_stretch) if config.tbt_stretch is not None and paces else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.policy = policy_for(self)

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
        """One iteration's batch, built by the policy's named steps (policies.py)."""
        batch = Batch()
        self.policy.fill(batch)
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

    def start(self, req: Request) -> None:
        """A waiting request joins the running set (its first chunk or encode is in the batch)."""
        self.waiting.remove(req)
        req.status = Status.RUNNING
        self.running.append(req)

    # -- step 1: running decodes, every policy's ---------------------------------------------------

    def running_decodes(self, batch: Batch) -> None:
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
        req.lose_prefix()  # images whose KV was in its prefix are encoded again
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        batch.preempted.append(req)
        if req in batch.decodes:
            batch.decodes.remove(req)

    # -- room left in a batch, and the pacing gate -------------------------------------------------

    def tokens_left(self, batch: Batch) -> int:
        if self.shared_limit:  # what the images leave of the limit, in tokens (exact integer floor)
            tau_t, tau_e = self.token_budget, self.image_budget * (self.image_unit or 1)
            return tau_t * max(0, tau_e - batch.image_cost(self.image_unit)) // tau_e - batch.num_tokens
        return self.token_budget - batch.num_tokens

    def images_left(self, batch: Batch) -> int:
        """Room left in τe, in cost units (images, or image tokens when image_unit is set)."""
        tau_e = self.image_budget * (self.image_unit or 1)
        if self.shared_limit:
            tau_t = self.token_budget
            return tau_e * max(0, tau_t - batch.num_tokens) // tau_t - batch.image_cost(self.image_unit)
        return tau_e - batch.image_cost(self.image_unit)

    def is_long(self, req: Request) -> bool:
        """A prompt long enough to be paced beside decodes."""
        return len(req.prompt_token_ids) > self.config.long_prefill

    def paced_out(self, batch: Batch) -> bool:
        """Whether long work (a long prompt's chunk, a clip's encode) sits this step out: decodes
        are in it and the pacer has no credit left."""
        return self.pacer is not None and bool(batch.decodes) and not self.pacer.allows()
