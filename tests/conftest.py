"""Shared pytest fixtures."""

from pathlib import Path

import pytest

from common.checkpoints import write_checkpoint


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
