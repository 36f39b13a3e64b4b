"""compose.yaml as Trident reads it: its services, their roles and environment, and each method's workers.

The planner's compose actuator scales from it, and `trident up` runs it (trident/launcher/specs.py
turns it into local processes) with the same commands and environment, except what only makes sense
inside containers: the `nats`/`redis` hostnames (local servers on loopback ports instead), the model
volume (a local directory), the advertised and bound host (127.0.0.1) and the fixed worker port (0:
each worker picks a free one). The file's `x-trident-up` key says which services are servers, which
is the gateway and which the planner, which services run for every method, and which services make
up each method.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml

from common.roles import InstanceKind, parse_roles


class ComposeError(ValueError):
    """compose.yaml cannot be run by `trident up` (missing key, bad value, bad interpolation)."""


class Method(StrEnum):
    """How the three stages are grouped into instances (docs/architecture.md)."""

    E_P_D = "e+p+d"
    EP_D = "ep+d"
    ED_P = "ed+p"
    EPD = "epd"


# Compose's default when a service gives no stop_grace_period.
DEFAULT_STOP_GRACE = 10.0

# $$, ${...} or $NAME, as Compose interpolates them.
_VAR = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>.*))?", re.DOTALL)
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
# scheme://[user[:password]@]host[:port]; the host is what gets mapped.
_URL_HOST = re.compile(r"(?P<prefix>[A-Za-z][A-Za-z0-9+.-]*://(?:[^@/\s]*@)?)(?P<host>[^:/\s@]+)(?::\d+)?")

# A whole URL, up to the next blank or comma.
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://(?:[^@/\s,]*@)?(?P<host>[^:/\s@,]+)[^\s,]*")


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Expand `$VAR`, `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?err}`, `${VAR:+alt}` and `$$`.

    The subset of Compose's interpolation that flat values use; a default holding another `${...}` is
    not supported.
    """

    def expand(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        if match["named"]:
            return env.get(match["named"], "")
        braced = _BRACED.fullmatch(match["braced"])
        if braced is None:
            raise ComposeError(f"invalid interpolation {match.group(0)!r}")
        name, op, arg = braced["name"], braced["op"], braced["arg"] or ""
        current = env.get(name)
        # The ':' forms treat an empty value like an unset one.
        missing = not current if op and op.startswith(":") else current is None
        if op in (":-", "-"):
            return arg if missing else (current or "")
        if op in (":?", "?"):
            if missing:
                raise ComposeError(f"{name}: {arg or 'required but not set'}")
            return current or ""
        if op in (":+", "+"):
            return "" if missing else arg
        return current or ""

    return _VAR.sub(expand, value)


def _interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    # Compose interpolates values only, never keys.
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {key: _interpolate_tree(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [_interpolate_tree(item, env) for item in node]
    return node


def parse_duration(text: str | int | float | None, default: float = DEFAULT_STOP_GRACE) -> float:
    """Seconds in a Compose duration such as `45s`, `1m30s` or `500ms`."""
    if text is None:
        return default
    if isinstance(text, int | float):
        return float(text)
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text.strip():
        raise ComposeError(f"invalid duration {text!r}")
    return sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)


def map_hosts(value: str, hosts: Mapping[str, str], urls: Mapping[str, str] | None = None) -> str:
    """Rewrite URLs whose host is a compose service run locally: `nats://nats:4222` → `nats://127.0.0.1:N`.
    A host in `urls` (a local group of servers) has its whole URL replaced, credentials included:
    `redis://redis:6379/0` → `redis+sentinel://127.0.0.1:S1,.../trident/0`."""
    if urls:
        value = _URL.sub(lambda m: urls.get(m["host"], m.group(0)), value)

    def replace(match: re.Match[str]) -> str:
        local = hosts.get(match["host"])
        return match["prefix"] + local if local else match.group(0)

    return _URL_HOST.sub(replace, value)


def _environment(raw: Any, env: Mapping[str, str]) -> dict[str, str]:
    """A service's environment as a dict, from either Compose form; a bare `KEY` takes the shell's value."""
    pairs: dict[str, Any] = {}
    if isinstance(raw, list):
        for item in raw:
            key, sep, value = str(item).partition("=")
            pairs[key] = value if sep else None
    elif isinstance(raw, dict):
        pairs = dict(raw)
    elif raw is not None:
        raise ComposeError(f"environment must be a list or a mapping, got {type(raw).__name__}")
    result: dict[str, str] = {}
    for key, value in pairs.items():
        if value is None:
            if key in env:
                result[key] = env[key]
        elif isinstance(value, bool):
            result[key] = "true" if value else "false"
        else:
            result[key] = str(value)
    return result


@dataclass(frozen=True)
class Service:
    """What `trident up` takes from one compose service."""

    name: str
    command: tuple[str, ...]
    environment: dict[str, str]
    restart: str
    stop_grace: float
    profiles: tuple[str, ...] = ()

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r.strip() for r in self.environment.get("TRIDENT_ROLES", "").split(",") if r.strip())

    @property
    def aliases(self) -> tuple[str, ...]:
        """Other names `--scale` accepts: the role (`encode`) or the hybrid's initials (`ep`)."""
        kind = InstanceKind.of(parse_roles(",".join(self.roles))) if self.roles else None
        return (kind.scale_name,) if kind else ()


@dataclass(frozen=True)
class ComposeFile:
    """compose.yaml, interpolated, with its `x-trident-up` map."""

    path: Path
    services: dict[str, Service]
    servers: dict[str, str]  # compose service -> local server kind ("nats" | "redis")
    model_init: str | None
    gateway: str
    always: tuple[str, ...]  # run once each, whatever the method (the planner and its jobs worker)
    methods: dict[Method, tuple[str, ...]]
    planner: str | None = None  # the service whose port is `trident up --planner-port`

    def workers(self, method: Method) -> tuple[str, ...]:
        """The services that run an engine for `method` (the ones `--scale` and a plan scale)."""
        return self.methods[method]

    @property
    def all_workers(self) -> tuple[str, ...]:
        """Every service that runs an engine for some method, each once."""
        return tuple(dict.fromkeys(name for names in self.methods.values() for name in names))


def load_compose(path: str | Path, env: Mapping[str, str]) -> ComposeFile:
    """Read and interpolate compose.yaml (anchors and `<<` merges resolved); check its x-trident-up."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ComposeError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("services"), dict):
        raise ComposeError(f"{path} has no services")
    data = _interpolate_tree(data, env)
    raw_services: dict[str, dict] = data["services"]
    up = data.get("x-trident-up")
    if not isinstance(up, dict):
        raise ComposeError(f"{path} has no x-trident-up map")

    def known(name: Any) -> str:
        if name not in raw_services:
            raise ComposeError(f"x-trident-up names {name!r}, which is not a service of {path}")
        return name

    servers = {known(service): str(kind) for service, kind in (up.get("servers") or {}).items()}
    unknown_kinds = set(servers.values()) - {"nats", "redis"}
    if unknown_kinds:
        raise ComposeError(f"x-trident-up.servers: unknown server kinds {sorted(unknown_kinds)}")
    model_init = known(up["model-init"]) if up.get("model-init") else None
    gateway = known(up.get("gateway"))
    planner = known(up["planner"]) if up.get("planner") else None
    always = tuple(known(name) for name in up.get("always") or [])
    if planner is not None and planner not in always:
        raise ComposeError(f"x-trident-up.planner {planner!r} must be listed in x-trident-up.always")
    methods: dict[Method, tuple[str, ...]] = {}
    for method in Method:
        names = (up.get("methods") or {}).get(method.value)
        if not names:
            raise ComposeError(f"x-trident-up.methods has no {method.value!r}")
        methods[method] = tuple(known(name) for name in names)
    run = {gateway, *always, *(name for names in methods.values() for name in names)}
    services = {name: _service(name, raw_services[name], env) for name in sorted(run)}
    return ComposeFile(path, services, servers, model_init, gateway, always, methods, planner)


def _service(name: str, raw: dict, env: Mapping[str, str]) -> Service:
    command = raw.get("command")
    if isinstance(command, str):
        command = shlex.split(command)
    if not command:
        raise ComposeError(f"service {name!r} needs a command for `trident up` to run it")
    restart = raw.get("restart", "no")
    return Service(
        name=name,
        command=tuple(str(part) for part in command),
        environment=_environment(raw.get("environment"), env),
        restart="no" if restart is False else str(restart),
        stop_grace=parse_duration(raw.get("stop_grace_period")),
        profiles=tuple(str(p) for p in raw.get("profiles") or ()),
    )


def parse_scale(items: list[str]) -> dict[str, int]:
    """`["decode=2", "encoder=1"]` → `{"decode": 2, "encoder": 1}`; ValueError says what is wrong."""
    scale: dict[str, int] = {}
    for item in items:
        name, sep, count = item.partition("=")
        name = name.strip()
        if not sep or not name or not count.strip().isdigit():
            raise ValueError(f"{item!r} is not SERVICE=N (e.g. decode=2)")
        if int(count) < 1:
            raise ValueError(f"{item!r}: every service of a method needs at least one process")
        scale[name] = int(count)
    return scale


def resolve_scale(compose: ComposeFile, method: Method, scale: Mapping[str, int]) -> dict[str, int]:
    """Processes per worker service of `method`; `scale` may name a service or its alias (role, initials)."""
    names = compose.workers(method)
    by_alias = {alias: name for name in names for alias in (name, *compose.services[name].aliases)}
    counts = dict.fromkeys(names, 1)
    for key, count in scale.items():
        if key not in by_alias:
            hint = (
                "it owns --port"
                if key == compose.gateway
                else f"method {method.value} runs {', '.join(names)}"
            )
            raise ValueError(f"cannot scale {key!r}: {hint}")
        counts[by_alias[key]] = count
    return counts


def plan_scale(compose: ComposeFile, method: Method, replicas: Mapping[str, int]) -> dict[str, int]:
    """Processes per worker service for a plan: `{"e": 2, "p": 1, "d": 3}` under e+p+d →
    `{"encoder": 2, "prefill": 1, "decode": 3}`. ValueError for a kind the method does not run."""
    unknown = sorted(set(replicas) - set(InstanceKind))
    if unknown:
        raise ValueError(f"unknown instance kinds {unknown}")
    # A kind as `--scale` names it: a role, or a hybrid's initials.
    given = {InstanceKind(k).scale_name: n for k, n in replicas.items() if n > 0}
    counts = resolve_scale(compose, method, given)
    missing = [name for name in counts if not given.keys() & {name, *compose.services[name].aliases}]
    if missing:
        raise ValueError(f"the plan gives no replicas for {', '.join(missing)} of {method.value}")
    return counts
