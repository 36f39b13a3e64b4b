"""The UCX backend's fixed parts: tags, control frames, transfer addresses, environment defaults."""

from __future__ import annotations

import base64
import os

import numpy as np
import torch

from common.transfer.errors import PeerUnreachable, TransferError
from common.transfer.liveness import ProcessId

CONTROL_TAG = 0x7472_6964_656E_7401  # "trident" + 1: requests and pings, on every worker
CONTROL_SIZE = 1024  # fixed-size control frames: a u16 length, then msgpack


def ucx_env_defaults() -> None:
    """UCX settings that must be in the environment before ucxx is imported."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    # ucxx defaults rendezvous bounce buffers to CUDA memory; on a host without a GPU use host memory.
    if not torch.cuda.is_available():
        os.environ.setdefault("UCX_RNDV_FRAG_MEM_TYPE", "host")


def frame(payload: bytes) -> np.ndarray:
    """A control message in a fixed-size buffer, since a receive must be posted before its size is known."""
    if len(payload) > CONTROL_SIZE - 2:
        raise TransferError("control message too large")
    buf = np.zeros(CONTROL_SIZE, dtype=np.uint8)
    buf[:2] = np.frombuffer(len(payload).to_bytes(2, "little"), dtype=np.uint8)
    buf[2 : 2 + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
    return buf


def unframe(buf: np.ndarray) -> bytes:
    return buf[2 : 2 + int.from_bytes(buf[:2].tobytes(), "little")].tobytes()


def format_address(worker_address: bytes, process: ProcessId | None) -> str:
    """`ucx://<worker address, base64>#<process id>`; the fragment lets peers check liveness."""
    text = "ucx://" + base64.urlsafe_b64encode(worker_address).decode()
    return text + ("#" + process.encode() if process else "")


def parse_address(address: str) -> tuple[bytes, ProcessId | None]:
    body, _, fragment = address.removeprefix("ucx://").partition("#")
    try:
        return base64.urlsafe_b64decode(body), ProcessId.decode(fragment) if fragment else None
    except ValueError:
        raise PeerUnreachable(f"bad UCX transfer address: {address[:60]!r}") from None
