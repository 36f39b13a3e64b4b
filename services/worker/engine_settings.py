"""How a worker's settings become its EngineConfig: each field from the setting of its own name
(`TRIDENT_<NAME>`), with one declared table for the few whose value the worker turns into the
engine's. No field is copied by hand, so a field added to both flows without a line here, and
tests/engine/test_engine_settings.py proves every one reachable from its variable."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from common.engine import EngineConfig
from common.roles import Role
from services.settings import WorkerSettings

ENCODER_FEATURE_CACHE = 512 << 20  # an encode-only instance's feature cache: its memory holds no KV
FEATURE_CACHE = 64 << 20  # beside a KV cache


def continues_turns(s: WorkerSettings, roles: frozenset[Role]) -> bool:
    """Whether a decode instance also prefills the conversations' next turns sent to it (decoder-side
    reuse, docs/architecture.md): its prefix cache keeps the turns it decoded."""
    return (
        Role.DECODE in roles
        and Role.PREFILL not in roles
        and s.decode_prefill_tokens > 0
        and s.prefix_caching
    )


def engine_roles(s: WorkerSettings, roles: frozenset[Role]) -> frozenset[Role]:
    """What the engine runs: the instance's roles, and prefill on a decoder that continues turns."""
    return roles | {Role.PREFILL} if continues_turns(s, roles) else roles


def feature_cache_bytes(s: WorkerSettings, roles: frozenset[Role]) -> int:
    if s.feature_cache_bytes is not None:
        return s.feature_cache_bytes
    return ENCODER_FEATURE_CACHE if roles == {Role.ENCODE} else FEATURE_CACHE


Convert = Callable[[WorkerSettings, frozenset[Role]], Any]

# The EngineConfig fields whose value is not their setting's as it stands, and what the worker
# makes of it from its settings and roles (`TRIDENT_ROLES`, parsed).
CONVERTED: dict[str, Convert] = {
    "roles": engine_roles,
    "feature_cache_bytes": feature_cache_bytes,  # unset: by the instance's roles
    "num_threads": lambda s, _: s.num_threads or None,  # 0: torch's default
    "tbt_stretch": lambda s, _: s.tbt_stretch or None,  # 0: no pacing
    "kv_cache_dtype": lambda s, _: None if s.kv_cache_dtype == "auto" else s.kv_cache_dtype,  # the model's
    "dtype": lambda s, _: None if s.dtype == "auto" else s.dtype,  # float32 on a CPU, bfloat16 on a GPU
    "gpu_memory_share": lambda s, _: s.memory_share(),  # this instance kind's share, if one is given
    "detokenize": lambda s, _: False,  # the gateway makes the text from the ordered token stream
}
# EngineConfig fields no service sets: the engine's defaults hold for every deployment so far.
ENGINE_DEFAULTS = frozenset({"gpu_memory_fraction", "encode_with_prefill", "kernels"})
# The rest are taken by name.
BY_NAME = tuple(
    f.name
    for f in dataclasses.fields(EngineConfig)
    if f.name in WorkerSettings.model_fields and f.name not in CONVERTED and f.name not in ENGINE_DEFAULTS
)


def engine_config(s: WorkerSettings, roles: frozenset[Role]) -> EngineConfig:
    """The engine's config for an instance of `roles` with these settings."""
    values = {name: getattr(s, name) for name in BY_NAME}
    values.update({name: convert(s, roles) for name, convert in CONVERTED.items()})
    return EngineConfig(**values)
