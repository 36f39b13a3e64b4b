"""Typed transfer failures. Nearly every one means "recompute": the caller need not tell them apart
to recover, but the type says why, for logs and metrics. Two say the bytes do not fit where the
caller wanted them (SizeMismatch, SinkRefused): pulling them again would not help."""

from __future__ import annotations


class TransferError(RuntimeError):
    """Base of every bulk-transfer failure."""


class PeerUnreachable(TransferError):
    """The owner cannot be reached at all (gone, wrong address, nothing listening)."""


class PeerLost(TransferError):
    """The connection to the owner broke during a transfer (it died, or closed on us)."""


class HandleNotFound(TransferError):
    """The owner does not hold this handle: never published, released, or expired."""


class TransferTimeout(TransferError):
    """The transfer did not finish within its deadline."""


class SizeMismatch(TransferError):
    """The caller's destination buffer does not match the tensor's size."""


class SinkRefused(TransferError):
    """The bytes came, and the caller's Sink could not write them where it keeps them (sink.py)."""


class Forbidden(TransferError):
    """The owner refused the pull: it asks for the deployment's transfer secret, and this was not it."""


class TransferClosed(TransferError):
    """The local backend was closed while the transfer was in flight."""


# Codes for failures the owner reports in its reply header.
ERROR_CODES: dict[str, type[TransferError]] = {
    "not_found": HandleNotFound,
    "size_mismatch": SizeMismatch,
    "bad_request": TransferError,
    "forbidden": Forbidden,
}


def error_from_code(code: str, message: str) -> TransferError:
    """The exception for an owner's error reply."""
    return ERROR_CODES.get(code, TransferError)(message)
