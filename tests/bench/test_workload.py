"""What the bench sends: workload shapes at a rate, production traces' arrival times, trace files."""

from __future__ import annotations

import itertools
import json

import pytest

from common.planner.trace import TraceEntry, write_trace
from trident.bench.workload import TRACE_FILES, WorkloadError, build, trace_timestamps, traces_dir


def test_mooncake_and_azure_formats_give_seconds(tmp_path):
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text("\n".join(json.dumps({"timestamp": t, "input_length": 9}) for t in (0, 1500, 4000)))
    assert trace_timestamps(str(mooncake)) == [0.0, 1.5, 4.0]
    azure = tmp_path / "a.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:05.4799600,31,8\n"
    )
    first, second = trace_timestamps(str(azure))
    assert second - first == pytest.approx(1.5)
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"when": 1}\n{"when": 2}\n')
    with pytest.raises(WorkloadError, match="not a Mooncake JSONL or Azure CSV"):
        trace_timestamps(str(bad))
    with pytest.raises(WorkloadError, match="no such arrival trace"):
        trace_timestamps("nowhere")


def test_replayed_arrivals_keep_the_recording_shape_at_the_asked_rate(tmp_path):
    recording = tmp_path / "burst.jsonl"
    # Bursts of five arrivals 10 ms apart, every 10 s: the replay must keep the bursts.
    times = [b * 10_000 + k * 10 for b in range(40) for k in range(5)]
    recording.write_text("\n".join(json.dumps({"timestamp": t}) for t in times))
    entries = build(rate=2.0, duration=20, workload="pope", arrivals=str(recording), image_tokens=16)
    arrivals = [e.arrival for e in entries]
    assert len(entries) == 40
    assert (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) == pytest.approx(2.0)
    gaps = sorted(b - a for a, b in itertools.pairwise(arrivals))
    assert gaps[len(gaps) // 2] < 0.1 * gaps[-1]  # most gaps are inside a burst
    assert all(e.num_images == 1 for e in entries)  # contents from the workload shape


def test_the_same_seed_sends_the_same_requests_at_every_rate():
    slow = build(rate=1.0, duration=30, workload="mix", image_tokens=16)
    fast = build(rate=2.0, duration=15, workload="mix", image_tokens=16)
    assert [e.prompt_tokens for e in slow[:10]] == [e.prompt_tokens for e in fast[:10]]


def test_a_trace_file_is_rescaled_to_the_rate_and_cut_at_the_duration(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, [TraceEntry(float(i), 20, 0, 0, 4) for i in range(100)])
    entries = build(rate=10.0, duration=5.0, trace=path)
    assert len(entries) == 50 and entries[-1].arrival < 5.0


def test_unusable_inputs_say_what_is_wrong(tmp_path):
    with pytest.raises(WorkloadError, match="unknown workload 'nope'"):
        build(rate=1, duration=1, workload="nope")
    with pytest.raises(WorkloadError, match="not both"):
        build(rate=1, duration=1, workload="mix", trace=tmp_path / "t.jsonl")
    with pytest.raises(WorkloadError, match="unknown arrivals"):
        build(rate=1, duration=1, workload="mix", arrivals="uniform")
    with pytest.raises(WorkloadError, match="must be > 0"):
        build(rate=0, duration=1, workload="mix")


@pytest.mark.parametrize("name", sorted(TRACE_FILES))
def test_the_production_traces_replay(name):
    if not (traces_dir() / TRACE_FILES[name]).is_file():
        pytest.skip(f"{traces_dir()} does not hold {TRACE_FILES[name]}")
    times = trace_timestamps(name)
    assert len(times) > 1000 and max(times) > min(times)
    entries = build(rate=4.0, duration=60, workload="textcaps", arrivals=name, image_tokens=576)
    assert len(entries) == 240


def test_a_clip_entry_is_sent_as_a_real_video():
    """A trace entry's clip goes out as a `video_url` data: URL of an H.264 file of its length and
    size (what the server's decoder then reads), on a conversation's first turn only."""
    import base64

    from common.video import VideoLimits, decode_video
    from trident.bench.client import RequestOptions, user_content

    entry = TraceEntry(0.0, 100, 0, 0, 4, num_videos=1, video_tokens=90, clips=((2.0, 160, 96),))
    parts = user_content(entry, 7, RequestOptions(model="m"))
    assert [p["type"] for p in parts] == ["video_url", "text"]
    url = parts[0]["video_url"]["url"]
    assert url.startswith("data:video/mp4;base64,")
    clip = decode_video(base64.b64decode(url.split(",", 1)[1]), VideoLimits(), 2.0, 32)
    assert clip.duration_s == pytest.approx(2.0) and clip.frames.shape[1:3] == (96, 160)
    later = user_content(entry, 7, RequestOptions(model="m"), 0, clips=False)
    assert [p["type"] for p in later] == ["text"]
