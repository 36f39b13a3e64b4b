"""What an engine's config and device decide as it is built (common/engine/build.py). The choices read
only the device's type, so the GPU's are checked here on a CPU, from a `torch.device("cuda")` that
no tensor is put on."""

from __future__ import annotations

import pytest
import torch

from common.engine import build
from common.engine.config import EngineConfig
from common.engine.kv_cache import KVSpec

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_model_dtype_is_float32_on_a_cpu_bfloat16_on_a_gpu_unless_configured() -> None:
    assert build.compute_dtype(EngineConfig(), CPU) == torch.float32  # exact parity with HF
    assert build.compute_dtype(EngineConfig(), CUDA) == torch.bfloat16
    assert build.compute_dtype(EngineConfig(dtype="float16"), CPU) == torch.float16
    assert build.compute_dtype(EngineConfig(dtype="float32"), CUDA) == torch.float32


def test_a_kv_cache_dtype_apart_from_the_models_is_a_cpu_choice_only() -> None:
    half = EngineConfig(kv_cache_dtype="float16")
    assert build.kv_dtype(EngineConfig(), torch.bfloat16, CUDA) == torch.bfloat16  # unset: the model's
    assert build.kv_dtype(half, torch.float32, CPU) == torch.float16
    assert build.kv_dtype(half, torch.float16, CUDA) == torch.float16  # the model's own: allowed
    with pytest.raises(ValueError, match="supported on a CPU only"):
        build.kv_dtype(half, torch.bfloat16, CUDA)


def test_a_cpu_kv_cache_holds_as_many_blocks_as_its_bytes_allow() -> None:
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    assert spec.bytes_per_block == 2 * 2 * 2 * 8 * 4 * 4
    config = EngineConfig(kv_cache_bytes=10 * spec.bytes_per_block + 1, block_size=4)
    assert build.num_kv_blocks(config, spec, CPU) == 10


def test_no_decode_graphs_without_a_cache_or_when_off() -> None:
    assert build.decode_graphs(EngineConfig(decode_graphs="eager"), None, None, 2048) is None
    assert build.decode_graphs(EngineConfig(decode_graphs="off"), None, None, 2048) is None
