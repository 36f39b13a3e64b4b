"""`trident up` / `trident down` (trident/launcher): compose.yaml → local processes.

The pure parts are tested on the repository's compose.yaml. The run itself is tested on the same
file with every service's command swapped for a stand-in script (a dummy gateway that is ready once
it can reach the local nats and redis, dummy workers that record their environment and drain on
SIGTERM), against the real nats-server and redis-server, so it stays fast and needs no model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from common.compose import (
    ComposeError,
    Method,
    interpolate,
    load_compose,
    map_hosts,
    parse_duration,
    parse_scale,
    resolve_scale,
)
from common.infra import free_port
from common.threads import thread_split
from tests.helpers.stand_in_up import (
    read_until,
    stand_in_compose,
    stand_in_record,
    start_up,
    stop_up,
    wait_until,
)
from trident.launcher.processes import FIRST_BACKOFF, MAX_BACKOFF, restart_delay
from trident.launcher.specs import LocalSetup, plan
from trident.launcher.state import identity, is_alive, program, recorded, start_time

REPO = Path(__file__).resolve().parents[1]
COMPOSE = REPO / "compose.yaml"
HOSTS = {"nats": "127.0.0.1:14222", "redis": "127.0.0.1:16379"}
PLANNER = ["planner-1", "planner-jobs-1"]  # x-trident-up.always: one each, whatever the method


def _setup(cpus: int = 8, user_env: dict[str, str] | None = None) -> LocalSetup:
    return LocalSetup(Path("/m/tiny-llava"), 8123, HOSTS, cpus, user_env or {})


# -- pure parts ----------------------------------------------------------------------------------
def test_interpolate_follows_compose() -> None:
    env = {"A": "x", "EMPTY": ""}
    assert interpolate("${A}-$A-$$A", env) == "x-x-$A"
    assert interpolate("${MISSING:-d} ${EMPTY:-d} ${EMPTY-d} ${MISSING-d}", env) == "d d  d"
    assert interpolate("${A:+alt}${EMPTY:+alt}${EMPTY+set}", env) == "altset"
    assert interpolate("${A:?boom}", env) == "x"
    with pytest.raises(ComposeError, match="boom"):
        interpolate("${EMPTY:?boom}", env)
    with pytest.raises(ComposeError):
        interpolate("${not valid}", env)


def test_parse_duration() -> None:
    assert parse_duration("45s") == 45
    assert parse_duration("1m30s") == 90
    assert parse_duration("500ms") == 0.5
    assert parse_duration(None) == 10  # Compose's default stop grace
    with pytest.raises(ComposeError):
        parse_duration("soon")


def test_map_hosts_rewrites_only_local_servers() -> None:
    assert map_hosts("nats://nats:4222", HOSTS) == "nats://127.0.0.1:14222"
    assert map_hosts("redis://redis:6379/0", HOSTS) == "redis://127.0.0.1:16379/0"
    assert map_hosts("redis://:secret@redis:6379/2", HOSTS) == "redis://:secret@127.0.0.1:16379/2"
    assert map_hosts("nats://nats", HOSTS) == "nats://127.0.0.1:14222"
    for untouched in ("nats://natsbox:4222", "http://gateway:8000/ready", "/models/tiny-llava", "redis"):
        assert map_hosts(untouched, HOSTS) == untouched


def test_thread_split() -> None:
    assert thread_split(2, 3) == 1  # never 0
    assert thread_split(16, 3) == 5
    assert thread_split(8, 1) == 8
    assert thread_split(8, 0) == 8


def test_parse_scale() -> None:
    assert parse_scale([]) == {}
    assert parse_scale(["decode=2", "encoder=3"]) == {"decode": 2, "encoder": 3}
    for bad in ("decode", "decode=", "=2", "decode=two", "decode=-1", "decode=0"):
        with pytest.raises(ValueError):
            parse_scale([bad])


def test_restart_policy_and_backoff() -> None:
    assert restart_delay("no", 1, 1.0, 0.0) is None
    assert restart_delay("on-failure", 0, 1.0, 0.0) is None
    assert restart_delay("on-failure:3", 1, 1.0, 0.0) == FIRST_BACKOFF
    assert restart_delay("unless-stopped", 0, 1.0, 0.0) == FIRST_BACKOFF
    assert restart_delay("always", 1, 1.0, 4.0) == 8.0  # still crash-looping: back off
    assert restart_delay("always", 1, 1.0, MAX_BACKOFF) == MAX_BACKOFF
    assert restart_delay("always", 1, 60.0, 8.0) == FIRST_BACKOFF  # ran a while: start over


def test_compose_file_methods() -> None:
    compose = load_compose(COMPOSE, {})
    assert compose.servers == {"nats": "nats", "redis": "redis"}
    assert compose.gateway == "gateway"
    assert compose.model_init == "model-init"
    roles = {m: [compose.services[s].roles for s in compose.workers(m)] for m in Method}
    assert roles == {
        Method.E_P_D: [("encode",), ("prefill",), ("decode",)],
        Method.EP_D: [("encode", "prefill"), ("decode",)],
        Method.ED_P: [("encode", "decode"), ("prefill",)],
        Method.EPD: [("encode", "prefill", "decode")],
    }


@pytest.mark.parametrize(
    ("method", "names"),
    [
        (Method.E_P_D, ["encoder-1", "prefill-1", "decode-1"]),
        (Method.EP_D, ["worker-ep-1", "decode-1"]),
        (Method.ED_P, ["worker-ed-1", "prefill-1"]),
        (Method.EPD, ["worker-epd-1"]),
    ],
)
def test_plan_per_method(method: Method, names: list[str]) -> None:
    compose = load_compose(COMPOSE, {"TRIDENT_LOG_LEVEL": "DEBUG"})
    procs = plan(compose, method, {}, _setup(cpus=8))
    # Workers, then the services every method runs (the planner), then the gateway.
    assert [p.name for p in procs] == [*names, *PLANNER, "gateway-1"]
    workers, gateway = procs[: len(names)], procs[-1]
    threads = str(thread_split(8, len(workers)))
    for proc in procs:
        assert proc.argv[0] == sys.executable  # compose's `python` is this interpreter
        assert proc.env["TRIDENT_NATS_URL"] == "nats://127.0.0.1:14222"
        assert proc.env["TRIDENT_REDIS_URL"] == "redis://127.0.0.1:16379/0"
        assert proc.env["TRIDENT_MODEL"] == "/m/tiny-llava"
        assert proc.env["TRIDENT_ADVERTISE_HOST"] == "127.0.0.1"
        assert proc.env["TRIDENT_BIND_HOST"] == "127.0.0.1"
        assert proc.env["TRIDENT_LOG_LEVEL"] == "DEBUG"  # ${TRIDENT_LOG_LEVEL:-INFO} from the caller
        assert proc.restart == "unless-stopped"
    for proc in workers:
        assert proc.env["TRIDENT_HTTP_PORT"] == "0"
        assert proc.env["TRIDENT_NUM_THREADS"] == threads
        assert proc.env["TRIDENT_ROLES"] == ",".join(proc.roles)
        assert proc.argv[1:2] == ("-m",) and proc.argv[2].startswith("services.")
    assert gateway.gateway and not gateway.roles
    assert gateway.argv[1:] == ("-m", "services.gateway")
    assert gateway.env["TRIDENT_PORT"] == gateway.env["TRIDENT_HTTP_PORT"] == "8123"
    assert "TRIDENT_NUM_THREADS" not in gateway.env
    for proc in procs[len(names) : -1]:
        assert not proc.roles and "TRIDENT_NUM_THREADS" not in proc.env
        assert proc.env["TRIDENT_HTTP_PORT"] == "0"  # `trident up` sets the planner's own with service_env


def test_workers_share_a_core_board_unless_the_caller_fixed_their_threads() -> None:
    compose = load_compose(COMPOSE, {})
    board = Path("/run/trident/cores.board")
    setup = dataclasses.replace(_setup(cpus=2), core_board=board)
    procs = plan(compose, Method.EP_D, {}, setup)
    workers = [p for p in procs if p.roles]
    assert [(p.env["TRIDENT_CORE_BOARD"], p.env["TRIDENT_HOST_CORES"]) for p in workers] == [
        (str(board), "2")
    ] * 2
    assert all("TRIDENT_CORE_BOARD" not in p.env for p in procs if not p.roles)
    fixed = dataclasses.replace(_setup(cpus=2, user_env={"TRIDENT_NUM_THREADS": "2"}), core_board=board)
    assert all("TRIDENT_CORE_BOARD" not in p.env for p in plan(compose, Method.EP_D, {}, fixed))


def test_scale_by_service_role_or_initials() -> None:
    compose = load_compose(COMPOSE, {})
    procs = plan(compose, Method.E_P_D, {"decode": 3, "encode": 2}, _setup(cpus=16))
    assert [p.name for p in procs] == [
        "encoder-1", "encoder-2", "prefill-1", "decode-1", "decode-2", "decode-3", *PLANNER, "gateway-1",
    ]  # fmt: skip
    assert {p.env.get("TRIDENT_NUM_THREADS") for p in procs[:6]} == {"2"}  # 16 cores / 6 workers
    procs = plan(compose, Method.EP_D, {"ep": 2}, _setup())
    assert [p.name for p in procs] == ["worker-ep-1", "worker-ep-2", "decode-1", *PLANNER, "gateway-1"]
    with pytest.raises(ValueError, match="planner"):
        resolve_scale(compose, Method.EP_D, {"planner": 2})
    with pytest.raises(ValueError, match="worker-epd"):
        resolve_scale(compose, Method.EPD, {"decode": 2})
    with pytest.raises(ValueError, match="--port"):
        resolve_scale(compose, Method.E_P_D, {"gateway": 2})


def test_callers_thread_count_wins() -> None:
    compose = load_compose(COMPOSE, {})
    procs = plan(compose, Method.E_P_D, {}, _setup(user_env={"TRIDENT_NUM_THREADS": "7"}))
    assert all("TRIDENT_NUM_THREADS" not in p.env for p in procs)  # inherited from the caller as is


def test_process_identity() -> None:
    me = identity(os.getpid())
    assert me["start"] == start_time(os.getpid()) is not None
    assert is_alive(me)
    assert not is_alive({**me, "start": me["start"] + 1})  # a reused pid is another process
    assert not is_alive({**me, "argv": ["redis-server"]})  # the pid runs something else
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not is_alive(identity(proc.pid))


def test_program_survives_a_retitle() -> None:
    """redis-server replaces its arguments with `redis-server host:port`: still the same program."""
    assert program(["redis-server 127.0.0.1:6379"]) == program(["/usr/bin/redis-server", "--port", "6379"])
    assert program([sys.executable, "-m", "x"]) == Path(sys.executable).name
    assert program([]) == ""


# -- the commands --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(scope="module")
def app() -> typer.Typer:
    """The `trident` app, imported on first use: it pulls in the model stack."""
    from trident.cli.app import app

    return app


def test_usage_errors_exit_2(cli_runner: CliRunner, app: typer.Typer) -> None:
    for args in (
        ["--method", "p+d"],
        ["--scale", "decode"],
        ["--scale", "decode=x"],
        ["--scale", "gateway=2"],
    ):
        result = cli_runner.invoke(app, ["up", *args])
        assert result.exit_code == 2, (args, result.output)


def test_down_with_nothing_running(
    cli_runner: CliRunner, app: typer.Typer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = cli_runner.invoke(app, ["down"])
    assert result.exit_code == 0
    assert "nothing is running" in result.output


def test_up_refuses_a_second_run(
    cli_runner: CliRunner, app: typer.Typer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / ".trident").mkdir()
    (tmp_path / ".trident" / "up.json").write_text(json.dumps(identity(os.getpid())))  # a live `trident up`
    monkeypatch.chdir(tmp_path)
    result = cli_runner.invoke(app, ["up", "--port", str(free_port())])
    assert result.exit_code == 1
    assert "already running" in result.output


def test_down_stops_what_a_killed_up_left(
    cli_runner: CliRunner, app: typer.Typer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`trident up` SIGKILLed leaves its children running; `trident down` stops them from the state file."""
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    state = {
        **identity(dead.pid),
        "processes": [{"name": "decode-1", **identity(orphan.pid), "stop_grace": 5}],
    }
    (tmp_path / ".trident").mkdir()
    (tmp_path / ".trident" / "up.json").write_text(json.dumps(state))
    monkeypatch.chdir(tmp_path)
    result = cli_runner.invoke(app, ["down"])
    assert result.exit_code == 0, result.output
    assert "stopped 1 process" in result.output
    assert orphan.wait(timeout=5) == -signal.SIGTERM
    assert not (tmp_path / ".trident" / "up.json").exists()


# -- a whole run, with stand-ins for the services ------------------------------------------------
@pytest.mark.slow  # `trident up` over stand-in services
@pytest.mark.timeout(60)
def test_up_runs_method_restarts_and_down_drains(
    tmp_path: Path, cli_runner: CliRunner, app: typer.Typer, monkeypatch: pytest.MonkeyPatch
) -> None:
    stand_in_compose(tmp_path)
    port = free_port()
    proc, lines = start_up(tmp_path, "--method", "ep+d", "--scale", "decode=2", "--port", str(port))
    try:
        assert read_until(lines, "gateway:")[-1] == f"gateway: http://127.0.0.1:{port}"
        assert (
            '"model": "model"' in read_until(lines, "try: curl")[-1]
        )  # the served name is the model directory's name

        state = json.loads((tmp_path / ".trident" / "up.json").read_text())
        assert state["method"] == "ep+d" and state["port"] == port
        names = [p["name"] for p in state["processes"]]
        assert names == ["worker-ep-1", "decode-1", "decode-2", *PLANNER, "gateway-1"]
        for p in state["processes"]:
            assert Path(p["log"]).is_file()
        records = {p["name"]: stand_in_record(tmp_path, p["pid"]) for p in state["processes"]}
        worker_env = records["worker-ep-1"]["env"]
        assert worker_env["TRIDENT_ROLES"] == "encode,prefill"
        assert worker_env["TRIDENT_NATS_URL"] == state["servers"]["nats"]["url"]
        assert worker_env["TRIDENT_REDIS_URL"] == state["servers"]["redis"]["url"]
        assert worker_env["TRIDENT_MODEL"] == str((tmp_path / "model").resolve())
        assert worker_env["TRIDENT_HTTP_PORT"] == "0"
        assert worker_env["TRIDENT_LOG_LEVEL"] == "DEBUG"
        threads = thread_split(len(os.sched_getaffinity(0)), 3)
        assert {records[n]["env"]["TRIDENT_NUM_THREADS"] for n in names[:3]} == {str(threads)}
        planner = records["planner-1"]["env"]
        assert planner["TRIDENT_HTTP_PORT"] == str(state["planner"].rsplit(":", 1)[1])
        assert "TRIDENT_PLANNER_ACTUATOR" not in planner or planner["TRIDENT_PLANNER_ACTUATOR"] == "advisory"
        assert records["decode-2"]["env"]["TRIDENT_ROLES"] == "decode"

        # A crashed worker is restarted (compose's restart: unless-stopped) and the state file follows.
        old = state["processes"][1]["pid"]
        os.kill(old, signal.SIGKILL)
        read_until(lines, "decode-1: restarted")
        state = json.loads((tmp_path / ".trident" / "up.json").read_text())
        new = state["processes"][1]["pid"]
        assert new != old
        # The stand-in handles SIGTERM once it has written its record.
        wait_until(lambda: (tmp_path / "out" / f"{new}.json").exists())

        # So is a crashed NATS, and the state file names the new server, not the dead one.
        old_nats = state["servers"]["nats"]
        os.kill(old_nats["pid"], signal.SIGKILL)
        read_until(lines, "nats: restarted")
        state = json.loads((tmp_path / ".trident" / "up.json").read_text())
        assert state["servers"]["nats"]["pid"] != old_nats["pid"]
        assert is_alive(state["servers"]["nats"])

        monkeypatch.chdir(tmp_path)
        result = cli_runner.invoke(app, ["down", "--timeout", "30"])
        assert result.exit_code == 0, result.output
        assert "stopped" in result.output
        assert proc.wait(timeout=10) == 0
    finally:
        stop_up(proc)
    # Every service got SIGTERM and drained; the servers are gone and so is the state file.
    for p in state["processes"]:
        assert stand_in_record(tmp_path, p["pid"]).get("drained"), p["name"]
    for server in state["servers"].values():
        wait_until(lambda server=server: not is_alive(server))
    assert not (tmp_path / ".trident" / "up.json").exists()
    assert (tmp_path / ".trident" / "logs" / "nats.log").is_file()


@pytest.mark.slow  # `trident up` over stand-in services
@pytest.mark.timeout(60)
def test_up_fails_when_a_service_dies_during_start_up(tmp_path: Path, monkeypatch) -> None:
    # The gateway waits for every worker, as a real one does, so it is never ready here: else, on a
    # busy machine, the stand-in gateway answered /ready before the failing decoder had exited.
    stand_in_compose(tmp_path, decode_mode="fail", gateway_mode="waiting-gateway")
    monkeypatch.setenv("STAND_IN_WORKERS", "5")  # encoder, prefill, decode, planner, planner-jobs
    proc, lines = start_up(tmp_path, "--port", str(free_port()), "--ready-timeout", "30")
    text = "\n".join(read_until(lines, None, timeout=40))
    assert proc.wait(timeout=5) == 1
    assert "decode-1 exited (code 3) during start-up" in text
    assert "boom: cannot start" in text  # the tail of its log
    assert "gateway:" not in text
    assert not (tmp_path / ".trident" / "up.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_killed_up_takes_its_servers_and_services_with_it(tmp_path: Path) -> None:
    """`trident up` SIGKILLed (a test harness, the OOM killer) left nats-server, redis-server and every
    service running, holding their ports; the kernel now sends them SIGTERM when it dies."""
    stand_in_compose(tmp_path)
    proc, lines = start_up(tmp_path, "--method", "ep+d", "--port", str(free_port()))
    try:
        read_until(lines, "gateway:")
        state = json.loads((tmp_path / ".trident" / "up.json").read_text())
        children = recorded(state)
        assert len(children) == 7 and all(is_alive(r) for r in children)
        proc.kill()
        proc.wait()
        wait_until(lambda: not any(is_alive(r) for r in children), timeout=20)
    finally:
        stop_up(proc)
    # The services were told to stop, not killed: each drained.
    assert all(stand_in_record(tmp_path, p["pid"]).get("drained") for p in state["processes"])


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_second_up_clears_what_a_dead_one_left_and_ctrl_c_stops_it(tmp_path: Path) -> None:
    """A gateway that outlived its SIGKILLed `trident up` held the port: the next `trident up` on that
    port refused to start. It now stops what the dead run's state file names, then starts. And
    SIGINT (Ctrl-C) drains that second run like `trident down`, and it exits 0."""
    stand_in_compose(tmp_path, gateway_mode="stubborn-gateway")
    port = free_port()
    first, lines = start_up(tmp_path, "--method", "epd", "--port", str(port))
    gateway: dict = {}
    try:
        read_until(lines, "gateway:")
        state = json.loads((tmp_path / ".trident" / "up.json").read_text())
        gateway = next(p for p in state["processes"] if p["service"] == "gateway")
        first.kill()
        first.wait()
        others = [r for r in recorded(state) if r is not gateway]
        wait_until(lambda: not any(is_alive(r) for r in others), timeout=20)
        assert is_alive(gateway)  # it ignores the SIGTERM its parent's death sent

        stand_in_compose(tmp_path)  # the second run's gateway stops when told, as every other service
        second, lines = start_up(tmp_path, "--method", "epd", "--port", str(port))
        try:
            seen = read_until(lines, "gateway:", timeout=40)
            assert any(
                f"trident up (pid {state['pid']}) had died; stopped 1 process" in line for line in seen
            )
            assert not is_alive(gateway)
            again = json.loads((tmp_path / ".trident" / "up.json").read_text())
            assert again["pid"] == second.pid and again["port"] == port
            assert [p["name"] for p in again["processes"]] == ["worker-epd-1", *PLANNER, "gateway-1"]
            assert (
                stand_in_record(tmp_path, again["processes"][0]["pid"])["env"]["TRIDENT_ROLES"]
                == "encode,prefill,decode"
            )
            second.send_signal(signal.SIGINT)
            assert "stopped" in read_until(lines, None)
            assert second.wait(timeout=10) == 0
        finally:
            stop_up(second)
        assert all(stand_in_record(tmp_path, p["pid"]).get("drained") for p in again["processes"])
        assert not any(is_alive(server) for server in again["servers"].values())
    finally:
        stop_up(first)
        with contextlib.suppress(ProcessLookupError):
            if is_alive(gateway):
                os.kill(gateway["pid"], signal.SIGKILL)
