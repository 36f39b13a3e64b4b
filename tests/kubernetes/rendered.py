"""Rendered manifests read as the cluster runs them: each workload's pods as a network endpoint, and
a container's settings as its service reads them (tests/kubernetes/test_flows.py and
test_autoscaling.py)."""

from __future__ import annotations

from services.settings import GatewaySettings, PlannerSettings, WorkerSettings
from tests.kubernetes.netpol import Endpoint

NS = "trident"  # the namespace the manifests are rendered into


def pods(objects: list[dict]) -> dict[str, tuple[Endpoint, dict]]:
    """Each workload's pods as one endpoint (name, labels, ports), with its container."""
    out = {}
    for i, o in enumerate(o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")):
        template = o["spec"]["template"]
        (container,) = template["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        out[o["metadata"]["name"]] = (
            Endpoint(o["metadata"]["name"], NS, template["metadata"]["labels"], f"10.1.0.{i + 1}", ports),
            container,
        )
    return out


def settings(container: dict):
    """The container's settings, as its service reads them (the folders it is given are not there)."""
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    given = {
        k.removeprefix("TRIDENT_").lower(): v
        for k, v in env.items()
        if k.startswith("TRIDENT_") and k not in ("TRIDENT_SECRETS_DIR", "TRIDENT_TLS_DIR")
    }
    module = " ".join(container["command"])
    kind = (
        GatewaySettings
        if "services.gateway" in module
        else WorkerSettings
        if "services.worker" in module
        else PlannerSettings
    )
    return kind(**given), module
