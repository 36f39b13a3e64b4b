"""Role sets as operators write them: full names, initials, or `+`-joined."""

from __future__ import annotations

import pytest

from common.roles import ALL_ROLES, InstanceKind, Role, StepKind, letters, parse_roles


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


def test_instance_kinds_are_one_table() -> None:
    """The kind ↔ roles ↔ `--scale` name table was written twice (launcher and bench); now it is derived."""
    assert {kind: letters(kind.roles) for kind in InstanceKind} == {kind: kind.value for kind in InstanceKind}
    assert [kind.scale_name for kind in InstanceKind] == ["encode", "prefill", "decode", "ep", "ed", "epd"]
    assert InstanceKind.of(["prefill", "encode"]) is InstanceKind.EP
    assert InstanceKind.of([]) is None and InstanceKind.of(["verify"]) is None
    assert InstanceKind("ep") == "ep" and f"{InstanceKind.EPD}" == "epd"  # the wire's and a label's string


def test_a_step_kind_is_its_one_stage_or_mixed() -> None:
    assert StepKind.of([Role.DECODE]) is StepKind.DECODE
    assert StepKind.of([Role.ENCODE, Role.PREFILL]) is StepKind.MIXED
    assert StepKind.of([]) is StepKind.MIXED  # an empty batch, as Batch.kind always said
    assert [str(k) for k in StepKind] == ["encode", "prefill", "decode", "mixed"]
