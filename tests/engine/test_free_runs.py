"""The free-run index the block manager places requests by, against a plain set of free ids."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.engine.free_runs import FreeRuns


def runs_of(free: set[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for block in sorted(free):
        if out and out[-1][1] == block:
            out[-1] = (out[-1][0], block + 1)
        else:
            out.append((block, block + 1))
    return out


def test_taking_from_inside_a_run_leaves_both_sides_and_giving_back_joins_them():
    runs = FreeRuns(10)
    assert runs.longest() == (0, 10)
    assert list(runs.take(0, 4, 2)) == [4, 5]
    assert runs.runs() == [(0, 4), (6, 10)] and len(runs) == 8
    assert runs.longest() == (0, 4), "the lowest of equal runs"
    assert runs.end_of_run_at(6) == 10 and runs.end_of_run_at(5) is None
    runs.give(5)
    assert runs.runs() == [(0, 4), (5, 10)] and runs.longest() == (5, 10)
    runs.give(4)
    assert runs.runs() == [(0, 10)] and runs.longest() == (0, 10)
    runs.check()


def test_an_empty_pool_has_no_longest_run():
    assert FreeRuns(0).longest() is None
    runs = FreeRuns(3)
    runs.take(0, 0, 3)
    assert runs.longest() is None and len(runs) == 0 and runs.check() == set()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 63), st.integers(1, 8)), max_size=120))
def test_any_takes_and_gives_keep_the_runs_exact(ops):
    """Each op takes `count` blocks from inside the run holding `seed` (or gives `seed` back);
    after each, the runs, count and longest run are exactly a plain set's."""
    runs, free = FreeRuns(64), set(range(64))
    for take, seed, count in ops:
        if take and seed in free:
            start, end = next((s, e) for s, e in runs_of(free) if s <= seed < e)
            count = min(count, end - seed)
            assert set(runs.take(start, seed, count)) == set(range(seed, seed + count))
            free -= set(range(seed, seed + count))
        elif not take and seed not in free:
            runs.give(seed)
            free.add(seed)
        assert runs.check() == free
        assert runs.runs() == runs_of(free)
        expected = max(runs_of(free), key=lambda r: (r[1] - r[0], -r[0]), default=None)
        assert runs.longest() == expected
