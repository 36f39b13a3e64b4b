"""A worker process's parts, built once and wired in one place: the engine on its thread, the
ledger, the stage handlers, the output publisher, the intake (worker.py) and the upkeep
(upkeep.py), on the service runtime's clients (common/runtime). `build` is the only place that
creates them; `start` puts every loop under the runtime's supervision; `close` stops them in order.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from prometheus_client import CollectorRegistry

from common.aio import raise_if_cancelled
from common.bus import keep_alive
from common.engine import Engine, RequestOutput
from common.engine.scheduler import Batch
from common.failover import instance_name
from common.protocol import Budgets, Heartbeat
from common.roles import PULL_ORDER, Role, in_path_order, letters, parse_roles
from common.runtime import Runtime
from common.tracing import Tracing
from common.transfer import TransferConfig
from services.settings import WorkerSettings
from services.worker import profiling
from services.worker.context import StageContext
from services.worker.cores import CoreBoard
from services.worker.counters import Counters
from services.worker.engine_loop import EngineLoop
from services.worker.engine_settings import continues_turns, engine_config, engine_roles
from services.worker.kv_announce import PrefixAnnouncer
from services.worker.ledger import Ledger
from services.worker.outputs import OutputPublisher
from services.worker.stage import StageHandler
from services.worker.stage_metrics import StageMetrics
from services.worker.stage_spans import StageSpans
from services.worker.step_log import StepLog
from services.worker.upkeep import Housekeeping, StepPublisher
from services.worker.worker import StageWorker

log = logging.getLogger(__name__)
Stages = Mapping[Role, type[StageHandler]]


def advertise_host(value: str) -> str:
    """`auto` means this container's hostname (compose cannot expand it for us)."""
    return socket.gethostname() if value == "auto" else value


def transfer_config(s: WorkerSettings) -> TransferConfig:
    host = advertise_host(s.advertise_host)
    return TransferConfig(
        backend=s.transfer,
        host="0.0.0.0" if s.bind_host == "0.0.0.0" else host,
        advertise_host=host,
        port=s.transfer_port,
        secret=s.transfer_secret,
        inline_max_bytes=s.transfer_inline_max_bytes,
        tls=s.tls,
        host_local=s.transfer_host_local,
        device=s.device if s.device.startswith("cuda") else None,  # where GPU tensors it pulls land
        device_bytes=s.transfer_device_bytes,
    )


@dataclass(frozen=True)
class Started:
    """What `WorkerInstance.build` brings up before anything is wired: the engine (loaded on a
    thread), the runtime's clients, and the id of the stage profile its budgets came from."""

    engine: Engine
    runtime: Runtime
    profile_id: str


class WorkerInstance:
    def __init__(self, settings: WorkerSettings, stages: Stages, started: Started, http_address: str) -> None:
        engine, runtime = started.engine, started.runtime
        assert runtime.transfer is not None, "a worker serves tensors: its runtime has a transfer endpoint"
        self.settings = settings
        self.roles = parse_roles(settings.roles)
        self.instance_id = runtime.instance_id
        self.runtime = runtime
        self.profile_id = started.profile_id
        self.http_address = http_address
        self.counters = Counters()
        self.registry = CollectorRegistry()  # what /metrics serves (services/worker/http.py)
        self.metrics = StageMetrics(self.registry, self.instance_id, ",".join(sorted(self.roles)))
        self.tracing = Tracing.configured(settings.otlp_endpoint, "trident-worker", self.instance_id)
        self.steps = StepLog()
        self._outputs: asyncio.Queue[list[RequestOutput]] = asyncio.Queue()
        self.loop = EngineLoop(engine, self._outputs.put_nowait, self._core_board(stages))
        engine.on_step = self._on_step
        # A task taken is a task the failover must know of: the heartbeat says so at once.
        self.ledger = Ledger(
            self.loop,
            runtime.transfer,
            runtime.record,
            on_begin=runtime.heartbeats.poke,
            finals_window=settings.finals_window,
        )
        self.ctx = StageContext(
            instance_id=self.instance_id,
            roles=self.roles,
            engine=self.loop,
            ledger=self.ledger,
            bus=runtime.bus,
            store=runtime.store,
            transfer=runtime.transfer,
            dispatch=runtime.dispatch,
            counters=self.counters,
            metrics=self.metrics,
            spans=StageSpans(self.tracing, self.instance_id),
        )
        self._wire_stages(stages)
        self._wire_upkeep()
        runtime.on_fence(self._fenced)

    def _wire_stages(self, stages: Stages) -> None:
        """The handlers of the engine's roles, their outputs, and the intake that pulls their tasks."""
        settings = self.settings
        self.handlers = {
            role: stages[role].from_settings(self.ctx, settings)
            for role in in_path_order(engine_roles(settings, self.roles))
        }
        self.prefills_up_to = 0
        if continues_turns(settings, self.roles):  # its prefill takes only the turns sent here
            self.handlers[Role.PREFILL].shared_queue = False
            self.prefills_up_to = settings.decode_prefill_tokens
        self.outputs = OutputPublisher.for_handlers(self.ctx, self.handlers.values())
        self.intake = StageWorker(
            self.ctx,
            self.handlers,
            self.runtime.reaper.fenced,
            self.runtime.heartbeats.poke,
            settings.drain_timeout,
        )
        # Where prefixes live, for gateways routing by them: what a prefill instance caches.
        routed = [h for h in self.handlers.values() if h.routed_by_prefix]
        self.announcer = None
        if routed and self.loop.engine.blocks.caching:
            self.announcer = PrefixAnnouncer(self.instance_id, self.loop, self.runtime.bus)

    def _wire_upkeep(self) -> None:
        """The periodic loops: housekeeping, and the steps published for the planner."""
        runtime = self.runtime
        self.upkeep = Housekeeping(
            instance_id=self.instance_id,
            ledger=self.ledger,
            engine=self.loop,
            bus=runtime.bus,
            store=runtime.store,
            fenced_gateways=runtime.reaper.fenced,
            on_fenced=self._fenced,
            is_fenced=self.ctx.fenced.is_set,
            failover_after=self.settings.failover_after,
            check=self.settings.check_integrity,
        )
        self.step_publisher = StepPublisher(
            instance_id=self.instance_id,
            roles=self.roles,
            profile_id=self.profile_id,
            steps=self.steps,
            engine=self.loop,
            store=runtime.store,
            cores=self._shared_cores(),
        )

    @classmethod
    async def build(cls, settings: WorkerSettings, stages: Stages, http_address: str) -> WorkerInstance:
        """The engine (loaded on a thread), the runtime's clients, and the stage profile the
        budgets come from, before any task is pulled."""
        roles = parse_roles(settings.roles)
        instance_id = settings.instance_id or instance_name(letters(roles))
        engine = await asyncio.to_thread(Engine, settings.model, engine_config(settings, roles))
        runtime = await Runtime.connect(
            settings,
            instance_id,
            transfer=transfer_config(settings),
            heartbeat_ttl=settings.heartbeat_ttl,
            registered=True,
        )
        try:
            profile_id = await profiling.establish(engine, runtime.store, settings, instance_id)
        except BaseException:
            await runtime.close()
            raise
        return cls(settings, stages, Started(engine, runtime, profile_id), http_address)

    # -- running -----------------------------------------------------------------------------------

    def start(self) -> None:
        """The engine thread, then every loop under the runtime's supervision."""
        self.loop.start()
        rt = self.runtime
        rt.start(self.heartbeat)
        rt.supervise("outputs", self._pump_outputs)
        rt.supervise("resends", self.outputs.watch)  # gateways' Resends: the one output recovery rule
        rt.supervise(
            "keep-alive", functools.partial(keep_alive, self.intake.tasks, rt.bus.config.keep_alive_period)
        )
        rt.supervise("housekeeping", self.upkeep.run)
        rt.supervise("steps", self.step_publisher.run)
        rt.supervise("cancels", self.ctx.watch_cancels)
        for role, handler in self.handlers.items():
            rt.supervise(f"{role}-watch", handler.watch, may_end=True)  # most stages have none
        for role in PULL_ORDER:
            if role in self.handlers and self.handlers[role].shared_queue:
                rt.supervise(f"{role}-intake", functools.partial(self.intake.pull, self.handlers[role]))
        for handler in self.handlers.values():  # tasks sent here alone (routing by cached prefix)
            if handler.routed_by_prefix:
                pull = functools.partial(self.intake.pull, handler, mailbox=True)
                rt.supervise(f"{handler.role}-mailbox", pull)
        if self.announcer is not None:
            rt.supervise("prefix-announce", self.announcer.run)
        log.info(
            "%s ready: roles %s, transfer %s", self.instance_id, sorted(self.roles), self.ctx.transfer.address
        )

    def drain(self) -> None:
        """SIGTERM: drain under supervision, then stop. A second one hurries the drain."""
        if self.ctx.draining.is_set():
            log.warning("%s: asked again, giving held tasks back now", self.instance_id)
            self.intake.hurry_drain()
        else:
            log.info("%s: draining", self.instance_id)
            self.ctx.draining.set()  # now: a second signal before the drain runs still hurries it
            self.runtime.supervise("drain", self._drain, may_end=True)

    async def _drain(self) -> None:
        await self.intake.drain()
        await self.upkeep.check_integrity()
        self.runtime.request_stop()

    async def close(self) -> None:
        """Stop in order (Runtime.close). Held tasks go back to their queues first, unless this
        instance was taken for dead: then they were handed on already, and it says nothing more."""
        fenced = self.ctx.fenced.is_set()
        closers = [self.loop.stop] if fenced else [self.intake.give_back, self.loop.stop]
        closers.append(lambda: asyncio.to_thread(self.tracing.shutdown))  # the spans still batched
        await self.runtime.close(leave=not fenced, closers=closers)
        if self.loop.cores is not None:
            self.loop.cores.close()  # the slot is free for the next worker on this host

    # -- what others read --------------------------------------------------------------------------

    def heartbeat(self) -> Heartbeat:
        stats = self.loop.stats
        return Heartbeat(
            instance_id=self.instance_id,
            roles=in_path_order(self.roles),
            held=tuple(task.stream_seq for task in self.intake.tasks()),
            http_address=self.http_address,
            transfer_address=self.ctx.transfer.address,
            queue_depth=stats.waiting,
            running=stats.running,
            free_kv_blocks=stats.free_blocks,
            total_kv_blocks=stats.total_blocks,
            cached_kv_blocks=stats.cached_blocks,
            prefix_queried_tokens=stats.prefix_queried_tokens,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            prefix_evictions=stats.prefix_evictions,
            images_encoded=stats.images_encoded,
            prefills_up_to=self.prefills_up_to,
            budgets=Budgets(image_budget=stats.image_budget, token_budget=stats.token_budget),
            profile_id=self.profile_id,
            draining=self.ctx.draining.is_set(),
            started_at=self.counters.started_at,
            time=time.time(),
        )

    # -- internals ---------------------------------------------------------------------------------

    def _host_cores(self) -> int:
        """The host's cores the core board shares out (TRIDENT_HOST_CORES, or this process's CPUs)."""
        return self.settings.host_cores or len(os.sched_getaffinity(0))

    def _shared_cores(self) -> int:
        """The cores this worker's steps share with the host's other workers (0: on a GPU)."""
        return self._host_cores() if self.settings.device == "cpu" else 0

    def _core_board(self, stages: Stages) -> CoreBoard | None:
        s = self.settings
        if not s.core_board:
            return None
        greedy = any(stages[role].takes_idle_cores for role in self.roles)
        return CoreBoard(s.core_board, self._host_cores(), greedy)

    def _on_step(self, batch: Batch, seconds: float) -> None:  # on the engine thread
        self.metrics.step(batch.kind, seconds)
        cores = self.loop.cores
        if cores is not None:
            threads, overlap = cores.step_threads(), cores.step_overlap()
        else:  # which other steps ran beside it is not known
            threads, overlap = torch.get_num_threads(), None
        self.steps.record(batch, seconds, self.loop.engine.scheduler.image_unit, threads, overlap)

    async def _pump_outputs(self) -> None:
        while True:
            raise_if_cancelled()
            await self.outputs.publish(await self._outputs.get())

    def _fenced(self, instance_id: str) -> None:
        """Another instance was found dead; if it is this one (it was frozen, and came back), it
        does nothing more and leaves: its tasks went to others."""
        if instance_id == self.instance_id and not self.ctx.fenced.is_set():
            log.error("%s was taken for dead and its work handed on; leaving", self.instance_id)
            self.ctx.fenced.set()
            self.runtime.request_stop()
