"""The feature index (002 §3.2's MM store): image content hash -> who holds the features.

The entry is a hash with the owner beside the encoded FeatureEntry, so an owner can delete its
own entry atomically without removing one a newer owner wrote in the meantime.
"""

from __future__ import annotations

import logging

from redis.asyncio import Redis

from common.protocol import FeatureEntry, ProtocolError, decode
from common.store.keys import Keys

log = logging.getLogger(__name__)

# Seconds an image's features stay served by their encoder, and indexed, after their last use: each
# hit (a lookup that finds them, a pull) starts the time again, so a hot image stays.
FEATURE_TTL = 600.0

# Delete the key only if it still names this owner.
_DELETE_IF_OWNER = """
if redis.call('HGET', KEYS[1], 'owner') == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


class FeatureIndex:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self._r = redis
        self._keys = keys
        self._delete_if_owner = redis.register_script(_DELETE_IF_OWNER)

    async def put(self, entry: FeatureEntry, ttl: float) -> None:
        """Publish where an image's features are; the entry expires with the owner's copy."""
        key = self._keys.feature(entry.content_hash)
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"owner": entry.ref.owner, "entry": entry.to_bytes()})
            pipe.pexpire(key, int(ttl * 1000))
            await pipe.execute()

    async def get(self, content_hash: str) -> FeatureEntry | None:
        return self._decode(await self._r.hget(self._keys.feature(content_hash), "entry"))

    async def get_many(self, content_hashes: list[str]) -> dict[str, FeatureEntry]:
        """The entries that exist, by hash (one round trip)."""
        async with self._r.pipeline(transaction=False) as pipe:
            for h in content_hashes:
                pipe.hget(self._keys.feature(h), "entry")
            raws = await pipe.execute()
        found = {h: self._decode(raw) for h, raw in zip(content_hashes, raws, strict=True)}
        return {h: e for h, e in found.items() if e is not None}

    async def touch(self, content_hash: str, ttl: float) -> bool:
        """Extend an entry's life (its features were just used); False if it is gone."""
        return bool(await self._r.pexpire(self._keys.feature(content_hash), int(ttl * 1000)))

    async def get_many_touched(self, content_hashes: list[str], ttl: float) -> dict[str, FeatureEntry]:
        """`get_many`, and each entry found lives `ttl` on from now, in the same round trip (PEXPIRE
        on a key that is not there does nothing)."""
        async with self._r.pipeline(transaction=False) as pipe:
            for h in content_hashes:
                pipe.hget(self._keys.feature(h), "entry")
                pipe.pexpire(self._keys.feature(h), int(ttl * 1000))
            raws = (await pipe.execute())[::2]
        found = {h: self._decode(raw) for h, raw in zip(content_hashes, raws, strict=True)}
        return {h: e for h, e in found.items() if e is not None}

    async def remove(self, content_hash: str, owner: str) -> bool:
        """Remove the entry if `owner` still holds it (an evicting owner calls this)."""
        return bool(await self._delete_if_owner(keys=[self._keys.feature(content_hash)], args=[owner]))

    @staticmethod
    def _decode(raw: bytes | None) -> FeatureEntry | None:
        if raw is None:
            return None
        try:
            return decode(raw, expect=FeatureEntry)
        except ProtocolError as exc:  # unreadable entry: treat as a miss, so the image is re-encoded
            log.warning("unreadable feature-index entry: %s", exc)
            return None
