"""One iteration's work: the contract between the scheduler, which fills it, and the model runner,
which runs it (and the planner's simulator, which times it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.request import Request
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
