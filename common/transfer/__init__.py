"""Bulk transfer of tensors between instances (features E→P, KV P→D), pulled by handle.

    backend = create_backend(TransferConfig())   # UCX when ucxx imports, else TCP
    await backend.start()
    handle = backend.publish(features)           # owner side; advertise (backend.address, handle)
    pulled = await backend.pull(address, handle) # receiver side; raises a TransferError on failure
    with pulled as tensor: ...                   # the pool buffer goes back on exit

Small tensors need no transfer at all: `share()` puts them inline in the message.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from common.protocol import InlineTensor, TensorRef, dtype_name
from common.transfer.base import (
    HandleTable,
    Pulled,
    TransferBackend,
    TransferConfig,
    TransferPath,
    write_inline,
)
from common.transfer.errors import (
    HandleNotFound,
    PeerLost,
    PeerUnreachable,
    SizeMismatch,
    TransferClosed,
    TransferError,
    TransferTimeout,
)
from common.transfer.pool import BufferPool, PoolBuffer
from common.transfer.sink import EMPTY, Sink
from common.transfer.tcp import TcpBackend

log = logging.getLogger(__name__)


def ucx_available() -> bool:
    """Whether the ucxx package and its UCX libraries load in this environment."""
    if importlib.util.find_spec("ucxx") is None:
        return False
    try:
        from common.transfer.ucx_wire import ucx_env_defaults

        ucx_env_defaults()
        import ucxx._lib.libucxx  # noqa: F401  (loads libucx; fails where the libraries are broken)
    except Exception as exc:
        log.warning("ucxx is installed but does not load (%r); using TCP", exc)
        return False
    return True


def create_backend(config: TransferConfig | None = None) -> TransferBackend:
    """The configured backend; "auto" picks UCX when it loads and TCP otherwise, and TCP (over TLS)
    whenever the deployment speaks TLS: UCX carries its bytes unencrypted."""
    config = config or TransferConfig()
    if config.tls is not None and config.backend == "ucx":
        raise ValueError(
            "the UCX transfer backend has no encryption and the deployment speaks TLS "
            "(TRIDENT_TLS_DIR): use TRIDENT_TRANSFER=tcp or auto, which moves tensors over TLS"
        )
    # ucx_available() loads UCX's libraries: asked only when "auto" has no other reason for TCP.
    if config.backend == "tcp" or (
        config.backend == "auto" and (config.tls is not None or not ucx_available())
    ):
        return TcpBackend(config)
    from common.transfer.ucx import UcxBackend

    return UcxBackend(config)


async def fetch(
    backend: TransferBackend,
    payload: InlineTensor | TensorRef,
    timeout: float | None = None,
    into: Sink | None = None,
) -> Pulled:
    """The tensor a message carries, inline or by reference; with `into`, written there (sink.py)."""
    if isinstance(payload, InlineTensor):
        tensor = payload.to_tensor()
        if into is not None:  # small (inline_max_bytes): written at once, no copier thread
            write_inline(into, tensor)
            return Pulled(EMPTY, path=TransferPath.INLINE, nbytes=into.nbytes)
        return Pulled(tensor, path=TransferPath.INLINE)
    return await backend.pull(payload.address, payload.handle, into, timeout=timeout)


def share(
    backend: TransferBackend, tensor: torch.Tensor, owner: str, ttl: float | None = None
) -> InlineTensor | TensorRef:
    """Put a tensor in a message: inline when small, else published under a handle."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes <= backend.config.inline_max_bytes:
        return InlineTensor.from_tensor(tensor)
    handle = backend.publish(tensor, ttl=ttl)
    return TensorRef(
        owner=owner,
        address=backend.address,
        handle=handle,
        shape=tuple(tensor.shape),
        dtype=dtype_name(tensor.dtype),
    )


__all__ = [
    "BufferPool",
    "HandleNotFound",
    "HandleTable",
    "PeerLost",
    "PeerUnreachable",
    "PoolBuffer",
    "Pulled",
    "Sink",
    "SizeMismatch",
    "TcpBackend",
    "TransferBackend",
    "TransferClosed",
    "TransferConfig",
    "TransferError",
    "TransferPath",
    "TransferTimeout",
    "create_backend",
    "fetch",
    "share",
    "ucx_available",
]
