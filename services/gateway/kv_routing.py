"""Routing by cached prefix (issue 26): a request goes to the prefill instance that holds the
longest run of its prompt's prefix-cache keys, when the tokens that saves outweigh the requests
queued there; otherwise to the shared queue, as every request without a useful prefix does.

Instances announce the keys they gain and give up (services/worker/kv_announce.py); `PrefixIndex`
keeps them per instance. A delta applies in order; a snapshot (every few seconds, in parts when
large) replaces what an instance is known to hold, so a lost delta or a gateway started late is
healed within one snapshot period. An instance gone from the registry is forgotten. A request's
own keys are computed as the prefill instance will compute them (common/engine/spec_prompt.py).

Sending to one instance never strands a request: its task waits in that instance's mailbox at
most `kv_routing_take_back` seconds before the gateway moves it to the shared queue
(common/dispatch.py), and the failover hands on a dead instance's mailbox with the rest."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from common.engine.spec_prompt import spec_block_hashes, spec_image_spans
from common.protocol import Heartbeat, PrefixBlocks, RequestSpec
from common.roles import Role

log = logging.getLogger(__name__)
FORGET_AFTER = 15.0  # seconds an instance absent from the registry keeps its entry (it may be new)
# What /metrics counts routing decisions by: sent to a prefill instance for its prefix; to a decode
# instance that continues the conversation (it holds the history and prefills the rest itself);
# to the shared queue for load, or with no useful prefix; taken back from a mailbox.
REASONS = ("prefix", "decoder", "load", "none", "fallback")


@dataclass
class _Held:
    block_size: int
    keys: set[bytes] = field(default_factory=set)
    seq: int = 0
    heard: float = 0.0  # monotonic time of its last message
    parts: dict[int, tuple[int, dict[int, tuple[bytes, ...]]]] = field(default_factory=dict)  # snapshots


class PrefixIndex:
    """Which prefix-cache keys each instance holds, as it announced them."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        self.gaps = 0  # deltas found missing (healed by the next snapshot)

    def apply(self, msg: PrefixBlocks) -> None:
        held = self._held.get(msg.instance_id)
        if held is None or held.block_size != msg.block_size:
            held = self._held[msg.instance_id] = _Held(msg.block_size)
        held.heard = time.monotonic()
        if msg.snapshot:
            parts = held.parts.setdefault(msg.seq, (msg.parts, {}))[1]
            parts[msg.part] = msg.gained
            if len(parts) == msg.parts:  # whole: it replaces what was known, older halves dropped
                held.keys = {k for chunk in parts.values() for k in chunk}
                held.seq = msg.seq
                held.parts = {s: p for s, p in held.parts.items() if s > msg.seq}
            return
        if held.seq and msg.seq != held.seq + 1:
            self.gaps += 1
        held.seq = msg.seq
        held.keys.difference_update(msg.dropped)
        held.keys.update(msg.gained)

    def matched(self, instance_id: str, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, the instance holds."""
        held = self._held.get(instance_id)
        if held is None:
            return 0
        n = 0
        for key in keys:
            if key not in held.keys:
                break
            n += 1
        return n

    def block_size(self, instance_id: str) -> int | None:
        held = self._held.get(instance_id)
        return held.block_size if held is not None else None

    def instances(self) -> set[str]:
        return set(self._held)

    def size(self) -> int:
        """Keys known, over all instances."""
        return sum(len(h.keys) for h in self._held.values())

    def forget_absent(self, live: set[str]) -> None:
        """Drop the instances not in `live` that have been silent for FORGET_AFTER seconds."""
        now = time.monotonic()
        gone = [i for i, h in self._held.items() if i not in live and now - h.heard > FORGET_AFTER]
        for instance_id in gone:
            del self._held[instance_id]


@dataclass
class Choice:
    target: str | None  # the instance to send the request to; None: the shared queue
    reason: str  # one of REASONS
    cached_tokens: int = 0  # what the target is expected to find in its cache
    # The request's images wholly inside that cached prefix: their KV is there, so they need
    # neither encoding nor features (routing.py routes them around the encode stage).
    in_prefix: tuple[int, ...] = ()
    encodes: bool = False  # whether the target holds the vision tower (EP, EPD): it encodes the rest


class PrefixRouter:
    """Chooses where a request's prefill goes, from the index and the instances' heartbeats."""

    def __init__(self, placeholders: int | tuple[int, ...], min_tokens: int, load_tokens: int) -> None:
        self.index = PrefixIndex()
        self.placeholders = placeholders  # the model's image (and video) pad tokens
        self.min_tokens = min_tokens
        self.load_tokens = load_tokens

    def choose(self, spec: RequestSpec, beats: list[Heartbeat]) -> Choice:
        live = [hb for hb in beats if hb.kind == "worker" and not hb.draining]
        prefills = [hb for hb in live if Role.PREFILL in hb.roles]
        # Decode instances that continue conversations: for a turn whose uncached rest is short.
        decoders = [hb for hb in live if Role.PREFILL not in hb.roles and hb.prefills_up_to > 0]
        if not prefills and not decoders:
            return Choice(None, "none")
        prompt = len(spec.prompt_token_ids)
        chains: dict[int, list[bytes]] = {}
        best: tuple[float, int, Heartbeat, str] | None = None  # (cost, cached tokens, instance, reason)
        for hb in prefills + decoders:
            size = self.index.block_size(hb.instance_id)
            if size is None:
                continue
            if size not in chains:
                chains[size] = spec_block_hashes(spec, self.placeholders, size)
            cached = min(self.index.matched(hb.instance_id, chains[size]) * size, prompt - 1)
            if cached < self.min_tokens:
                continue
            reason = "prefix"
            if Role.PREFILL not in hb.roles:  # a decoder: a short rest, and room for the whole request
                need = -(-(prompt - cached + spec.sampling.max_tokens) // size)
                if prompt - cached > hb.prefills_up_to or need > hb.free_kv_blocks:
                    continue
                reason = "decoder"
            cost = prompt - cached + self.load_tokens * self._load(hb)
            # At equal cost the decoder: its KV then never moves between instances.
            if best is None or cost < best[0] or (cost == best[0] and reason == "decoder"):
                best = (cost, cached, hb, reason)
        if best is None:
            return Choice(None, "none")
        if prefills:
            shared = prompt + self.load_tokens * min(self._load(hb) for hb in prefills)
            if best[0] >= shared:
                return Choice(None, "load", 0)
        _, cached, hb, reason = best
        spans = spec_image_spans(spec, self.placeholders)
        inside = tuple(i for i, (_, end) in enumerate(spans) if end <= cached)
        return Choice(hb.instance_id, reason, cached, inside, Role.ENCODE in hb.roles)

    def _load(self, hb: Heartbeat) -> int:
        """Requests waiting at the instance, as its last heartbeat says."""
        return hb.queue_depth
