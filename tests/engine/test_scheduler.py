"""Which requests run in which iteration, for each policy, on scripted scenarios (no model)."""

from __future__ import annotations

import pytest

from common.engine.block_manager import BlockManager
from common.engine.config import EngineConfig, Policy
from common.engine.scheduler import Scheduler
from common.roles import Role
from tests.helpers.scheduling import complete, names, req


def make(policy: Policy, tokens: int = 10, images: int = 2, blocks: int = 64, roles=None) -> Scheduler:
    cfg = EngineConfig(policy=policy, token_budget=tokens, image_budget=images, block_size=4)
    if roles:
        cfg = EngineConfig(policy=policy, token_budget=tokens, image_budget=images, block_size=4, roles=roles)
    return Scheduler(cfg, BlockManager(blocks, 4))


def run(s: Scheduler, steps: int) -> list[dict]:
    out = []
    for _ in range(steps):
        b = s.schedule()
        out.append(names(b))
        complete(b)
    return out


def scenario(s: Scheduler) -> list[dict]:
    """A decoding request, a 3-image request and a long text request arrive together."""
    d = req("d", 4)
    s.add(d)
    complete(s.schedule())  # d prefilled: now it decodes
    for r in (req("img", 6, images=3), req("txt", 14)):
        s.add(r)
    return run(s, 4)


def test_stage_policy_follows_algorithm_1():
    steps = scenario(make(Policy.STAGE))
    # Decodes first; then new work, prefill-ready requests before image ones: txt fills τt with a
    # chunk, which spends the iteration's limit, so no image is encoded beside it.
    assert steps[0] == {"encode": [], "prefill": [("txt", 9)], "decode": ["d"]}
    # Continuing work: the rest of txt's prompt. 6 of τt = 10 tokens leave 0.8 of an image: none.
    assert steps[1] == {"encode": [], "prefill": [("txt", 5)], "decode": ["d"]}
    # Two decodes leave 8/10 of the limit: one image of τe = 2; img cannot prefill while encoding.
    assert steps[2] == {"encode": [("img", 1)], "prefill": [], "decode": ["d", "txt"]}
    assert steps[3] == {"encode": [("img", 1)], "prefill": [], "decode": ["d", "txt"]}


def test_images_and_tokens_share_the_iteration_limit_where_both_run_in_one():
    """τe and τt are each a whole iteration's worth: together, images/τe + tokens/τt ≤ 1."""
    for roles in (frozenset(Role), frozenset({Role.ENCODE, Role.PREFILL})):
        s = make(Policy.STAGE, tokens=24, images=3, blocks=512, roles=roles)
        reqs = [r for i in range(4) for r in (req(f"img{i}", 5, images=1 + i % 3), req(f"txt{i}", 9 + 4 * i))]
        for r in reqs:
            s.add(r)
        mixed = 0
        for _ in range(30):
            b = s.schedule()
            complete(b)
            assert b.num_images * 24 + b.num_tokens * 3 <= 24 * 3
            mixed += bool(b.encodes and b.prefills)
        assert mixed, "no iteration held both an encode and a prefill chunk"
        assert all(r.output_token_ids for r in reqs), "a request never finished its prefill"
    # Where an iteration runs only one of them, each budget is the whole limit.
    p = make(Policy.STAGE, tokens=12, images=3, roles=frozenset({Role.PREFILL, Role.DECODE}))
    p.add(req("long", 30))
    assert names(p.schedule())["prefill"] == [("long", 12)]


def test_prefill_first_runs_whole_prefills_before_any_decode():
    steps = scenario(make(Policy.PREFILL_FIRST))
    # Whole prompts, images encoded inline, decodes wait: img (6) fits τt, txt (14) does not fit after it.
    assert steps[0] == {"encode": [("img", 3)], "prefill": [("img", 6)], "decode": []}
    assert steps[1] == {"encode": [], "prefill": [("txt", 14)], "decode": []}
    assert steps[2] == {"encode": [], "prefill": [], "decode": ["d", "img", "txt"]}


def test_decode_first_chunks_prefill_behind_decodes_with_inline_encode():
    steps = scenario(make(Policy.DECODE_FIRST))
    # All 3 images are encoded inline (no image budget) and img's prefill starts in the same iteration.
    assert steps[0] == {"encode": [("img", 3)], "prefill": [("img", 6), ("txt", 3)], "decode": ["d"]}
    # Two decodes leave 8 of τt = 10 for the rest of txt's 14-token prompt.
    assert steps[1] == {"encode": [], "prefill": [("txt", 8)], "decode": ["d", "img"]}
    assert steps[2] == {"encode": [], "prefill": [("txt", 3)], "decode": ["d", "img"]}


def test_new_prefills_wait_in_order_when_kv_is_short():
    s = make(Policy.STAGE, tokens=64, blocks=5)
    for r in (req("a", 12), req("b", 12), req("c", 2)):
        s.add(r)
    first = names(s.schedule())
    # a takes 3 blocks; b needs 3 of the 2 left and c, though it would fit, must not overtake b.
    assert first["prefill"] == [("a", 12)]
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_decode_out_of_blocks_preempts_the_newest_request():
    s = make(Policy.STAGE, tokens=64, blocks=4)
    a, b = req("a", 8), req("b", 7)
    s.add(a)
    s.add(b)
    complete(s.schedule())  # a: 2 blocks, b: 2 blocks, both sampled a token
    batch = s.schedule()  # a now needs a third block for its 9th token: b is preempted
    assert [r.request_id for r in batch.preempted] == ["b"]
    assert names(batch)["decode"] == ["a"]
    assert b.num_computed_tokens == 0 and list(s.waiting) == [b]
    assert b.num_uncomputed == 8  # recompute covers prompt and its sampled token
    s.blocks.check_integrity()


def test_encode_only_instance_never_prefills():
    s = make(Policy.STAGE, roles=frozenset({Role.ENCODE}))
    s.add(req("img", 6, images=3))
    s.add(req("img2", 6, images=1))
    steps = run(s, 2)
    assert steps[0] == {"encode": [("img", 2)], "prefill": [], "decode": []}
    assert steps[1] == {"encode": [("img", 1), ("img2", 1)], "prefill": [], "decode": []}


@pytest.mark.parametrize("policy", [Policy.PREFILL_FIRST, Policy.DECODE_FIRST])
def test_an_instance_that_does_not_prefill_encodes_under_tau_e_whatever_its_policy(policy):
    """The comparison policies encode inline with a prefill; where there is none to run (E, ED),
    Algorithm 1 batches: encodes within τe, never a prefill chunk, decodes beside them."""
    encoder = make(policy, roles=frozenset({Role.ENCODE}))
    encoder.add(req("img", 6, images=3))
    encoder.add(req("img2", 6, images=1))
    steps = run(encoder, 2)
    assert steps[0] == {"encode": [("img", 2)], "prefill": [], "decode": []}
    assert steps[1] == {"encode": [("img", 1), ("img2", 1)], "prefill": [], "decode": []}
    ed = make(policy, roles=frozenset({Role.ENCODE, Role.DECODE}))
    decoding = req("d", 4)
    decoding.num_computed_tokens, decoding.output_token_ids = 4, [7]
    ed.add_running(decoding)
    ed.add(req("img", 6, images=3))
    # Only `stage` shares the iteration's limit between images and tokens: here τe is whole.
    assert run(ed, 1)[0] == {"encode": [("img", 2)], "prefill": [], "decode": ["d"]}


def test_seed_001_variant_keeps_encodes_out_of_prefill_iterations():
    cfg = EngineConfig(token_budget=10, image_budget=2, block_size=4, encode_with_prefill=False)
    s = Scheduler(cfg, BlockManager(64, 4))
    s.add(req("txt", 14))
    s.add(req("img", 6, images=1))
    steps = run(s, 3)
    assert steps[0] == {"encode": [], "prefill": [("txt", 10)], "decode": []}
    assert steps[1] == {"encode": [], "prefill": [("txt", 4)], "decode": []}
    assert steps[2] == {"encode": [("img", 1)], "prefill": [], "decode": ["txt"]}
