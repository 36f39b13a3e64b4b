"""Reserved handles over real UCX and TCP, between two processes: a pull of a handle advertised
before its tensor exists waits at the owner and gets the tensor's exact bytes once it is filled (from
another thread); a release, or the owner's death, ends the wait with a typed error."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from common.transfer import (
    HandleNotFound,
    PeerLost,
    PeerUnreachable,
    TransferConfig,
    TransferTimeout,
    create_backend,
)
from common.transfer.testing import OwnerProcess, TensorSpec, make_tensor, same_bytes
from tests.substrate.backends import BACKENDS
from tests.substrate.helpers import run

pytestmark = pytest.mark.timeout(120)

SMALL = TensorSpec((64, 64), "float32", 11)  # 16 KB
LARGE = TensorSpec((4, 2, 1 << 20), "bfloat16", 12)  # 16 MB: a KV layer group's size
STILL_WAITING = 0.3  # seconds a pull is watched to see that it does not end before the fill


async def _puller(backend: str, timeout: float = 10.0):
    puller = create_backend(TransferConfig(backend=backend, timeout=timeout))  # type: ignore[arg-type]
    await puller.start()
    return puller


@pytest.fixture(scope="module", params=BACKENDS)
def owner(request: pytest.FixtureRequest) -> Iterator[OwnerProcess]:
    with OwnerProcess(request.param, [SMALL]) as proc:
        yield proc


def test_a_pull_waits_for_the_fill_and_gets_its_exact_bytes(owner: OwnerProcess) -> None:
    backend = owner.backend
    small, large = owner.reserve(), owner.reserve()

    async def main() -> None:
        puller = await _puller(backend)
        # Two pulls of one handle and one of another, all sent before anything is filled.
        pulls = [asyncio.create_task(puller.pull(owner.address, h)) for h in (small, small, large)]
        done, _ = await asyncio.wait(pulls, timeout=STILL_WAITING)
        assert not done, "a pull of a reserved handle ended before its fill"
        assert await asyncio.to_thread(owner.fill, large, LARGE)
        with await pulls[2] as got:
            assert same_bytes(got, make_tensor(LARGE))
        assert not pulls[0].done() and not pulls[1].done()  # each waits for its own handle
        assert await asyncio.to_thread(owner.fill, small, SMALL)
        for pull in pulls[:2]:
            with await pull as got:
                assert same_bytes(got, make_tensor(SMALL))
        # Filled is filled: a later pull is answered at once, and a second fill is refused.
        with await puller.pull(owner.address, small) as got:
            assert same_bytes(got, make_tensor(SMALL))
        assert not await asyncio.to_thread(owner.fill, small, LARGE)
        await puller.close()

    run(main())


def test_releasing_a_reserved_handle_ends_its_waiting_pulls(owner: OwnerProcess) -> None:
    backend = owner.backend
    handle = owner.reserve()

    async def main() -> None:
        puller = await _puller(backend)
        pull = asyncio.create_task(puller.pull(owner.address, handle))
        done, _ = await asyncio.wait([pull], timeout=STILL_WAITING)
        assert not done
        t0 = time.monotonic()
        assert await asyncio.to_thread(owner.release, handle)
        with pytest.raises(HandleNotFound):
            await pull
        assert time.monotonic() - t0 < 2.0
        assert not await asyncio.to_thread(owner.fill, handle, SMALL)  # released: nothing kept
        # The owner still serves what it published.
        with await puller.pull(owner.address, owner.handles[0]) as got:
            assert same_bytes(got, make_tensor(SMALL))
        await puller.close()

    run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_owner_that_dies_before_the_fill_fails_the_waiting_pull(backend: str) -> None:
    timeout = 5.0
    with OwnerProcess(backend, [SMALL]) as owner:
        handle = owner.reserve()

        async def main() -> None:
            puller = await _puller(backend, timeout=timeout)
            pull = asyncio.create_task(puller.pull(owner.address, handle))
            done, _ = await asyncio.wait([pull], timeout=STILL_WAITING)
            assert not done
            t0 = time.monotonic()
            await asyncio.to_thread(owner.kill)
            with pytest.raises((PeerLost, PeerUnreachable, TransferTimeout)):
                await pull
            assert time.monotonic() - t0 < timeout + 2.5  # within the pull's deadline (and UCX's abort grace)
            await puller.close()

        run(main())
