"""`trident up` and `trident down`: compose.yaml's services as local processes, where there is no Docker."""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Annotated, Any

import typer

from common.compose import ComposeError, Method, load_compose, parse_scale, resolve_scale
from common.infra import free_port
from common.models import ModelError, resolve_model
from trident.launcher.compose_follow import (
    ComposeProject,
    Follower,
    FollowError,
    GatewayView,
    default_gateway,
)
from trident.launcher.deployment import Deployment, UpConfig
from trident.launcher.state import HOME, STATE, StateFile, clear_leftovers, is_alive, send, wait_gone
from trident.launcher.warm import WarmStarter

DEFAULT_PLANNER_PORT = 8100
PORTS_FREED = 10.0  # seconds a dead run's ports get to be released after its processes are stopped


def find_compose(file: Path | None) -> Path:
    """--file, else ./compose.yaml, else the repository's (an editable install runs from anywhere)."""
    if file is not None:
        return file
    for candidate in (Path("compose.yaml"), Path(__file__).resolve().parents[2] / "compose.yaml"):
        if candidate.is_file():
            return candidate
    raise typer.BadParameter("no compose.yaml here or in the repository; pass one", param_hint="--file")


def port_free(port: int) -> bool:
    """True if nothing listens on 127.0.0.1:`port` (the gateway's bind would fail otherwise)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As the gateway's server does: connections of a just-stopped run in TIME_WAIT do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def clear_dead_run(state_file: StateFile) -> None:
    """Refuse to start beside a live `trident up`; stop what a dead one (SIGKILL, OOM) left running,
    so its servers and gateway give their ports back before this run binds them."""
    state = state_file.read()
    if state is None:
        return
    if is_alive(state):
        typer.echo(
            f"error: trident up is already running here (pid {state['pid']}, {state.get('gateway')}); "
            "stop it with `trident down`",
            err=True,
        )
        raise typer.Exit(1)
    stopped = clear_leftovers(state)
    state_file.remove()
    if stopped:
        pid = state["pid"]
        typer.echo(f"an earlier trident up (pid {pid}) had died; stopped {stopped} process(es) it left")
        # A process's last thread may still be closing its sockets when /proc shows it gone.
        wait_ports_free(recorded_ports(state), PORTS_FREED)


def recorded_ports(state: dict[str, Any]) -> list[int]:
    """The ports a state file's deployment listened on: the gateway's, the planner's, the servers'."""
    ports = [state.get("port")]
    if state.get("planner"):
        ports.append(urllib.parse.urlsplit(state["planner"]).port)
    ports += [server.get("port") for server in state.get("servers", {}).values()]
    return [int(port) for port in ports if port]


def wait_ports_free(ports: list[int], timeout: float) -> bool:
    """Wait until nothing listens on any of `ports`; False on timeout (the caller's own check says which)."""
    deadline = time.monotonic() + timeout
    while not all(port_free(port) for port in ports):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


# `trident up`'s flags, one alias each, so its signature reads as the table of them.
Model = Annotated[
    str | None,
    typer.Option(
        help="A checkpoint directory, or a preset name (tiny-llava, small-llava, ...; `trident "
        "make-model --help` lists them) written to .trident/models/<preset> on first use; "
        "default: tiny-llava."
    ),
]
MethodFlag = Annotated[
    Method, typer.Option(help="How stages group into instances: e+p+d, ep+d, ed+p or epd.")
]
Scale = Annotated[
    list[str] | None,
    typer.Option(
        metavar="SERVICE=N",
        help="Processes of one of the method's services (decode=2; a role or ep/ed/epd works too).",
    ),
]
Port = Annotated[int, typer.Option(min=1, max=65535, help="The gateway's API port.")]
ComposeFlag = Annotated[
    Path | None,
    typer.Option("--file", "-f", exists=True, dir_okay=False, help="Compose file; default: compose.yaml."),
]
ReadyTimeout = Annotated[
    float, typer.Option(min=1, help="Seconds to wait for the gateway's /ready before giving up.")
]
PlannerPort = Annotated[
    int, typer.Option(min=0, max=65535, help="The planner's port; 0: 8100 if free, else any free port.")
]
FollowPlan = Annotated[
    bool,
    typer.Option(
        "--follow-plan",
        help="Apply the planner's plans: start and drain workers to match (the launcher actuator).",
    ),
]
Ha = Annotated[
    bool,
    typer.Option(
        "--ha",
        help="Run NATS as a three-node cluster (the task stream kept on all three) and Redis as "
        "a primary with a replica and three sentinels, so losing any one of them loses nothing.",
    ),
]
TlsFlag = Annotated[
    bool,
    typer.Option(
        "--tls",
        help="Mutual TLS on every channel between the deployment's processes (NATS, Redis, bulk "
        "transfers, the workers' HTTP), from a private CA made for this run under "
        ".trident/secrets/tls. The gateway's API stays plain HTTP on loopback.",
    ),
]
Warm = Annotated[
    bool,
    typer.Option(
        "--warm/--cold",
        help="--warm: fork each service from one process that imported torch and transformers "
        "once (faster start and restart, shared pages); --cold: each from a bare interpreter.",
    ),
]


def up(
    model: Model = None,
    method: MethodFlag = Method.E_P_D,
    scale: Scale = None,
    port: Port = 8000,
    file: ComposeFlag = None,
    ready_timeout: ReadyTimeout = 120.0,
    planner_port: PlannerPort = 0,
    follow_plan: FollowPlan = False,
    ha: Ha = False,
    tls: TlsFlag = False,
    warm: Warm = True,
) -> None:
    """Run compose.yaml's services as local processes (no Docker); Ctrl-C or `trident down` stops them."""
    compose, counts = _compose_and_scale(file, method, scale)
    try:
        model_dir = resolve_model(model, HOME / "models", typer.echo).resolve()
    except ModelError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from None
    clear_dead_run(StateFile(STATE))
    config = UpConfig(
        compose=compose,
        method=method,
        scale=counts,
        model=model_dir,
        port=port,
        home=HOME,
        ready_timeout=ready_timeout,
        planner_port=_free_ports(port, planner_port),
        follow_plan=follow_plan,
        ha=ha,
        tls=tls,
    )
    deployment = Deployment(config, typer.echo, starter=WarmStarter() if warm else None)
    raise typer.Exit(deployment.run())


def _compose_and_scale(file: Path | None, method: Method, scale: list[str] | None):
    """compose.yaml read, and --scale checked against its services for `method`."""
    try:
        counts = parse_scale(scale or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--scale") from None
    try:
        compose = load_compose(find_compose(file), os.environ)
    except ComposeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    try:
        resolve_scale(compose, method, counts)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--scale") from None
    return compose, counts


def _free_ports(port: int, planner_port: int) -> int:
    """Exit 1 if the gateway's or the planner's port is taken; the planner's port (8100 if free, else
    any free one, unless --planner-port names one)."""
    if not port_free(port):
        typer.echo(f"error: port {port} is in use; choose another with --port", err=True)
        raise typer.Exit(1)
    if planner_port and not port_free(planner_port):
        typer.echo(f"error: port {planner_port} is in use; choose another with --planner-port", err=True)
        raise typer.Exit(1)
    if not planner_port:
        planner_port = DEFAULT_PLANNER_PORT if port_free(DEFAULT_PLANNER_PORT) else free_port()
    return planner_port


def down(
    timeout: Annotated[
        float, typer.Option(min=0, help="Seconds to wait for `trident up` to drain and stop everything.")
    ] = 120.0,
) -> None:
    """Stop the `trident up` running from this directory: it drains the services, then exits."""
    state_file = StateFile(STATE)
    state = state_file.read()
    if state is None:
        typer.echo(f"nothing is running: no {STATE} here")
        return
    if is_alive(state):
        typer.echo(f"stopping trident up (pid {state['pid']}); the services drain first")
        send(state, signal.SIGTERM)
        if not wait_gone([state], timeout):
            typer.echo(f"error: trident up (pid {state['pid']}) still runs after {timeout:.0f} s", err=True)
            raise typer.Exit(1)
        typer.echo("stopped")
        return
    # `trident up` died without cleaning up (SIGKILL, a crash): stop what it left behind.
    stopped = clear_leftovers(state)
    state_file.remove()
    if stopped:
        typer.echo(f"trident up (pid {state['pid']}) was gone; stopped {stopped} process(es) it had left")
    else:
        typer.echo(f"nothing is running (removed a stale {STATE})")


def follow_plan(
    file: Annotated[
        Path | None, typer.Option("--file", "-f", help="The compose file the deployment runs.")
    ] = None,
    project: Annotated[
        str | None, typer.Option("--project-name", "-p", help="Compose project (default: the file's `name`).")
    ] = None,
    gateway: Annotated[
        str | None,
        typer.Option(help="The gateway's URL (default: http://127.0.0.1:$TRIDENT_PORT, or :8000)."),
    ] = None,
    api_key: Annotated[
        str, typer.Option(envvar="TRIDENT_API_KEY", help="Bearer key, when the gateway asks for one.")
    ] = "",
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between looks at the plan.")] = 5.0,
    ready_timeout: Annotated[
        float, typer.Option(min=1, help="Seconds new replicas get to register before giving up.")
    ] = 300.0,
    once: Annotated[bool, typer.Option("--once", help="Apply the current plan, then exit.")] = False,
) -> None:
    """Make a `docker compose` deployment run the plans its planner makes: new replicas first,
    then the ones the plan drops, drained. Run it on the Docker host."""
    path = find_compose(file)
    try:
        compose = load_compose(path, os.environ)
    except ComposeError as exc:
        raise typer.BadParameter(str(exc), param_hint="--file") from None
    view = GatewayView(gateway or default_gateway(os.environ), api_key)
    follower = Follower(
        compose, ComposeProject(compose, project, os.environ), view, ready_timeout, typer.echo
    )
    typer.echo(f"following the plans {view.url}/v1/cluster shows, for {path}")
    while True:
        try:
            follower.step()
        except (FollowError, ValueError) as exc:
            typer.echo(f"error: {exc}", err=True)
            if once:
                raise typer.Exit(1) from None
        if once:
            return
        time.sleep(interval)
