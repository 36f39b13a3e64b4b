"""Shared pytest fixtures."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from common.checkpoints import write_checkpoint
from common.infra import NatsServer, RedisServer


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-llava checkpoint (seed 0), written once per test session; treat it as read-only."""
    return write_checkpoint(tmp_path_factory.mktemp("checkpoints") / "tiny-llava", "tiny-llava", seed=0)


@pytest.fixture(scope="session")
def hf_tiny(tiny_model_dir: Path):
    """HF transformers' own model and processor on the tiny checkpoint: the correctness oracle."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(tiny_model_dir).eval()
    return model, AutoProcessor.from_pretrained(tiny_model_dir)


@pytest.fixture
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A real nats-server of the test's own (~0.1 s to start): a test that restarts or kills it
    cannot disturb another."""
    with NatsServer(workdir=tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server of the test's own."""
    with RedisServer(workdir=tmp_path_factory.mktemp("redis")) as server:
        yield server
