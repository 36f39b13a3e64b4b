"""Workloads that repeat (trident/bench/repeat.py): a shared system prompt, an image pool and
multi-turn conversations, seeded and replayable."""

from __future__ import annotations

import pytest

from common.planner.trace import TraceEntry
from trident.bench.client import RequestOptions, chat_body, turn_messages, user_content
from trident.bench.repeat import Repeats, conversation_rate
from trident.bench.sweep import LoadSpec


def entry(images: int = 1, text: int = 12, output: int = 4) -> TraceEntry:
    return TraceEntry(
        arrival=0.0,
        prompt_tokens=text + 10 * images,
        num_images=images,
        image_tokens=10 * images,
        output_tokens=output,
    )


def images_of(parts: list[dict]) -> list[str]:
    return [p["image_url"]["url"] for p in parts if p["type"] == "image_url"]


def test_bad_repeats_say_what_is_wrong() -> None:
    for kwargs, message in (
        ({"turns": 0}, "at least one turn"),
        ({"pool_share": 1.5}, "between 0 and 1"),
        ({"image_prob": -0.1}, "between 0 and 1"),
        ({"think_time": -1}, "think time"),
        ({"image_pool": -3}, ">= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            Repeats(**kwargs)


def test_the_system_prompt_is_shared_by_every_request_and_depends_on_its_seed_alone() -> None:
    repeats = Repeats(system_tokens=300, seed=7)
    bodies = [
        chat_body(entry(), i, RequestOptions(model="m", seed=s, repeats=repeats))
        for i in range(3)
        for s in (0, 9)
    ]
    systems = {b["messages"][0]["content"] for b in bodies}
    assert len(systems) == 1 and all(b["messages"][0]["role"] == "system" for b in bodies)
    assert len(systems.pop().split()) == 300
    assert Repeats(system_tokens=300, seed=8).system_prompt() != repeats.system_prompt()
    assert (
        chat_body(entry(), 0, RequestOptions(model="m"))["messages"][0]["role"] == "user"
    )  # none by default


def test_images_come_from_the_pool_at_its_share_and_otherwise_are_distinct() -> None:
    def images(repeats: Repeats, n: int = 200) -> list[str]:
        opts = RequestOptions(model="m", image_size=(32, 32), repeats=repeats)
        return [url for i in range(n) for url in images_of(user_content(entry(), i, opts))]

    assert len(set(images(Repeats()))) == 200  # no pool: every image its own
    pooled = images(Repeats(image_pool=5, pool_share=1.0))
    assert len(set(pooled)) == 5
    assert images(Repeats(image_pool=5, pool_share=1.0)) == pooled  # replayable
    assert set(images(Repeats(image_pool=5, pool_share=1.0, seed=1))).isdisjoint(pooled)  # the seed's pool
    mixed = images(Repeats(image_pool=5, pool_share=0.8))
    from_pool = sum(url in set(pooled) for url in mixed)
    assert 0.7 * 200 < from_pool < 0.9 * 200
    assert len(set(mixed)) == 200 - from_pool + len(set(mixed) & set(pooled))


def test_a_turn_resends_the_history_and_keeps_images_only_inside_the_window() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:x"}}

    def said(k: int) -> list[dict]:
        return [image, {"type": "text", "text": f"question {k}"}]

    history = [(said(k), f"answer {k}") for k in range(3)]
    messages = turn_messages(history, said(3), image_window=0)
    assert [m["role"] for m in messages] == ["user", "assistant"] * 3 + ["user"]
    assert [m["content"] for m in messages[1::2]] == ["answer 0", "answer 1", "answer 2"]
    assert all(images_of(m["content"]) for m in messages[::2])  # no window: every image resent
    windowed = turn_messages(history, said(3), image_window=2)  # this turn and the one before
    assert [len(images_of(m["content"])) for m in windowed[::2]] == [0, 0, 1, 1]
    assert [m["content"][-1]["text"] for m in windowed[::2]] == [f"question {k}" for k in range(4)]


def test_a_multi_turn_load_arrives_at_the_rate_of_turns() -> None:
    repeats = Repeats(turns=4)
    assert conversation_rate(8.0, repeats) == 2.0
    load = LoadSpec(rates=(8.0,), duration=30.0, workload="textcaps", repeats=repeats)
    single = LoadSpec(rates=(8.0,), duration=30.0, workload="textcaps")
    assert 0.15 < len(load.entries(8.0)) / len(single.entries(8.0)) < 0.35
    assert load.describe()["repeats"]["turns"] == 4
