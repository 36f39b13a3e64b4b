"""The three stages of inference, spelled once for the engine, the wire, the bus and the gateway."""

from __future__ import annotations

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
