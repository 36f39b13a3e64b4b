"""Image features kept by content hash, so a repeated image is not encoded again (LRU, byte cap)."""

from __future__ import annotations

from collections import OrderedDict

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class FeatureCache:
    """LRU map content hash → projected image features [num_image_tokens, hidden]."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        """The features for `key`, refreshed as most recently used; None on a miss."""
        features = self._entries.get(key)
        if features is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return features

    def put(self, key: str, features: torch.Tensor) -> bool:
        """Insert, evicting least recently used entries; False if it can never fit."""
        size = tensor_bytes(features)
        if size > self.capacity_bytes:
            return False
        self.pop(key)
        while self.used_bytes + size > self.capacity_bytes:
            self.pop(next(iter(self._entries)))
        self._entries[key] = features
        self.used_bytes += size
        return True

    def pop(self, key: str) -> torch.Tensor | None:
        features = self._entries.pop(key, None)
        if features is not None:
            self.used_bytes -= tensor_bytes(features)
        return features

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        return list(self._entries)

    def check_integrity(self) -> None:
        """The byte count matches the entries and stays within the cap."""
        total = sum(tensor_bytes(t) for t in self._entries.values())
        assert total == self.used_bytes, f"tracked {self.used_bytes} bytes, holds {total}"
        assert self.used_bytes <= self.capacity_bytes, "over capacity"
