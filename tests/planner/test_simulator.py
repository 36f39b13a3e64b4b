"""The simulator on cases whose queueing delays can be worked out by hand."""

from __future__ import annotations

import dataclasses
import math

import pytest

from common.planner.profiles import ProfileSet, StageCurves, TransferModel
from common.planner.simulator import Correction, Simulation, simulate
from common.planner.trace import TraceEntry
from common.planner.types import Deployment
from common.stats import SLO
from tests.helpers.planning import CURVES

HOP = 0.01
PROFILES = ProfileSet(CURVES, TransferModel(latency=HOP, bandwidth=1e12, hop=HOP))
# α·TTFT = 0.15 s: τe = 1 image (two would take 0.2 s), τt = 150 tokens on E/P instances.
SLO_ = SLO(ttft=0.3, tbt=0.5)


def entry(arrival: float, images: int = 1, prompt: int = 12, output: int = 2) -> TraceEntry:
    return TraceEntry(arrival, prompt, images, 10 * images, output)


def test_one_text_request_on_one_instance_is_prefill_then_decode_steps() -> None:
    one = [entry(0.0, images=0, prompt=10, output=3)]
    result = simulate(one, Deployment.of("epd", epd=1), PROFILES, SLO_)
    assert result.ttft[0] == pytest.approx(0.010)  # one 10-token prefill
    assert list(result.gaps) == pytest.approx([0.02, 0.02])
    assert result.attainment == 1.0 and result.complete


def test_e_p_d_queueing_and_hand_offs_add_up_exactly() -> None:
    # A at 0 encodes 0→0.1; B (at 0.05) waits for the image budget and encodes 0.1→0.2.
    # Each hand-off is one hop (0.01) to the queue and one (0.01) for the pull: A's 12-token
    # prefill runs 0.12→0.132, its KV reaches decode at 0.152, its second token at 0.172.
    result = simulate([entry(0.0), entry(0.05)], Deployment.of("e+p+d", e=1, p=1, d=1), PROFILES, SLO_)
    assert result.ttft[0] == pytest.approx(0.132)
    assert result.ttft[1] == pytest.approx(0.232 - 0.05)
    assert list(result.gaps) == pytest.approx([0.04, 0.04])


def test_hybrid_encode_prefill_hands_off_in_memory() -> None:
    # EP: encode 0→0.1 and prefill 0.1→0.112 on one instance, no hop between them.
    result = simulate([entry(0.0)], Deployment.of("ep+d", ep=1, d=1), PROFILES, SLO_)
    assert result.ttft[0] == pytest.approx(0.112)


def test_a_busy_instance_batches_the_next_prefill_with_running_decodes() -> None:
    # Two 100-token prompts at once on one EPD instance (τt = 300 under a 0.3 s TBT SLO). The first
    # starts alone (0→0.1); the second's prefill rides with the first's decode: 101 tokens, 0.101 s.
    reqs = [entry(0.0, images=0, prompt=100, output=2), entry(0.0, images=0, prompt=100, output=2)]
    result = simulate(reqs, Deployment.of("epd", epd=1), PROFILES, SLO(ttft=0.3, tbt=0.3))
    assert list(result.ttft) == pytest.approx([0.100, 0.201])
    assert list(result.gaps) == pytest.approx([0.101, 0.02])


def test_instances_on_shared_cores_slow_each_other_only_while_they_overlap() -> None:
    """Processor sharing on one core. A's 0.1 s prefill runs alone 0→0.05, then beside B's at half
    speed, so its last 0.05 s of work ends at 0.15; B has done 0.05 s by then and finishes alone at
    0.2. (Slowing an iteration by the instances busy when it starts gave A 0.1 and B 0.2.)"""
    shared = dataclasses.replace(PROFILES, host_cores=1)
    reqs = [entry(0.0, images=0, prompt=100, output=1), entry(0.05, images=0, prompt=100, output=1)]
    result = simulate(reqs, Deployment.of("epd", epd=2), shared, SLO(ttft=1.0, tbt=0.5))
    assert list(result.ttft) == pytest.approx([0.15, 0.15])
    # Each prefill took 0.15 s of 0.1 s of work: what sharing added, by iteration kind.
    assert result.sharing == pytest.approx({"prefill": 1.5})
    alone = simulate(reqs, Deployment.of("epd", epd=2), PROFILES, SLO(ttft=1.0, tbt=0.5))
    assert alone.sharing == pytest.approx({"prefill": 1.0})


def test_an_instance_that_prefills_takes_the_cores_the_others_leave() -> None:
    """The core board (common/threads.py) where the profile says it was measured on one thread: a
    prefill alone on two cores runs on both, at 2^exponent the profiled speed."""
    text = [entry(0.0, images=0, prompt=100, output=1)]  # 0.1 s of work at the profiled thread
    deployment = Deployment.of("ep+d", ep=1, d=1)
    for exponent, ttft in ((1.0, 0.05), (0.5, 0.1 / 2**0.5), (0.0, 0.1)):
        board = dataclasses.replace(PROFILES, host_cores=2, threads=1, thread_exponent={"prefill": exponent})
        result = simulate(text, deployment, board, SLO(ttft=1.0, tbt=0.5))
        assert result.ttft[0] == pytest.approx(ttft), exponent
        assert result.sharing == pytest.approx({"prefill": 1.0})  # faster, but not shared
    unknown = dataclasses.replace(PROFILES, host_cores=2, thread_exponent={"prefill": 1.0})  # threads unknown
    assert simulate(text, deployment, unknown, SLO(ttft=1.0, tbt=0.5)).ttft[0] == pytest.approx(0.1)


def test_a_greedy_instance_shares_while_another_steps_and_takes_back_once_it_is_not_recent() -> None:
    """Two EPD instances on two cores, profiled on one thread, steps twice as fast on two. A
    (0.1 s of work) runs alone on both cores 0→0.025 (0.05 done). B (0.5 s, in chunks of 450 and
    50 tokens) starts, and each drops to one thread, so A ends at 0.075. B stays on one thread while
    A's step is recent (RECENT = 0.25 s, to 0.325: 0.3 s done), then takes both cores for its last
    0.2 s: its first token at 0.425, 0.4 s after it came."""
    board = dataclasses.replace(PROFILES, host_cores=2, threads=1, thread_exponent={"prefill": 1.0})
    reqs = [entry(0.0, images=0, prompt=100, output=1), entry(0.025, images=0, prompt=500, output=1)]
    result = simulate(reqs, Deployment.of("epd", epd=2), board, SLO(ttft=1.0, tbt=0.5))
    assert list(result.ttft) == pytest.approx([0.075, 0.4])
    assert result.sharing == pytest.approx({"prefill": 1.0})


def test_a_step_beside_another_runs_slower_by_its_kinds_interference() -> None:
    """Two EPD instances with a core each; a prefill beside another runs at e^-λ = half speed. A
    (0.1 s) runs alone 0→0.05, then beside B at half speed, so its last 0.05 s ends at 0.15; B has
    done 0.05 s by then and ends alone at 0.2. The cores were not shared: no stretch for that."""
    board = dataclasses.replace(PROFILES, host_cores=2, threads=1, interference={"prefill": math.log(2)})
    reqs = [entry(0.0, images=0, prompt=100, output=1), entry(0.05, images=0, prompt=100, output=1)]
    result = simulate(reqs, Deployment.of("epd", epd=2), board, SLO(ttft=1.0, tbt=0.5))
    assert list(result.ttft) == pytest.approx([0.15, 0.15])
    assert result.sharing == pytest.approx({"prefill": 1.0})
    gpus = dataclasses.replace(board, host_cores=0)  # own devices: nothing shared
    assert list(
        simulate(reqs, Deployment.of("epd", epd=2), gpus, SLO(ttft=1.0, tbt=0.5)).ttft
    ) == pytest.approx([0.1, 0.1])


def test_correction_scales_predicted_latency_and_the_verdict() -> None:
    trace = [entry(0.0)]
    plain = simulate(trace, Deployment.of("ep+d", ep=1, d=1), PROFILES, SLO_)
    slow = simulate(trace, Deployment.of("ep+d", ep=1, d=1), PROFILES, SLO_, correction=Correction(ttft=3.0))
    assert slow.ttft[0] == pytest.approx(3 * plain.ttft[0])
    assert plain.attainment == 1.0 and slow.attainment == 0.0


def test_stop_early_gives_up_once_attainment_is_out_of_reach() -> None:
    flood = [entry(0.001 * i) for i in range(200)]
    result = simulate(flood, Deployment.of("e+p+d", e=1, p=1, d=1), PROFILES, SLO_, stop_early=True)
    assert not result.complete and result.attainment < 0.9


def test_kv_memory_limits_decode_pulls() -> None:
    # Each request needs 2 blocks (12 + 20 tokens); a decoder with 2 blocks serves them one at a time.
    small = ProfileSet(
        StageCurves(CURVES.encode, CURVES.prefill, CURVES.decode, num_kv_blocks=2),
        PROFILES.transfer,
    )
    reqs = [entry(0.0, images=0, output=20), entry(0.0, images=0, output=20)]
    result = simulate(reqs, Deployment.of("e+p+d", e=1, p=1, d=1), small, SLO(ttft=5, tbt=5))
    assert result.complete and result.attainment == 1.0
    # The second request's decoding starts only after the first finished and freed its blocks.
    assert max(result.gaps) > 19 * 0.02


def test_the_image_budget_counts_tokens_where_the_profile_names_its_image() -> None:
    """With `tokens_per_image` (the profiled image's tokens) τe counts image tokens, as the engine's
    scheduler does for LLaVA-NeXT and Qwen-VL: two half-size images share one iteration's budget
    and are encoded together (0→0.1); counted as images, the second waits for the first (0.1→0.2)."""
    halves = [TraceEntry(0.0, 12, 1, 5, 2), TraceEntry(0.0, 12, 1, 5, 2)]
    deployment = Deployment.of("e+p+d", e=1, p=1, d=1)
    by_tokens = dataclasses.replace(PROFILES, curves=dataclasses.replace(CURVES, tokens_per_image=10))
    together = simulate(halves, deployment, by_tokens, SLO_)
    apart = simulate(halves, deployment, PROFILES, SLO_)
    assert max(apart.ttft) - max(together.ttft) == pytest.approx(0.1, abs=0.02)


def test_the_simulated_governor_shrinks_budgets_as_the_workers_does_on_shared_cores() -> None:
    """Two EPD instances on one core: each full iteration runs twice its profiled time, so the
    governor (the engine's own BudgetGovernor and budget share) halves τt, as it would in service.
    Off, the start-up budgets stay."""
    shared = dataclasses.replace(PROFILES, host_cores=1)
    # Long prompts arriving steadily keep both instances' iterations full of prefill tokens.
    trace = [entry(0.02 * i, images=0, prompt=600, output=8) for i in range(80)]
    slo = SLO(ttft=30, tbt=0.25)
    deployment = Deployment.of("epd", epd=2)

    on = Simulation(trace, deployment, shared, slo)
    on.run()
    off = Simulation(trace, deployment, shared, slo, governor=False)
    off.run()
    start = off.instances[0].scheduler.token_budget
    assert all(i.scheduler.token_budget == start for i in off.instances)
    for inst in on.instances:
        assert inst.governor.scale == pytest.approx(0.5, abs=0.1)
        assert inst.scheduler.token_budget < 0.6 * start


def test_cached_prefix_tokens_are_not_computed_in_whole_blocks_and_never_the_last() -> None:
    # 100-token prompts at 1 ms a token; blocks of 16. A cache hit skips whole blocks only, and the
    # last token is always computed (its logits are sampled), as the engine's lookup does.
    def ttft(cached: int) -> float:
        one = [TraceEntry(0.0, 100, 0, 0, 2, cached_tokens=cached)]
        return float(simulate(one, Deployment.of("epd", epd=1), PROFILES, SLO_).ttft[0])

    assert CURVES.block_size == 16
    assert ttft(0) == pytest.approx(0.100)
    assert ttft(64) == pytest.approx(0.036)
    assert ttft(70) == pytest.approx(0.036)  # 4 whole blocks of the 70
    assert ttft(100) == pytest.approx(0.004)  # 96 of 99: the last token stays


def test_stored_images_skip_the_encoder() -> None:
    # E+P+D: encoded, A's first token comes at 0.132 (above); with its image's features stored it
    # goes straight to prefill: the features' transfer (one latency), then the 12-token prefill.
    stored = [TraceEntry(0.0, 12, 1, 10, 2, encoded_images=1)]
    result = simulate(stored, Deployment.of("e+p+d", e=1, p=1, d=1), PROFILES, SLO_)
    assert result.ttft[0] == pytest.approx(HOP + 0.012)
    # Of two images, one stored: the encoder runs once, for the other.
    half = [TraceEntry(0.0, 22, 2, 20, 2, encoded_images=1)]
    result = simulate(half, Deployment.of("epd", epd=1), PROFILES, SLO_)
    assert result.ttft[0] == pytest.approx(0.1 + 0.022)


def test_a_clip_prefills_paced_beside_a_decoding_request() -> None:
    """A 1,500-token clip arrives while a text request decodes on one EPD instance. Paced (the
    engine's default, fed the simulated steps as the engine feeds it its own), the text's gaps
    average about tbt_stretch × a decode step and never two chunk steps come in a row; unpaced,
    the clip's τt chunks fill every step until it has prefilled."""
    text = entry(0.0, images=0, prompt=10, output=80)
    clip = TraceEntry(0.1, 1520, 0, 0, 2, num_videos=1, video_tokens=1500, clips=((8.0, 640, 360),))

    def text_gaps(paced: bool) -> list[float]:
        room = dataclasses.replace(PROFILES, curves=dataclasses.replace(CURVES, num_kv_blocks=256))
        sim = Simulation([text, clip], Deployment.of("epd", epd=1), room, SLO(ttft=60, tbt=0.3))
        if not paced:
            for inst in sim.instances:
                inst.scheduler.pacer = None
        result = sim.run()
        assert result.complete and all(t is not None and t > 0 for t in result.ttft)  # both answered
        return sim.tracks["r0"].gaps

    def longest_run_of_chunk_steps(gaps: list[float]) -> int:
        runs = "".join("x" if g > 0.2 else "." for g in gaps).split(".")  # a chunk: 0.25 s
        return max(len(run) for run in runs)

    paced, unpaced = text_gaps(True), text_gaps(False)
    assert longest_run_of_chunk_steps(unpaced) >= 5  # 1,500 tokens in τt chunks, one after another
    assert longest_run_of_chunk_steps(paced) == 1  # each chunk's time earned back before the next
    assert sum(paced) / len(paced) <= 1.6 * 0.02  # tbt_stretch 1.5, and the chunks that ran
    assert sorted(paced)[len(paced) * 9 // 10] == pytest.approx(0.02)  # p90: a decode step
