"""The Kubernetes manifests `trident kubernetes` writes, checked offline for every method, with and
without GPUs: the Kubernetes schemas (kubernetes-validate, strict), the KEDA, Prometheus-operator and
cert-manager CRD schemas (the @kubernetes-models validators, in node), checkov's policies with the
exceptions deploy/kubernetes/checkov.yaml writes down, and the invariants every instance kind must
hold. The flows the policies allow: test_flows.py; the autoscaling contract: test_autoscaling.py.

The checkers live in .venv-tools (`make install` puts them there)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from common.infra.settings import NATS
from common.planner.types import METHOD_KINDS
from common.roles import InstanceKind
from trident.cli.app import app
from trident.kubernetes.render import DRAIN_TIMEOUT, Options, render, to_yaml

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".venv-tools"
VARIANTS = [(method, gpu) for method in METHOD_KINDS for gpu in (False, True)]
IDS = [f"{m}{'-gpu' if g else ''}" for m, g in VARIANTS]


def tool(name: str) -> Path:
    path = TOOLS / "bin" / name
    if not path.exists():
        pytest.fail(f"{path} is missing: `make install` installs the Kubernetes checkers")
    return path


@pytest.fixture(scope="module")
def rendered() -> dict[tuple[str, bool], list[dict]]:
    return {(m, g): render(Options(method=m, gpu=g)) for m, g in VARIANTS}


@pytest.fixture(scope="module")
def written(rendered, tmp_path_factory) -> Path:
    """Every variant as YAML, one folder each, read back as `kubectl apply` would read it."""
    root = tmp_path_factory.mktemp("k8s")
    for (method, gpu), objects in rendered.items():
        folder = root / f"{method.replace('+', '-')}{'-gpu' if gpu else ''}"
        folder.mkdir()
        (folder / "trident.yaml").write_text(to_yaml(objects))
        assert list(yaml.safe_load_all((folder / "trident.yaml").read_text())) == objects
    return root


@pytest.mark.slow  # an external validator over every object (tens of seconds): `make test`, not the fast tier
def test_the_objects_pass_the_kubernetes_schemas(written: Path) -> None:
    files = sorted(str(p) for p in written.glob("*/trident.yaml"))
    run = subprocess.run([tool("kubernetes-validate"), "--strict", *files], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    unknown = set(re.findall(r"find schema for kind (\w+)", run.stdout + run.stderr))
    custom = {"ScaledObject", "ServiceMonitor", "Certificate", "Issuer"}
    assert unknown == custom, unknown  # the custom resources: below


def crd_check(objects: list[dict]) -> tuple[int, list[dict]]:
    """Run tests/kubernetes/crd_check.mjs where node resolves the packages (.venv-tools/npm)."""
    packages = TOOLS / "npm"
    if not (packages / "node_modules" / "@kubernetes-models").exists() or shutil.which("node") is None:
        pytest.fail("node or the @kubernetes-models packages are missing: `make install` installs them")
    script = packages / "crd_check.mjs"
    shutil.copyfile(Path(__file__).with_name("crd_check.mjs"), script)
    run = subprocess.run(
        ["node", script], input=json.dumps(objects), capture_output=True, text=True, timeout=120
    )
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode in (0, 1), run.stderr
    return run.returncode, lines


def test_the_custom_resources_pass_their_crd_schemas(rendered) -> None:
    objects = [o for variant in rendered.values() for o in variant]
    code, lines = crd_check(objects)
    assert code == 0 and all(line["valid"] for line in lines), [line for line in lines if not line["valid"]]
    # Every kind in every variant: the planner may move any deployment to another method.
    assert sum(line["kind"] == "ScaledObject" for line in lines) == len(InstanceKind) * len(VARIANTS)
    # Two per variant: the gateway's and planner's over HTTP, the workers' over mutual TLS.
    assert sum(line["kind"] == "ServiceMonitor" for line in lines) == 2 * len(VARIANTS)
    # cert-manager: the self-signed issuer, the CA, the CA's issuer, Prometheus's certificate.
    assert sum(line["kind"] in ("Certificate", "Issuer") for line in lines) == 4 * len(VARIANTS)
    # The check can fail: a threshold that is not a string, as KEDA's schema says it must be.
    broken = json.loads(json.dumps(next(o for o in objects if o["kind"] == "ScaledObject")))
    broken["spec"]["triggers"][0]["metadata"]["threshold"] = 1
    code, lines = crd_check([broken])
    assert code == 1 and "threshold" in lines[0]["error"]
    broken = json.loads(json.dumps(next(o for o in objects if o["kind"] == "Certificate")))
    broken["spec"]["isCA"] = "yes"
    code, lines = crd_check([broken])
    assert code == 1 and "isCA" in lines[0]["error"]


@pytest.mark.slow  # an external validator over every object (tens of seconds): `make test`, not the fast tier
def test_checkov_passes_with_the_written_down_exceptions(written: Path) -> None:
    config = ROOT / "deploy" / "kubernetes" / "checkov.yaml"
    failed, passed = checkov(written, "--config-file", str(config))
    assert failed == [] and passed > 500, failed
    # Without them, exactly the excepted checks fail: each exception is needed, and no other is made.
    failed, _ = checkov(written / "ep-d-gpu")
    excepted = {line.strip()[2:] for line in config.read_text().splitlines() if re.match(r"\s+- CKV_", line)}
    assert {check for check, _ in failed} == excepted
    # Each exception carries its reason: a comment right above it.
    lines = config.read_text().splitlines()
    skips = [i for i, line in enumerate(lines) if re.match(r"\s+- CKV_", line)]
    assert skips and all(lines[i - 1].strip().startswith("#") for i in skips)


def checkov(folder: Path, *options: str) -> tuple[list[tuple[str, str]], int]:
    """The failed (check, resource) pairs and the number passed."""
    run = subprocess.run(
        [tool("checkov"), "-d", str(folder), "--framework", "kubernetes", "--quiet", "-o", "json", *options],
        capture_output=True, text=True, timeout=600, env={"BC_SKIP_MAPPING": "TRUE", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    reports = json.loads(run.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [(c["check_id"], c["resource"]) for r in reports for c in r["results"]["failed_checks"]]
    assert run.returncode == (1 if failed else 0), run.stderr[-2000:]
    return failed, sum(r["summary"]["passed"] for r in reports)


def containers(obj: dict) -> list[dict]:
    return obj["spec"]["template"]["spec"]["containers"]


@pytest.mark.parametrize(("method", "gpu"), VARIANTS, ids=IDS)
def test_every_instance_kind_holds_the_invariants(rendered, method: str, gpu: bool) -> None:
    objects = rendered[(method, gpu)]
    by_kind: dict[str, list[dict]] = {}
    for obj in objects:
        by_kind.setdefault(obj["kind"], []).append(obj)
    deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}
    workers = {
        n: d
        for n, d in deployments.items()
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    }
    # One Deployment per instance kind, every kind (the method is where the planner starts), labelled
    # with its roles; none says how many replicas: KEDA does, and an apply must not reset it.
    kinds = {d["spec"]["template"]["metadata"]["labels"]["trident.dev/kind"]: d for d in workers.values()}
    assert set(kinds) == {k.value for k in InstanceKind}
    for kind, d in kinds.items():
        roles = d["spec"]["template"]["metadata"]["labels"]["trident.dev/roles"].split("-")
        assert frozenset(roles) == {r.value for r in InstanceKind(kind).roles}
        assert "replicas" not in d["spec"]
        (worker,) = containers(d)
        assert {"name": "TRIDENT_ROLES", "value": ",".join(roles)} in worker["env"]
        # Probes that show the deployment's certificate (the kubelet's httpGet cannot), and a drain
        # that the grace period outlasts.
        probe = ["python", "-m", "services.worker.probe"]
        assert worker["readinessProbe"]["exec"]["command"] == [*probe, "/ready"]
        assert worker["livenessProbe"]["exec"]["command"] == [*probe, "/health"]
        assert "kill -TERM 1" in " ".join(worker["lifecycle"]["preStop"]["exec"]["command"])
        assert d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > DRAIN_TIMEOUT
        assert {"name": "TRIDENT_DRAIN_TIMEOUT", "value": str(DRAIN_TIMEOUT)} in worker["env"]
        limits = worker["resources"]["limits"]
        assert ("nvidia.com/gpu" in limits) == gpu and worker["resources"]["requests"]["cpu"]
    for name, d in deployments.items():
        pod = d["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["automountServiceAccountToken"] is False
        for c in containers(d):
            assert (
                c["securityContext"]["readOnlyRootFilesystem"]
                and not c["securityContext"]["allowPrivilegeEscalation"]
            )
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], name
            assert "livenessProbe" in c and "readinessProbe" in c, name
            # Secrets only by reference: the Secret volume, or a key of a Secret.
            for e in c["env"]:
                assert "value" in e or "valueFrom" in e
                assert not re.fullmatch(r"[a-z][0-9a-f]{48}", str(e.get("value", ""))), (name, e["name"])
            assert {"name": "TRIDENT_NATS_STREAM_REPLICAS", "value": str(NATS.stream_replicas)} in c["env"]
            assert c["imagePullPolicy"] == "IfNotPresent" and re.search(
                r":\d+\.\d+\.\d+-(cpu|gpu)$", c["image"]
            )
            assert {"name": "TRIDENT_TLS_DIR", "value": "/tls"} in c["env"]
            assert {"name": "tls", "mountPath": "/tls", "readOnly": True} in c["volumeMounts"]
        # A disruption budget selects its pods.
        select = d["spec"]["selector"]["matchLabels"]
        assert [
            b for b in by_kind["PodDisruptionBudget"] if b["spec"]["selector"]["matchLabels"] == select
        ], name
    # One KEDA scaler per worker Deployment, driven by the planner's desired count of its kind, and
    # nothing else scales them.
    scalers = {s["spec"]["scaleTargetRef"]["name"]: s for s in by_kind["ScaledObject"]}
    assert set(scalers) == set(workers) and "HorizontalPodAutoscaler" not in by_kind
    for name, s in scalers.items():
        kind = workers[name]["spec"]["template"]["metadata"]["labels"]["trident.dev/kind"]
        (trigger,) = s["spec"]["triggers"]
        assert trigger["metadata"]["query"] == f'max(trident_planner_desired_instances{{kind="{kind}"}})'
    # NATS: three nodes, JetStream; the planner's budget in the unit the deployment has.
    (nats,) = [s for s in by_kind["StatefulSet"] if s["metadata"]["name"] == "nats"]
    assert nats["spec"]["replicas"] == 3
    conf = next(c for c in by_kind["ConfigMap"] if c["metadata"]["name"] == "nats-config")["data"][
        "nats.conf"
    ]
    assert "jetstream" in conf and 'include "routes.conf"' in conf and "$NATS_TOKEN" in conf
    # Mutual TLS for clients (handshake first) and routes; Redis and its sentinels TLS only.
    assert conf.count('ca_file: "/tls/ca.pem", verify: true') == 2 and "handshake_first: true" in conf
    for server in by_kind["StatefulSet"]:
        (c,) = containers(server)
        assert {"name": "tls", "mountPath": "/tls", "readOnly": True} in c["volumeMounts"]
        if server["metadata"]["name"].startswith("redis"):
            script = c["command"][-1]
            assert (
                "tls-port" in script and "tls-auth-clients yes" in script and "tls-replication yes" in script
            )
            assert "redis-cli --tls --cert /tls/cert.pem" in c["readinessProbe"]["exec"]["command"][-1]
    start = nats["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert start.count(".nats-cluster.") == 3 and "nats-route://route:%s@" in start
    planner_env = {e["name"]: e.get("value") for e in containers(deployments["trident-planner"])[0]["env"]}
    assert planner_env["TRIDENT_PLANNER_BUDGET_UNIT"] == ("gpus" if gpu else "cores")
    # Metrics: one ServiceMonitor finds the gateway's and the planner's Service, the other every
    # worker's, which it scrapes over HTTPS with the deployment's certificate.
    labelled = [s["metadata"]["labels"].get("trident.dev/metrics") for s in by_kind["Service"]]
    assert labelled.count("true") == 2 and labelled.count("tls") == len(workers)
    monitors = {
        m["spec"]["selector"]["matchLabels"]["trident.dev/metrics"]: m for m in by_kind["ServiceMonitor"]
    }
    (endpoint,) = monitors["tls"]["spec"]["endpoints"]
    # Prometheus shows a certificate of its own (cert-manager's Secret), not a key any pod holds.
    prometheus = next(c for c in by_kind["Certificate"] if c["metadata"]["name"] == "trident-prometheus")
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"]["keySecret"] == {
        "name": prometheus["spec"]["secretName"],
        "key": "tls.key",
    }
    assert prometheus["spec"]["usages"] == ["digital signature", "client auth"]
    assert "tlsConfig" not in monitors["true"]["spec"]["endpoints"][0]
    # kube-prometheus-stack's Prometheus selects monitors by its release's label.
    assert all(m["metadata"]["labels"]["release"] == "kube-prometheus-stack" for m in monitors.values())
    dashboard = next(c for c in by_kind["ConfigMap"] if c["metadata"]["name"] == "trident-dashboard")
    assert json.loads(dashboard["data"]["trident.json"])["panels"]


def test_the_command_writes_files_secrets_and_refuses_bad_options(tmp_path: Path) -> None:
    runner = CliRunner()
    done = runner.invoke(app, ["kubernetes", "--method", "ed+p", "--secrets", "--out", str(tmp_path)])
    assert done.exit_code == 0, done.output
    objects = list(yaml.safe_load_all((tmp_path / "trident.yaml").read_text()))
    (secret,) = [o for o in objects if o["kind"] == "Secret"]  # TLS keys come from cert-manager, per pod
    assert set(secret["stringData"]) == {"nats-token", "redis-password", "transfer-secret", "planner-key"}
    assert len(set(secret["stringData"].values())) == 4
    assert "trident.yaml" in (tmp_path / "kustomization.yaml").read_text()
    assert not [o for o in render(Options(method="ed+p")) if o["kind"] == "Secret"]  # only when asked
    bad = runner.invoke(app, ["kubernetes", "--method", "nope"])
    assert bad.exit_code == 2 and "unknown method 'nope'" in bad.output


@pytest.mark.slow  # one more kubernetes-validate run: `make test`, not the fast tier
def test_without_tls_the_manifests_are_plain_and_still_valid(tmp_path: Path) -> None:
    objects = render(Options(method="ep+d", tls=False))
    assert not [o for o in objects if o["kind"] == "Secret"]
    text = to_yaml(objects)
    assert "/tls" not in text and "TRIDENT_TLS_DIR" not in text and "tls-port" not in text
    worker = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "trident-ep")
    assert containers(worker)[0]["readinessProbe"]["httpGet"]["path"] == "/ready"
    (tmp_path / "trident.yaml").write_text(text)
    run = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(tmp_path / "trident.yaml")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    code, lines = crd_check([o for o in objects if o["kind"] in ("ScaledObject", "ServiceMonitor")])
    assert code == 0 and len([line for line in lines if line["kind"] == "ServiceMonitor"]) == 1
    assert not [o for o in objects if o["apiVersion"].startswith("cert-manager")]
