"""Failover in seconds: a dead instance is noticed by its silence, and its work is handed on at once.

Every instance publishes a heartbeat every interval; a worker's lists the stream sequences of the
tasks it holds. Every instance, gateways and workers alike, watches the others. One silent for
`after` seconds, while the watcher's own connection was up all that time, is asked for its
`/health` (`probe`):
- it answers, as itself: slow (starved of CPU), not dead; it gets another allowance;
- nothing listens there any more (connection refused, its name gone), or another process answers
  in its place (a restarted container): it is dead, now;
- the connection hangs (a frozen process still has its socket; a host cut off): it is taken for
  dead only once silent for `unresponsive_after` — a loop held up a few seconds on a busy machine
  must not cost a restart and a re-prefill of everything it holds.
The first watcher to claim a death (in Redis) fences the instance — a mark in Redis and a
broadcast, so that should it come back (it was frozen, not killed) it leaves, and whatever it
still sends is ignored — takes it out of the registry, and hands every task it held back to its
queue: the stored message, again, with a header naming the dead instance, so the next holder
resumes the request from the tokens its client already has. Without this, a dead instance's
tasks wait out their ack deadline.

A watcher that could not hear — cut off from NATS, or itself stalled (frozen with SIGSTOP, starved
of CPU) — judges no one until it has listened again for `after` seconds: a broker restart, or a
watcher waking from a freeze, is not taken for the death of everyone.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import secrets
import socket
import ssl
import time
from collections.abc import Callable
from typing import Protocol

import httpx
from nats.js.errors import NotFoundError

from common.aio import raise_if_cancelled
from common.bus import Bus
from common.bus.tasks import FAILOVER_HEADER, published_id
from common.protocol import Fence, Heartbeat
from common.roles import Role
from common.store import Store
from common.tls import Tls

log = logging.getLogger(__name__)
TICK = 0.25  # seconds between judgements
STALL = 0.75  # a judgement this late means the watcher itself stalled: it counts afresh
SWEEP_GRACE = 0.5  # seconds live instances have to list tasks they took as another died
# A gateway's death hands nothing on (its clients are gone with it), while taking a live one for
# dead ends every request it serves; and its event loop, busy answering an overload, is the one
# most likely to beat late. So a gateway gets this much silence at least before it is judged.
GATEWAY_PATIENCE = 10.0
PROBE_TIMEOUT = 1.0  # a silent instance is asked over HTTP before it is taken for dead
INSTANCE_HEADER = "x-trident-instance"  # every /health names who answers it


class Probe(enum.Enum):
    ANSWERS = "answers"  # alive, as itself
    GONE = "gone"  # nothing listens at its address, or another process does
    SILENT = "silent"  # the connection hangs or breaks: frozen, or its host cut off


async def probe(
    http_address: str, instance_id: str, timeout: float = PROBE_TIMEOUT, tls: Tls | None = None
) -> Probe:
    """Ask a silent instance's `/health` whether it is still there (with `tls`, showing our
    certificate: a worker's HTTP then answers members only)."""
    verify: ssl.SSLContext | bool = tls.client_context() if tls is not None else True
    try:
        async with httpx.AsyncClient(timeout=timeout, trust_env=False, verify=verify) as http:
            resp = await http.get(http_address + "/health")
    except httpx.ConnectError:  # refused, unreachable, or its name no longer resolves
        return Probe.GONE
    except httpx.HTTPError:  # a timeout, a connection cut mid-answer
        return Probe.SILENT
    return Probe.ANSWERS if resp.headers.get(INSTANCE_HEADER) == instance_id else Probe.GONE


def instance_name(kind: str) -> str:
    """`<kind>-<host>-<nonce>-<pid>`: unique per process start — a restarted container keeps its
    host name and pid 1, but a dead instance's id stays fenced — and ending in the pid."""
    return f"{kind}-{socket.gethostname()}-{secrets.token_hex(2)}-{os.getpid()}"


class FailoverSettings(Protocol):
    """What the reaper reads of a service's settings (services/settings.py ServiceSettings)."""

    failover_after: float  # silence after which a dead instance's work is handed on
    unresponsive_after: float  # silence that fences one whose socket hangs
    tls: Tls | None  # how its probes reach the workers' HTTP


class Reaper:
    def __init__(
        self,
        bus: Bus,
        store: Store,
        me: str,
        settings: FailoverSettings,
        on_fence: Callable[[str], None] | None = None,
    ) -> None:
        self.tls = settings.tls
        self.bus = bus
        self.store = store
        self.me = me
        self.after = settings.failover_after
        self.unresponsive_after = settings.unresponsive_after
        self.on_fence = on_fence  # told of every instance fenced, by anyone (this one too)
        self.fenced: set[str] = set()
        self.reaped = 0  # deaths this watcher handed over
        self.handed_on = 0  # tasks it handed on
        self._last: dict[str, tuple[float, Heartbeat]] = {}
        self._hanging: set[str] = set()  # silent ones whose probe hung: judged again each tick
        self._blind_until = 0.0
        self._reconnects = bus.reconnects
        self._ask_about_me = False  # a fence of this instance may have been missed: ask Redis

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._hear_heartbeats())
            tg.create_task(self._hear_fences())
            tg.create_task(self._judge())

    async def _hear_heartbeats(self) -> None:
        async with await self.bus.events.heartbeats() as stream:
            async for beat in stream:
                if beat.leaving or beat.instance_id in self.fenced:
                    self._last.pop(beat.instance_id, None)
                elif beat.instance_id != self.me:
                    self._last[beat.instance_id] = (time.monotonic(), beat)
                    self._hanging.discard(beat.instance_id)

    async def _hear_fences(self) -> None:
        async with await self.bus.events.fences() as stream:
            async for fence in stream:
                self._fenced(fence.instance_id)

    def _fenced(self, instance_id: str) -> None:
        if instance_id not in self.fenced:
            self.fenced.add(instance_id)
            self._last.pop(instance_id, None)
            self._hanging.discard(instance_id)
            if self.on_fence is not None:
                self.on_fence(instance_id)

    async def _judge(self) -> None:
        while True:
            raise_if_cancelled()
            slept = time.monotonic()
            await asyncio.sleep(TICK)
            now = time.monotonic()
            late = now - slept - TICK  # how long this process itself did not run
            if self.me in self.fenced:
                return  # taken for dead itself: it judges no one
            if not self.bus.connected or self.bus.reconnects != self._reconnects or late > STALL:
                # Cut off, just back, or this process stalled (frozen, starved of CPU): everyone's
                # silence may be its own deafness. Start counting afresh.
                self._reconnects = self.bus.reconnects
                self._blind_until = now + self.after
                self._last = {i: (now, hb) for i, (_, hb) in self._last.items()}
                self._ask_about_me = True
                continue
            if self._ask_about_me:
                await self._was_i_fenced()
            if now < self._blind_until:
                continue
            for instance_id, (seen, beat) in list(self._last.items()):
                if now - seen > self._patience(beat):
                    await self._reap(instance_id, beat, now - seen)

    def _patience(self, beat: Heartbeat) -> float:
        return self.after if beat.kind == "worker" else max(self.after, GATEWAY_PATIENCE)

    async def _was_i_fenced(self) -> None:
        """After its own outage or stall, the broadcast of its fence may have been missed."""
        try:
            fenced = await self.store.registry.is_fenced(self.me)
        except Exception:  # Redis away: ask again at the next tick
            return
        self._ask_about_me = False
        if fenced:
            self._fenced(self.me)

    async def _reap(self, instance_id: str, beat: Heartbeat, silent: float) -> None:
        found = await probe(beat.http_address, instance_id, tls=self.tls) if beat.http_address else Probe.GONE
        if found is Probe.ANSWERS:
            # Starved of CPU, or its loop held up: slow, not dead. Taking it for dead would cost
            # a restart and every request it holds a re-prefill; it gets another allowance.
            log.warning("%s silent for %.1fs but it answers: slow, not dead", instance_id, silent)
            self._hanging.discard(instance_id)
            self._last[instance_id] = (time.monotonic(), beat)
            return
        if found is Probe.SILENT and silent < self.unresponsive_after:
            if instance_id not in self._hanging:
                self._hanging.add(instance_id)
                log.warning(
                    "%s silent for %.1fs and its /health hangs; dead at %.1fs unless it answers",
                    instance_id,
                    silent,
                    self.unresponsive_after,
                )
            return
        try:
            mine = await self.store.registry.claim_death(instance_id)
        except Exception as exc:  # Redis away: judge again at the next tick
            log.warning("cannot claim the death of %s yet: %r", instance_id, exc)
            return
        self._last.pop(instance_id, None)
        self._hanging.discard(instance_id)
        if not mine:
            return  # another watcher hands it over
        health = "hangs" if found is Probe.SILENT else "is gone"
        reason = f"no heartbeat for {silent:.1f}s, and its /health {health}"
        log.warning(
            "%s is dead (%s); fencing it and handing on its %d tasks", instance_id, reason, len(beat.held)
        )
        try:
            await self.store.registry.fence(instance_id)
        except Exception as exc:  # the broadcast still fences it for everyone listening
            log.warning("could not mark %s fenced in the registry: %r", instance_id, exc)
        await self.bus.events.fence(Fence(instance_id=instance_id, reason=reason))
        self._fenced(instance_id)
        self.reaped += 1
        delivered = await self._delivered(beat.roles)
        handed = {seq for seq in beat.held if await self._hand_on(instance_id, seq)}
        # Tasks delivered to it in its last moments, before a heartbeat could list them: taken
        # once every live instance has had time to list what it took meanwhile.
        await asyncio.sleep(SWEEP_GRACE)
        live = {seq for _, hb in self._last.values() for seq in hb.held}
        for role, upto in delivered.items():
            for seq in await self._unsettled(self.bus.subjects.task(role), upto):
                if seq not in live and seq not in handed and await self._hand_on(instance_id, seq):
                    handed.add(seq)
        if Role.PREFILL in beat.roles:  # what was sent to it alone: nobody else reads its mailbox
            mailbox = self.bus.subjects.mailbox(Role.PREFILL, instance_id)
            for seq, msg_id in (await self._unsettled(mailbox, upto=None)).items():
                mine = seq not in handed and await self._mailbox_claim(instance_id, seq, msg_id)
                if mine and await self._hand_on(instance_id, seq):
                    handed.add(seq)
        self.handed_on += len(handed)
        if handed:
            log.warning("handed on %d tasks of %s", len(handed), instance_id)

    async def _delivered(self, roles) -> dict:
        """For each role, the last stream sequence its consumer had delivered (now)."""
        subjects, found = self.bus.subjects, {}
        for role in roles:
            with contextlib.suppress(Exception):
                info = await self.bus.js.consumer_info(subjects.task_stream, subjects.consumer(role))
                found[role] = info.delivered.stream_seq or 0
        return found

    async def _mailbox_claim(self, dead: str, seq: int, msg_id: str) -> bool:
        """Whether a task left in a dead instance's mailbox is the failover's to hand on: unclaimed,
        or claimed by the dead instance itself (its sender, taking it back, has it otherwise)."""
        try:
            stream = self.bus.subjects.task_stream
            holder = await self.store.registry.claim_task(stream, seq, msg_id, f"failover:{dead}")
        except Exception as exc:  # Redis away: its sender takes it back
            log.warning("cannot claim task %d of %s's mailbox: %r", seq, dead, exc)
            return False
        return holder in (f"failover:{dead}", dead)

    async def _unsettled(self, subject: str, upto: int | None) -> dict[int, str]:
        """The tasks on `subject` still in the stream (not settled), up to `upto`: each one's
        sequence and the id it was published with (what a mailbox task's claim is keyed by)."""
        js, stream = self.bus.js, self.bus.subjects.task_stream
        found: dict[int, str] = {}
        seq = 0
        while True:
            try:
                msg = await js.get_msg(stream, seq=seq + 1, subject=subject, next=True)
            except NotFoundError:
                return found
            seq = msg.seq
            if upto is not None and seq > upto:
                return found
            found[seq] = published_id(msg.headers)

    async def _hand_on(self, dead: str, seq: int) -> bool:
        """Queue the task at `seq` again for a live replica, and remove the dead one's copy."""
        js, stream = self.bus.js, self.bus.subjects.task_stream
        try:
            stored = await js.get_msg(stream, seq)
        except NotFoundError:
            return False  # settled before the instance died
        await self.bus.tasks.restore(  # a task sent to its mailbox goes to the shared queue
            self.bus.subjects.shared(stored.subject),
            stored.data,
            msg_id=f"failover:{dead}:{seq}",
            headers={FAILOVER_HEADER: dead},
        )
        with contextlib.suppress(NotFoundError):
            await js.delete_msg(stream, seq)
        return True
