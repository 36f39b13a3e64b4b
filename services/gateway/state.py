"""The gateway's long-lived parts: connections, the request processor, limits and metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from common.bus import Bus
from common.dispatch import Dispatcher
from common.engine.loader import load_config
from common.engine.processor import RequestProcessor
from common.failover import Reaper, instance_name
from common.protocol import Cancel, Heartbeat
from common.roles import Role
from common.runtime import Runtime
from common.stats import SLO
from common.store import Store
from common.store.recorder import StageRecorder
from common.tracing import Tracing
from common.transfer import TransferBackend, TransferConfig
from services.gateway.images import ImagePolicy
from services.gateway.journal import OutputJournal
from services.gateway.kv_routing import REASONS as ROUTE_REASONS
from services.gateway.kv_routing import PrefixRouter
from services.gateway.logprobs import TokenText
from services.gateway.preprocess import ImagePreprocessor
from services.gateway.queues import QueueDepths
from services.gateway.routing import LiveRoles
from services.settings import GatewaySettings

log = logging.getLogger(__name__)
TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)


@dataclass
class Metrics:
    registry: CollectorRegistry
    requests: Counter
    routed: Counter
    prefix_routes: Counter
    images_in_prefix: Counter
    prefix_index_keys: Gauge
    in_flight: Gauge
    queued: Gauge
    failovers: Gauge
    handed_on: Gauge
    held: Gauge
    ttft: Histogram
    latency: Histogram
    tbt: Histogram

    @classmethod
    def create(cls) -> Metrics:
        r = CollectorRegistry()
        return cls(
            r,
            Counter(
                "trident_gateway_requests",
                "Requests by endpoint and status",
                ["endpoint", "status"],
                registry=r,
            ),
            Counter("trident_gateway_routed", "Requests by first stage", ["stage"], registry=r),
            Counter(
                "trident_gateway_prefix_routes",
                "Prefill routing decisions by reason: prefix (sent to the instance holding the "
                "prompt's prefix), load (a prefix was cached, but its holder was too busy), none (no "
                "useful prefix anywhere), fallback (sent, then moved to the shared queue)",
                ["reason"],
                registry=r,
            ),
            Counter(
                "trident_gateway_images_in_prefix",
                "Images sent on neither encoded nor with features: their KV was cached where the request "
                "was routed",
                registry=r,
            ),
            Gauge(
                "trident_gateway_prefix_index_keys",
                "Prefix-cache keys the gateway knows prefill instances to hold (all instances)",
                registry=r,
            ),
            Gauge("trident_gateway_in_flight", "Requests being served", registry=r),
            Gauge(
                "trident_gateway_queued_tasks", "Tasks waiting in each stage's queue", ["stage"], registry=r
            ),
            Gauge("trident_failovers", "Dead instances whose work this gateway handed on", registry=r),
            Gauge("trident_tasks_handed_on", "Tasks of dead instances this gateway queued again", registry=r),
            Gauge(
                "trident_gateway_held_requests",
                "Requests waiting for a live instance of a stage they need (TRIDENT_HOLD_TIMEOUT)",
                registry=r,
            ),
            Histogram("trident_gateway_ttft_seconds", "Time to first token", registry=r),
            Histogram("trident_gateway_latency_seconds", "Request latency", registry=r),
            Histogram(
                "trident_gateway_tbt_seconds",
                "Time between output tokens as they reached the gateway",
                registry=r,
                buckets=TBT_BUCKETS,
            ),
        )


class Links:
    """What the gateway reaches the deployment through, built once by `connect` on the service
    runtime (common/runtime): the substrate's clients and the gateway's own loops' state."""

    def __init__(self, runtime: Runtime, queue_limit: int, queued: Gauge) -> None:
        self.runtime = runtime
        self.live_roles = LiveRoles(runtime.store)
        self.journal = OutputJournal(runtime.store)  # streamed tokens, for resuming after a death
        self.queues = QueueDepths(runtime.bus, queue_limit, queued)

    @classmethod
    async def connect(cls, s: GatewaySettings, instance_id: str, queued: Gauge) -> Links:
        host = socket.gethostname() if s.advertise_host == "auto" else s.advertise_host
        transfer = TransferConfig(
            backend="tcp",
            host=s.bind_host,
            advertise_host=host,
            port=s.transfer_port,
            secret=s.transfer_secret,
            inline_max_bytes=s.transfer_inline_max_bytes,
            tls=s.tls,
            host_local=s.transfer_host_local,
        )
        runtime = await Runtime.connect(s, instance_id, transfer=transfer)
        return cls(runtime, s.max_queued_tasks, queued)


class Gateway:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.model_name = settings.served_model_name
        self.instance_id = settings.instance_id or instance_name("gateway")
        self.processor = RequestProcessor(settings.model)
        text_config = load_config(settings.model).text_config
        self.max_model_len = text_config.max_position_embeddings
        self.vocab_size = text_config.vocab_size  # token-id prompts must index the embedding table
        self.token_text = TokenText(self.processor.tokenizer)  # log-probabilities' tokens as text and bytes
        self.images = ImagePolicy(
            max_bytes=settings.max_image_bytes,
            timeout_s=settings.image_fetch_timeout,
            allow_private=settings.allow_private_image_urls,
            max_images=settings.max_images,
            max_pixels=settings.max_image_pixels,
        )
        # Clips are fetched under the same rules (addresses, one deadline), with their own size cap.
        self.videos = dataclasses.replace(self.images, max_bytes=settings.max_video_bytes, part="video_url")
        self.slo = SLO(settings.ttft_slo, settings.tbt_slo)  # each request's outcome is judged by it
        self.api_keys = settings.api_key_set
        self.metrics = Metrics.create()
        self.tracing = Tracing.configured(settings.otlp_endpoint, "trident-gateway", self.instance_id)
        # Decoding images and running the HF processor take milliseconds of CPU per request; on the
        # event loop they would hold back every other request's tokens. One thread: the tokenizer
        # is not safe to share between threads, and the work stays in arrival order.
        self.cpu = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-processor")
        self.preprocess = ImagePreprocessor(
            settings.model, settings.image_workers, settings.max_image_pixels, settings.max_request_pixels
        )  # requests with images: their own bounded pool (preprocess.py)
        # The deployment is reached from inside uvicorn's event loop (its lifespan), after the app
        # and its middleware exist: until start() no request is served, and `links` is None.
        self.links: Links | None = None
        self.prefix_router = (  # routing by cached prefix (kv_routing.py), unless switched off
            PrefixRouter(
                self.processor.placeholder_ids,
                settings.kv_routing_min_tokens,
                settings.kv_routing_load_tokens,
            )
            if settings.kv_routing
            else None
        )

    # -- the deployment, once started -----------------------------------------------------------

    def _linked(self) -> Links:
        if self.links is None:
            raise RuntimeError("the gateway has not started")
        return self.links

    @property
    def runtime(self) -> Runtime:
        return self._linked().runtime

    @property
    def store(self) -> Store:
        return self.runtime.store

    @property
    def bus(self) -> Bus:
        return self.runtime.bus

    @property
    def record(self) -> StageRecorder:
        return self.runtime.record

    @property
    def dispatch(self) -> Dispatcher:
        return self.runtime.dispatch

    @property
    def reaper(self) -> Reaper:
        return self.runtime.reaper

    @property
    def transfer(self) -> TransferBackend:
        transfer = self.runtime.transfer
        assert transfer is not None, "the gateway's runtime has a transfer endpoint"
        return transfer

    @property
    def journal(self) -> OutputJournal:
        return self._linked().journal

    @property
    def live_roles(self) -> LiveRoles:
        return self._linked().live_roles

    def queue_full(self) -> Role | None:
        """A stage whose queue is at its limit (none before the gateway has started)."""
        return self.links.queues.full() if self.links is not None else None

    def unhealthy(self) -> str | None:
        """Why the gateway cannot serve (one of its loops failed), or None."""
        return self.links.runtime.health() if self.links is not None else None

    async def cancel(self, request_id: str, reason: str) -> None:
        """Stop a request everywhere: the instances holding it drop it and free what it holds, and
        its tasks still queued are dropped unrun (the tombstone, checked when a task is pulled)."""
        await self.bus.events.cancel(Cancel(request_id=request_id, reason=reason))
        try:
            await self.store.requests.cancel(request_id, ttl=2 * self.settings.request_timeout)
        except Exception as exc:  # the broadcast still reaches every live instance
            log.warning("tombstone for %s not written: %r", request_id, exc)

    async def off_loop(self, fn, *args):
        """Run CPU-bound request processing on the processor thread."""
        return await asyncio.get_running_loop().run_in_executor(self.cpu, fn, *args)

    # -- life --------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect through the service runtime and put every loop under its supervision: a loop
        that fails ends the process (EXIT_LOOP_FAILED), the gateway never serves on without it.
        The gateway watches for dead instances too (it outlives most), and is watched itself: a
        dead gateway's requests are dropped everywhere."""
        self.links = links = await Links.connect(self.settings, self.instance_id, self.metrics.queued)
        rt = links.runtime
        rt.on_fence(self._on_fence)
        self.metrics.failovers.set_function(lambda: rt.reaper.reaped)
        self.metrics.handed_on.set_function(lambda: rt.reaper.handed_on)
        self.metrics.held.set_function(lambda: links.live_roles.held)
        rt.start(self.heartbeat)
        rt.supervise("journal", links.journal.run)
        rt.supervise("queues", links.queues.run)
        if self.prefix_router is not None:
            rt.dispatch.take_back_after = self.settings.kv_routing_take_back
            rt.dispatch.on_take_back = lambda target: self.metrics.prefix_routes.labels("fallback").inc()
            rt.supervise("prefix-index", self._index_prefixes)
            for reason in ROUTE_REASONS:  # each shows from the start, at 0
                self.metrics.prefix_routes.labels(reason)
            self.metrics.prefix_index_keys.set_function(self.prefix_router.index.size)
        rt.supervise("exit-on-failure", lambda: rt.exit_on_failure(self._closers()), may_end=True)

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(instance_id=self.instance_id, kind="gateway", time=time.time())

    async def _index_prefixes(self) -> None:
        """Keep the prefix index (kv_routing.py) as instances announce their keys; forget the
        instances the registry no longer lists."""
        router = self.prefix_router
        assert router is not None
        forgot = time.monotonic()
        async with await self.bus.events.prefix_blocks_all() as stream:
            async for msg in stream:
                router.index.apply(msg)
                if time.monotonic() - forgot > 1.0:
                    router.index.forget_absent({hb.instance_id for hb in self.live_roles.beats})
                    forgot = time.monotonic()

    def _on_fence(self, instance_id: str) -> None:
        """Taken for dead itself (its loop stalled past the others' patience): its requests were
        dropped everywhere, and they end with an error (the collector sees the fence). Unlike a
        worker it need not leave: nothing it holds can be duplicated, so it serves on under a new
        name, and its clients' retries reach it."""
        if instance_id != self.instance_id:
            return
        self.instance_id = instance_name("gateway")
        self.reaper.me = self.instance_id
        log.error("this gateway was taken for dead; its requests end with an error; now %s", self.instance_id)
        self.runtime.heartbeats.poke()

    def _closers(self) -> list:
        """What the gateway closes of its own, once its loops have stopped."""

        async def shut_cpu() -> None:
            self.cpu.shutdown(wait=False, cancel_futures=True)
            self.preprocess.close()

        async def flush_spans() -> None:
            await asyncio.to_thread(self.tracing.shutdown)

        return [self.journal.write, shut_cpu, flush_spans]

    async def close(self) -> None:
        if self.links is not None:
            await self.links.runtime.close(closers=self._closers())
