"""Is a puller on this host, and which host-local way may a tensor take to it?

A pull asks for a host-local copy by sending its host key and the kinds of handle it can open; the
owner compares the key with its own and, where they match and the tensor suits a kind the puller
named, answers with a handle to its memory instead of the bytes (host_local.py). The key is the
kernel's boot id and this process's IPC and pid namespaces: two processes with the same key run on
one machine, where a CUDA IPC handle can be opened (same IPC namespace) and another process's file
descriptor reached through /proc (same pid namespace). Containers without a shared IPC or pid
namespace, another boot, another machine: the keys differ and the bytes stream as before.
"""

from __future__ import annotations

import functools
import os
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.transfer.config import TransferConfig


class Kind(StrEnum):
    """How a same-host puller reaches the owner's memory."""

    FD = "fd"  # a CPU tensor in an anonymous shared-memory file (memfd), mapped through /proc
    CUDA = "cuda"  # a CUDA tensor, opened by CUDA IPC on the puller's GPU


class TransferPath(StrEnum):
    """How a pulled tensor travelled (Pulled.path, the transfer metrics)."""

    INLINE = "inline"  # inside the message: nothing pulled
    STREAM = "stream"  # its bytes over the transport (TCP, or UCX)
    HOST_LOCAL = "host_local"  # copied from the owner's memory on this host (fd or CUDA IPC)


@functools.cache
def host_key() -> str:
    """`<boot id>:<IPC namespace>:<pid namespace>`, or "" where /proc cannot say (no host-local path)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        ipc = os.stat("/proc/self/ns/ipc").st_ino
        pid = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}:{ipc}:{pid}"


def puller_kinds(config: TransferConfig, by_socket: bool = True) -> list[str]:
    """The kinds of handle this process asks for, as its pulls name them (none: never host-local).
    `by_socket`: the owner's bytes would cross a socket (TCP), not UCX's shared memory."""
    if not config.host_local or not host_key():
        return []
    kinds = []
    cpu = by_socket if config.host_local_cpu is None else config.host_local_cpu
    if cpu and hasattr(os, "memfd_create"):
        kinds.append(Kind.FD.value)
    if config.device is not None and config.device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            kinds.append(Kind.CUDA.value)
    return kinds


def offer(config: TransferConfig, by_socket: bool = True) -> dict[str, object]:
    """The fields a pull request adds to ask for a host-local copy; empty when it cannot take one."""
    kinds = puller_kinds(config, by_socket)
    return {"hk": host_key(), "hl": kinds, "pp": os.getpid()} if kinds else {}


def choose(request: dict, device_type: str, nbytes: int, config: TransferConfig) -> Kind | None:
    """The owner's choice for one pull of a tensor on `device_type` of `nbytes`: a host-local kind,
    or None for the byte stream. A CUDA tensor goes by CUDA IPC to a same-host puller with a GPU
    (never to this very process: CUDA cannot open its own handles); a CPU one by shared memory
    when it is big enough that mapping beats a few socket copies."""
    key = host_key()
    if not config.host_local or not key or request.get("hk") != key:
        return None
    kinds = request.get("hl")
    if not isinstance(kinds, list):
        return None
    if device_type == "cuda":
        return Kind.CUDA if Kind.CUDA.value in kinds and request.get("pp") != os.getpid() else None
    if device_type == "cpu" and Kind.FD.value in kinds and nbytes >= config.host_local_min_bytes:
        return Kind.FD
    return None
