"""Trace entries, the JSONL trace file, traces from the store's records, and rate helpers."""

import json

import numpy as np
import pytest

from common.planner.trace import (
    Trace,
    TraceEntry,
    TraceError,
    from_records,
    rate,
    read_trace,
    rescale,
    rescale_times,
    summary,
    write_trace,
)
from common.planner.workloads import generate
from common.protocol import TraceRecord

BASE = {"arrival": 0.0, "prompt_tokens": 600, "num_images": 1, "image_tokens": 576, "output_tokens": 8}


def _entry(**kw) -> TraceEntry:
    return TraceEntry(**(BASE | kw))


def test_entry_validates_and_derives_text_tokens():
    assert _entry().text_tokens == 24
    clip = _entry(num_videos=1, video_tokens=20, clips=[[8, 640, 360]])
    assert clip.text_tokens == 4 and clip.clips == ((8.0, 640, 360),)
    assert _entry(image_sizes=[[640, 480]]).image_sizes == ((640, 480),)
    for bad, message in [
        ({"arrival": -1.0}, "arrival"),
        ({"arrival": float("nan")}, "arrival"),
        ({"output_tokens": -1}, "output_tokens"),
        ({"image_tokens": 700}, "image_tokens 700 > prompt_tokens 600"),
        ({"image_sizes": ((640, 480), (640, 480))}, "2 image_sizes for 1 images"),
        ({"image_sizes": ((0, 480),)}, "positive"),
        ({"ttft": -0.1}, "ttft"),
        ({"encoded_images": 2}, "encoded_images 2 > num_images 1"),
        ({"cached_tokens": 601}, "cached_tokens 601 > prompt_tokens 600"),
        ({"cached_tokens": -1}, "cached_tokens"),
        ({"num_videos": 1, "video_tokens": 30}, r"image_tokens 576 \+ video_tokens 30 > prompt_tokens 600"),
        ({"num_videos": 2, "video_tokens": 10, "clips": [[8, 640, 360]]}, "1 clips for 2 videos"),
        ({"num_videos": 1, "video_tokens": 10, "clips": [[0, 640, 360]]}, "positive seconds"),
    ]:
        with pytest.raises(ValueError, match=message):
            _entry(**bad)


def test_round_trip_with_header(tmp_path):
    entries = generate("mix", rate=3, num_requests=100, seed=1)
    entries[3] = _entry(arrival=entries[3].arrival, ttft=0.25, tbt_p90=0.03, slo_met=True, request_id="x")
    entries[4] = _entry(arrival=entries[4].arrival, encoded_images=1, cached_tokens=592)
    entries[5] = _entry(arrival=entries[5].arrival, num_videos=1, video_tokens=20, clips=((4.5, 640, 360),))
    path = tmp_path / "t.jsonl"
    write_trace(path, entries, meta={"shape": "mix", "rate": 3})
    trace = read_trace(path)
    assert trace.entries == entries and len(trace) == 100
    assert trace.meta == {"shape": "mix", "rate": 3}
    assert json.loads(path.read_text().splitlines()[0]) == {
        "format": "trident-trace",
        "version": 1,
        "shape": "mix",
        "rate": 3,
    }


def test_reads_a_file_without_header_and_ignores_unknown_fields(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"arrival": 0, "prompt_tokens": 30, "output_tokens": 5, "colour": "blue"}\n'
        "\n"
        '{"arrival": 1.5, "prompt_tokens": 630, "num_images": 1, "image_tokens": 576, "output_tokens": 9,'
        ' "image_sizes": [[640, 480]], "slo_met": false}\n'
    )
    trace = read_trace(path)
    assert trace.meta == {}
    assert trace.entries == [
        TraceEntry(0.0, 30, 0, 0, 5),
        TraceEntry(1.5, 630, 1, 576, 9, image_sizes=((640, 480),), slo_met=False),
    ]


def test_write_refuses_meta_that_overrides_the_header(tmp_path):
    with pytest.raises(ValueError, match="header"):
        write_trace(tmp_path / "t.jsonl", [], meta={"version": 2})


GOOD = '{"arrival": 0, "prompt_tokens": 30, "output_tokens": 5}'


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"arrival": 1, "prompt_tokens": 30', "Expecting"),  # cut-off JSON
        ("[1, 2]", "expected a JSON object"),
        ('{"arrival": 1, "prompt_tokens": 30}', "missing field(s): output_tokens"),
        ('{"arrival": 1, "prompt_tokens": -3, "output_tokens": 5}', "prompt_tokens must be >= 0"),
        ('{"arrival": "soon", "prompt_tokens": 3, "output_tokens": 5}', "arrival must be a number"),
        ('{"arrival": 1, "prompt_tokens": 3.5, "output_tokens": 5}', "prompt_tokens must be an integer"),
        ('{"arrival": 1, "prompt_tokens": 3, "output_tokens": 5, "image_tokens": 9}', "image_tokens 9 >"),
        ('{"arrival": 1, "prompt_tokens": 3, "output_tokens": 5, "image_sizes": [[1]]}', "[width, height]"),
        ('{"arrival": 1, "prompt_tokens": 3, "output_tokens": 5, "slo_met": "yes"}', "slo_met"),
        ('{"format": "trident-trace", "version": 1}', "header is only allowed on the first line"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "t.jsonl"
    path.write_text(f"{GOOD}\n\n{bad_line}\n{GOOD}\n")
    with pytest.raises(TraceError) as info:
        read_trace(path)
    assert info.value.line == 3 and str(info.value).startswith(f"{path}:3: ")
    assert message in info.value.reason
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "header, message",
    [
        ('{"format": "other-trace"}', "expected 'trident-trace'"),
        ('{"format": "trident-trace", "version": 2}', "version 2"),
    ],
)
def test_bad_header(tmp_path, header, message):
    path = tmp_path / "t.jsonl"
    path.write_text(f"{header}\n{GOOD}\n")
    with pytest.raises(TraceError, match=message) as info:
        read_trace(path)
    assert info.value.line == 1


def test_from_records_makes_arrivals_relative_and_sorted():
    stages = {"arrival": 1_700_000_010.0, "first_token": 1_700_000_010.4}
    records = [
        TraceRecord(
            request_id="b",
            arrival=1_700_000_010.0,
            prompt_tokens=620,
            image_tokens=576,
            num_images=1,
            output_tokens=32,
            finish_reason="length",
            stages=stages,
        ),
        TraceRecord(request_id="a", arrival=1_700_000_007.5, prompt_tokens=40, output_tokens=12),
    ]
    entries = from_records(records)
    assert [e.request_id for e in entries] == ["a", "b"]
    assert [e.arrival for e in entries] == [0.0, 2.5]
    b = entries[1]
    assert (b.prompt_tokens, b.num_images, b.image_tokens, b.output_tokens) == (620, 1, 576, 32)
    assert entries[0].ttft is None and b.ttft == pytest.approx(0.4)
    assert from_records([]) == []


def test_from_records_takes_measured_outcomes_and_what_caches_spared():
    record = TraceRecord(request_id="a", arrival=5.0, prompt_tokens=40, ttft=0.2, tbt_p90=0.03, slo_met=True)
    (entry,) = from_records([record])
    assert (entry.ttft, entry.tbt_p90, entry.slo_met) == (0.2, 0.03, True)
    assert (entry.encoded_images, entry.cached_tokens) == (0, 0)
    record = TraceRecord(
        request_id="b", arrival=5.0, prompt_tokens=640, num_images=1, image_tokens=576,
        encoded_images=1, cached_tokens=624,
    )  # fmt: skip
    (entry,) = from_records([record])
    assert (entry.encoded_images, entry.cached_tokens) == (1, 624)


def test_rate_and_rescale_keep_the_shape():
    entries = [_entry(arrival=t) for t in (4.0, 0.0, 1.0, 1.5, 8.0)]
    assert rate(entries) == pytest.approx(4 / 8)
    fast = rescale(entries, 2.0)
    assert [e.arrival for e in fast] == pytest.approx([0, 0.25, 0.375, 1.0, 2.0])
    assert rate(fast) == pytest.approx(2.0)
    assert rate(entries[:1]) == 0.0 and rescale(entries[:1], 5.0)[0].arrival == 0.0
    with pytest.raises(ValueError, match="rate must be > 0"):
        rescale(entries, 0)
    with pytest.raises(ValueError, match="same instant"):
        rescale_times([2.0, 2.0], 1.0)


def test_rescale_a_bursty_trace_keeps_its_burstiness():
    entries = generate("pope", rate=2, num_requests=2000, arrival="gamma", cv=3.0, seed=9)
    scaled = rescale(entries, 10.0)
    before, after = (np.diff([e.arrival for e in t]) for t in (entries, scaled))
    assert rate(scaled) == pytest.approx(10.0)
    assert after.std() / after.mean() == pytest.approx(before.std() / before.mean())


def test_summary():
    entries = [
        _entry(arrival=0.0, slo_met=True),
        _entry(arrival=1.0, prompt_tokens=40, num_images=0, image_tokens=0, output_tokens=20, slo_met=False),
        _entry(arrival=2.0, prompt_tokens=1200, num_images=2, image_tokens=1152, output_tokens=2),
    ]
    s = summary(entries)
    assert (s["count"], s["duration"], s["rate"]) == (3, 2.0, 1.0)
    assert s["prompt_tokens"] == {"mean": pytest.approx(1840 / 3), "p50": 600.0, "p90": pytest.approx(1080.0)}
    assert s["image_tokens"]["p50"] == 576.0 and s["text_tokens"]["mean"] == pytest.approx(112 / 3)
    assert s["output_tokens"]["mean"] == pytest.approx(10.0)
    assert s["images_per_request"] == 1.0 and s["text_only"] == pytest.approx(1 / 3)
    assert s["slo_attainment"] == 0.5
    empty = summary(Trace([]).entries)
    assert empty["count"] == 0 and empty["rate"] == 0.0 and empty["slo_attainment"] is None
    json.dumps(s)  # the planner service sends it as is
