"""What an engine's config and device decide as it is built: the dtypes it computes and keeps KV
in, how many KV blocks it holds, whether the decoder's weights are packed, and decode graphs.
Each is a small function of the config, so Engine.__init__ reads as the parts it composes."""

from __future__ import annotations

import logging

import torch

from common.engine.config import DecodeGraphMode, Dtype, EngineConfig, PackedWeightMode
from common.engine.decode_graphs import DecodeGraphs
from common.engine.kv_cache import KVCache, KVSpec, gpu_kv_bytes, num_blocks_for
from common.engine.packed import pack_projections, packing_available
from common.roles import Role

log = logging.getLogger(__name__)


def torch_dtype(dtype: Dtype) -> torch.dtype:
    return getattr(torch, dtype.value)


def compute_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """The model's dtype: as configured, else float32 on a CPU (exact parity with HF), bfloat16 on CUDA."""
    default = Dtype.BFLOAT16 if device.type == "cuda" else Dtype.FLOAT32
    return torch_dtype(config.dtype or default)


def kv_dtype(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype: the model's, or `kv_cache_dtype` where it may differ (on a CPU)."""
    name = config.kv_cache_dtype
    if name is None or torch_dtype(name) == dtype:
        return dtype
    if device.type != "cpu":
        raise ValueError(
            f"kv_cache_dtype {name} differs from the model's dtype "
            f"({str(dtype).removeprefix('torch.')}): supported on a CPU only; leave it unset on a GPU"
        )
    return torch_dtype(name)


def kv_spec(text_config, config: EngineConfig, dtype: torch.dtype) -> KVSpec:
    """The KV cache's shape from the language model's config (`text_config`, HF's)."""
    heads = text_config.num_attention_heads
    return KVSpec(
        num_layers=text_config.num_hidden_layers,
        num_kv_heads=text_config.num_key_value_heads or heads,
        head_dim=getattr(text_config, "head_dim", None) or text_config.hidden_size // heads,
        block_size=config.block_size,
        dtype=dtype,
    )


def num_kv_blocks(config: EngineConfig, spec: KVSpec, device: torch.device) -> int:
    """CPU: as many blocks as `kv_cache_bytes` holds. GPU: a fraction of the memory the weights left
    (of the engine's share of the device, where instances share one: kv_cache.gpu_kv_bytes)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
        room = gpu_kv_bytes(free, total, held, config.gpu_memory_fraction, config.gpu_memory_share)
        return room // spec.bytes_per_block
    return num_blocks_for(spec, config.kv_cache_bytes)


def pack_weights(model, config: EngineConfig, device: torch.device, dtype: torch.dtype) -> int:
    """Pack the decoder's projections for decode-sized products where that pays (packed.py);
    the bytes the packed copies take."""
    wanted = (
        config.packed_weights == PackedWeightMode.AUTO
        and Role.DECODE in config.roles
        and device.type == "cpu"
        and dtype == torch.float32
    )
    if not wanted or not packing_available():
        return 0
    added = pack_projections(model.language_model)
    log.info("decoder weights packed for decode batches: %.0f MB more memory", added / 1e6)
    return added


def decode_graphs(
    config: EngineConfig, model, cache: KVCache | None, max_model_len: int
) -> DecodeGraphs | None:
    """Decode-only steps padded to buckets: captured on CUDA (`auto`), or padded eagerly anywhere."""
    mode = config.decode_graphs
    on_cuda = cache is not None and cache.kv.device.type == "cuda"
    if cache is None or mode == DecodeGraphMode.OFF or (mode == DecodeGraphMode.AUTO and not on_cuda):
        return None
    return DecodeGraphs(model, cache, max_model_len, capture=mode == DecodeGraphMode.AUTO)
