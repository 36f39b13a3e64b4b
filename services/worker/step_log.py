"""The engine's last steps as they ran in service, for the planner to calibrate its stage curves
with (common/planner/calibrate.py `service_factors`): the profile times the model alone at
start-up; in service the same step shares the cores and pays for the worker around it.

The engine thread appends one sample per step; the worker publishes the window with the budgets
in force every PUBLISH_EVERY seconds when it has stepped since, and every REPUBLISH_EVERY when
idle (Redis `<p>:steps`, docs/substrate.md).
"""

from __future__ import annotations

from collections import deque

from common.engine.scheduler import Batch
from common.protocol.records import Step

KEPT = 512  # steps in the window
PUBLISH_EVERY = 5.0  # seconds
# An idle instance says the same again this often: the planner takes records older than
# STEPS_MAX_AGE (60 s) for an instance that is gone, and would plan an idle deployment uncalibrated.
REPUBLISH_EVERY = 15.0  # seconds


class StepLog:
    def __init__(self, kept: int = KEPT) -> None:
        self._steps: deque[Step] = deque(maxlen=kept)

    def record(
        self, batch: Batch, seconds: float, image_unit: int | None, threads: float, overlap: float | None
    ) -> None:
        """On the engine thread, after each step (a deque's append is thread-safe). `threads`: the
        torch threads the step ran with, averaged over its layers where they changed mid-step;
        `overlap`: how many other workers' steps ran beside it on average (None: not known)."""
        images = batch.image_cost(image_unit) / (image_unit or 1)
        self._steps.append(
            Step(
                kind=batch.kind,
                images=round(images, 4),
                prefill_tokens=batch.prefill_tokens,
                decodes=len(batch.decodes),
                decode_context=round(batch.decode_context, 1),
                seconds=round(seconds, 6),
                threads=round(threads, 3),
                overlap=-1.0 if overlap is None else round(overlap, 3),
            )
        )

    def __len__(self) -> int:
        return len(self._steps)

    def window(self) -> tuple[Step, ...]:
        """The steps kept, oldest first (StepPublisher sends them with the budgets in force)."""
        return tuple(self._steps)
