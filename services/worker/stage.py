"""The shape of a stage's handler, which the worker runtime drives: a hybrid instance holds one
handler per role and routes each task, and each hand-off, to the handler it belongs to."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from common.bus import Task
from common.engine.admission import Load
from common.roles import Role
from services.settings import WorkerSettings
from services.worker.context import StageContext
from services.worker.ledger import Held


class StageHandler:
    """What a stage pulls and admits (`take`), what it hands on when its part is done (`hand_on`),
    and any background work of its own (`watch`); how much it asks its queue for (`pull_rule`)
    whether its steps take the host's idle cores (`takes_idle_cores`), and whether requests are
    sent to where their prefix is cached (`routed_by_prefix`)."""

    role: ClassVar[Role]
    # The stage this one queues next, when the engine says a request needs it and this instance
    # does not run it (None: the request ends here).
    hands_on_to: ClassVar[Role | None] = None
    # How many tasks to fetch given the engine's load: a pure function of common/engine/admission,
    # so that the planner's simulator replays the same rule.
    pull_rule: ClassVar[Callable[[Load], int]]
    # Whether an instance running this stage lends its steps the host's idle cores (a core board):
    # the stages a request's TTFT waits on run large steps.
    takes_idle_cores: ClassVar[bool] = False
    # Whether requests are sent to the instance that holds their prefix for this stage (routing by
    # cached prefix): the instance then also reads its own mailbox, and tells the cluster which
    # prefix-cache keys it holds.
    routed_by_prefix: ClassVar[bool] = False

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        # Whether it pulls its role's shared queue; False: only the tasks sent to this instance (its
        # mailbox), as a decode instance's prefill does for the conversations it continues.
        self.shared_queue = True

    @classmethod
    def from_settings(cls, ctx: StageContext, settings: WorkerSettings) -> StageHandler:
        """The handler as a worker's settings configure it."""
        return cls(ctx)

    async def take(self, task: Task) -> None:
        """Record a pulled task's request, pull what it needs, and admit it into the engine."""
        raise NotImplementedError

    async def hand_on(self, held: Held) -> None:
        """Queue the request's next stage (the engine handed it off) and settle its task."""
        raise NotImplementedError(f"the {self.role} stage hands nothing on")

    def first_token(self, held: Held) -> None:
        """A request's first token came out of this instance's engine: the stage's marks and
        metrics of it (prefill's; nothing by default)."""

    def finished(self, held: Held) -> None:
        """A request ended in this instance's engine: the stage's marks and metrics of it
        (decode's; nothing by default)."""

    def figures(self) -> tuple[list[tuple[str, float, str]], list[tuple[str, float, str]]]:
        """The stage's own counters and gauges for /metrics, each (name, value, help), named
        trident_<name> (none by default)."""
        return [], []

    def room(self, load: Load) -> int:
        """How many of this stage's tasks to fetch now."""
        return type(self).pull_rule(load)

    async def watch(self) -> None:
        """Background work of the stage's own, run for the worker's life (none by default)."""
