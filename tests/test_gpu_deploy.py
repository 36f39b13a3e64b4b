"""The deployment files say what the GPU check proved: compose.gpu.yaml's workers and `trident
kubernetes --gpu`'s run trident/gpu_deploy.py's settings (device, GPUs per worker, transfer path,
memory shares), the ones bench/gpu_serve.py runs, and every worker reads its own share from them."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.planner.types import METHOD_KINDS
from common.roles import InstanceKind
from services.settings import WorkerSettings
from tests.bench import load_script
from tests.helpers.compose_files import merge, read_compose_file
from trident import gpu_deploy
from trident.kubernetes.render import Options, render

REPO = Path(__file__).resolve().parents[1]
WORKERS = ("encoder", "prefill", "decode", "worker-ep", "worker-ed", "worker-epd")


def test_compose_gpu_workers_run_the_checked_settings() -> None:
    merged = merge(read_compose_file("compose.yaml"), read_compose_file("compose.gpu.yaml"))
    for name in WORKERS:
        service = merged["services"][name]
        env = service["environment"]
        assert {k: env.get(k) for k in gpu_deploy.worker_env()} == gpu_deploy.worker_env(), name
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["count"] == gpu_deploy.GPUS_PER_INSTANCE, name


@pytest.mark.parametrize("method", sorted(METHOD_KINDS))
def test_kubernetes_gpu_workers_run_the_checked_settings(method: str) -> None:
    objects = render(Options(method=method, gpu=True))
    workers = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].startswith("trident-")
    ]
    workers = [o for o in workers if o["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"]
    assert len(workers) == len(InstanceKind)  # every kind: the planner may move to any method
    for deployment in workers:
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        # Transfers stay on TCP on Kubernetes, on the port the NetworkPolicies name (flows.py).
        wanted = {**gpu_deploy.worker_env(), "TRIDENT_TRANSFER": "tcp"}
        assert {k: env.get(k) for k in wanted} == wanted
        limits = container["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == str(gpu_deploy.GPUS_PER_INSTANCE)
    for deployment in (o for o in render(Options(method=method)) if o["kind"] == "Deployment"):
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        assert "TRIDENT_GPU_MEMORY_SHARE" not in {e["name"] for e in container["env"]}  # CPU: none


def test_each_worker_reads_its_kinds_share_and_every_method_fits_one_gpu() -> None:
    setting = gpu_deploy.worker_env()["TRIDENT_GPU_MEMORY_SHARE"]
    for kind, share in gpu_deploy.MEMORY_SHARES.items():
        roles = ",".join(r.value for r in kind.roles)
        assert WorkerSettings(roles=roles, gpu_memory_share=setting).memory_share() == share
    assert set(gpu_deploy.MEMORY_SHARES) == set(InstanceKind)
    for method in METHOD_KINDS:  # room left for each process's CUDA context
        assert gpu_deploy.method_share(method) <= 0.95, method


def test_the_gpu_check_deploys_the_same_settings() -> None:
    check = load_script(REPO / "bench" / "gpu_serve.py", "gpu_serve")
    assert check.deployment_env(cpu=False).items() >= gpu_deploy.worker_env().items()
    on_cpu = check.deployment_env(cpu=True)
    assert on_cpu["TRIDENT_DEVICE"] == "cpu"
    assert on_cpu["TRIDENT_GPU_MEMORY_SHARE"] == gpu_deploy.memory_share_setting()
