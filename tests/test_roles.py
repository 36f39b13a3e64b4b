"""Role sets as operators write them: full names, initials, or `+`-joined."""

from __future__ import annotations

import pytest

from common.roles import ALL_ROLES, Role, letters, parse_roles


@pytest.mark.parametrize(
    ("text", "roles"),
    [
        ("encode,prefill", {Role.ENCODE, Role.PREFILL}),
        ("ep", {Role.ENCODE, Role.PREFILL}),
        ("e+p+d", set(Role)),
        ("decode", {Role.DECODE}),
        ("", set(Role)),
        (" Prefill , DECODE ", {Role.PREFILL, Role.DECODE}),
    ],
)
def test_parse_roles(text: str, roles: set[Role]) -> None:
    assert parse_roles(text) == roles


def test_unknown_roles_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown role in 'encode,render'"):
        parse_roles("encode,render")


def test_letters_follow_the_request_path() -> None:
    assert letters(frozenset({Role.DECODE, Role.ENCODE})) == "ed"
    assert letters(ALL_ROLES) == "epd"
    assert Role.PREFILL == "prefill"  # a role is its wire name
