"""The transfer layer's parts in one process: buffer pool, handle table, backend choice, inline sharing."""

from __future__ import annotations

import time

import pytest
import torch

from common.protocol import InlineTensor, TensorRef
from common.transfer import (
    BufferPool,
    HandleNotFound,
    TcpBackend,
    TransferConfig,
    create_backend,
    fetch,
    share,
    ucx_available,
)
from common.transfer.base import HandleTable
from common.transfer.liveness import ProcessId, checkable, known_dead, this_process
from common.transfer.pool import PAGE, size_class
from tests.substrate.helpers import run

pytestmark = pytest.mark.timeout(60)


def test_pool_hands_out_aligned_buffers_and_reuses_them() -> None:
    pool = BufferPool(max_cached_bytes=8 << 20)
    a = pool.acquire(3_700_000)
    assert a.capacity == size_class(3_700_000) == 4 << 20
    assert a.storage.data_ptr() % PAGE == 0
    view = a.view((576, 1600), "float32")
    assert view.shape == (576, 1600) and view.data_ptr() == a.storage.data_ptr()
    with pytest.raises(ValueError):
        a.view((1024, 1024), "float32")  # 4 MB does not fit in the 3.7 MB asked for
    a.release()
    a.release()  # idempotent
    b = pool.acquire(3_000_000)  # same size class: the same memory again
    assert b.storage.data_ptr() == a.storage.data_ptr()
    assert (pool.stats.allocated, pool.stats.reused) == (1, 1)
    big = [pool.acquire(4 << 20) for _ in range(3)]
    b.release()
    for buf in big:
        buf.release()
    assert pool.stats.cached_bytes <= 8 << 20  # idle memory stays under the cap


def test_handle_table_expires_and_releases() -> None:
    table = HandleTable()
    keep = table.put(torch.arange(6).reshape(2, 3), "keep", ttl=None)
    brief = table.put(torch.ones(4), None, ttl=0.05)
    assert table.get(keep) is not None and table.get(brief) is not None
    time.sleep(0.1)
    assert table.get(brief) is None and len(table) == 1
    assert table.pop(keep) and not table.pop(keep)


def test_a_sliding_handle_lives_its_ttl_from_its_last_serve(monkeypatch) -> None:
    """Hot image features stay: each pull (serve) starts a sliding handle's time again; a plain
    handle and a mere lookup do not."""
    now = [1000.0]
    monkeypatch.setattr("common.transfer.base.time.monotonic", lambda: now[0])
    table = HandleTable()
    hot = table.put(torch.ones(3), "hot", ttl=10, sliding=True)
    plain = table.put(torch.ones(3), "plain", ttl=10)
    for _ in range(3):
        now[0] += 8
        assert table.serve(hot) is not None and table.serve(plain if now[0] < 1010 else hot) is not None
    assert table.get(plain) is None, "a plain handle expires 10 s after its publication"
    now[0] += 9.9
    assert table.get(hot) is not None, "served 9.9 s ago: still there"
    now[0] += 0.2
    assert table.get(hot) is None and len(table) == 0


def test_factory_picks_ucx_when_it_loads_and_tcp_on_request() -> None:
    assert isinstance(create_backend(TransferConfig(backend="tcp")), TcpBackend)
    auto = create_backend(TransferConfig(backend="auto"))
    assert type(auto).__name__ == ("UcxBackend" if ucx_available() else "TcpBackend")


def test_small_tensors_ride_inline_and_big_ones_by_handle() -> None:
    async def main() -> None:
        owner, puller = TcpBackend(), TcpBackend()
        await owner.start()
        await puller.start()
        small, big = torch.randn(8, 8), torch.randn(576, 1024)
        inline = share(owner, small, owner="enc-1")
        ref = share(owner, big, owner="enc-1", ttl=60)
        assert isinstance(inline, InlineTensor) and isinstance(ref, TensorRef)
        assert ref.nbytes == big.numel() * 4 and ref.address == owner.address
        with await fetch(puller, inline) as got:
            assert torch.equal(got, small)
        with await fetch(puller, ref) as got:
            assert torch.equal(got, big)
        owner.release(ref.handle)
        with pytest.raises(HandleNotFound):
            await fetch(puller, ref)
        await owner.close()
        await puller.close()

    run(main())


@pytest.mark.skipif(not ucx_available(), reason="ucxx does not load here")
def test_a_ucx_puller_also_pulls_from_a_tcp_owner() -> None:
    """Mixed deployments: an owner without ucxx serves over TCP, and UCX pullers follow its address."""

    async def main() -> None:
        owner = TcpBackend()
        puller = create_backend(TransferConfig(backend="ucx"))
        await owner.start()
        await puller.start()
        t = torch.randn(100, 100)
        with await puller.pull(owner.address, owner.publish(t)) as got:
            assert torch.equal(got, t)
        await puller.close()
        await owner.close()

    run(main())


def test_liveness_knows_this_process_and_a_dead_one() -> None:
    me = this_process()
    assert me is not None and checkable(me) and not known_dead(me)
    assert ProcessId.decode(me.encode()) == me
    assert known_dead(ProcessId(me.scope, me.pid, me.start + 1))  # same pid, another start: pid reused
    assert not known_dead(ProcessId("other-host:1", me.pid, 0))  # not ours to judge
