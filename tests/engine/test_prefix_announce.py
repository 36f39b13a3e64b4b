"""What a prefill instance tells the cluster of its prefix cache (block_manager's change journal),
and the keys a gateway computes for a request it has not sent yet (spec_prompt.py): the same keys
the engine files the request's blocks under, images included — or routing by prefix finds nothing."""

from __future__ import annotations

from common.engine.block_manager import BlockManager
from common.engine.sampling import SamplingParams
from common.engine.spec_prompt import spec_block_hashes
from common.protocol import ImageSpec, RequestSpec
from common.protocol import SamplingParams as WireSampling


def test_the_journal_says_what_became_findable_and_what_was_given_up():
    blocks = BlockManager(4, 2, caching=True)
    blocks.allocate("a", 8)
    blocks.remember("a", [b"k0", b"k1"])
    assert blocks.take_changes() == ([], []), "unwatched, nothing is kept"
    blocks.watch_changes()
    blocks.remember("a", [b"k0", b"k1", b"k2", b"k3"])
    assert blocks.take_changes() == ([b"k2", b"k3"], [])
    assert blocks.take_changes() == ([], [])
    blocks.free("a")  # all four cached, owned by nobody
    blocks.allocate("b", 4)  # takes two: a prompt's last blocks are given up first
    assert blocks.take_changes() == ([], [b"k3", b"k2"])
    assert sorted(blocks.cached_hashes()) == [b"k0", b"k1"]
    blocks.free("b")
    blocks.check_integrity()


def test_a_key_found_then_given_up_within_one_period_is_reported_by_its_state_now():
    blocks = BlockManager(2, 2, caching=True)
    blocks.watch_changes()
    blocks.allocate("a", 4)
    blocks.remember("a", [b"x", b"y"])
    blocks.free("a")
    blocks.allocate("b", 4)  # both given up again
    gained, dropped = blocks.take_changes()
    assert gained == [] and sorted(dropped) == [b"x", b"y"]


def test_a_gateway_computes_the_keys_the_engine_files_a_request_under(make_engine, images):
    engine = make_engine()
    prompt = engine.chat_prompt("What is in the picture? Tell me a long story about it", 1)
    processed = engine.processor.process(prompt, images[:1])
    engine.generate([prompt], [images[:1]], SamplingParams(max_tokens=2))
    spec = RequestSpec(
        request_id="r", prompt_token_ids=tuple(processed.token_ids), arrival_time=0.0,
        sampling=WireSampling(max_tokens=2),
        images=tuple(
            ImageSpec(content_hash=i.content_hash, num_tokens=i.num_tokens, grid_thw=i.grid_thw,
                      image_size=i.image_size)
            for i in processed.images
        ),
    )  # fmt: skip
    size = engine.blocks.block_size
    keys = spec_block_hashes(spec, engine.processor.image_token_id, size)
    assert len(keys) == len(processed.token_ids) // size > 2
    assert set(keys[:-1]) <= set(engine.blocks.cached_hashes())  # every full block of the prompt but
    # the last, which may end on the first output token's position, was filed under these keys
    other = spec.model_copy(update={"images": (spec.images[0].model_copy(update={"content_hash": "other"}),)})
    assert not set(spec_block_hashes(other, engine.processor.image_token_id, size)) & set(keys[1:])
