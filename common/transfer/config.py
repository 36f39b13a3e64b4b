"""Transfer settings, shared by both backends and the owner's handle table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from common.tls import Tls


@dataclass(frozen=True)
class TransferConfig:
    """Transfer settings; `backend="auto"` takes UCX when ucxx imports, else TCP."""

    backend: Literal["auto", "ucx", "tcp"] = "auto"
    host: str = "127.0.0.1"  # where the TCP server binds; "0.0.0.0" for other hosts
    advertise_host: str | None = None  # the host others dial, when it differs from `host`
    port: int = 0
    timeout: float = 10.0  # default deadline of one pull
    max_cached_bytes: int = 1 << 30  # idle pool buffers kept for reuse
    # UCX transports. Not cma: with UCX error handling off (needed for shared memory at all) a
    # peer that dies during a cma read aborts the reader's process. See docs/substrate.md.
    ucx_tls: str = "^cma"
    # While a UCX pull waits, ping the owner this often; a dead owner fails the ping at once.
    probe_interval: float = 0.25
    inline_max_bytes: int = 256 * 1024  # smaller tensors ride inside the NATS message
    # Sent with every pull, and asked of every puller: a client without it gets nothing. Empty: open.
    secret: str = ""
    # The deployment's certificates: TCP transfers go over mutual TLS (UCX has no encryption, so
    # "auto" then picks TCP, and "ucx" is refused).
    tls: Tls | None = None
    # Host-local pulls (same_host.py): a puller on this host copies straight from the owner's
    # memory (shared memory for CPU tensors, CUDA IPC for GPU ones) instead of taking the bytes
    # over the transport. Off on either side: the bytes stream.
    host_local: bool = True
    # CPU tensors too (through a memfd), from owners whose bytes would otherwise cross a socket (TCP);
    # None: so, but not from UCX owners, whose shared-memory transport already pipelines the two
    # copies that a memfd makes one after the other. True: from any owner (the tests, on UCX).
    host_local_cpu: bool | None = None
    host_local_min_bytes: int = 1 << 20  # CPU tensors smaller than this stream (a copy costs more)
    # The CUDA device this process pulls GPU tensors onto (its engine's); None: it opens no CUDA
    # IPC handle, and GPU tensors reach it through host memory.
    device: str | None = None
    # Published CUDA tensors stay on their GPU, for host-local pullers, up to this many bytes in all;
    # past it the oldest are moved to host memory (0: every tensor is served from host memory).
    device_bytes: int = 4 << 30
