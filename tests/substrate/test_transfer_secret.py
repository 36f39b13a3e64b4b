"""The transfer port answers only pullers that bring the deployment's secret, over UCX and TCP."""

from __future__ import annotations

import pytest

from common.transfer import TransferConfig, create_backend, ucx_available
from common.transfer.errors import Forbidden
from common.transfer.testing import OwnerProcess, TensorSpec, make_tensor, same_bytes
from tests.substrate.helpers import run

pytestmark = pytest.mark.timeout(120)

BACKENDS = [
    pytest.param("ucx", marks=pytest.mark.skipif(not ucx_available(), reason="ucxx does not load here")),
    "tcp",
]
SPEC = TensorSpec((256, 256), "float32", 9)  # 256 KB: pulled by handle, not inline


@pytest.mark.parametrize("backend", BACKENDS)
def test_only_a_puller_with_the_secret_gets_the_tensor(backend: str) -> None:
    with OwnerProcess(backend, [SPEC], env={"TRIDENT_TRANSFER_SECRET": "s3cret"}) as owner:
        (handle,) = owner.handles

        async def pull_with(secret: str):
            puller = create_backend(TransferConfig(backend=backend, timeout=10, secret=secret))  # type: ignore[arg-type]
            await puller.start()
            try:
                with await puller.pull(owner.address, handle) as tensor:
                    return tensor.clone()
            except Forbidden as exc:
                return exc
            finally:
                await puller.close()

        assert isinstance(run(pull_with("")), Forbidden)
        assert isinstance(run(pull_with("s3cre")), Forbidden)
        assert same_bytes(run(pull_with("s3cret")), make_tensor(SPEC))
