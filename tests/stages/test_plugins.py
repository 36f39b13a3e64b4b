"""Each stage's handler owns how much it pulls and whether it takes idle cores, as pure rules the
planner's simulator replays; the worker runs whatever handlers its entry point composes."""

from __future__ import annotations

import sys

import pytest

from common.engine.admission import DECODE_WAITING_LIMIT, PREFILL_WAITING, Load
from common.planner.simulator import IDLE_CORE_ROLES, PULL_RULES
from common.roles import Role
from services.stages import STAGES
from services.worker.main import main


def test_the_simulator_replays_each_stages_own_rules() -> None:
    for role, handler in STAGES.items():
        assert handler.role is role
        assert handler.pull_rule is PULL_RULES[role], role
        assert handler.takes_idle_cores is (role in IDLE_CORE_ROLES), role


def test_encode_keeps_two_iterations_of_images_waiting() -> None:
    room = STAGES[Role.ENCODE].pull_rule
    assert room(Load(waiting=0, free_blocks=0, image_budget=3)) == 6
    assert room(Load(waiting=5, free_blocks=0, image_budget=3)) == 1
    assert room(Load(waiting=9, free_blocks=0, image_budget=3)) == 0


def test_prefill_keeps_a_few_waiting() -> None:
    room = STAGES[Role.PREFILL].pull_rule
    assert room(Load(waiting=0, free_blocks=0, image_budget=0)) == PREFILL_WAITING
    assert room(Load(waiting=PREFILL_WAITING + 3, free_blocks=0, image_budget=0)) == 0


def test_decode_takes_one_at_a_time_within_blocks_waiting_and_token_budget() -> None:
    room = STAGES[Role.DECODE].pull_rule
    assert room(Load(waiting=0, free_blocks=10, image_budget=0, running=3, token_budget=8)) == 1
    assert room(Load(waiting=0, free_blocks=0, image_budget=0)) == 0  # no block free
    assert room(Load(waiting=DECODE_WAITING_LIMIT, free_blocks=10, image_budget=0)) == 0
    assert room(Load(waiting=2, free_blocks=10, image_budget=0, running=6, token_budget=8)) == 0
    assert room(Load(waiting=2, free_blocks=10, image_budget=0, running=6, token_budget=0)) == 1


def test_an_entry_point_without_a_roles_handler_says_so(monkeypatch, capsys) -> None:
    """`python -m services.encoder` composes only the encoder: asked for decode it stops at once
    with a usage error, before loading anything."""
    monkeypatch.setattr(sys, "argv", ["services.encoder"])
    with pytest.raises(SystemExit) as exited:
        main({Role.ENCODE: STAGES[Role.ENCODE]}, roles="encode,decode")
    assert exited.value.code == 2
    assert "no stage handler for decode in this entry point" in capsys.readouterr().err
