"""The model server protocol's metrics (services/worker/model_server_metrics.py) as an endpoint
picker reads them, scraped in Prometheus' text format from a stage handler's instance at work: real
engine, NATS, Redis and transfer. A request still pulling its pixels waits; one decoding runs and
holds KV blocks; the figures match the engine's own, read on its thread at the same moment."""

from __future__ import annotations

import asyncio
import threading

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from common.protocol import EncodeTask, PrefillTask, SamplingParams, TokenDelta
from common.roles import Role
from services.worker.model_server_metrics import ModelServerCollector, ModelServerLoad
from tests.stages.flows import request
from tests.stages.rig import StageRig, stage_rig

E = frozenset({Role.ENCODE})
PD = frozenset({Role.PREFILL, Role.DECODE})


def scrape(rig: StageRig) -> dict[str, tuple[dict, float]]:
    """Each vllm: series of the instance's /metrics text, parsed as a scraper parses it."""
    registry = CollectorRegistry()
    block_size = rig.engine.kv_spec.block_size
    load = lambda: ModelServerLoad.of(rig.ctx.engine.stats, rig.ledger, block_size)  # noqa: E731
    registry.register(ModelServerCollector(load, "tiny-llava"))
    text = generate_latest(registry).decode()
    return {s.name: (s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples}


async def test_a_request_pulling_its_pixels_waits_and_nothing_runs(
    tiny_model_dir, nats_server, redis_server, owner
):
    async with stage_rig(E, tiny_model_dir, nats_server, redis_server) as e:
        idle = scrape(e)
        assert idle["vllm:num_requests_waiting"] == ({"model_name": "tiny-llava"}, 0.0)
        assert idle["vllm:num_requests_running"][1] == 0.0
        spec, _, _ = request(e, owner, "r-waits", num_images=1)
        await e.ctx.dispatch.send(EncodeTask(request=spec), "test")
        owner.freeze()  # the gateway serving the pixels stalls: the encoder's pull hangs
        taking = asyncio.create_task(e.take(Role.ENCODE))
        await e.until(lambda: len(e.ledger) == 1, what="the task taken")
        metrics = scrape(e)
        assert metrics["vllm:num_requests_waiting"][1] == 1.0
        assert metrics["vllm:num_requests_running"][1] == 0.0
        owner.thaw()
        await taking
        await e.idle()
        assert scrape(e)["vllm:num_requests_waiting"][1] == 0.0


async def test_a_decoding_request_runs_and_its_blocks_count_as_used(
    tiny_model_dir, nats_server, redis_server, owner
):
    async with stage_rig(PD, tiny_model_dir, nats_server, redis_server) as pd:
        total = pd.engine.blocks.num_blocks
        info = scrape(pd)["vllm:cache_config_info"]
        assert info == (
            {"model_name": "tiny-llava", "block_size": str(pd.engine.kv_spec.block_size),
             "num_gpu_blocks": str(total)},
            1.0,
        )  # fmt: skip
        assert scrape(pd)["vllm:kv_cache_usage_perc"][1] == 0.0
        spec, _, _ = request(pd, owner, "r-runs", num_images=0)
        spec = spec.model_copy(update={"sampling": SamplingParams(max_tokens=400, ignore_eos=True)})
        stream = await pd.ctx.bus.events.outputs(spec.request_id)
        await pd.ctx.dispatch.send(PrefillTask(request=spec), "test")
        await pd.take(Role.PREFILL)
        async with asyncio.timeout(30):
            while not isinstance(await stream.get(), TokenDelta):
                pass  # a first token: the request decodes now
        # Hold the engine thread between two steps: the figures cannot move while they are read.
        held, release = threading.Event(), threading.Event()
        truth = {}

        def hold() -> None:
            e = pd.engine
            truth.update(running=len(e.scheduler.running), used=e.blocks.num_blocks - e.blocks.num_free)
            held.set()
            release.wait(30)

        pd.ctx.engine.post(hold)
        await asyncio.to_thread(held.wait, 30)
        try:
            metrics = scrape(pd)
        finally:
            release.set()
        assert truth["running"] == 1 and truth["used"] > 0
        assert metrics["vllm:num_requests_running"][1] == 1.0
        assert metrics["vllm:num_requests_waiting"][1] == 0.0
        assert metrics["vllm:kv_cache_usage_perc"][1] == truth["used"] / total
        assert metrics["vllm:gpu_cache_usage_perc"][1] == truth["used"] / total
        await pd.ledger.abort(spec.request_id)  # as its client leaving would
        await pd.idle()
        # The figures are the engine thread's, refreshed as it comes back from the call idle() made.
        gone = lambda: scrape(pd)["vllm:num_requests_running"][1] == 0.0  # noqa: E731
        await pd.until(gone, 5, "no running request in the figures")
        assert scrape(pd)["vllm:kv_cache_usage_perc"][1] == 0.0
        await stream.close()
