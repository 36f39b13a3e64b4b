"""compose.yaml, compose.gpu.yaml and the Dockerfiles: valid against the Compose Specification, and built
so that `docker compose up --scale decode=3` works (no container names, no host ports on workers, health
checks, ordered start-up). No Docker engine runs here, so the schema is the check.
"""

from __future__ import annotations

import copy
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import typer

from services.settings import GatewaySettings, PlannerSettings, WorkerSettings
from tests.helpers.compose_files import merge, read_compose_file
from trident.cli.up import up

REPO = Path(__file__).resolve().parents[1]
SCHEMA_PATH = REPO / "tests" / "data" / "compose-spec.json"  # shipped: data/README.md says whence
WORKERS = ("encoder", "prefill", "decode", "worker-ep", "worker-ed", "worker-epd")
APP = ("gateway", *WORKERS)  # the services built from this repository that load the model
PLANNER = ("planner", "planner-jobs")  # built from this repository too; they need no model
DEFAULT = {"nats", "redis", "secrets-init", "model-init", "gateway", "encoder", "prefill", "decode", *PLANNER}
# Compose's rule for profile names (a '+' is not allowed, hence ep-d rather than ep+d).
PROFILE_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]+$")


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    """The Compose Specification's schema (shipped in tests/data); a missing file fails."""
    candidates = [SCHEMA_PATH]
    if os.environ.get("TRIDENT_COMPOSE_SCHEMA"):
        candidates.append(Path(os.environ["TRIDENT_COMPOSE_SCHEMA"]))
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        pytest.fail(f"Compose schema not found at {SCHEMA_PATH} (or $TRIDENT_COMPOSE_SCHEMA)")
    schema = json.loads(path.read_text())
    # The file names draft-07 by a URL jsonschema does not map, so pick the validator explicitly.
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return read_compose_file("compose.yaml")


@pytest.fixture(scope="module")
def gpu(compose: dict[str, Any]) -> dict[str, Any]:
    return merge(compose, read_compose_file("compose.gpu.yaml"))


def _errors(validator: jsonschema.Draft7Validator, doc: dict[str, Any]) -> list[str]:
    return [f"{e.json_path}: {e.message}" for e in validator.iter_errors(doc)]


def test_files_match_the_compose_spec(validator: jsonschema.Draft7Validator, gpu: dict[str, Any]) -> None:
    assert _errors(validator, read_compose_file("compose.yaml")) == []
    assert _errors(validator, read_compose_file("compose.gpu.yaml")) == []
    assert _errors(validator, gpu) == []


def test_schema_catches_mistakes(validator: jsonschema.Draft7Validator, compose: dict[str, Any]) -> None:
    """Guards the test above against a schema that accepts anything."""
    broken = copy.deepcopy(compose)
    broken["services"]["decode"]["replica"] = 3
    broken["services"]["nats"]["healthcheck"]["retries"] = [5]
    assert len(_errors(validator, broken)) == 2


def _walk(node: Any) -> list[dict[str, Any]]:
    if isinstance(node, dict):
        return [node] + [m for value in node.values() for m in _walk(value)]
    if isinstance(node, list):
        return [m for item in node for m in _walk(item)]
    return []


@pytest.mark.parametrize("name", ["compose.yaml", "compose.gpu.yaml"])
def test_no_container_names(name: str) -> None:
    # A fixed container name would make `--scale` fail on the second replica.
    assert all("container_name" not in mapping for mapping in _walk(read_compose_file(name)))


def test_only_unscaled_services_publish_ports(compose: dict[str, Any], gpu: dict[str, Any]) -> None:
    for doc in (compose, gpu):
        published = {
            name for name, service in doc["services"].items()
            if service.get("ports") and "monitoring" not in service.get("profiles", ())
        }  # fmt: skip
        assert published == {"gateway"}  # secure by default: nothing else is reachable from the host
    # The opt-in monitoring profile publishes Prometheus and Grafana, on loopback only.
    monitoring = {n: s for n, s in compose["services"].items() if "monitoring" in s.get("profiles", ())}
    assert set(monitoring) == {"prometheus", "grafana"}
    assert all(port.startswith("127.0.0.1:") for s in monitoring.values() for port in s["ports"])
    assert compose["services"]["gateway"]["ports"] == ["${TRIDENT_PORT:-8000}:8000"]
    expose = merge(compose, read_compose_file("compose.expose.yaml"))
    assert expose["services"]["planner"]["ports"] == ["127.0.0.1:${TRIDENT_PLANNER_PORT:-8100}:8100"]


def test_start_up_order(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        depends = service.get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions"
        for dep in ("nats", "redis"):
            if dep in depends:
                assert depends[dep] == {"condition": "service_healthy"}, name
        if "model-init" in depends:
            assert depends["model-init"] == {"condition": "service_completed_successfully"}, name
    for name in APP:
        assert set(compose["services"][name]["depends_on"]) == {"nats", "redis", "model-init"}
    assert set(compose["services"]["planner"]["depends_on"]) == {"nats", "redis"}
    assert set(compose["services"]["planner-jobs"]["depends_on"]) == {"redis"}


def test_health_checks(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        if service.get("restart", "no") != "no":
            assert service.get("healthcheck", {}).get("test"), f"{name} runs for good but has no health check"
    model_init = compose["services"]["model-init"]
    assert model_init["restart"] == "no" and "healthcheck" not in model_init
    for name in APP:
        service = compose["services"][name]
        # The probe dials the port the service is told to serve on.
        assert "os.environ['TRIDENT_HTTP_PORT']" in service["healthcheck"]["test"][-1]
        assert "/health" in service["healthcheck"]["test"][-1]
        assert service["environment"]["TRIDENT_HTTP_PORT"] == ("8000" if name == "gateway" else "9000")
    planner = compose["services"]["planner"]
    assert planner["healthcheck"] == compose["services"]["gateway"]["healthcheck"]
    assert planner["environment"]["TRIDENT_HTTP_PORT"] == "8100"
    assert "inspect ping" in compose["services"]["planner-jobs"]["healthcheck"]["test"][-1]


def test_nats_monitoring_answers_inside_its_container_only(compose: dict[str, Any]) -> None:
    """/connz, /subsz and /jsz list connections, subjects and streams: no other container may ask."""
    conf = compose["configs"]["nats-conf"]["content"]
    assert re.search(r"^http: 127\.0\.0\.1:8222$", conf, re.M) and "http_port" not in conf
    assert "http://127.0.0.1:8222/healthz" in " ".join(compose["services"]["nats"]["healthcheck"]["test"])


def test_services_and_profiles(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert {name for name, s in services.items() if not s.get("profiles")} == DEFAULT
    for name, service in services.items():
        assert all(PROFILE_NAME.match(p) for p in service.get("profiles", [])), name
    assert services["worker-ep"]["profiles"] == ["ep-d"]
    assert services["worker-ed"]["profiles"] == ["ed-p"]
    assert services["worker-epd"]["profiles"] == ["epd"]
    methods = compose["x-trident-up"]["methods"]
    assert set(methods) == {"e+p+d", "ep+d", "ed+p", "epd"}
    assert all(name in services for names in methods.values() for name in names)
    assert compose["x-trident-up"]["always"] == list(PLANNER)
    assert compose["x-trident-up"]["planner"] == "planner"


def test_planner_services(compose: dict[str, Any]) -> None:
    planner, jobs = (compose["services"][name] for name in PLANNER)
    assert planner["command"] == ["python", "-m", "services.planner"]
    # `python -m celery` so that `trident up` runs it with its own interpreter, like every service.
    assert jobs["command"][:4] == ["python", "-m", "celery", "--app=services.planner.jobs"]
    assert "--pool=solo" in jobs["command"] and "--concurrency=1" in jobs["command"]
    for service in (planner, jobs):
        assert service["environment"]["TRIDENT_REDIS_URL"] == "redis://redis:6379/0"
        assert service["image"] == "trident:cpu" and service["init"] is True
    # The compose actuator reads the methods of the file it would scale.
    assert planner["volumes"] == ["./compose.yaml:/app/compose.yaml:ro", "secrets:/secrets:ro"]
    assert jobs["volumes"] == ["secrets:/secrets:ro"]
    assert planner["environment"]["TRIDENT_PLANNER_ACTUATOR"] == "${TRIDENT_PLANNER_ACTUATOR:-advisory}"


def test_environment(compose: dict[str, Any]) -> None:
    roles = {
        "encoder": "encode",
        "prefill": "prefill",
        "decode": "decode",
        "worker-ep": "encode,prefill",
        "worker-ed": "encode,decode",
        "worker-epd": "encode,prefill,decode",
    }
    for name in APP:
        env = compose["services"][name]["environment"]
        # Strings only: YAML would turn an unquoted 9000 into an int, and `no` into False.
        assert all(isinstance(value, str) for value in env.values()), name
        assert env["TRIDENT_ADVERTISE_HOST"] == "auto"
        assert env["TRIDENT_BIND_HOST"] == "0.0.0.0"
        assert env["TRIDENT_NATS_URL"] == "nats://nats:4222"
        assert env["TRIDENT_REDIS_URL"] == "redis://redis:6379/0"
        assert env["TRIDENT_MODEL"] == "/models/tiny-llava"
        assert env.get("TRIDENT_ROLES") == roles.get(name)
        assert env["TRIDENT_SECRETS_DIR"] == "/secrets"
        assert compose["services"][name]["volumes"] == ["models:/models:ro", "secrets:/secrets:ro"]
    assert compose["services"]["model-init"]["volumes"] == ["models:/models"]
    script = compose["services"]["model-init"]["command"][-1]
    assert "trident make-model /models/tiny-llava --preset tiny-llava" in script


def test_gpu_override(gpu: dict[str, Any]) -> None:
    for name in ("model-init", *APP, *PLANNER):
        service = gpu["services"][name]
        assert service["image"] == "trident:gpu"
        assert service["build"] == {"context": ".", "dockerfile": "Dockerfile.gpu"}
    for name in WORKERS:
        service = gpu["services"][name]
        assert service["environment"]["TRIDENT_DEVICE"] == "cuda"
        assert service["environment"]["TRIDENT_ROLES"]  # merged over compose.yaml's, not replacing it
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "deploy" not in gpu["services"]["gateway"]
    assert gpu["services"]["worker-ep"]["profiles"] == ["ep-d"]


def test_dockerfiles() -> None:
    cpu = (REPO / "Dockerfile").read_text()
    assert cpu.startswith("#") and "FROM python:3.11-slim" in cpu
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in cpu
    # The CPU torch first, then the dependencies alone, then the project's code without them.
    assert cpu.index("torch==2.13.0") < cpu.index("pip install -r") < cpu.index("pip install --no-deps .")
    assert cpu.index("COPY pyproject.toml") < cpu.index("pip install -r") < cpu.index("COPY common")
    assert "WORKDIR /app" in cpu and re.search(r"^USER (?!root)\w+", cpu, re.M)
    gpu = (REPO / "Dockerfile.gpu").read_text()
    assert "nvidia/cuda:" in gpu and "'.[gpu]'" in gpu and re.search(r"^USER (?!root)\w+", gpu, re.M)
    ignored = set((REPO / ".dockerignore").read_text().split())
    assert {".git", ".venv", ".trident", "**/__pycache__"} <= ignored


def test_pyyaml_is_a_runtime_dependency() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"pyyaml\b", d, re.I) for d in deps)


def test_running_md_documents_every_variable_and_flag() -> None:
    doc = (REPO / "docs" / "running.md").read_text()
    fields = {*WorkerSettings.model_fields, *GatewaySettings.model_fields, *PlannerSettings.model_fields}
    missing = sorted(f"TRIDENT_{f.upper()}" for f in fields if f"`TRIDENT_{f.upper()}`" not in doc)
    assert not missing, f"docs/running.md lacks {missing}"
    from trident.cli.plan import plan
    from trident.cli.up import follow_plan

    for command in (up, plan, follow_plan):
        app = typer.Typer(add_completion=False)
        app.command()(command)
        flags = [opt for param in typer.main.get_command(app).params for opt in param.opts]
        assert [f for f in flags if f"`{f}" not in doc] == [], command.__name__


@pytest.fixture(scope="module")
def ha(compose: dict[str, Any]) -> dict[str, Any]:
    return merge(compose, read_compose_file("compose.ha.yaml"))


def test_ha_override(validator: jsonschema.Draft7Validator, ha: dict[str, Any]) -> None:
    """compose.ha.yaml: three NATS nodes routed with the token, Redis with a replica and three
    sentinels, every Trident service pointed at all of them, and still nothing published."""
    assert _errors(validator, read_compose_file("compose.ha.yaml")) == []
    assert _errors(validator, ha) == []
    services = ha["services"]
    nodes = ["nats", "nats-2", "nats-3"]
    assert all(
        services[n]["configs"] == [{"source": "nats-cluster-conf", "target": "/etc/nats/nats.conf"}]
        for n in nodes
    )
    conf = ha["configs"]["nats-cluster-conf"]["content"]
    assert 'include "routes.conf"' in conf
    command = ha["x-nats-node"]["command"][-1]
    assert "nats-route://route:%s@%s:6222" in command and "for n in nats nats-2 nats-3;" in command
    assert "user: route" in conf and "http: 127.0.0.1:8222" in conf
    sentinels = [f"sentinel-{i}" for i in (1, 2, 3)]
    assert {services[s]["environment"]["NODE"] for s in sentinels} == set(sentinels)
    assert services["redis-replica"]["environment"] == {"NODE": "redis-replica", "PRIMARY": "redis"}
    for name in (*APP, *PLANNER):
        env = services[name]["environment"]
        assert env["TRIDENT_NATS_URL"] == ",".join(f"nats://{n}:4222" for n in nodes)
        assert (
            env["TRIDENT_REDIS_URL"]
            == "redis+sentinel://" + ",".join(f"{s}:26379" for s in sentinels) + "/trident/0"
        )
        assert env["TRIDENT_NATS_STREAM_REPLICAS"] == "3"
        assert env["TRIDENT_SECRETS_DIR"] == "/secrets"  # merged over compose.yaml's, not replacing it
        assert {*nodes, "redis", "redis-replica", *sentinels} <= set(services[name]["depends_on"])
    published = {name for name, s in services.items() if s.get("ports") and not s.get("profiles")}
    assert published == {"gateway"}


@pytest.fixture(scope="module")
def tls(compose: dict[str, Any]) -> dict[str, Any]:
    return merge(compose, read_compose_file("compose.tls.yaml"))


def test_tls_override(validator: jsonschema.Draft7Validator, tls: dict[str, Any]) -> None:
    """compose.tls.yaml: secrets-init makes the deployment's CA once, NATS asks clients for its
    certificate before a word, Redis listens on TLS only and asks the same, every Trident service
    is told the folder, and a worker's health check shows the certificate (its HTTP asks for one).
    Run under a real engine by hand (docs/running.md); CI checks the merged file here."""
    assert _errors(validator, read_compose_file("compose.tls.yaml")) == []
    assert _errors(validator, tls) == []
    services = tls["services"]
    init = services["secrets-init"]["command"][-1]
    assert "issue(tls" in init and '(tls / "key.pem").exists() or' in init and "os.chown" in init
    assert services["nats"]["configs"] == [{"source": "nats-tls-conf", "target": "/etc/nats/nats.conf"}]
    conf = tls["configs"]["nats-tls-conf"]["content"]
    assert (
        "verify: true" in conf
        and "handshake_first: true" in conf
        and 'ca_file: "/secrets/tls/ca.pem"' in conf
    )
    redis = services["redis"]["command"][-1]
    assert "--port 0 --tls-port 6379" in redis and "--tls-auth-clients yes" in redis
    assert "--requirepass" in redis  # the password still asked, besides the certificate
    assert "redis-cli --tls --cert /secrets/tls/cert.pem" in services["redis"]["healthcheck"]["test"][-1]
    for name in (*APP, *PLANNER):
        env = services[name]["environment"]
        assert env["TRIDENT_TLS_DIR"] == "/secrets/tls"
        assert env["TRIDENT_SECRETS_DIR"] == "/secrets"  # merged over compose.yaml's, not replacing it
    for name in APP:
        probe = services[name]["healthcheck"]["test"]
        if name == "gateway":  # the gateway's API stays HTTP
            assert "urlopen" in probe[-1]
        else:
            assert probe == ["CMD", "python", "-m", "services.worker.probe", "/health"]
            assert services[name]["healthcheck"]["start_period"] == "120s"  # merged, not replaced
