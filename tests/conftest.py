"""Shared pytest fixtures."""

from pathlib import Path

import pytest

from common.checkpoints import write_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny-llava checkpoint (seed 0), written once per test session; treat it as read-only."""
    return write_checkpoint(tmp_path_factory.mktemp("checkpoints") / "tiny-llava", "tiny-llava", seed=0)
