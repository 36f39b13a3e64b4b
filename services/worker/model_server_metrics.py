"""The model server protocol's metrics (Gateway API Inference Extension, proposal 003) on every
worker's /metrics, under vLLM's names: the ones its endpoint picker reads when no flag says
otherwise, so an InferencePool over Trident's workers (or llm-d's scheduler) needs no mapping.

- TotalQueuedRequests, `vllm:num_requests_waiting`: requests taken here that do not run yet: in the
  engine's waiting queue, or still pulling their features or KV, or waiting for KV blocks.
- TotalRunningRequests, `vllm:num_requests_running`: the engine's running set.
- KVCacheUtilization, `vllm:kv_cache_usage_perc` (and `vllm:gpu_cache_usage_perc`, its name before
  vLLM v1, which endpoint pickers before v0.4 read): KV blocks in use over all blocks, 0 to 1. A
  block cached for its prefix that no request holds counts as free, as in vLLM.
- BlockSize and NumGPUBlocks (optional), `vllm:cache_config_info{block_size, num_gpu_blocks}`.

No LoRA metric (`vllm:lora_requests_info`): Trident serves no adapters, and vLLM exports none
without them either. Each series carries `model_name`, the served model, as vLLM's do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric

from services.worker.engine_loop import EngineStats
from services.worker.ledger import Held

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_BEFORE_V1 = "vllm:gpu_cache_usage_perc"  # what endpoint pickers before v0.4 read
CACHE_INFO = "vllm:cache_config_info"


@dataclass(frozen=True)
class ModelServerLoad:
    """The figures the protocol asks for, read at one moment."""

    waiting: int
    running: int
    kv_usage: float  # 0 to 1
    block_size: int
    num_blocks: int

    @classmethod
    def of(cls, stats: EngineStats, held: Iterable[Held], block_size: int) -> ModelServerLoad:
        """From the engine's last step and the ledger: a request taken here that has not entered the
        engine (pulling, or waiting for blocks) waits as much as one in the engine's queue."""
        outside = sum(h.holds_task and not h.in_engine and not h.cancelled for h in held)
        used = stats.total_blocks - stats.free_blocks
        usage = used / stats.total_blocks if stats.total_blocks else 0.0
        return cls(stats.waiting + outside, stats.running, usage, block_size, stats.total_blocks)


class ModelServerCollector:
    """Reads the load at scrape time (a prometheus_client custom collector)."""

    def __init__(self, load: Callable[[], ModelServerLoad], model_name: str) -> None:
        self.load = load
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        load, labels, values = self.load(), ["model_name"], [self.model_name]
        gauges = (
            (WAITING, "Requests taken here that are not running yet", load.waiting),
            (RUNNING, "Requests running in the engine", load.running),
            (KV_USAGE, "Fraction of KV cache blocks in use (1 is full)", load.kv_usage),
            (KV_USAGE_BEFORE_V1, f"{KV_USAGE} under its name before vLLM v1", load.kv_usage),
        )
        for name, doc, value in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(values, value)
            yield gauge
        info = GaugeMetricFamily(
            CACHE_INFO, "The KV cache's shape (1)", labels=[*labels, "block_size", "num_gpu_blocks"]
        )
        info.add_metric([*values, str(load.block_size), str(load.num_blocks)], 1)
        yield info
