"""Host-local pulls between two real processes, over UCX and TCP: a puller on the owner's host
copies straight from the owner's memory (CPU tensors: a memfd it maps; common/transfer/shm.py)
instead of taking the bytes over the transport, and acknowledges; the owner's hold ends then.

Where the copy cannot be made (another IPC namespace, a handle it may not open) the bytes stream
as before, and a peer SIGKILLed at the worst moment — holding the owner's memory open — leaves
nothing behind: no lease at the owner, no memfd open or mapped anywhere, nothing in /dev/shm.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.certs import issue
from common.transfer import (
    PeerLost,
    PeerUnreachable,
    TransferConfig,
    TransferPath,
    create_backend,
)
from common.transfer.errors import Forbidden
from common.transfer.shm import mapped_segments, open_segments
from common.transfer.testing import OwnerProcess, TensorSpec, make_tensor, same_bytes
from tests.substrate.backends import BACKENDS
from tests.substrate.helpers import pull_and_hold, pull_unprivileged, run, settles, spawn

pytestmark = pytest.mark.timeout(120)

SPECS = [
    TensorSpec((64, 64), "float32", 21),  # 16 KB: under host_local_min_bytes, streams
    TensorSpec((576, 1607), "float32", 22),  # 3.7 MB: one LLaVA-1.5 image's features
    TensorSpec((4, 2, 1 << 20), "bfloat16", 23, offset=5),  # 16 MB, a view 5 elements into its storage
    TensorSpec((2, 1 << 20), "int64", 24),  # 16 MB
]
BIG = 2


def _config(backend: str, **kw) -> TransferConfig:
    # CPU tensors host-local over UCX too (by default UCX's own shared memory carries them).
    return TransferConfig(backend=backend, timeout=kw.pop("timeout", 10.0), host_local_cpu=True, **kw)  # type: ignore[arg-type]


def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.fixture(scope="module", params=BACKENDS)
def owner(request: pytest.FixtureRequest) -> Iterator[OwnerProcess]:
    with OwnerProcess(request.param, SPECS) as proc:
        yield proc


def test_same_host_pulls_copy_from_the_owners_memory(owner: OwnerProcess) -> None:
    shm_before = _dev_shm()

    async def main() -> None:
        puller = create_backend(_config(owner.backend))
        await puller.start()
        for spec, handle in zip(SPECS, owner.handles, strict=True):
            expected = make_tensor(spec)
            small = expected.numel() * expected.element_size() < puller.config.host_local_min_bytes
            want = TransferPath.STREAM if small else TransferPath.HOST_LOCAL
            pulled = await puller.pull(owner.address, handle)  # into a pool buffer
            assert pulled.path is want and same_bytes(pulled.tensor, expected), spec
            pulled.release()
            out = torch.zeros_like(expected)
            pulled = await puller.pull(owner.address, handle, out=out)  # into the caller's tensor
            assert pulled.tensor is out and pulled.path is want and same_bytes(out, expected), spec
        many = await puller.pull_many(owner.address, owner.handles)  # in flight together
        assert all(same_bytes(p.tensor, make_tensor(s)) for p, s in zip(many, SPECS, strict=True))
        assert [p.path for p in many] == [TransferPath.STREAM] + [TransferPath.HOST_LOCAL] * 3
        for p in many:
            p.release()
        host_local = puller.stats[TransferPath.HOST_LOCAL]
        assert host_local.pulls == 9 and host_local.bytes == 3 * sum(make_tensor(s).nbytes for s in SPECS[1:])
        assert mapped_segments() == [] and open_segments() == []  # nothing of the owner's kept here
        await puller.close()

    run(main())
    stats = owner.stats()
    assert stats["leases"] == 0  # every hold ended with its acknowledgement
    # Nine pulls, at most three at once: their memfds went back to the pool and were used again.
    assert 1 <= stats["idle_segments"] <= 3 and len(open_segments(owner.pid)) == stats["idle_segments"]
    assert _dev_shm() == shm_before  # nothing named in /dev/shm, ever


def test_a_reserved_handle_is_copied_once_filled(owner: OwnerProcess) -> None:
    handle = owner.reserve()

    async def main() -> None:
        puller = create_backend(_config(owner.backend))
        await puller.start()
        pull = asyncio.create_task(puller.pull(owner.address, handle))
        done, _ = await asyncio.wait([pull], timeout=0.3)
        assert not done
        assert await asyncio.to_thread(owner.fill, handle, SPECS[1])
        pulled = await pull
        assert pulled.path is TransferPath.HOST_LOCAL and same_bytes(pulled.tensor, make_tensor(SPECS[1]))
        pulled.release()
        await puller.close()

    run(main())
    assert owner.release(handle)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_puller_that_may_not_map_the_memory_gets_the_bytes(backend: str) -> None:
    """Same host key, but the handle cannot be opened (a puller without CAP_SYS_PTRACE over a
    non-dumpable owner may not reach its descriptors through /proc): the puller says so in its
    acknowledgement and takes the bytes."""
    if os.geteuid() != 0:
        pytest.skip("a user namespace beside a non-dumpable owner: run as root")
    with OwnerProcess(backend, [SPECS[BIG]], env={"TRIDENT_TEST_NOT_DUMPABLE": "1"}) as owner:
        proc, conn = spawn(pull_unprivileged, backend, owner.address, owner.handles[0])
        try:
            assert conn.poll(60), "the puller did not report"
            paths, got = conn.recv()
        finally:
            proc.join(10)
        assert got == make_tensor(SPECS[BIG]).reshape(-1).view(torch.uint8).numpy().tobytes()
        # It was offered the memory, could not open it, said so, and took the bytes.
        assert paths == {"inline": 0, "stream": 1, "host_local": 0, "fallbacks": 1}
        assert owner.stats()["leases"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_owner_in_another_ipc_namespace_streams_the_bytes(backend: str) -> None:
    """Another IPC namespace (a container without the host's): the host keys differ, so the owner
    never offers its memory, and the bytes go over the transport."""
    if os.geteuid() != 0:
        pytest.skip("a new IPC namespace needs root")
    with OwnerProcess(backend, [SPECS[BIG]], env={"TRIDENT_TEST_NEW_IPC_NS": "1"}) as owner:

        async def main() -> None:
            puller = create_backend(_config(backend))
            await puller.start()
            with await puller.pull(owner.address, owner.handles[0]) as got:
                assert same_bytes(got, make_tensor(SPECS[BIG]))
            assert puller.stats[TransferPath.STREAM].pulls == 1
            assert puller.stats[TransferPath.HOST_LOCAL].pulls == 0
            await puller.close()

        run(main())
        assert open_segments(owner.pid) == []  # it never made one


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reader_killed_holding_the_memory_leaves_nothing_behind(backend: str) -> None:
    shm_before = _dev_shm()
    with OwnerProcess(backend, [SPECS[BIG]]) as owner:
        proc, conn = spawn(pull_and_hold, backend, owner.address, owner.handles[0], None)
        try:
            assert conn.poll(60) and conn.recv() == "mapped"
            assert owner.stats()["leases"] == 1  # the owner holds the memory for it
            assert len(open_segments(proc.pid)) == 1  # it has the owner's memfd open
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)
        finally:
            if proc.is_alive():
                proc.kill()
        # Its connection dropped (TCP) or its process is found gone (UCX): the hold ends.
        assert settles(lambda: owner.stats()["leases"] == 0), "the dead reader's hold was kept"
        assert owner.release(owner.handles[0])
        # What it held went back to the pool, to be lent again (the owner's only memfd).
        assert owner.stats()["handles"] == 0 and owner.stats()["idle_segments"] == 1
        assert len(open_segments(owner.pid)) == 1
        # And it serves on: a new pull of a new tensor is copied as before.
        handle = owner.publish(SPECS[BIG])

        async def again() -> None:
            puller = create_backend(_config(backend))
            await puller.start()
            with await puller.pull(owner.address, handle) as got:
                assert same_bytes(got, make_tensor(SPECS[BIG]))
            assert puller.stats[TransferPath.HOST_LOCAL].pulls == 1
            await puller.close()

        run(again())
        assert len(open_segments(owner.pid)) == 1  # the same one
    assert _dev_shm() == shm_before


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_owner_killed_while_its_memory_is_read_fails_the_pull_promptly(backend: str) -> None:
    shm_before = _dev_shm()
    with OwnerProcess(backend, [SPECS[BIG]]) as owner:
        mapped, go = threading.Event(), threading.Event()

        def hold() -> None:  # on the copying thread, with the owner's memory mapped
            mapped.set()
            go.wait(30)

        async def main() -> None:
            puller = create_backend(_config(backend, timeout=20.0))
            puller.on_mapped = hold
            await puller.start()
            pull = asyncio.create_task(puller.pull(owner.address, owner.handles[0]))
            assert await asyncio.to_thread(mapped.wait, 30)
            await asyncio.to_thread(owner.kill)
            killed = time.monotonic()
            go.set()
            with pytest.raises((PeerLost, PeerUnreachable)):
                await pull
            assert time.monotonic() - killed < 3.0  # well inside the 20 s deadline
            assert mapped_segments() == [] and open_segments() == []  # its mapping is closed
            assert puller.pool.stats.cached_bytes > 0  # its pool buffer came back after the copy
            await puller.close()

        run(main())
    assert _dev_shm() == shm_before


def test_with_tls_the_control_path_is_tls_and_the_bytes_stay_on_the_host(tmp_path: Path) -> None:
    """A host-local copy never leaves the machine, so TLS does not force it onto TCP: the request,
    reply and acknowledgement go over TLS; the bytes are copied from the owner's memory. Without
    the certificate nothing is answered at all."""
    tls = issue(tmp_path / "tls")
    with pytest.raises(ValueError):
        create_backend(_config("ucx", tls=tls))  # still: UCX has no encryption, refused with TLS
    with OwnerProcess("auto", [SPECS[BIG]], env={"TRIDENT_TLS_DIR": str(tls.folder)}) as owner:
        assert owner.address.startswith("tcp://")  # auto picked TCP, because of TLS

        async def main() -> None:
            member = create_backend(_config("auto", tls=tls))
            await member.start()
            with await member.pull(owner.address, owner.handles[0]) as got:
                assert same_bytes(got, make_tensor(SPECS[BIG]))
            assert member.stats[TransferPath.HOST_LOCAL].pulls == 1
            await member.close()
            stranger = create_backend(_config("tcp", timeout=5.0))
            await stranger.start()
            with pytest.raises((PeerLost, PeerUnreachable)):
                await stranger.pull(owner.address, owner.handles[0])
            await stranger.close()

        run(main())
        assert owner.stats()["leases"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_puller_without_the_secret_is_lent_nothing(backend: str) -> None:
    with OwnerProcess(backend, [SPECS[BIG]], env={"TRIDENT_TRANSFER_SECRET": "s3cret"}) as owner:

        async def main() -> None:
            puller = create_backend(_config(backend, secret="wrong"))
            await puller.start()
            with pytest.raises(Forbidden):
                await puller.pull(owner.address, owner.handles[0])
            await puller.close()

        run(main())
        assert owner.stats()["leases"] == 0 and open_segments(owner.pid) == []  # nothing was copied
