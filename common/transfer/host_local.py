"""The puller's side of a host-local pull, the same over TCP and UCX: where the tensor lands, and
the copy from the owner's memory, on a thread of its own (a GiB of KV must not stall an event loop
or the UCX thread).

The copy is never abandoned half way: the owner frees its memory once the puller's connection
drops (or its acknowledgement comes), so a cancelled pull lets the copy finish before it lets the
connection go, and only then gives its pool buffer back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from common.transfer import shm
from common.transfer.base import Landing, destination
from common.transfer.errors import TransferError
from common.transfer.same_host import Kind
from common.transfer.sink import COPIERS, Out

if TYPE_CHECKING:
    from common.transfer.base import TransferBackend


def landing(backend: TransferBackend, header: dict, out: Out) -> Landing:
    """Where a host-local copy writes: `out` (a tensor, or a Sink handed the owner's bytes), else
    a CUDA tensor on the puller's device for a CUDA source, else a pool buffer."""
    cuda = isinstance(header.get("x"), dict) and header["x"].get("k") == Kind.CUDA.value
    device = backend.config.device if cuda else None
    return destination(backend.pool, tuple(header["s"]), str(header["d"]), out, host=False, device=device)


def copy(
    desc: object,
    data: torch.Tensor | Callable[[torch.Tensor], None],
    device: str | None,
    on_mapped: Callable[[], None] | None,
) -> None:
    """Copy the memory `desc` names into `data` (flat uint8), or hand it to `data(source)` (a
    Sink's write), on the calling thread. Raises when it cannot be opened or read from here."""
    if not isinstance(desc, dict):
        raise TransferError("a host-local reply without a handle")
    kind = desc.get("k")
    if kind == Kind.FD.value:
        shm.read_into(desc, data, on_mapped)
    elif kind == Kind.CUDA.value:
        from common.transfer.cuda_ipc import CudaHandle, copy_from

        if device is None:
            raise TransferError("a CUDA IPC handle, and no CUDA device to open it on")
        cuda_dest = isinstance(data, torch.Tensor) and data.device.type == "cuda"
        target = data.device if cuda_dest else torch.device(device)
        if target.index is None:  # "cuda": the current device
            target = torch.device("cuda", torch.cuda.current_device())
        copy_from(CudaHandle.from_wire(desc), data, target, on_mapped)
    else:
        raise TransferError(f"unknown kind of host-local handle: {kind!r}")


def start(backend: TransferBackend, header: dict, spot: Landing) -> concurrent.futures.Future[None]:
    """Begin the copy of a host-local reply into `spot` on a copier thread."""
    dest = spot.sink.write if spot.sink is not None else spot.data
    return COPIERS.submit(copy, header.get("x"), dest, backend.config.device, backend.on_mapped)


async def copied(
    job: concurrent.futures.Future[None], spot: Landing, when_over: Callable[[], None]
) -> str | None:
    """Wait for a copy: None once done, or why it failed (the handle could not be opened or read
    here: the caller acknowledges so and asks for the bytes). Cancelled meanwhile: once the copy
    stops, `spot`'s pool buffer goes back and `when_over()` lets the owner's memory go."""
    waited = asyncio.wrap_future(job)
    try:
        await asyncio.shield(waited)
    except asyncio.CancelledError:

        def over(_: object) -> None:
            spot.abandon()
            when_over()

        job.add_done_callback(over)
        raise
    except Exception as exc:  # opening failed (another namespace, no permission, no peer access)
        return f"{type(exc).__name__}: {exc}"
    return None
