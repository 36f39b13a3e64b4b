"""What the planner publishes as each kind's desired count, so that an autoscaler that follows the
counts alone (KEDA on Kubernetes) moves a running deployment from one method to another with
nothing lost: make before break.

A recommendation of another method drops some kinds to 0 (EP+D to E+P+D: ep to 0, e and p up).
Published at once, the autoscaler would stop the old instances while the new ones still start,
and the stages only the old ones ran would have no instance for minutes. So a live kind that the
recommendation drops keeps its live count while a stage it runs has no live instance of a kind
the recommendation keeps; once those are up (registered: loaded, profiled, pulling), it goes to 0
and drains. Whatever has no live instance meanwhile is held by the gateway (TRIDENT_HOLD_TIMEOUT).
"""

from __future__ import annotations

from collections.abc import Mapping

from common.planner.types import KIND_ROLES
from common.roles import InstanceKind

KINDS = tuple(k.value for k in InstanceKind)


def hand_over(
    desired: Mapping[str, int], live: Mapping[str, int], maximum: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Every kind's count to publish: `desired`, with a dropped live kind kept (at its live count,
    within `maximum` but at least one: a cap of 0 retires a kind too, after the hand-over) while the
    kinds kept do not yet cover its stages with live instances."""
    maximum = maximum or {}
    out = {kind: desired.get(kind, 0) for kind in KINDS}
    covered = {
        role for kind, n in live.items() if n > 0 and out.get(kind, 0) > 0 for role in KIND_ROLES[kind]
    }
    for kind, n in live.items():
        if n > 0 and out.get(kind, 0) == 0 and not KIND_ROLES[kind] <= covered:
            out[kind] = min(n, max(1, maximum.get(kind, n)))
    return out


def standing(live: Mapping[str, int], start: Mapping[str, int]) -> dict[str, int] | None:
    """What to publish before the first sizing: the method the deployment starts with, and whatever
    runs besides (a restarted planner stops nothing; instances still starting are not dropped
    because others registered first); None when neither is known."""
    if not start and not any(n > 0 for n in live.values()):
        return None
    return {kind: max(live.get(kind, 0), start.get(kind, 0)) for kind in KINDS}
