"""Queueing a request's next stage, the one way every service does it: mark the stage queued in
the request's record, then store the task in JetStream under a de-duplication id.

The id names the request, the stage and the step that sends it (`source`: the gateway, or the
stream sequence of the task being handed on). A retry of that very step (after a NATS restart,
say) is stored once; a later step of the same request — a second prefill after its KV was lost —
has another source and is not mistaken for a duplicate.
"""

from __future__ import annotations

from common.bus import TaskPublisher
from common.protocol import StageTask
from common.roles import Role
from common.store import Stage
from common.store.recorder import StageRecorder

QUEUED = {
    Role.ENCODE: Stage.ENCODE_QUEUED,
    Role.PREFILL: Stage.PREFILL_QUEUED,
    Role.DECODE: Stage.DECODE_QUEUED,
}


class Dispatcher:
    def __init__(self, tasks: TaskPublisher, record: StageRecorder) -> None:
        self.tasks = tasks
        self.record = record

    async def send(self, task: StageTask, source: str | int) -> None:
        """Queue `task` for its stage; `source` names the step that sends it (see the module doc)."""
        rid = task.request.request_id
        self.record.mark(rid, QUEUED[task.ROLE])
        await self.tasks.publish(task, msg_id=f"{rid}:{task.ROLE}:from-{source}")
