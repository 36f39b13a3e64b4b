"""Pulls into a Sink (common/transfer/sink.py), between two real processes over UCX and TCP: the
bytes reach the sink's own layout once — scattered over blocks, as a decoder's KV import writes
them — straight from the owner's memory where it is on this host, else from the pool buffer they
streamed into; always on a copier thread, the pool buffer back and no mapping left afterwards, also
when the write fails or the pull is cancelled while it runs.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from common.protocol import InlineTensor
from common.transfer import Sink, TransferConfig, TransferPath, create_backend, fetch
from common.transfer.errors import SinkRefused
from common.transfer.handles import as_bytes
from common.transfer.pool import size_class
from common.transfer.shm import mapped_segments, open_segments
from common.transfer.testing import OwnerProcess, TensorSpec, make_tensor
from tests.substrate.backends import BACKENDS
from tests.substrate.helpers import run, settles

pytestmark = pytest.mark.timeout(120)

BLOCK = 4096  # bytes a block of the sink's store holds
SPEC = TensorSpec((64, 2, 4096), "bfloat16", 31)  # 1 MiB: 256 blocks
NBLOCKS = 256


class ScatteredBlocks(Sink):
    """Bytes written block by block into a store twice their size, in a shuffled order."""

    def __init__(self, fail: Exception | None = None, hold: threading.Event | None = None) -> None:
        self.nbytes = NBLOCKS * BLOCK
        self.store = torch.zeros(2 * NBLOCKS, BLOCK, dtype=torch.uint8)
        self.ids = torch.randperm(2 * NBLOCKS, generator=torch.Generator().manual_seed(0))[:NBLOCKS]
        self.threads: list[str] = []
        self.fail, self.hold = fail, hold
        self.started = threading.Event()

    def write(self, source: torch.Tensor) -> None:
        self.threads.append(threading.current_thread().name)
        self.started.set()
        if self.hold is not None:
            self.hold.wait(30)
        if self.fail is not None:
            raise self.fail
        self.store.index_copy_(0, self.ids, source.view(NBLOCKS, BLOCK))

    def gathered(self) -> torch.Tensor:
        return self.store.index_select(0, self.ids).reshape(-1)


def _config(backend: str, host_local: bool) -> TransferConfig:
    return TransferConfig(backend=backend, timeout=10.0, host_local=host_local, host_local_cpu=True)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=BACKENDS)
def owner(request: pytest.FixtureRequest):
    with OwnerProcess(request.param, [SPEC]) as proc:
        yield proc


@pytest.mark.parametrize("host_local", [True, False], ids=["host_local", "stream"])
def test_the_bytes_land_in_the_sinks_layout_once_on_a_copier_thread(owner: OwnerProcess, host_local: bool):
    want = as_bytes(make_tensor(SPEC))

    async def main() -> None:
        puller = create_backend(_config(owner.backend, host_local))
        await puller.start()
        sink = ScatteredBlocks()
        pulled = await puller.pull(owner.address, owner.handles[0], sink)
        assert pulled.path is (TransferPath.HOST_LOCAL if host_local else TransferPath.STREAM)
        assert pulled.nbytes == sink.nbytes and pulled.tensor.numel() == 0
        assert torch.equal(sink.gathered(), want)
        assert len(sink.threads) == 1 and sink.threads[0].startswith("transfer-copy")
        if host_local:  # straight from the owner's memfd: no pool buffer taken
            assert puller.pool.stats.allocated == 0
        else:  # streamed into a pool buffer, which is back
            assert puller.pool.stats.allocated == 1 and puller.pool.stats.cached_bytes > 0
        assert puller.stats[pulled.path].bytes == sink.nbytes
        await puller.close()

    run(main())
    assert mapped_segments() == [] and open_segments() == []
    assert owner.stats()["leases"] == 0


def test_several_sinks_in_flight_together(owner: OwnerProcess):
    async def main() -> None:
        puller = create_backend(_config(owner.backend, True))
        await puller.start()
        sinks = [ScatteredBlocks() for _ in range(3)]
        pulled = await puller.pull_many(owner.address, [owner.handles[0]] * 3, sinks)
        assert all(p.path is TransferPath.HOST_LOCAL for p in pulled)
        assert all(torch.equal(s.gathered(), as_bytes(make_tensor(SPEC))) for s in sinks)
        await puller.close()

    run(main())


def test_an_inline_tensor_is_written_into_the_sink_too():
    tensor = make_tensor(SPEC)

    async def main() -> None:
        sink = ScatteredBlocks()
        pulled = await fetch(None, InlineTensor.from_tensor(tensor), into=sink)  # type: ignore[arg-type]
        assert pulled.path is TransferPath.INLINE and torch.equal(sink.gathered(), as_bytes(tensor))

    run(main())


@pytest.mark.parametrize("host_local", [True, False], ids=["host_local", "stream"])
def test_a_write_that_fails_fails_the_pull_and_leaves_nothing_held(owner: OwnerProcess, host_local: bool):
    async def main() -> None:
        puller = create_backend(_config(owner.backend, host_local))
        await puller.start()
        sink = ScatteredBlocks(fail=ValueError("KV buffer shape does not match"))
        with pytest.raises(SinkRefused, match="does not match"):
            await puller.pull(owner.address, owner.handles[0], sink)
        # Host-local, the failed copy was tried once more with the bytes streamed.
        assert len(sink.threads) == (2 if host_local else 1)
        if host_local:
            assert puller.host_local_fallbacks == 1
        stats = puller.pool.stats  # every buffer taken is back
        assert stats.cached_bytes == stats.allocated * size_class(sink.nbytes)
        await puller.close()

    run(main())
    assert mapped_segments() == [] and open_segments() == []
    assert owner.stats()["leases"] == 0


@pytest.mark.parametrize("host_local", [True, False], ids=["host_local", "stream"])
def test_a_pull_cancelled_mid_write_lets_the_write_end_before_its_memory_goes(
    owner: OwnerProcess, host_local: bool
):
    async def main() -> None:
        puller = create_backend(_config(owner.backend, host_local))
        await puller.start()
        go = threading.Event()
        sink = ScatteredBlocks(hold=go)
        pull = asyncio.create_task(puller.pull(owner.address, owner.handles[0], sink))
        assert await asyncio.to_thread(sink.started.wait, 30)
        pull.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pull
        if not host_local:
            assert puller.pool.stats.cached_bytes == 0  # its buffer is still being read
        go.set()
        # The write ends with the owner's (or the pool's) bytes whole, and only then lets them go.
        assert await asyncio.to_thread(settles, lambda: owner.stats()["leases"] == 0)
        if not host_local:
            assert await asyncio.to_thread(settles, lambda: puller.pool.stats.cached_bytes > 0)
        assert torch.equal(sink.gathered(), as_bytes(make_tensor(SPEC)))
        await puller.close()

    run(main())
    assert mapped_segments() == [] and open_segments() == []
