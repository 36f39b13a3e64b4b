"""Several instances on one GPU: each sizes its KV cache from its own share of the device's memory
(TRIDENT_GPU_MEMORY_SHARE), and a worker computes in the dtype it is told (TRIDENT_DTYPE). The GPU
arithmetic runs on numbers here (torch.cuda.mem_get_info is what feeds it on a GPU); the settings
are carried into a real engine on the CPU, and the memory a worker reports is read off it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from common.engine.kv_cache import gpu_kv_bytes
from common.roles import InstanceKind, parse_roles
from services.settings import WorkerSettings, parse_memory_shares
from services.worker.engine_settings import engine_config
from services.worker.http import memory

GIB = 1 << 30
TOTAL = 140 * GIB
WEIGHTS = 14 * GIB  # a 7B model in bfloat16


def test_alone_the_kv_cache_takes_its_fraction_of_what_is_free() -> None:
    free = TOTAL - WEIGHTS
    assert gpu_kv_bytes(free, TOTAL, WEIGHTS, 0.85, None) == int(free * 0.85)


def test_with_a_share_the_kv_cache_takes_its_fraction_of_what_is_left_of_the_share() -> None:
    room = int(0.45 * TOTAL) - WEIGHTS
    assert gpu_kv_bytes(TOTAL - WEIGHTS, TOTAL, WEIGHTS, 0.85, 0.45) == int(room * 0.85)
    # Never more than is free (another process took more than its share), never below nothing.
    assert gpu_kv_bytes(GIB, TOTAL, WEIGHTS, 0.85, 0.45) == int(GIB * 0.85)
    assert gpu_kv_bytes(TOTAL - WEIGHTS, TOTAL, WEIGHTS, 0.85, 0.05) == 0


def test_instances_that_start_at_once_stay_within_the_device() -> None:
    """E+P+D on one GPU: each process sees nearly the whole device free when it sizes its cache (they
    start together); by their shares they still fit, which sizing by what is free would not."""
    shares = {"e": (0.08, 1 * GIB), "p": (0.42, WEIGHTS), "d": (0.45, WEIGHTS)}
    by_share = sum(held + gpu_kv_bytes(TOTAL - held, TOTAL, held, 0.85, s) for s, held in shares.values())
    by_free = sum(held + gpu_kv_bytes(TOTAL - held, TOTAL, held, 0.85, None) for _, held in shares.values())
    assert by_share <= TOTAL < by_free


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_a_share_outside_0_to_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_share"):
        EngineConfig(gpu_memory_share=share)


def test_each_worker_takes_its_kinds_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIDENT_GPU_MEMORY_SHARE", "e=0.08, p=0.42,d=0.45,ep=0.5")
    for roles, share in [("encode", 0.08), ("prefill", 0.42), ("decode", 0.45), ("encode,prefill", 0.5)]:
        settings = WorkerSettings(roles=roles)
        assert engine_config(settings, parse_roles(roles)).gpu_memory_share == share
    assert WorkerSettings(roles="encode,prefill,decode").memory_share() is None  # epd not given
    monkeypatch.setenv("TRIDENT_GPU_MEMORY_SHARE", "0.3")
    assert WorkerSettings(roles="encode,decode").memory_share() == 0.3
    monkeypatch.delenv("TRIDENT_GPU_MEMORY_SHARE")
    assert WorkerSettings(roles="decode").memory_share() is None


@pytest.mark.parametrize("text", ["x=0.2", "e=1.2", "d=", "half"])
def test_a_bad_share_stops_the_worker_naming_the_part(text: str) -> None:
    with pytest.raises(ValueError, match="TRIDENT_GPU_MEMORY_SHARE"):
        WorkerSettings(roles="decode", gpu_memory_share=text)
    assert parse_memory_shares("epd=1") == {InstanceKind.EPD: 1.0}


def test_the_workers_dtype_reaches_the_engine_and_its_memory_is_reported(tiny_model_dir: Path) -> None:
    roles = parse_roles("prefill,decode")
    assert engine_config(WorkerSettings(roles="prefill,decode"), roles).dtype is None  # auto
    settings = WorkerSettings(roles="prefill,decode", dtype="bfloat16", kv_cache_bytes=1 << 20)
    engine = Engine(tiny_model_dir, engine_config(settings, roles))
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    rows = {name: value for name, value, _ in memory(engine)}
    # The cache holds its blocks and the scratch block; on a CPU there are no device rows.
    per_block = engine.kv_spec.bytes_per_block
    assert rows == {"kv_cache_bytes": (engine.blocks.num_blocks + 1) * per_block}
    assert engine.cache.kv.dtype == torch.bfloat16 and rows["kv_cache_bytes"] > 0
