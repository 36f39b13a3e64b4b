"""A tensor owner in a child process, for the two-process tests and the benchmark.

The child publishes deterministic tensors (the same seed gives the same bytes in any process),
reports its address and handles, and serves until told to stop, or until it is killed to see
what a puller does when its owner dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from types import TracebackType
from typing import ClassVar, Self

import torch

from common.protocol.tensors import torch_dtype


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str
    seed: int
    device: str = "cpu"  # where the owner keeps it ("cuda:0": a GPU tensor, pulled by CUDA IPC)
    # Published as a view this many elements into a larger tensor (a storage offset to honour).
    offset: int = 0
    # On a GPU: published with this many pairs of XORs over its bytes still queued behind it (its
    # bytes are right only once they have run).
    busy: int = 0


def make_tensor(spec: TensorSpec) -> torch.Tensor:
    """Deterministic contents: random bytes from `seed`, viewed as `dtype` (any bit pattern is fine,
    since comparisons are bytewise)."""
    dtype = torch_dtype(spec.dtype)
    numel = 1
    for d in spec.shape:
        numel *= d
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(spec.seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(spec.shape)


def published(spec: TensorSpec) -> torch.Tensor:
    """`make_tensor(spec)` where the owner keeps it: on its device, `offset` elements into a larger
    tensor when asked (the same bytes either way)."""
    tensor = make_tensor(spec)
    if spec.offset:
        flat = tensor.reshape(-1)
        padded = torch.cat(
            [torch.zeros(spec.offset, dtype=flat.dtype), flat, torch.zeros(3, dtype=flat.dtype)]
        )
        tensor = padded.to(spec.device)[spec.offset : spec.offset + flat.numel()].view(tensor.shape)
    tensor = tensor.to(spec.device)
    raw = tensor.view(-1).view(torch.uint8)
    for _ in range(spec.busy):
        raw.bitwise_xor_(0x5A)
        raw.bitwise_xor_(0x5A)
    return tensor


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-identical (NaN payloads included), regardless of dtype."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


class OwnerProcess:
    """Starts an owner; `address` and `handles` are set once `start()` returns.

    The owner is a fresh interpreter (spawned) unless `context` names another multiprocessing
    context: the tests start theirs from a forkserver that has imported torch already."""

    context: ClassVar[BaseContext | None] = None

    def __init__(self, backend: str, specs: list[TensorSpec], env: dict[str, str] | None = None) -> None:
        self.backend = backend
        self.specs = specs
        self.env = env or {}
        self.address = ""
        self.handles: list[str] = []
        self._conn: Connection | None = None
        self._proc: mp.process.BaseProcess | None = None

    def start(self, timeout: float = 60.0) -> None:
        ctx = self.context or mp.get_context("spawn")
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_owner_main, args=(self.backend, self.specs, self.env, child), daemon=True
        )
        self._proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(timeout):
            self.kill()
            raise RuntimeError("owner process did not start")
        self.address, self.handles = parent.recv()

    def release(self, handle: str) -> bool:
        return bool(self._ask("release", handle))

    def reserve(self) -> str:
        """A handle the owner advertises before it has the tensor (`fill` gives it one)."""
        return str(self._ask("reserve", ""))

    def fill(self, handle: str, spec: TensorSpec) -> bool:
        """Fill a reserved handle with `spec`'s tensor, from a thread other than the serving loop's,
        as a prefill engine's thread fills streamed KV."""
        return bool(self._ask("fill", (handle, spec)))

    def stats(self) -> dict[str, int]:
        """What the owner holds now: handles, same-host readers' leases, bytes kept on a GPU, and
        (with CUDA) the bytes its caching allocator has handed out."""
        return dict(self._ask("stats", ""))  # type: ignore[call-overload]

    def publish(self, spec: TensorSpec) -> str:
        return str(self._ask("publish", spec))

    def republish(self) -> list[str]:
        """Release the start-up tensors' handles and publish the same tensors afresh: each pull of
        the new handles is a first one (a GPU tensor shared, or moved to host, anew), as a request's
        KV is pulled once."""
        self.handles = list(self._ask("republish", ""))  # type: ignore[call-overload]
        return self.handles

    def _ask(self, op: str, arg: object) -> object:
        assert self._conn is not None
        self._conn.send((op, arg))
        return self._conn.recv()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def kill(self) -> None:
        """SIGKILL the owner: a crash, with no chance to close anything."""
        if self._proc is not None and self._proc.is_alive() and self._proc.pid is not None:
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.join(10)

    def stop(self) -> None:
        if self._proc is None:
            return
        if self._proc.is_alive() and self._conn is not None:
            with contextlib.suppress(OSError):  # the child may be gone already
                self._conn.send(("stop", ""))
            self._proc.join(15)
        if self._proc.is_alive():
            self.kill()
        if self._conn is not None:
            self._conn.close()
        self._proc = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


CLONE_NEWIPC = 0x08000000


def _owner_main(backend: str, specs: list[TensorSpec], env: dict[str, str], conn: Connection) -> None:
    os.environ.update(env)
    if env.get("TRIDENT_NETNS"):  # another "host" (bench/transfer.py across namespaces)
        from common.infra import netns

        netns.enter(env["TRIDENT_NETNS"])
    if env.get("TRIDENT_TEST_NEW_IPC_NS"):  # a container without the host's IPC namespace
        import ctypes

        if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWIPC) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWIPC)")
    if env.get("TRIDENT_TEST_NOT_DUMPABLE"):  # only a peer with CAP_SYS_PTRACE may open its /proc/<pid>/fd
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    asyncio.run(_serve(backend, specs, conn))


async def _serve(backend_name: str, specs: list[TensorSpec], conn: Connection) -> None:
    from common.tls import tls_from_env
    from common.transfer import TransferConfig, create_backend

    # From the owner's env (OwnerProcess(env=...)).
    secret = os.environ.get("TRIDENT_TRANSFER_SECRET", "")
    host = os.environ.get("TRIDENT_BIND_HOST", "127.0.0.1")
    host_local = os.environ.get("TRIDENT_TRANSFER_HOST_LOCAL", "1") not in ("0", "false")
    device_bytes = int(os.environ.get("TRIDENT_TRANSFER_DEVICE_BYTES", 4 << 30))
    config = TransferConfig(
        backend=backend_name, secret=secret, host=host, tls=tls_from_env(), host_local=host_local,  # type: ignore[arg-type]
        device_bytes=device_bytes,
    )  # fmt: skip
    backend = create_backend(config)
    await backend.start()
    tensors = [published(s) for s in specs]
    handles = [backend.publish(t) for t in tensors]
    await asyncio.to_thread(conn.send, (backend.address, handles))
    try:
        while True:
            op, arg = await asyncio.to_thread(conn.recv)
            if op == "stop":
                return
            if op == "release":
                await asyncio.to_thread(conn.send, backend.release(arg))
            elif op == "reserve":
                await asyncio.to_thread(conn.send, backend.reserve())
            elif op == "fill":
                handle, spec = arg
                filled = await asyncio.to_thread(backend.fill, handle, published(spec))
                await asyncio.to_thread(conn.send, filled)
            elif op == "publish":
                await asyncio.to_thread(conn.send, backend.publish(published(arg)))
            elif op == "stats":
                await asyncio.to_thread(conn.send, _stats(backend))
            elif op == "republish":
                for handle in handles:
                    backend.release(handle)
                handles = [backend.publish(t) for t in tensors]
                await asyncio.to_thread(conn.send, handles)
    except EOFError:
        return  # the parent went away
    finally:
        await backend.close()


def _stats(backend) -> dict[str, int]:  # type: ignore[no-untyped-def]
    stats = {
        "handles": len(backend.handles), "leases": backend.handles.leases,
        "device_bytes": backend.handles.device_bytes, "idle_segments": backend.handles.idle_segments,
    }  # fmt: skip
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        stats["cuda_allocated"] = torch.cuda.memory_allocated()
    return stats
