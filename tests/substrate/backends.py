"""The transfer backends a substrate test runs each of its cases over: UCX where ucxx loads, and TCP.
(Apart from helpers.py, which spawned pullers import before they unshare their user namespace.)"""

from __future__ import annotations

import pytest

from common.transfer import ucx_available

BACKENDS = [
    pytest.param("ucx", marks=pytest.mark.skipif(not ucx_available(), reason="ucxx does not load here")),
    "tcp",
]
