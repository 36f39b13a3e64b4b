"""A worker's settings reach its EngineConfig by field name (services/worker/engine_settings.py):
every field a service can set comes from its own TRIDENT_ variable, and the settings' spellings of
"unset" (0, "auto") become the engine's None."""

from __future__ import annotations

import dataclasses

import pytest

from common.engine.config import DecodeGraphMode, Dtype, EngineConfig, PackedWeightMode, Policy
from common.roles import Role, parse_roles
from services.settings import WorkerSettings
from services.worker.engine_settings import (
    BY_NAME,
    CONVERTED,
    ENCODER_FEATURE_CACHE,
    ENGINE_DEFAULTS,
    engine_config,
)

FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
DEFAULT = EngineConfig()

# For each field a service sets: a value of its variable, and what the engine then gets (never the
# engine's default, so a field that did not flow would fail).
SAMPLES = {
    "roles": ("prefill", frozenset({Role.PREFILL})),
    "policy": ("decode-first", Policy.DECODE_FIRST),
    "block_size": ("32", 32),
    "kv_cache_bytes": ("1048576", 1 << 20),
    "token_budget": ("100", 100),
    "image_budget": ("3", 3),
    "adapt_budgets": ("false", False),
    "tbt_stretch": ("2.5", 2.5),
    "long_prefill": ("77", 77),
    "max_num_seqs": ("9", 9),
    "prefix_caching": ("false", False),
    "feature_cache_bytes": ("4096", 4096),
    "device": ("cuda:1", "cuda:1"),
    "num_threads": ("3", 3),
    "decode_graphs": ("eager", DecodeGraphMode.EAGER),
    "packed_weights": ("off", PackedWeightMode.OFF),
    "kv_cache_dtype": ("float16", Dtype.FLOAT16),
    "dtype": ("bfloat16", Dtype.BFLOAT16),
    "gpu_memory_share": ("0.4", 0.4),
}


def config_from_env(monkeypatch, **env: str) -> EngineConfig:
    for name, value in env.items():
        monkeypatch.setenv(f"TRIDENT_{name.upper()}", value)
    settings = WorkerSettings()
    return engine_config(settings, parse_roles(settings.roles))


def test_every_engine_field_is_taken_by_name_converted_or_left_to_the_engine() -> None:
    taken = [set(BY_NAME), set(CONVERTED), set(ENGINE_DEFAULTS)]
    assert set.union(*taken) == FIELDS, "an EngineConfig field the worker neither sets nor leaves"
    assert sum(map(len, taken)) == len(FIELDS), "a field is claimed twice"
    # A setting named as one of these would be read and then dropped on the way to the engine.
    assert not ENGINE_DEFAULTS & set(WorkerSettings.model_fields)


def test_each_field_a_service_sets_reaches_the_engine_from_its_variable(monkeypatch) -> None:
    assert set(SAMPLES) == FIELDS - ENGINE_DEFAULTS - {"detokenize"}
    config = config_from_env(monkeypatch, **{name: text for name, (text, _) in SAMPLES.items()})
    for name, (_, want) in SAMPLES.items():
        assert want != getattr(DEFAULT, name), name
        assert getattr(config, name) == want, name
    assert config.policy is Policy.DECODE_FIRST and config.kv_cache_dtype is Dtype.FLOAT16  # enums
    assert config.detokenize is False  # the gateway makes the text


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("num_threads", "0"),
        ("tbt_stretch", "0"),
        ("kv_cache_dtype", "auto"),
        ("dtype", "auto"),
        ("gpu_memory_share", ""),
    ],
)
def test_a_settings_spelling_of_unset_is_the_engines_none(monkeypatch, name: str, text: str) -> None:
    assert getattr(config_from_env(monkeypatch, **{name: text}), name) is None


def test_unset_feature_cache_follows_the_roles_and_a_continuing_decoder_prefills(monkeypatch) -> None:
    encoder = config_from_env(monkeypatch, roles="encode")
    assert encoder.feature_cache_bytes == ENCODER_FEATURE_CACHE
    decoder = config_from_env(monkeypatch, roles="decode", decode_prefill_tokens="64")
    assert decoder.roles == {Role.DECODE, Role.PREFILL}
