"""A worker's small HTTP side: liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from fastapi import FastAPI, Response
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.failover import INSTANCE_HEADER
from services.worker.model_server_metrics import ModelServerCollector, ModelServerLoad

if TYPE_CHECKING:
    from common.engine.engine import Engine
    from services.worker.instance import WorkerInstance


class WorkerCollector:
    """Reads the worker's figures at scrape time, so nothing is counted twice."""

    def __init__(self, worker: WorkerInstance) -> None:
        self.w = worker

    def collect(self):
        w = self.w
        labels = ["instance", "roles"]
        values = [w.instance_id, ",".join(sorted(w.roles))]
        stages = [h.figures() for h in w.handlers.values()]  # each stage's own
        counters = self.counters() + [row for c, _ in stages for row in c]
        gauges = self.gauges() + [row for _, g in stages for row in g]
        for kind, table in ((CounterMetricFamily, counters), (GaugeMetricFamily, gauges)):
            for name, value, doc in table:
                metric = kind(f"trident_{name}", doc, labels=labels)
                metric.add_metric(values, value)
                yield metric
        info = GaugeMetricFamily(
            "trident_profile_info",
            "The stage profile in use (1; no sample with profiling off)",
            labels=[*labels, "profile_id"],
        )
        if w.profile_id:
            info.add_metric([*values, w.profile_id], 1)
        yield info

    def counters(self) -> list[tuple[str, float, str]]:
        """(name, value, help) of each counter, named trident_<name>."""
        w, c, stats = self.w, self.w.counters, self.w.loop.stats
        return [
            ("images_encoded", stats.images_encoded, "Images the vision tower ran on"),
            (
                "images_to_encode",
                c.images_to_encode,
                "Images taken with pixels to encode (feature-cache hits included)",
            ),
            ("prefills", c.prefills, "Prefill tasks taken"),
            ("decodes_admitted", c.decodes_admitted, "Decode tasks admitted after pulling KV"),
            ("tokens_generated", c.tokens_generated, "Output tokens produced"),
            ("requests_finished", c.finished, "Requests that ended here"),
            ("request_errors", c.errors, "Requests failed here"),
            ("feature_fetch_failures", c.feature_fetch_failures, "Image features that could not be pulled"),
            ("kv_pull_failures", c.kv_pull_failures, "KV pulls that failed"),
            ("resumed_tokens", c.resumed_tokens, "Streamed tokens requests resumed from after a loss"),
            ("cancelled_unrun", c.cancelled_unrun, "Tasks of cancelled requests dropped when pulled"),
            ("mailbox_tasks", c.mailbox_taken, "Tasks sent to this instance alone (for its cached prefix)"),
            ("mailbox_taken_back", c.taken_back, "Tasks sent to this instance that their sender took back"),
            ("feature_cache_hits", stats.feature_hits, "Images found in the feature cache"),
            ("integrity_failures", w.upkeep.integrity_failures, "Ledger/engine integrity checks that failed"),
            ("failovers", w.runtime.reaper.reaped, "Dead instances whose work this one handed on"),
            ("tasks_handed_on", w.runtime.reaper.handed_on, "Tasks of dead instances this one queued again"),
            (
                "prefix_queried_tokens",
                stats.prefix_queried_tokens,
                "Prompt tokens looked up in the prefix cache",
            ),
            ("prefix_hit_tokens", stats.prefix_hit_tokens, "Prompt tokens found in the prefix cache"),
            ("prefix_evictions", stats.prefix_evictions, "Cached KV blocks given up to an allocation"),
            (
                "decode_bucket_steps",
                stats.decode_bucket_steps,
                "Decode steps run padded to a bucket (replayed from CUDA graphs on a GPU)",
            ),
            (
                "graph_capture_failures",
                stats.graph_capture_failures,
                "Decode buckets whose CUDA graph could not be captured (they run uncaptured)",
            ),
        ]

    def gauges(self) -> list[tuple[str, float, str]]:
        """(name, value, help) of each gauge, named trident_<name>."""
        w, stats = self.w, self.w.loop.stats
        held = list(w.ledger)
        return [
            ("free_kv_blocks", stats.free_blocks, "Free KV cache blocks (cached ones nobody holds included)"),
            ("cached_kv_blocks", stats.cached_blocks, "KV blocks findable by their prefix key"),
            ("total_kv_blocks", stats.total_blocks, "KV cache blocks in all"),
            ("running_requests", stats.running, "Requests in the running set"),
            ("waiting_requests", stats.waiting, "Requests admitted, not yet scheduled"),
            ("held_requests", sum(h.holds_task for h in held), "Requests inside this instance"),
            (
                "kept_kv_requests",
                sum(bool(h.kv_handles) for h in held),
                "Requests whose KV waits to be pulled",
            ),
            ("engine_steps", w.loop.steps, "Engine iterations so far"),
            ("image_budget", stats.image_budget, "Images encoded per iteration at most (τe)"),
            ("token_budget", stats.token_budget, "Tokens per iteration at most (τt)"),
            ("budget_scale", stats.budget_scale, "The governor's scale of the profiled budgets"),
            ("feature_cache_bytes", stats.feature_cache_bytes, "Bytes of image features cached"),
            ("feature_cache_capacity_bytes", stats.feature_cache_capacity, "The feature cache's byte cap"),
            *memory(w.loop.engine),
        ]


def memory(engine: Engine) -> list[tuple[str, float, str]]:
    """What the engine holds: its KV cache's bytes and, on a GPU, this process's device memory as
    torch's allocator counts it (the CUDA context's own is outside it)."""
    cache = engine.cache
    kv = cache.kv.numel() * cache.kv.element_size() if cache is not None else 0
    rows = [("kv_cache_bytes", kv, "Bytes of the KV cache")]
    device = engine.device
    if device.type == "cuda":
        rows += [
            ("device_memory_allocated_bytes", torch.cuda.memory_allocated(device), "GPU memory in tensors"),
            ("device_memory_reserved_bytes", torch.cuda.memory_reserved(device), "GPU memory torch holds"),
            ("device_memory_peak_bytes", torch.cuda.max_memory_reserved(device), "The most torch has held"),
        ]
    return rows


def unhealthy(worker: WorkerInstance) -> str | None:
    """Why the worker cannot serve: its engine thread or one of its loops failed (None: healthy)."""
    if worker.loop.failure is not None:
        return f"engine failed: {worker.loop.failure!r}"
    return worker.runtime.health()


def make_app(worker: WorkerInstance) -> FastAPI:
    app = FastAPI(title=f"trident worker {worker.instance_id}", docs_url=None, redoc_url=None)
    registry = worker.registry  # the stage histograms are in it already
    registry.register(WorkerCollector(worker))
    block_size = worker.loop.engine.kv_spec.block_size

    def load() -> ModelServerLoad:
        return ModelServerLoad.of(worker.loop.stats, worker.ledger, block_size)

    registry.register(ModelServerCollector(load, worker.settings.served_model_name))

    @app.get("/health")
    def health() -> Response:
        problem = unhealthy(worker)
        return Response(
            problem or "ok",
            status_code=500 if problem else 200,
            headers={INSTANCE_HEADER: worker.instance_id},  # failover's probe: is it still this one
        )

    @app.get("/ready")
    def ready() -> Response:
        ok = unhealthy(worker) is None and worker.ctx.bus.connected and not worker.ctx.draining.is_set()
        return Response("ready" if ok else "not ready", status_code=200 if ok else 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    return app
