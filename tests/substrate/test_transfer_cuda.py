"""GPU tensors between two processes of one host by CUDA IPC: the owner keeps them on its GPU, a
puller with a GPU copies device to device, and nothing of the owner's GPU memory outlives its
release, whoever dies when. Runs only where CUDA exists (the GPU check's machine); the CPU tests of
the same contract are test_transfer_same_host.py and test_transfer_host_local.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from common.transfer import PeerLost, PeerUnreachable, Sink, TransferConfig, TransferPath, create_backend
from common.transfer.testing import OwnerProcess, TensorSpec, make_tensor, same_bytes
from tests.substrate.backends import BACKENDS
from tests.substrate.helpers import pull_and_hold, pull_held_until_told, run, settles, spawn

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU: none here"),
]

GPU = "cuda:0"
SPECS = [
    TensorSpec((256,), "int64", 31, GPU),  # 2 KB: small, still by IPC (a GPU tensor has no cheaper way)
    TensorSpec((576, 1607), "float32", 32, GPU),  # 3.7 MB: one LLaVA-1.5 image's features
    TensorSpec((4, 2, 2, 16, 8, 128), "bfloat16", 33, GPU, offset=5),  # a KV group, 5 elements into its block
    TensorSpec((8, 2, 1 << 21), "float16", 34, GPU),  # 64 MB
]
BIG = 3


def _puller(backend: str, device: str | None = GPU, **kw):  # type: ignore[no-untyped-def]
    # host_local_cpu: a GPU tensor moved to host memory goes by memfd over UCX too, as over TCP.
    config = TransferConfig(backend=backend, timeout=20.0, device=device, host_local_cpu=True, **kw)  # type: ignore[arg-type]
    return create_backend(config)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_tensors_go_device_to_device(backend: str) -> None:
    with OwnerProcess(backend, SPECS) as owner:
        assert owner.stats()["device_bytes"] == sum(make_tensor(s).nbytes for s in SPECS)  # kept on the GPU

        async def main() -> None:
            puller = _puller(backend)
            await puller.start()
            for spec, handle in zip(SPECS, owner.handles, strict=True):
                expected = make_tensor(spec)
                pulled = await puller.pull(owner.address, handle)
                assert pulled.path is TransferPath.HOST_LOCAL and pulled.tensor.device.type == "cuda"
                assert same_bytes(pulled.tensor.cpu(), expected), spec
                on_gpu = torch.zeros(expected.shape, dtype=expected.dtype, device=GPU)
                assert (await puller.pull(owner.address, handle, out=on_gpu)).tensor is on_gpu
                assert same_bytes(on_gpu.cpu(), expected), spec
                on_host = torch.zeros_like(expected)
                await puller.pull(owner.address, handle, out=on_host)  # device to host, from the mapping
                assert same_bytes(on_host, expected), spec
            many = await puller.pull_many(owner.address, owner.handles)
            assert all(same_bytes(p.tensor.cpu(), make_tensor(s)) for p, s in zip(many, SPECS, strict=True))
            assert puller.stats[TransferPath.STREAM].pulls == 0
            await puller.close()

        run(main())
        assert owner.stats()["leases"] == 0


class _GpuBlocks(Sink):
    """A decoder's KV import in small: the bytes scattered over blocks of a store on the GPU."""

    def __init__(self, nbytes: int, block: int) -> None:
        self.nbytes, self.block = nbytes, block
        count = nbytes // block
        self.store = torch.zeros(2 * count, block, dtype=torch.uint8, device=GPU)
        self.ids = torch.randperm(2 * count)[:count].to(GPU)
        self.sources: list[torch.device] = []

    def write(self, source: torch.Tensor) -> None:
        self.sources.append(source.device)
        self.store.index_copy_(0, self.ids, source.view(-1, self.block))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sink_is_written_straight_from_the_owners_gpu_memory(backend: str) -> None:
    spec = SPECS[BIG]
    with OwnerProcess(backend, [spec]) as owner:

        async def main() -> None:
            puller = _puller(backend)
            await puller.start()
            sink = _GpuBlocks(make_tensor(spec).nbytes, 4096)
            pulled = await puller.pull(owner.address, owner.handles[0], sink)
            assert pulled.path is TransferPath.HOST_LOCAL and sink.sources == [torch.device(GPU)]
            got = sink.store.index_select(0, sink.ids).reshape(-1).cpu()
            assert torch.equal(got, make_tensor(spec).reshape(-1).view(torch.uint8))
            assert puller.stats[TransferPath.STREAM].pulls == 0 and puller.pool.stats.allocated == 0
            await puller.close()

        run(main())
        assert owner.stats()["leases"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_puller_without_a_gpu_gets_the_bytes_through_host_memory(backend: str) -> None:
    with OwnerProcess(backend, [SPECS[BIG]]) as owner:

        async def main() -> None:
            for host_local, path in ((False, TransferPath.STREAM), (True, TransferPath.HOST_LOCAL)):
                puller = _puller(backend, device=None, host_local=host_local)
                await puller.start()
                with await puller.pull(owner.address, owner.handles[0]) as got:
                    assert got.device.type == "cpu" and same_bytes(got, make_tensor(SPECS[BIG]))
                assert puller.stats[path].pulls == 1  # host-local: the memfd it went into
                await puller.close()

        run(main())
        assert owner.stats()["device_bytes"] == 0  # moved to host memory for it


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_owners_gpu_memory_is_freed_on_release(backend: str) -> None:
    """torch parks a shared block while its readers' count is above zero; the owner keeps that
    count itself, so its memory goes back as soon as it is released and read."""
    with OwnerProcess(backend, []) as owner:
        base = owner.stats()["cuda_allocated"]
        handle = owner.publish(SPECS[BIG])
        assert owner.stats()["cuda_allocated"] >= base + make_tensor(SPECS[BIG]).nbytes

        async def main() -> None:
            puller = _puller(backend)
            await puller.start()
            for _ in range(3):
                pulled = await puller.pull(owner.address, handle)
                assert pulled.path is TransferPath.HOST_LOCAL
            await puller.close()

        run(main())
        assert owner.release(handle)
        assert settles(lambda: owner.stats()["cuda_allocated"] <= base), owner.stats()


@pytest.mark.parametrize("backend", BACKENDS)
def test_past_its_device_budget_the_owner_moves_the_oldest_to_host(backend: str) -> None:
    budget = {"TRIDENT_TRANSFER_DEVICE_BYTES": str(100 << 20)}
    with OwnerProcess(backend, [SPECS[BIG], SPECS[BIG], SPECS[1]], env=budget) as owner:
        assert owner.stats()["device_bytes"] <= 100 << 20

        async def main() -> None:
            puller = _puller(backend)
            await puller.start()
            for spec, handle in zip([SPECS[BIG], SPECS[BIG], SPECS[1]], owner.handles, strict=True):
                with await puller.pull(owner.address, handle) as got:
                    assert same_bytes(got.cpu(), make_tensor(spec))
            await puller.close()

        run(main())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reader_killed_holding_gpu_memory_leaves_the_owner_whole(backend: str) -> None:
    with OwnerProcess(backend, []) as owner:
        base = owner.stats()["cuda_allocated"]
        handle = owner.publish(SPECS[BIG])
        proc, conn = spawn(pull_and_hold, backend, owner.address, handle, GPU)
        try:
            assert conn.poll(120) and conn.recv() == "mapped"
            assert owner.stats()["leases"] == 1
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
        finally:
            if proc.is_alive():
                proc.kill()
        assert settles(lambda: owner.stats()["leases"] == 0), "the dead reader's hold was kept"
        assert owner.release(handle)
        assert settles(lambda: owner.stats()["cuda_allocated"] <= base), owner.stats()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_owner_killed_while_its_gpu_memory_is_mapped_fails_the_pull(backend: str) -> None:
    with OwnerProcess(backend, [SPECS[BIG]]) as owner:
        proc, conn = spawn(pull_held_until_told, backend, owner.address, owner.handles[0], GPU)
        try:
            assert conn.poll(120) and conn.recv() == "mapped"
            owner.kill()
            killed = time.monotonic()
            conn.send("go")
            assert conn.poll(30), "the reader's pull did not end"
            outcome, message = conn.recv()
            assert outcome in (PeerLost.__name__, PeerUnreachable.__name__), (outcome, message)
            assert time.monotonic() - killed < 5.0
        finally:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_copy_waits_for_the_writes_still_queued_when_the_tensor_was_published(backend: str) -> None:
    """The owner publishes while kernels that end in the tensor's bytes are still queued (a
    thousand pairs of XORs: its bytes are right only once all have run). The reader must see the
    final bytes: the owner answers only once the event recorded after them has completed."""
    spec = TensorSpec((8, 2, 1 << 21), "float16", 35, GPU, busy=1000)
    with OwnerProcess(backend, [spec]) as owner:

        async def main() -> None:
            puller = _puller(backend)
            await puller.start()
            with await puller.pull(owner.address, owner.handles[0]) as got:
                assert same_bytes(got.cpu(), make_tensor(spec))
            await puller.close()

        run(main())
