"""Shared fixtures: the tiny checkpoint is written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.checkpoints import write_checkpoint


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-llava", "tiny-llava", seed=0)
