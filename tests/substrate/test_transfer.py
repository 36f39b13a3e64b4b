"""Bulk transfer between two processes over real UCX (ucxx) and TCP: exact bytes, typed failures.

The owner is a separate process (`OwnerProcess`); the puller is this test process. The bytes go
over the transport (host-local pulls off): test_transfer_host_local.py has the same-host path.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import pytest
import torch

from common.transfer import (
    HandleNotFound,
    PeerLost,
    PeerUnreachable,
    SizeMismatch,
    TransferBackend,
    TransferConfig,
    TransferError,
    TransferPath,
    create_backend,
)
from common.transfer.testing import OwnerProcess, TensorSpec, make_tensor, same_bytes
from tests.substrate.backends import BACKENDS
from tests.substrate.helpers import pull_forever, run, spawn

pytestmark = pytest.mark.timeout(120)

SPECS = [
    TensorSpec((1024,), "uint8", 1),  # 1 KB
    TensorSpec((128, 128), "float32", 2),  # 64 KB
    TensorSpec((576, 1607), "float32", 3),  # 3.7 MB: one LLaVA-1.5 image's features
    TensorSpec((2, 1 << 20), "int64", 4),  # 16 MB
    TensorSpec((16, 2, 1 << 20), "float16", 5),  # 64 MB
    TensorSpec((32, 1 << 20), "bfloat16", 6),  # 64 MB
    TensorSpec((0, 8), "float32", 7),  # empty
]
BIG = 5  # index of a 64 MB spec


@pytest.fixture(scope="module", params=BACKENDS)
def owner(request: pytest.FixtureRequest) -> Iterator[OwnerProcess]:
    with OwnerProcess(request.param, SPECS) as proc:
        yield proc


def _puller(backend: str, timeout: float = 5.0) -> TransferBackend:
    config = TransferConfig(backend=backend, timeout=timeout, host_local=False)  # type: ignore[arg-type]
    return create_backend(config)


def test_transfers_are_byte_identical(owner: OwnerProcess) -> None:
    async def main() -> None:
        puller = _puller(owner.backend)
        await puller.start()
        for spec, handle in zip(SPECS, owner.handles, strict=True):
            expected = make_tensor(spec)
            with await puller.pull(owner.address, handle) as got:  # into a pool buffer
                assert same_bytes(got, expected), spec
            out = (
                torch.full_like(expected, 0)
                if expected.dtype.is_floating_point
                else torch.zeros_like(expected)
            )
            pulled = await puller.pull(owner.address, handle, out=out)  # into the caller's tensor
            assert pulled.tensor is out and same_bytes(out, expected), spec
            assert pulled.path is TransferPath.STREAM
        # Several at once from one owner, as decode pulls a request's KV layer groups.
        many = await puller.pull_many(owner.address, owner.handles)
        assert all(same_bytes(p.tensor, make_tensor(s)) for p, s in zip(many, SPECS, strict=True))
        for p in many:
            p.release()
        assert puller.pool.stats.reused > 0  # the second round of pool pulls reused buffers
        await puller.close()

    run(main())


def test_unknown_released_and_mismatched_handles_fail_promptly(owner: OwnerProcess) -> None:
    async def main() -> None:
        puller = _puller(owner.backend)
        await puller.start()
        t0 = time.monotonic()
        with pytest.raises(HandleNotFound):
            await puller.pull(owner.address, "no-such-handle")
        with pytest.raises(SizeMismatch):
            await puller.pull(owner.address, owner.handles[1], out=torch.empty(3))
        # the connection is still good after the errors
        with await puller.pull(owner.address, owner.handles[0]) as got:
            assert same_bytes(got, make_tensor(SPECS[0]))
        assert time.monotonic() - t0 < 1.0
        await puller.close()

    run(main())
    assert owner.release(owner.handles[0])

    async def after_release() -> None:
        puller = _puller(owner.backend)
        await puller.start()
        t0 = time.monotonic()
        with pytest.raises(HandleNotFound):
            await puller.pull(owner.address, owner.handles[0])
        assert time.monotonic() - t0 < 1.0
        await puller.close()

    run(after_release())


@pytest.mark.parametrize("backend", BACKENDS)
def test_pulling_from_a_dead_owner_fails_promptly(backend: str) -> None:
    with OwnerProcess(backend, SPECS[:1]) as dead:
        dead.kill()

        async def main() -> None:
            puller = _puller(backend, timeout=5.0)
            await puller.start()
            t0 = time.monotonic()
            with pytest.raises((PeerUnreachable, PeerLost)):
                await puller.pull(dead.address, dead.handles[0])
            assert time.monotonic() - t0 < 2.0  # well inside the 5 s deadline
            await puller.close()

        run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_owner_killed_mid_transfer_raises_a_typed_error_within_the_timeout(backend: str) -> None:
    timeout = 4.0
    with OwnerProcess(backend, [SPECS[BIG]]) as victim:

        async def main() -> None:
            puller = _puller(backend, timeout=timeout)
            await puller.start()
            out = torch.empty(SPECS[BIG].shape, dtype=torch.bfloat16)
            killed_at: list[float] = []
            pulled = asyncio.Event()

            async def killer() -> None:
                await pulled.wait()  # pulls of 64 MB run back to back from then on
                await asyncio.to_thread(victim.kill)
                killed_at.append(time.monotonic())

            kill = asyncio.create_task(killer())
            with pytest.raises(TransferError) as failure:
                for _ in range(10_000):
                    await puller.pull(victim.address, victim.handles[0], out=out)
                    pulled.set()
            await kill
            assert isinstance(failure.value, PeerLost | PeerUnreachable), repr(failure.value)
            assert time.monotonic() - killed_at[0] < timeout
            await puller.close()

        run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_puller_killed_mid_transfer_leaves_the_owner_serving(backend: str) -> None:
    with OwnerProcess(backend, [SPECS[BIG]]) as owner:
        proc, conn = spawn(pull_forever, backend, owner.address, owner.handles[0], False)
        try:
            assert conn.poll(60) and conn.recv() == "pulled"
            time.sleep(0.05)  # into the next pull
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
        finally:
            if proc.is_alive():
                proc.kill()

        async def main() -> None:
            puller = _puller(backend)
            await puller.start()
            with await puller.pull(owner.address, owner.handles[0]) as got:
                assert same_bytes(got, make_tensor(SPECS[BIG]))
            await puller.close()

        run(main())
        # It did not crash: it still answers on its control pipe (a dead owner's pipe raises
        # EOFError) and still holds the handle the killed puller was pulling.
        assert owner.release(owner.handles[0])
