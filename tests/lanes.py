"""`make test` runs the suite in two lanes side by side (`pytest -n 2 --dist loadgroup`): each lane
is one xdist worker's, its tests in collection order.

Run one after another, the suite keeps about half a core busy: most of its time is spent waiting
— on processes starting, heartbeats lapsing, containers building, streams timed to SLOs — so two
lanes on two cores take little more than the longer one alone. Lanes are folders, never split
inside a module (module fixtures start once) and never across the deployments tests/services
shares (tests/services/shared.py): every test that can use a shared deployment is in lane `a`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# Top-level folders of lane `b`: none of them uses a shared deployment. Roughly half of the suite's
# time (tests/docker alone is a quarter of it); everything else is lane `a`.
LANE_B = ("docker", "engine", "gateway", "runtime", "stages", "substrate")


def lane_of(item: pytest.Item) -> str:
    parts = item.path.relative_to(TESTS).parts
    return "b" if len(parts) > 1 and parts[0] in LANE_B else "a"


def mark_lanes(items: list[pytest.Item]) -> None:
    """Puts each test in its lane's xdist group (harmless without xdist)."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(f"lane-{lane_of(item)}"))
