"""What the planner does with a decision: the compose command it prints, the plan it hands to
`trident up --follow-plan`, and `trident up` moving its worker processes to that plan (against the real
redis-server and nats-server, with stand-in service commands as in tests/test_launcher.py)."""

from __future__ import annotations

import asyncio
import json
import shlex
import signal
import time
from pathlib import Path

import pytest
import redis

from common.compose import Method, load_compose, plan_scale
from common.infra import RedisServer, free_port
from common.protocol import Heartbeat, Plan, decode
from common.secrets import DeploymentSecrets
from common.store import Store, StoreConfig
from common.store.keys import Keys
from services.planner.actuators import LauncherActuator, compose_command
from tests.helpers.stand_in_up import (
    read_until,
    stand_in_compose,
    stand_in_record,
    start_up,
    stop_up,
    wait_until,
)
from trident.launcher.follow import change_for
from trident.launcher.processes import Child
from trident.launcher.specs import ProcessSpec

REPO = Path(__file__).resolve().parents[2]
COMPOSE = load_compose(REPO / "compose.yaml", {})
ALL = "--profile ed-p --profile ep-d --profile epd up -d"


@pytest.fixture
def redis_server(tmp_path: Path):
    with RedisServer(workdir=tmp_path / "redis") as server:
        yield server


def _plan(method: str, decision_id: int = 1, **replicas: int) -> Plan:
    return Plan(decision_id=decision_id, method=method, replicas=replicas, time=time.time())


@pytest.mark.parametrize(
    ("plan", "scales"),
    [
        (_plan("e+p+d", e=2, p=1, d=3), "encoder=2 prefill=1 decode=3 worker-ep=0 worker-ed=0 worker-epd=0"),
        (_plan("ep+d", ep=5, d=3), "encoder=0 prefill=0 decode=3 worker-ep=5 worker-ed=0 worker-epd=0"),
        (_plan("ed+p", ed=2, p=4), "encoder=0 prefill=4 decode=0 worker-ep=0 worker-ed=2 worker-epd=0"),
        (_plan("epd", epd=4), "encoder=0 prefill=0 decode=0 worker-ep=0 worker-ed=0 worker-epd=4"),
    ],
)
def test_compose_command(plan: Plan, scales: str) -> None:
    """Every hybrid profile is on, so the services of the other methods can be scaled to 0."""
    expected = f"docker compose -f compose.yaml {ALL} " + " ".join(f"--scale {s}" for s in scales.split())
    assert shlex.join(compose_command(COMPOSE, plan)) == expected


def test_plan_scale_rejects_what_the_method_does_not_run() -> None:
    assert plan_scale(COMPOSE, Method.EP_D, {"ep": 2, "d": 1}) == {"worker-ep": 2, "decode": 1}
    with pytest.raises(ValueError, match="cannot scale 'encode'"):
        plan_scale(COMPOSE, Method.EP_D, {"e": 1, "ep": 1, "d": 1})
    with pytest.raises(ValueError, match="no replicas for decode"):
        plan_scale(COMPOSE, Method.EP_D, {"ep": 2})
    with pytest.raises(ValueError, match="unknown instance kinds"):
        plan_scale(COMPOSE, Method.EP_D, {"x": 2})


def _child(name: str) -> Child:
    service = name.rsplit("-", 1)[0]
    spec = ProcessSpec(name, service, ("true",), {}, COMPOSE.services[service].roles, "no", 10.0)
    return Child(spec, Path("/nonexistent"), {})


def test_change_starts_new_replicas_and_drains_the_rest() -> None:
    active = [_child(n) for n in ("encoder-1", "prefill-1", "decode-1", "decode-2", "decode-3")]
    used = {"encoder": {1}, "prefill": {1}, "decode": {1, 2, 3, 4}}  # decode-4 is still draining
    change = change_for(COMPOSE, _plan("ep+d", ep=2, d=1), active, used)
    assert change.method is Method.EP_D and change.counts == {"worker-ep": 2, "decode": 1}
    assert change.start == [("worker-ep", 1), ("worker-ep", 2)]
    assert [c.name for c in change.retire] == ["encoder-1", "prefill-1", "decode-2", "decode-3"]
    change = change_for(COMPOSE, _plan("e+p+d", e=1, p=1, d=5), active, used)
    assert change.start == [("decode", 5), ("decode", 6)] and change.retire == []


def test_launcher_actuator_hands_over_changed_plans(redis_server: RedisServer) -> None:
    async def scenario() -> list[int]:
        store = await Store.connect(StoreConfig(url=redis_server.url, prefix="t1"))
        actuator = LauncherActuator(store)
        seen = []
        for plan in (_plan("ep+d", 1, ep=2, d=1), _plan("ep+d", 2, ep=2, d=1), _plan("epd", 3, epd=3)):
            await actuator.apply(plan)
            seen.append(decode(await store.redis.get(Keys("t1").plan_apply), expect=Plan).decision_id)
        await store.close()
        return seen

    # Plan 2 recommends what plan 1 already asked for: trident up is not asked again.
    assert asyncio.run(scenario()) == [1, 1, 3]


def _register(r: redis.Redis, pid: int, roles: tuple[str, ...]) -> None:
    """What a real worker's heartbeat would write, for a stand-in that has none."""
    keys = Keys("trident")
    hb = Heartbeat(instance_id=f"{'-'.join(roles)}-host-{pid}", roles=roles, time=time.time())
    r.set(keys.instance(hb.instance_id), hb.to_bytes(), px=60_000)
    r.zadd(keys.instances, {hb.instance_id: time.time() + 60})


@pytest.mark.slow  # `trident up` over stand-in services
@pytest.mark.timeout(60)
def test_trident_up_follows_the_plan(tmp_path: Path) -> None:
    """E+P+D → 2EP1D: the EP replicas start, and encoder and prefill drain only once both registered."""
    stand_in_compose(tmp_path)
    planner_port = free_port()
    proc, lines = start_up(
        tmp_path, "--port", str(free_port()), "--planner-port", str(planner_port), "--follow-plan"
    )
    try:
        assert read_until(lines, "planner:")[-1] == (
            f"planner: http://127.0.0.1:{planner_port}/plan (trident up follows its plans)"
        )
        state = json.loads((tmp_path / ".trident" / "up.json").read_text())
        pids = {p["name"]: p["pid"] for p in state["processes"]}
        planner_env = stand_in_record(tmp_path, pids["planner-1"])["env"]
        assert planner_env["TRIDENT_PLANNER_ACTUATOR"] == "launcher"
        assert planner_env["TRIDENT_HTTP_PORT"] == str(planner_port)
        password = DeploymentSecrets.read(Path(state["secrets"])).redis_password
        r = redis.Redis.from_url(state["servers"]["redis"]["url"], password=password)
        r.set(Keys("trident").plan_apply, _plan("ep+d", 7, ep=2, d=1).to_bytes())
        read_until(lines, "plan 7 (ep+d: 2 worker-ep, 1 decode): applying")
        read_until(lines, "will drain encoder-1, prefill-1")
        state = json.loads((tmp_path / ".trident" / "up.json").read_text())
        started = [p for p in state["processes"] if p["service"] == "worker-ep"]
        assert [p["name"] for p in started] == ["worker-ep-1", "worker-ep-2"] and state["method"] == "ep+d"
        wait_until(lambda: (tmp_path / "out" / f"{started[0]['pid']}.json").exists())
        assert stand_in_record(tmp_path, started[0]["pid"])["env"]["TRIDENT_ROLES"] == "encode,prefill"
        time.sleep(1.5)  # not registered yet: nothing drains
        assert all(
            stand_in_record(tmp_path, pids[n]).get("drained") is None for n in ("encoder-1", "prefill-1")
        )
        for p in started:
            _register(r, p["pid"], ("encode", "prefill"))
        read_until(lines, "encoder-1: draining")

        def gone() -> bool:
            text = (tmp_path / ".trident" / "up.json").read_text()
            return "encoder-1" not in text and "prefill-1" not in text

        wait_until(gone)
        state = json.loads((tmp_path / ".trident" / "up.json").read_text())
        names = sorted(p["name"] for p in state["processes"])
        assert names == ["decode-1", "gateway-1", "planner-1", "planner-jobs-1", "worker-ep-1", "worker-ep-2"]
        assert (
            stand_in_record(tmp_path, pids["encoder-1"])["drained"]
            and stand_in_record(tmp_path, pids["prefill-1"])["drained"]
        )
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        stop_up(proc)
