"""Engine fixtures: HF transformers on the same tiny checkpoint is the correctness oracle (the
session's `hf_generate`, tests/conftest.py); what the engine tests share as functions is in
tests/helpers/engine.py."""

from __future__ import annotations

import logging

import pytest

from tests.helpers.engine import engines
from tests.helpers.images import make_image

logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture
def images():
    return [make_image(i) for i in range(4)]


@pytest.fixture
def make_engine(tiny_model_dir):
    with engines(tiny_model_dir) as build:
        yield build
