"""The vocabulary of stages, spelled once for the engine, the wire, the bus, the gateway and the planner:
the three roles, what one engine step ran (StepKind) and the role set of an instance (InstanceKind)."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum


class Role(StrEnum):
    """A stage a request passes through, in path order; an instance runs a non-empty set of them."""

    ENCODE = "encode"
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def letter(self) -> str:
        return self.value[0]


ALL_ROLES = frozenset(Role)
# A worker with several roles looks for decode work first: finishing what is started before
# taking new work keeps its KV and its TBT in check.
PULL_ORDER = (Role.DECODE, Role.PREFILL, Role.ENCODE)


def parse_roles(text: str | None) -> frozenset[Role]:
    """Parse `encode,prefill` (or the short forms `ep`, `e+p`) into a role set; empty means all three."""
    if not text:
        return ALL_ROLES
    short = {r.letter: r for r in Role}
    roles: set[Role] = set()
    for part in (p.strip().lower() for p in text.replace("+", ",").split(",")):
        if part in set(Role):
            roles.add(Role(part))
        elif part and set(part) <= set(short):
            roles.update(short[c] for c in part)
        elif part:
            raise ValueError(f"unknown role in {text!r}; expected a subset of encode,prefill,decode")
    return frozenset(roles) or ALL_ROLES


def in_path_order(roles: frozenset[Role]) -> tuple[Role, ...]:
    return tuple(r for r in Role if r in roles)


def letters(roles: frozenset[Role]) -> str:
    """`ep` for encode+prefill: the short name of a role set, in path order."""
    return "".join(r.letter for r in in_path_order(roles))


class StepKind(StrEnum):
    """What one engine step ran: one stage's work alone, or several stages' at once (`mixed`)."""

    ENCODE = "encode"
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"

    @classmethod
    def of(cls, roles: Iterable[Role]) -> StepKind:
        """The kind of a step that held work of these stages."""
        held = set(roles)
        return cls(next(iter(held)).value) if len(held) == 1 else cls.MIXED


class InstanceKind(StrEnum):
    """The role set an instance runs, by its initials, as a plan counts instances (`2E3P3D`)."""

    E = "e"
    P = "p"
    D = "d"
    EP = "ep"
    ED = "ed"
    EPD = "epd"

    @property
    def roles(self) -> frozenset[Role]:
        return parse_roles(self.value)

    @property
    def scale_name(self) -> str:
        """How `trident up --scale` and compose name its service: the role for a one-stage kind
        (`encode`), the initials for a hybrid (`ep`)."""
        roles = self.roles
        return next(iter(roles)).value if len(roles) == 1 else self.value

    @classmethod
    def of(cls, roles: Iterable[str]) -> InstanceKind | None:
        """The kind of a role set; None for a set no kind has (an empty one)."""
        try:
            wanted = frozenset(Role(r) for r in roles)
        except ValueError:
            return None
        return next((kind for kind in cls if kind.roles == wanted), None)
