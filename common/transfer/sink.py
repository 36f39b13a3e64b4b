"""Pulls whose bytes go straight where the puller keeps them, not into a tensor of their own.

A decoder keeps a request's KV in blocks scattered through its cache; pulled into a buffer, the KV
would be copied once more into those blocks, on the engine's thread. A `Sink` given to `pull`
instead of `out` is handed the bytes once, flat uint8, and copies them where it wants:

- host-local (host_local.py): straight from the owner's memory, a memfd mapped here or a CUDA
  tensor opened by IPC (its copies queued on the copy's side stream, which is waited for): one copy
  in all, on a copier thread;
- streamed: from the pool buffer the bytes landed in, on a copier thread (at most 256 KiB on the
  caller's: base.SMALL_WRITE; inline tensors too); the buffer goes back once the write is over,
  also when the pull was cancelled meanwhile.

A write that raises fails the pull (SinkRefused); a host-local one is first tried once more with
the bytes streamed, as any host-local copy that fails.
"""

from __future__ import annotations

import abc
import concurrent.futures

import torch

# Copies in flight at once (a request's KV groups come together); each is a memcpy or a device copy.
COPIERS = concurrent.futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="transfer-copy")


class Sink(abc.ABC):
    """Where one pulled tensor of `nbytes` bytes goes."""

    nbytes: int

    @abc.abstractmethod
    def write(self, source: torch.Tensor) -> None:
        """Copy `source` (the tensor's bytes, flat uint8, on the CPU or a GPU) where it belongs,
        before returning (on a GPU: queued on the current stream, which the caller waits for).
        Keeps no view of `source`. Called from a copier thread, or the caller's for small ones."""


EMPTY = torch.empty(0, dtype=torch.uint8)  # what a pull into a sink returns as its tensor

# Where a pull may write: a tensor of the caller's, a Sink, or (None) a pool buffer.
Out = torch.Tensor | Sink | None
