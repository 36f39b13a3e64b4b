"""The image features an encoder serves for prefill instances to pull, bounded in bytes.

Each image's features are published once, by content hash, and kept while they are used: a pull
(each one extends a handle's sliding TTL) or a later request with the same image. Past the byte
budget the least recently used go first; FEATURE_TTL since the last use still ends an idle one.
A prefill instance that pulls an evicted image's features gets "not found" and recomputes or
re-encodes them, as for any lost features; the feature index loses the entry too (the caller
removes what `serve` reports evicted), so routing stops counting on it.

Recency is kept lazily: the order is the order of publishing (or reuse), and a candidate for
eviction that was pulled since it was last placed moves to the back instead (its handle's sliding
expiry tells when it was last served). So serving costs the transport nothing, and an eviction
is amortised O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

import torch

from common.transfer import TransferBackend


@dataclass
class _Served:
    handle: str
    nbytes: int
    seen: float  # the last use this entry was placed after (monotonic)


class ServedFeatures:
    """content hash -> published features, within `budget` bytes (the newest one always kept)."""

    def __init__(self, transfer: TransferBackend, budget: int, ttl: float) -> None:
        self.transfer = transfer
        self.budget = budget
        self.ttl = ttl
        self.bytes = 0  # bytes of features held now
        self.evictions = 0  # entries dropped for the budget, since start
        self._held: OrderedDict[str, _Served] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    def serve(
        self, content_hash: str, features: torch.Tensor, keep: Collection[str] = ()
    ) -> tuple[str, list[str]]:
        """The handle `content_hash`'s features are served under (published now unless they are
        already), and the content hashes evicted to make room for them: never one in `keep` (the
        other images of the request being handed on, whose task points to them)."""
        self.prune()
        held = self._held.get(content_hash)
        if held is not None:
            held.seen = self._last_use(held) or held.seen
            self._held.move_to_end(content_hash)
            return held.handle, []
        nbytes = features.numel() * features.element_size()
        evicted = self._make_room(nbytes, set(keep))
        handle = self.transfer.publish(features, ttl=self.ttl, sliding=True)  # each pull extends it
        self._held[content_hash] = _Served(handle, nbytes, self._last_use_of(handle) or 0.0)
        self.bytes += nbytes
        return handle, evicted

    def prune(self) -> None:
        """Forget the entries at the front whose handles expired (idle for the TTL)."""
        while self._held:
            content_hash, held = next(iter(self._held.items()))
            if self._last_use(held) is not None:
                return
            self._forget(content_hash)

    def _make_room(self, nbytes: int, keep: set[str]) -> list[str]:
        evicted: list[str] = []
        for _ in range(2 * len(self._held)):  # each entry moves back at most once, then goes
            if self.bytes + nbytes <= self.budget or not self._held:
                break
            content_hash, held = next(iter(self._held.items()))
            used = self._last_use(held)
            if content_hash in keep or (used is not None and used > held.seen):  # to the back
                held.seen = max(used or 0.0, held.seen)
                self._held.move_to_end(content_hash)
                continue
            self._forget(content_hash)
            if used is not None:  # still served: evicted for the budget, not idle
                self.transfer.release(held.handle)
                self.evictions += 1
                evicted.append(content_hash)
        return evicted

    def _forget(self, content_hash: str) -> None:
        held = self._held.pop(content_hash)
        self.bytes -= held.nbytes

    def _last_use(self, held: _Served) -> float | None:
        return self._last_use_of(held.handle)

    def _last_use_of(self, handle: str) -> float | None:
        """When the handle was last served or published; None once it is gone (expired)."""
        return self.transfer.handles.last_use(handle)
