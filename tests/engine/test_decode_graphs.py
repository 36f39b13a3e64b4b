"""Decode steps padded to fixed buckets (common/engine/decode_graphs.py): the buckets, the scratch
block the padding rows write to, and when a step falls back to the eager path. Parity with HF
through padded steps is in test_parity*.py; capture itself is checked in test_gpu_contracts.py."""

from __future__ import annotations

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.decode_graphs import BATCH_BUCKETS, bucket, context_buckets
from common.engine.sampling import SamplingParams
from services.settings import WorkerSettings
from services.worker.engine_settings import engine_config


def test_context_buckets_pad_by_at_most_a_quarter_and_end_at_the_longest_context():
    assert context_buckets(1) == [1]
    assert context_buckets(11) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]
    widths = context_buckets(256)
    assert widths[-1] == 256 and widths == sorted(set(widths)) and len(widths) == 28
    for blocks in range(1, 257):
        width = bucket(blocks, widths)
        assert blocks <= width <= blocks * 5 // 4 + 1, blocks
    assert bucket(257, widths) is None
    assert bucket(5, BATCH_BUCKETS) == 8 and bucket(65, BATCH_BUCKETS) is None


def test_modes(make_engine):
    assert make_engine().runner.graphs is None  # auto: captured on CUDA only
    assert make_engine(decode_graphs="off").runner.graphs is None
    graphs = make_engine(decode_graphs="eager").runner.graphs
    assert graphs is not None and not graphs.capture
    with pytest.raises(ValueError, match="decode_graphs must be one of auto, off, eager"):
        EngineConfig(decode_graphs="always")
    settings = WorkerSettings(decode_graphs="off")
    assert engine_config(settings, frozenset(EngineConfig().roles)).decode_graphs == "off"


def test_the_scratch_block_is_never_handed_out(make_engine):
    engine = make_engine(kv_cache_bytes=1 << 20)
    cache, blocks = engine.cache, engine.blocks
    assert cache.scratch_block == cache.num_blocks == blocks.num_blocks
    assert cache.kv.shape[2] == cache.num_blocks + 1
    table = blocks.allocate("all", blocks.num_blocks * engine.config.block_size)
    assert table is not None and cache.scratch_block not in table
    assert blocks.allocate("more", 1) is None
    blocks.free("all")


def test_padding_rows_write_the_scratch_block_only(make_engine):
    """Three decodes in a bucket of four, each in a different context bucket: after every step, the
    blocks no request held before or after it are as they were; the fourth row wrote the scratch
    block."""
    engine = make_engine(decode_graphs="eager", prefix_caching=False)
    prompts = [engine.chat_prompt("Hi " * n, 0) for n in (1, 9, 30)]
    for p in prompts:
        engine.add_request(p, [], SamplingParams(max_tokens=12))
    engine.step()  # the prefills
    kv = engine.cache.kv

    def owned() -> set[int]:
        return {b for rid in engine.requests for b in engine.blocks.table(rid)}

    while engine.has_unfinished():
        held = owned()
        before = kv.clone()
        runs = engine.runner.graphs.runs
        engine.step()
        assert engine.runner.graphs.runs == runs + 1
        free = [b for b in range(engine.cache.num_blocks) if b not in held | owned()]
        assert torch.equal(kv[:, :, free], before[:, :, free])
    scratch_slot = engine.cache.scratch_block * engine.config.block_size
    (size, step), *_ = sorted(engine.runner.graphs.steps.items())
    assert size[0] == 4 and step.slots.tolist()[3] == scratch_slot  # 3 rows padded to 4


def test_steps_past_the_largest_bucket_run_eagerly(make_engine):
    padded = make_engine(decode_graphs="eager")
    plain = make_engine(decode_graphs="off")
    padded.runner.graphs.batches = [1, 2]  # as if 3 rows were past the largest bucket
    got = []
    for engine in (padded, plain):
        prompts = [engine.chat_prompt(f"Question {i}: what now?", 0) for i in range(3)]
        done = engine.generate(prompts, [[]] * 3, SamplingParams(max_tokens=8))
        got.append([c.token_ids for c in done])
    assert got[0] == got[1]
    # The three ran together (eagerly) until the batch shrank; nothing ever ran in a bucket of 3+.
    assert all(batch <= 2 for batch, _ in padded.runner.graphs.steps)


def test_a_failed_capture_leaves_decode_running_uncaptured(make_engine, monkeypatch, caplog):
    """A device that cannot capture the step: the failure is logged and counted once, that bucket
    and every later one run uncaptured, and the answers are the eager path's."""
    engine = make_engine(decode_graphs="eager")
    graphs = engine.runner.graphs
    graphs.capture = True  # as on CUDA, with a capture that fails

    def fail(step) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_capture", fail)
    plain = make_engine(decode_graphs="off")
    got = []
    for e in (engine, plain):
        prompts = [e.chat_prompt(f"Question {i}: and then?", 0) for i in range(3)]
        got.append([c.token_ids for c in e.generate(prompts, [[]] * 3, SamplingParams(max_tokens=24))])
    assert got[0] == got[1]
    assert graphs.capture_failures == 1 and not graphs.capture and len(graphs.steps) > 1
    assert all(step.graph is None for step in graphs.steps.values())
    assert "new buckets run uncaptured" in caplog.text


def test_worker_stats_count_bucket_steps_and_capture_failures(make_engine):
    from services.worker.engine_loop import EngineStats

    assert EngineStats.of(make_engine()).decode_bucket_steps == 0  # no graphs on the CPU by default
    engine = make_engine(decode_graphs="eager")
    engine.generate([engine.chat_prompt("Hi", 0)], [[]], SamplingParams(max_tokens=5))
    stats = EngineStats.of(engine)
    assert stats.decode_bucket_steps == engine.runner.graphs.runs == 4  # 5 tokens: 1 prefilled
    assert stats.graph_capture_failures == 0
