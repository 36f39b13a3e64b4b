"""Validating the simulator on conversations (trident/bench/validation.py): a turn's size and what
its server found cached come from its trace record, so the simulator replays what happened."""

from __future__ import annotations

from common.protocol import TraceRecord
from trident.bench.validation_run import Measured, attach, measured_entries


def record(
    rid: str, arrival: float, prompt: int, cached: int, images: int = 0, stored: int = 0
) -> TraceRecord:
    return TraceRecord(
        request_id=rid, arrival=arrival, prompt_tokens=prompt, image_tokens=16 * images, num_images=images,
        output_tokens=8, encoded_images=stored, cached_tokens=cached,
        stages={"arrival": arrival, "first_token": arrival + 0.3}, ttft=0.3, tbt_p90=0.05, slo_met=True,
    )  # fmt: skip


def test_turns_are_sized_from_their_trace_records_with_what_was_cached() -> None:
    records = [
        record("other", 50.0, 10, 0),  # not one of the run's: neither sized nor counted
        record("t1", 101.5, 140, 96),
        record("t0", 100.0, 80, 48, images=1),
        record("t2", 103.0, 200, 128, images=1, stored=1),
    ]
    turns = [Measured("t0", None), Measured("t1", None), Measured("t2", None)]
    attach(turns, records)
    entries = measured_entries(turns)
    assert [e.arrival for e in entries] == [0.0, 1.5, 3.0]  # from the run's first turn
    assert [(e.prompt_tokens, e.cached_tokens) for e in entries] == [(80, 48), (140, 96), (200, 128)]
    assert [(e.num_images, e.encoded_images, e.image_tokens) for e in entries] == [
        (1, 0, 16),
        (0, 0, 0),
        (1, 1, 16),
    ]
    assert all(e.ttft == 0.3 and e.tbt_p90 == 0.05 for e in entries)  # the gateway's measurement
