"""The host-local path's parts in one process: who is offered which handle, the CUDA IPC handle as
it crosses the wire and as torch's open call takes it, and the owner's table lending a memfd.

The CUDA IPC calls themselves need a GPU (test_transfer_cuda.py runs them between two processes
where one exists); here runs everything around them: the choice, the descriptor, the offsets.
"""

from __future__ import annotations

import os
import threading

import msgpack
import pytest
import torch

from common.transfer import TransferConfig, TransferError
from common.transfer.base import unpack
from common.transfer.cuda_ipc import NO_COUNTER, CudaHandle, bytes_of_storage
from common.transfer.handles import WAITING, HandleTable, Lease, as_bytes
from common.transfer.host_local import copy
from common.transfer.same_host import Kind, choose, host_key, offer, puller_kinds
from common.transfer.shm import mapped_segments, open_segments, read_into
from common.transfer.testing import TensorSpec, make_tensor, published

pytestmark = pytest.mark.timeout(60)

MIB = 1 << 20


def test_the_host_key_is_boot_ipc_and_pid_namespace() -> None:
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot = f.read().strip()
    ipc, pid = os.stat("/proc/self/ns/ipc").st_ino, os.stat("/proc/self/ns/pid").st_ino
    assert host_key() == f"{boot}:{ipc}:{pid}"


def test_a_same_host_puller_is_offered_what_it_can_open_and_nothing_else() -> None:
    owner = TransferConfig()
    cpu_puller = offer(TransferConfig())
    assert cpu_puller == {"hk": host_key(), "hl": ["fd"], "pp": os.getpid()}
    assert choose(cpu_puller, "cpu", 2 * MIB, owner) is Kind.FD
    assert choose(cpu_puller, "cpu", MIB - 1, owner) is None  # small: the bytes are quicker
    assert choose(cpu_puller, "cuda", 2 * MIB, owner) is None  # no GPU to open a CUDA handle on
    gpu_puller = {**cpu_puller, "hl": ["fd", "cuda"], "pp": os.getpid() + 1}
    assert choose(gpu_puller, "cuda", 16, owner) is Kind.CUDA  # any size: a GPU tensor has no cheaper way
    myself = {**gpu_puller, "pp": os.getpid()}
    assert choose(myself, "cuda", 16, owner) is None  # CUDA opens no handle of a process's own
    assert choose({**gpu_puller, "hk": "another-boot:1:2"}, "cuda", 16, owner) is None  # another host
    assert choose({**cpu_puller, "hk": host_key() + "0"}, "cpu", 2 * MIB, owner) is None  # another namespace
    assert choose({**cpu_puller, "hl": "fd"}, "cpu", 2 * MIB, owner) is None  # malformed
    assert choose({"h": "x"}, "cpu", 2 * MIB, owner) is None  # an older puller asks nothing of it
    assert choose(cpu_puller, "cpu", 2 * MIB, TransferConfig(host_local=False)) is None  # owner opted out
    assert offer(TransferConfig(host_local=False)) == {}  # puller opted out
    # CPU tensors go host-local from owners whose bytes would cross a socket; UCX's shared memory
    # already carries them, unless asked.
    assert puller_kinds(TransferConfig(), by_socket=False) == []
    assert puller_kinds(TransferConfig(host_local_cpu=True), by_socket=False) == ["fd"]
    assert puller_kinds(TransferConfig(host_local_cpu=False)) == []
    # Here (no CUDA) a puller configured for a GPU still only opens memfds.
    expected = ["fd", "cuda"] if torch.cuda.is_available() else ["fd"]
    assert puller_kinds(TransferConfig(device="cuda:0")) == expected


def _handle() -> CudaHandle:
    return CudaHandle(
        device=1, handle=bytes(range(64)), storage_bytes=4 * MIB, storage_offset=2 * MIB, offset=512,
        nbytes=MIB, event=bytes(range(64, 128)),
    )  # fmt: skip


def test_a_cuda_ipc_handle_round_trips_through_a_reply_header() -> None:
    handle = _handle()
    header = msgpack.packb(
        {"ok": True, "s": [MIB], "d": "uint8", "n": MIB, "x": handle.to_wire()}, use_bin_type=True
    )
    desc = unpack(header)["x"]
    assert desc["k"] == Kind.CUDA.value and CudaHandle.from_wire(desc) == handle


def test_the_handle_opens_with_torchs_argument_types_and_no_counter_of_the_owners() -> None:
    args = _handle().open_args(device_index=0)
    # UntypedStorage._new_shared_cuda(device, handle, size, offset, counter, counter offset, event,
    # event sync): ints, bytes and a bool, as torch checks them.
    assert [type(a) for a in args] == [int, bytes, int, int, bytes, int, bytes, bool]
    assert args[:4] == (0, bytes(range(64)), 4 * MIB, 2 * MIB)
    assert args[4] == NO_COUNTER and args[4].startswith(b"/trident-no-counter-")
    assert not os.path.exists("/dev/shm" + NO_COUNTER.decode())  # nobody made it: nothing decremented
    assert args[5:] == (0, bytes(range(64, 128)), False)  # the owner waited for the data: no event


@pytest.mark.parametrize(
    "broken",
    [{"h": None}, {"n": -1}, {"o": 4 * MIB}, {"h": b""}, {"sb": "many"}],
    ids=["no handle", "negative size", "past its storage", "empty handle", "not a number"],
)
def test_a_malformed_cuda_handle_is_refused(broken: dict) -> None:
    desc = {**_handle().to_wire(), **broken}
    with pytest.raises(TransferError):
        CudaHandle.from_wire(desc)


def test_the_bytes_of_a_tensor_are_found_at_its_storage_offset() -> None:
    """What the reader does with the opened storage, on a CPU storage: a view 5 elements into it."""
    spec = TensorSpec((4, 1000), "bfloat16", 3, offset=5)
    tensor = published(spec)
    assert tensor.storage_offset() == 5
    offset, nbytes = tensor.storage_offset() * tensor.element_size(), tensor.numel() * tensor.element_size()
    got = bytes_of_storage(tensor.untyped_storage(), offset, nbytes)
    assert torch.equal(got, as_bytes(make_tensor(spec)))


def test_the_reader_refuses_handles_it_cannot_open() -> None:
    data = torch.empty(MIB, dtype=torch.uint8)
    with pytest.raises(TransferError):
        copy(_handle().to_wire(), data, None, None)  # a CUDA handle, and no device here
    with pytest.raises(TransferError):
        copy({"k": "rdma"}, data, None, None)
    with pytest.raises(TransferError):
        copy("fd", data, None, None)


def _prepared(table: HandleTable, handle: str, request: dict) -> Lease | None:
    """`prepare`, waiting (bounded) for the job it starts, as a serving loop would."""
    for _ in range(3):
        woken = threading.Event()
        entry = table.serve(handle, woken.set)
        assert entry is not None and entry is not WAITING
        prepared = table.prepare(entry, request, woken.set)
        if prepared is not WAITING:
            return prepared  # type: ignore[return-value]
        assert woken.wait(10), "the job preparing the entry never ended"
    raise AssertionError("still not prepared")


def test_each_same_host_pull_is_lent_a_copy_that_outlives_the_release_until_it_lets_go() -> None:
    table = HandleTable()
    tensor = make_tensor(TensorSpec((2, MIB), "float32", 7))  # 8 MiB
    handle = table.put(tensor, None, ttl=None)
    assert _prepared(table, handle, {}) is None  # a puller elsewhere: its bytes stream
    first = _prepared(table, handle, offer(TransferConfig()))
    second = _prepared(table, handle, offer(TransferConfig()))
    assert isinstance(first, Lease) and isinstance(second, Lease) and first.kind is second.kind is Kind.FD
    assert first.descriptor["fd"] != second.descriptor["fd"] and table.leases == 2  # one copy each
    assert table.pop(handle) and handle not in table  # released while both hold theirs
    for lease in (first, second):
        dest = torch.empty(tensor.numel() * 4, dtype=torch.uint8)
        read_into(lease.descriptor, dest)  # still there for it
        assert torch.equal(dest, as_bytes(tensor))
    first.end()
    first.end()  # idempotent
    second.end()
    assert table.leases == 0 and table.idle_segments == 2  # back in the pool, for the next pulls
    again = table.put(tensor, None, ttl=None)
    third = _prepared(table, again, offer(TransferConfig()))
    assert third is not None and third.descriptor["fd"] in (first.descriptor["fd"], second.descriptor["fd"])
    third.end()
    table.clear()  # the backend closes
    assert open_segments() == [] and mapped_segments() == []


def test_an_expired_tensor_leaves_its_lent_copy_to_its_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("common.transfer.handles.time.monotonic", lambda: now[0])
    table = HandleTable()
    tensor = make_tensor(TensorSpec((MIB,), "int64", 8))
    handle = table.put(tensor, None, ttl=30)
    lease = _prepared(table, handle, offer(TransferConfig()))
    assert lease is not None
    now[0] += 31  # its time is up
    assert len(table) == 0 and table.leases == 1
    dest = torch.empty(tensor.numel() * 8, dtype=torch.uint8)
    read_into(lease.descriptor, dest)
    assert torch.equal(dest, as_bytes(tensor))
    lease.end()
    assert table.leases == 0
    table.clear()
    assert open_segments() == [] and mapped_segments() == []
