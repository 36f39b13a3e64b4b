"""Routing by cached prefix, in process: the gateway's index of who holds which prefix-cache keys
(deltas in order, gaps counted, snapshots in parts replacing what was known, the silent forgotten)
and the choice it makes from it — the longest prefix wins, a queue weighs against it, and a request
with no useful prefix anywhere goes to the shared queue."""

from __future__ import annotations

import time

from common.engine.spec_prompt import spec_block_hashes
from common.protocol import Heartbeat, ImageSpec, PrefixBlocks, RequestSpec, SamplingParams
from common.roles import Role
from services.gateway import kv_routing
from services.gateway.kv_routing import PrefixIndex, PrefixRouter

BS = 16
IMAGE_TOKEN = 32000


def spec(tokens: list[int], rid: str = "r") -> RequestSpec:
    return RequestSpec(
        request_id=rid,
        prompt_token_ids=tuple(tokens),
        arrival_time=0.0,
        sampling=SamplingParams(max_tokens=4),
    )


def keys_of(tokens: list[int]) -> list[bytes]:
    return spec_block_hashes(spec(tokens), IMAGE_TOKEN, BS)


def blocks(instance: str, seq: int, gained=(), dropped=(), **kw) -> PrefixBlocks:
    return PrefixBlocks(
        instance_id=instance, seq=seq, block_size=BS, gained=tuple(gained), dropped=tuple(dropped), **kw
    )


def beat(instance: str, queue_depth: int = 0, roles=(Role.PREFILL,), draining: bool = False) -> Heartbeat:
    return Heartbeat(
        instance_id=instance, roles=roles, queue_depth=queue_depth, draining=draining, time=time.time()
    )


PROMPT = list(range(100, 100 + 20 * BS))  # 20 full blocks
KEYS = keys_of(PROMPT)


def test_deltas_apply_in_order_and_a_gap_is_counted():
    index = PrefixIndex()
    index.apply(blocks("p1", 1, gained=KEYS[:5]))
    index.apply(blocks("p1", 2, gained=KEYS[5:8], dropped=KEYS[4:5]))
    assert index.matched("p1", KEYS) == 4  # the run stops at the first key it lacks
    index.apply(blocks("p1", 4, gained=KEYS[4:5]))  # seq 3 was lost
    assert index.gaps == 1 and index.matched("p1", KEYS) == 8
    assert index.matched("nobody", KEYS) == 0


def test_a_snapshot_in_parts_replaces_what_was_known_once_whole():
    index = PrefixIndex()
    index.apply(blocks("p1", 1, gained=KEYS[10:]))  # stale: the snapshot says otherwise
    index.apply(blocks("p1", 2, snapshot=True, part=0, parts=2, gained=KEYS[:3]))
    assert index.matched("p1", KEYS) == 0, "half a snapshot changes nothing"
    index.apply(blocks("p1", 2, snapshot=True, part=1, parts=2, gained=KEYS[3:6]))
    assert index.matched("p1", KEYS) == 6
    assert index.matched("p1", KEYS[10:]) == 0
    index.apply(blocks("p1", 3, gained=KEYS[6:7]))
    assert index.gaps == 0 and index.matched("p1", KEYS) == 7


def test_an_instance_gone_from_the_registry_and_silent_is_forgotten(monkeypatch):
    index = PrefixIndex()
    index.apply(blocks("p1", 1, gained=KEYS[:2]))
    index.apply(blocks("p2", 1, gained=KEYS[:2]))
    index.forget_absent({"p2"})
    assert index.instances() == {"p1", "p2"}, "a new instance may announce before it registers"
    monkeypatch.setattr(kv_routing, "FORGET_AFTER", -1.0)
    index.forget_absent({"p2"})
    assert index.instances() == {"p2"}


def router_holding(**held: int) -> PrefixRouter:
    router = PrefixRouter(IMAGE_TOKEN, min_tokens=64, load_tokens=256)
    for instance, n in held.items():
        router.index.apply(blocks(instance, 1, gained=KEYS[:n]))
    return router


def test_the_instance_with_the_longest_prefix_is_chosen():
    router = router_holding(p1=5, p2=12, p3=0)
    choice = router.choose(spec(PROMPT), [beat("p1"), beat("p2"), beat("p3")])
    assert (choice.target, choice.reason, choice.cached_tokens) == ("p2", "prefix", 12 * BS)


def test_a_queue_outweighs_a_short_prefix_and_a_draining_holder_is_passed_over():
    router = router_holding(p1=5, p2=12)
    choice = router.choose(spec(PROMPT), [beat("p1"), beat("p2", queue_depth=3)])
    assert choice.target == "p1"  # 7 blocks saved (112 tokens) < 3 queued requests (768)
    choice = router.choose(spec(PROMPT), [beat("p1", queue_depth=4), beat("p2", queue_depth=6), beat("p3")])
    assert (choice.target, choice.reason) == (None, "load")  # an idle instance computes it sooner
    choice = router.choose(spec(PROMPT), [beat("p1", draining=True), beat("p2", draining=True), beat("p3")])
    assert (choice.target, choice.reason) == (None, "none")


def test_no_useful_prefix_goes_to_the_shared_queue():
    router = router_holding(p1=3)  # 48 tokens: under the 64 that make it worth a detour
    assert router.choose(spec(PROMPT), [beat("p1")]).reason == "none"
    assert router.choose(spec(list(range(7, 400))), [beat("p1")]).target is None
    decode_only = beat("p1", roles=(Role.DECODE,))
    assert router_holding(p1=12).choose(spec(PROMPT), [decode_only]).target is None


def decoder(instance: str, up_to: int, free_blocks: int = 1000, queue_depth: int = 0) -> Heartbeat:
    return Heartbeat(
        instance_id=instance, roles=(Role.DECODE,), prefills_up_to=up_to, free_kv_blocks=free_blocks,
        queue_depth=queue_depth, time=time.time(),
    )  # fmt: skip


def test_a_decoder_that_holds_the_history_continues_a_turn_whose_rest_is_short():
    """Decoder-side reuse: a decode instance that prefills turns (prefills_up_to) gets a turn whose
    prompt it holds all but a short rest of, when it has room for the whole request; a longer rest,
    too little room, or a prefill instance holding more goes elsewhere."""
    router = router_holding(d1=19, p1=12)  # d1 holds all but the last block's 16 tokens
    prefill = beat("p1")
    choice = router.choose(spec(PROMPT), [prefill, decoder("d1", up_to=64)])
    assert (choice.target, choice.reason, choice.cached_tokens) == ("d1", "decoder", 19 * BS)
    assert router.choose(spec(PROMPT), [prefill, decoder("d1", up_to=8)]).target == "p1"  # 16 > 8
    assert router.choose(spec(PROMPT), [prefill, decoder("d1", up_to=64, free_blocks=1)]).target == "p1"
    router = router_holding(d1=12, p1=19)
    assert router.choose(spec(PROMPT), [prefill, decoder("d1", up_to=1000)]).target == "p1"
    # A decoder that does not prefill turns (0) is never a target, whatever it holds.
    assert router_holding(d1=19).choose(spec(PROMPT), [decoder("d1", up_to=0)]).target is None


def test_the_images_wholly_inside_the_chosen_prefix_are_named_and_whether_it_encodes():
    """What routing sends around the encode stage (routing.py): the images whose placeholders all
    lie in the prefix the target holds — not one that runs past it — and whether the target holds
    the vision tower, to encode the others itself."""
    tokens = list(PROMPT)
    first, second = range(2 * BS, 5 * BS), range(9 * BS + 3, 13 * BS)  # the second ends in block 12
    for p in (*first, *second):
        tokens[p] = IMAGE_TOKEN
    images = tuple(
        ImageSpec(content_hash=h, num_tokens=len(span)) for h, span in (("cat", first), ("dog", second))
    )
    request = spec(tokens).model_copy(update={"images": images})
    held = spec_block_hashes(request, IMAGE_TOKEN, BS)
    for blocks, inside in ((12, (0,)), (13, (0, 1)), (4, ())):
        router = PrefixRouter(IMAGE_TOKEN, min_tokens=16, load_tokens=256)
        router.index.apply(PrefixBlocks(instance_id="p1", seq=1, block_size=BS, gained=tuple(held[:blocks])))
        choice = router.choose(request, [beat("p1")])
        assert (choice.target, choice.in_prefix, choice.encodes) == ("p1", inside, False), blocks
    hybrid = beat("p1", roles=(Role.ENCODE, Role.PREFILL))
    assert router.choose(request, [hybrid]).encodes
