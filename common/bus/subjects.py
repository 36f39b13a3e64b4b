"""Every NATS subject, stream and consumer name in one place, derived from one prefix.

    <p>.task.{encode,prefill,decode}   JetStream work-queue stream <P>_TASKS, durable consumer per role
    <p>.task.prefill.to.<instance_id>  the same stream: tasks sent to one instance (its mailbox)
    <p>.out.<request_id>               core: TokenDelta / FinalOutput / ErrorOutput for one request
    <p>.ctl.cancel                     core: Cancel, broadcast to every instance
    <p>.ctl.resend                     core: Resend, broadcast: a gateway asks for outputs again
    <p>.ctl.fence                      core: Fence, broadcast: an instance was found dead
    <p>.ctl.release.<owner>            core: Release, to the instance that holds the KV
    <p>.plan                           core: Plan events from the planner
    <p>.hb.<instance_id>               core: Heartbeat (the registry in Redis is the source of truth)
    <p>.kv.<instance_id>               core: PrefixBlocks, the prefix-cache keys an instance gained/dropped

The prefix exists so tests (and two deployments on one NATS) do not see each other's traffic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from common.protocol import DecodeTask, EncodeTask, PrefillTask, StageTask
from common.roles import Role

TASK_KINDS: dict[Role, type[StageTask]] = {kind.ROLE: kind for kind in (EncodeTask, PrefillTask, DecodeTask)}

# A subject token may not hold '.', whitespace or the wildcards; ids that go into subjects are checked.
_TOKEN = re.compile(r"^[A-Za-z0-9_\-:=+/@]+$")


def check_token(value: str, what: str) -> str:
    """Return `value` if it can be one subject token, else raise ValueError naming `what`."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} cannot be a NATS subject token")
    return value


@dataclass(frozen=True)
class Subjects:
    """Names under one prefix."""

    prefix: str = "trident"

    def __post_init__(self) -> None:
        check_token(self.prefix, "subject prefix")

    @property
    def task_stream(self) -> str:
        return f"{self.prefix.upper().replace('-', '_')}_TASKS"

    def task(self, role: Role) -> str:
        return f"{self.prefix}.task.{_role(role)}"

    def consumer(self, role: Role) -> str:
        """The durable pull consumer every replica of `role` shares."""
        return f"{self.prefix}-{_role(role)}"

    def mailbox(self, role: Role, instance_id: str) -> str:
        """`role`'s tasks sent to one instance (routing by cached prefix), beside the shared queue."""
        return f"{self.task(role)}.to.{check_token(instance_id, 'instance id')}"

    def mailboxes(self, role: Role) -> str:
        return f"{self.task(role)}.to.*"

    def mailbox_consumer(self, role: Role, instance_id: str) -> str:
        return f"{self.consumer(role)}-to-{check_token(instance_id, 'instance id')}"

    def shared(self, subject: str) -> str:
        """The shared queue's subject for a task stored on `subject` (a mailbox's, or already it)."""
        return subject.split(".to.", 1)[0] if subject.startswith(f"{self.prefix}.task.") else subject

    def prefix_blocks(self, instance_id: str) -> str:
        return f"{self.prefix}.kv.{check_token(instance_id, 'instance id')}"

    @property
    def prefix_blocks_all(self) -> str:
        return f"{self.prefix}.kv.*"

    def output(self, request_id: str) -> str:
        token = request_id if request_id == "*" else check_token(request_id, "request id")
        return f"{self.prefix}.out.{token}"

    @property
    def cancel(self) -> str:
        return f"{self.prefix}.ctl.cancel"

    @property
    def resend(self) -> str:
        return f"{self.prefix}.ctl.resend"

    @property
    def fence(self) -> str:
        return f"{self.prefix}.ctl.fence"

    def release(self, owner: str) -> str:
        return f"{self.prefix}.ctl.release.{check_token(owner, 'instance id')}"

    @property
    def plan(self) -> str:
        return f"{self.prefix}.plan"

    def heartbeat(self, instance_id: str) -> str:
        return f"{self.prefix}.hb.{check_token(instance_id, 'instance id')}"

    @property
    def heartbeats_all(self) -> str:
        return f"{self.prefix}.hb.*"

    def max_deliveries_advisory(self) -> str:
        """JetStream's advisory when a message of this stream ran out of deliveries (any consumer)."""
        return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{self.task_stream}.*"


def _role(role: Role | str) -> Role:
    try:
        return Role(role)
    except ValueError:
        raise ValueError(f"unknown role {role!r}") from None
