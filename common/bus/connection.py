"""Connecting to NATS so that a server restart is survivable, and declaring the task stream."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from common.bus.subjects import Subjects
from common.roles import Role
from common.tls import Tls

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BusConfig:
    """How to reach NATS and how the task stream behaves.

    `ack_wait` bounds how long a crashed worker's task waits before redelivery; long work extends
    it with in-progress acks, so it can stay short. `max_deliver` bounds poison tasks: after that
    many deliveries the task is dead-lettered instead of crashing worker after worker.
    """

    # Credentials ride in the URL: nats://token@host or user:pass@host; a cluster's nodes, comma-separated.
    url: str = "nats://127.0.0.1:4222"
    name: str = "trident"
    prefix: str = "trident"
    ack_wait: float = 30.0
    max_deliver: int = 5
    # Retries of a task whose handler failed wait this long first, so a transient cause can clear.
    nak_delay: float = 1.0
    # A publish waits this long in total (across a NATS restart) for JetStream to store the task.
    publish_timeout: float = 30.0
    reconnect_wait: float = 0.25
    connect_timeout: float = 5.0
    # How long JetStream remembers a message id to drop a retried publish's duplicate.
    duplicate_window: float = 120.0
    max_task_bytes: int = 8 * 1024 * 1024
    # A backstop on each stage's queue (the gateway turns requests away long before, by queue
    # depth): past it, a publish fails with QueueFull instead of the stream growing without bound.
    max_queued_tasks: int = 10_000
    extra_servers: tuple[str, ...] = field(default_factory=tuple)
    # Copies JetStream keeps of the task stream (and its consumers): 3 on a three-node cluster, so
    # losing a node loses no task; 1 on a single server.
    stream_replicas: int = 1
    # The deployment's certificates: the connection is TLS, and the server must show a certificate
    # its CA signed (and is shown ours).
    tls: Tls | None = None

    @property
    def servers(self) -> list[str]:
        """The URL's servers: a cluster's nodes are listed comma-separated, nats://a:4222,nats://b:4222."""
        return [part.strip() for part in self.url.split(",") if part.strip()]

    @property
    def keep_alive_period(self) -> float:
        """How often a held task is marked in progress: three chances per ack_wait."""
        return max(0.1, self.ack_wait / 3)

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)


async def connect_nats(config: BusConfig, on_reconnect: Callable[[], None] | None = None) -> NATS:
    """A client that reconnects forever: publishes made while NATS is away are buffered and sent
    after the reconnect, and subscriptions (pull inboxes included) are re-established.
    `on_reconnect` is told each time the connection is back."""

    client: list[NATS] = []  # the callbacks need the client, which exists only after connect()

    async def on_disconnect() -> None:
        if client and (client[0].is_closed or client[0].is_draining):
            return  # our own close, not an outage
        log.warning("NATS connection lost (%s); reconnecting", config.name)

    async def reconnected() -> None:
        log.info("NATS reconnected (%s)", config.name)
        if on_reconnect is not None:
            on_reconnect()

    async def on_error(exc: Exception) -> None:
        # Connection-refused noise during a restart is expected; anything else is worth a line.
        log.debug("NATS client error (%s): %r", config.name, exc)

    servers = [*config.servers, *config.extra_servers]
    nc = await nats.connect(
        servers=servers,
        # Given outright, so they also reach the nodes a cluster tells the client of (bare host:port).
        **credentials(servers),
        name=config.name,
        allow_reconnect=True,
        max_reconnect_attempts=-1,
        reconnect_time_wait=config.reconnect_wait,
        connect_timeout=config.connect_timeout,
        disconnected_cb=on_disconnect,
        reconnected_cb=reconnected,
        error_cb=on_error,
        # Pings detect a dead server that did not close the socket (a SIGKILLed container).
        ping_interval=5,
        max_outstanding_pings=2,
        **(tls_options(config.tls) if config.tls is not None else {}),
    )
    client.append(nc)
    return nc


def tls_options(tls: Tls) -> dict[str, object]:
    """nats-py's TLS options: the server starts the handshake before anything else (common/infra)."""
    return {"tls": tls.client_context(), "tls_handshake_first": True}


def credentials(servers: list[str]) -> dict[str, str]:
    """The token, or user and password, the first of `servers` to carry any carries in its URL."""
    for server in servers:
        parts = urlsplit(server)
        if parts.username is None:
            continue
        if parts.password is None:
            return {"token": unquote(parts.username)}
        return {"user": unquote(parts.username), "password": unquote(parts.password)}
    return {}


async def ensure_task_stream(js: JetStreamContext, config: BusConfig) -> None:
    """Create (or update) the work-queue stream and the durable pull consumer of every role.

    Idempotent: every process calls it at start-up, so whichever comes first sets things up.
    """
    subjects = config.subjects
    stream = StreamConfig(
        name=subjects.task_stream,
        subjects=[subjects.task(role) for role in Role] + [subjects.mailboxes(Role.PREFILL)],
        # Work queue: a task is removed once acked, and each subject has exactly one consumer.
        retention=RetentionPolicy.WORK_QUEUE,
        # File storage: tasks survive a NATS restart; unacked ones are redelivered afterwards.
        storage=StorageType.FILE,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
        max_msgs_per_subject=config.max_queued_tasks,
        max_msg_size=config.max_task_bytes,
        duplicate_window=config.duplicate_window,
        num_replicas=config.stream_replicas,
    )
    await _declare(js, stream)
    for role in Role:
        await js.add_consumer(subjects.task_stream, consumer_config(config, role))


async def _declare(js: JetStreamContext, stream: StreamConfig) -> None:
    try:
        await js.add_stream(stream)
    except BadRequestError:
        await js.update_stream(stream)


def consumer_config(config: BusConfig, role: Role) -> ConsumerConfig:
    """The durable pull consumer that all replicas of `role` share."""
    name = config.subjects.consumer(role)
    return ConsumerConfig(
        name=name,
        durable_name=name,
        filter_subject=config.subjects.task(role),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=config.ack_wait,
        max_deliver=config.max_deliver,
        # Many replicas may each hold a waiting pull request; the default cap (512) is plenty.
        max_waiting=512,
    )


MAILBOX_IDLE = 60.0  # seconds a mailbox consumer outlives its instance's last pull (the server removes it)


def mailbox_config(config: BusConfig, role: Role, instance_id: str) -> ConsumerConfig:
    """One instance's consumer of the tasks sent to it. The server removes it once its instance
    has stopped pulling for MAILBOX_IDLE seconds; what is left in the mailbox is handed on by the
    failover, or taken back by its sender (common/dispatch.py)."""
    name = config.subjects.mailbox_consumer(role, instance_id)
    return ConsumerConfig(
        name=name,
        durable_name=name,
        filter_subject=config.subjects.mailbox(role, instance_id),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=config.ack_wait,
        max_deliver=config.max_deliver,
        inactive_threshold=MAILBOX_IDLE,
    )
