"""How workers on one host share its cores out as torch threads — the rule the workers run
(services/worker/cores.py, `trident up`'s split) and the planner's simulator replays.

A worker starts with an even split of the cores. One that encodes or prefills (a greedy worker)
takes, before each layer, the cores the others leave: all of them when no other worker has
stepped within RECENT seconds, an even share with those that have otherwise.
"""

from __future__ import annotations

RECENT = 0.25  # seconds: a worker that stepped this recently is in use


def thread_split(cpus: int, workers: int) -> int:
    """torch threads per worker so that co-located workers share the cores instead of fighting over them."""
    return max(1, cpus // max(1, workers))


def greedy_threads(cores: int, busy_others: int) -> int:
    """The threads a greedy worker takes while `busy_others` other workers are in use."""
    return max(1, cores // (1 + busy_others))
