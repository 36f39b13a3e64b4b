"""Long prompts paced beside decodes (common/engine/pacing.py): what the pacer learns from steps, and
which chunks the scheduler then gives a long prompt on an instance that decodes too."""

from __future__ import annotations

import pytest

from common.engine.block_manager import BlockManager
from common.engine.config import EngineConfig
from common.engine.pacing import Pacer
from common.engine.request import ImageInput, Request, Status
from common.engine.sampling import SamplingParams
from common.engine.scheduler import Scheduler
from common.roles import Role
from tests.helpers.engine import engines
from tests.helpers.scheduling import complete, names, req


def test_long_chunks_wait_until_the_time_they_took_is_earned_back() -> None:
    pacer = Pacer(stretch=1.5)
    pacer.observe(decodes=4, seconds=0.5, decode_only=False, paced=True)
    assert pacer.allows() and pacer.decode_step is None  # no decode-only step seen: nothing paced
    for seconds in (0.010, 0.011, 0.009):
        pacer.observe(decodes=4, seconds=seconds, decode_only=True, paced=False)
    assert pacer.decode_step == pytest.approx(0.010) and pacer.allows()
    assert pacer.credit == pytest.approx(0.005)  # never more than one step's earning saved up
    pacer.observe(decodes=4, seconds=0.060, decode_only=False, paced=True)  # 50 ms past a decode step
    waited = 0
    while not pacer.allows():
        pacer.observe(decodes=4, seconds=0.010, decode_only=True, paced=False)
        waited += 1
    assert waited == 8  # 5 ms saved + 5 earned − 50 spent: 40 ms owed, earned back at 5 ms a step
    pacer.observe(decodes=4, seconds=0.030, decode_only=False, paced=False)  # a short prompt: free
    assert pacer.allows() and pacer.decode_step == pytest.approx(0.010)
    pacer.observe(decodes=0, seconds=1.0, decode_only=False, paced=True)  # nobody decoding
    assert pacer.allows()
    with pytest.raises(ValueError, match="above 1"):
        Pacer(stretch=1.0)


def paced(stretch: float | None, roles=frozenset({Role.PREFILL, Role.DECODE})) -> Scheduler:
    cfg = EngineConfig(
        token_budget=64, block_size=4, long_prefill=40, tbt_stretch=stretch, roles=roles, image_budget=2
    )
    return Scheduler(cfg, BlockManager(256, 4))


def one_decoding(s: Scheduler) -> None:
    s.add(req("d", 4))
    complete(s.schedule())


def test_a_long_prompt_sits_out_steps_without_credit() -> None:
    s = paced(1.5)
    one_decoding(s)
    for _ in range(3):
        s.pacer.observe(decodes=1, seconds=0.010, decode_only=True, paced=False)
    s.pacer.observe(decodes=1, seconds=0.100, decode_only=False, paced=True)  # deep in debt
    s.add(req("long", 200))
    s.add(req("short", 30))
    # The long prompt waits; the short one, arriving after it, is not held back by it.
    first = s.schedule()
    assert names(first) == {"encode": [], "prefill": [("short", 30)], "decode": ["d"]}
    complete(first)
    s.pacer.credit = 0.0  # earned back
    assert names(s.schedule())["prefill"] == [("long", 62)]  # τt less the two decodes


def test_unpaced_where_nobody_decodes_or_pacing_is_off() -> None:
    alone = paced(1.25)
    alone.add(req("long", 200))
    alone.pacer.credit = -1.0  # in debt, but nobody decodes: nobody to wait for
    assert names(alone.schedule())["prefill"] == [("long", 64)]  # all of τt
    off = paced(None)
    one_decoding(off)
    off.add(req("long", 200))
    assert names(off.schedule())["prefill"] == [("long", 63)]  # τt less the decode
    prefill_only = paced(1.25, roles=frozenset({Role.PREFILL}))
    assert prefill_only.pacer is None


def test_a_paced_prompt_answers_the_same(tiny_model_dir) -> None:
    """Pacing changes which step computes which tokens, never the tokens: a long prompt beside two
    decoding requests answers as it does unpaced; paced, it took chunks beside the decodes only in
    steps the pacer allowed, and sat some out."""
    steps: dict[float | None, list] = {}  # (allowed, chunk or 0) of each step with decodes

    def answers(stretch: float | None) -> list[list[int]]:
        with engines(tiny_model_dir) as build:
            engine = build(tbt_stretch=stretch, long_prefill=64, token_budget=128)
            short = [
                engine.add_request(f"short question {i}", params=SamplingParams(max_tokens=60))
                for i in range(2)
            ]
            for _ in range(4):  # both prefill, then decode alone: the pacer learns a decode step
                engine.step()
            long_prompt = " ".join(f"word{i}" for i in range(300))
            long = engine.add_request(long_prompt, params=SamplingParams(max_tokens=4))
            scheduler = engine.scheduler
            schedule = scheduler.schedule

            def traced():
                allowed = scheduler.pacer.allows() if scheduler.pacer else True
                batch = schedule()
                if batch.decodes and (long.status == Status.WAITING or long.is_prefilling):
                    chunk = sum(n for r, n in batch.prefills if r is long)
                    steps.setdefault(stretch, []).append((allowed, chunk))
                return batch

            scheduler.schedule = traced
            while engine.has_unfinished():
                engine.step()
            return [r.output_token_ids for r in (*short, long)]

    assert answers(1.5) == answers(None)
    paced, unpaced = steps[1.5], steps[None]
    assert all(chunk for _, chunk in unpaced)  # τt alone: a chunk in every step until it is done
    assert all(allowed for allowed, chunk in paced if chunk)
    assert sum(1 for _, chunk in paced if chunk) >= 3 and any(chunk == 0 for _, chunk in paced), paced


def test_a_clips_encode_beside_decodes_is_paced_and_spends_credit() -> None:
    """On an ED instance a clip is one encode as long as its frames make it: beside decodes it goes
    only with credit, a picture queued behind it is not held back, and the step it took spends."""
    s = paced(1.5, roles=frozenset({Role.ENCODE, Role.DECODE}))
    decoding = req("d", 4)
    s.add_running(decoding)
    decoding.num_computed_tokens = 4
    decoding.output_token_ids.append(7)
    for _ in range(3):
        batch = s.schedule()
        complete(batch)
        s.observe(batch, 0.010)  # decode-only steps
    assert s.pacer.decode_step == pytest.approx(0.010)
    s.pacer.credit = -0.05
    clip = Request("clip", [1] * 20, SamplingParams(max_tokens=2), [ImageInput("c", 16, video=True)])
    s.add(clip)
    s.add(req("pic", 6, images=1))
    step = s.schedule()
    assert names(step) == {"encode": [("pic", 1)], "prefill": [], "decode": ["d"]}
    complete(step)
    s.pacer.credit = 0.0
    step = s.schedule()
    assert names(step)["encode"] == [("clip", 1)]
    s.observe(step, 0.110)  # 100 ms past a decode step
    assert s.pacer.credit == pytest.approx(0.005 - 0.100)
