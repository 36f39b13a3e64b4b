"""A first apply stands up with nothing made by hand (defects 7 and 8): the model volume is filled
by the manifests themselves (the init step run here for real), every image is an exact tag pulled
only when missing, every pod has its own key and certificate from the deployment's CA, renewed
before it ends, and Prometheus scrapes with a certificate of its own."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.checkpoints.writer import is_checkpoint_dir
from trident.kubernetes.models import READY
from trident.kubernetes.render import Options, render

EXACT = re.compile(r"^[\w./-]+:\d+\.\d+\.\d+(-[\w.]+)?$")  # name:MAJOR.MINOR.PATCH[-variant]


def workloads(objects: list[dict]) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] in ("Deployment", "StatefulSet", "Job")}


def run_init(container: dict, models: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    script = container["command"][-1].replace("/models", str(models))
    # The image has `trident` on PATH; here it is beside this interpreter (a venv not activated).
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PATH": path, **(env or {})})  # fmt: skip


@pytest.mark.slow  # `trident make-model` run as the pod would (~20 s): `make test`, not the fast tier
def test_every_pod_that_loads_the_model_fills_its_volume_first(tmp_path: Path) -> None:
    objects = render(Options(method="ep+d"))
    loading = {
        n: w for n, w in workloads(objects).items()
        if any(m["mountPath"] == "/models" for c in w["spec"]["template"]["spec"]["containers"]
               for m in c["volumeMounts"])
    }  # fmt: skip
    for name, w in loading.items():
        pod = w["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert {"name": "models", "emptyDir": {}} in pod["volumes"], name
        assert {"name": "models", "mountPath": "/models", "readOnly": False} in init["volumeMounts"]
    assert set(loading) == {
        "trident-gateway",
        *(f"trident-{k}" for k in ("encode", "prefill", "decode", "ep", "ed", "epd")),
    }
    # The step itself, run: it writes the checkpoint the services load, and a second run leaves it.
    init = loading["trident-ep"]["spec"]["template"]["spec"]["initContainers"][0]
    done = run_init(init, tmp_path)
    assert done.returncode == 0, done.stderr
    assert is_checkpoint_dir(tmp_path / "tiny-llava") and (tmp_path / "tiny-llava" / READY).exists()
    stamp = (tmp_path / "tiny-llava" / "config.json").stat().st_mtime_ns
    assert run_init(init, tmp_path).returncode == 0
    assert (tmp_path / "tiny-llava" / "config.json").stat().st_mtime_ns == stamp


def test_a_checkpoint_from_an_image_or_the_hub(tmp_path: Path, tiny_model_dir: Path) -> None:
    copied = render(Options(model_source="image:registry.example/llava-weights:1.0"))
    init = workloads(copied)["trident-decode"]["spec"]["template"]["spec"]["initContainers"][0]
    assert init["image"] == "registry.example/llava-weights:1.0"
    image = shutil.copytree(tiny_model_dir, tmp_path / "image-model")  # the image's /model
    copy = subprocess.run(["sh", "-c", init["command"][-1].replace("/model/.", f"{image}/.").replace(
        "/models", str(tmp_path / "volume"))], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert copy.returncode == 0, copy.stderr
    assert (
        is_checkpoint_dir(tmp_path / "volume" / "tiny-llava")
        and (tmp_path / "volume" / "tiny-llava" / READY).exists()
    )
    hub = render(Options(model_source="hub:llava-hf/llava-1.5-7b-hf", models_claim="weights"))
    (claim,) = [o for o in hub if o["kind"] == "PersistentVolumeClaim"]
    assert claim["metadata"]["name"] == "weights" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    job = workloads(hub)["trident-models"]["spec"]["template"]["spec"]
    assert 'snapshot_download("llava-hf/llava-1.5-7b-hf"' in job["containers"][0]["command"][-1]
    assert {"name": "HF_HUB_OFFLINE", "value": "0"} in job["containers"][0]["env"]
    pod = workloads(hub)["trident-decode"]["spec"]["template"]["spec"]
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod[
        "volumes"
    ]
    # A pod waits for the Job's checkpoint: its init step ends once the folder is whole.
    volume = tmp_path / "hub"
    (volume / "tiny-llava").mkdir(parents=True)
    wait = pod["initContainers"][0]["command"][-1].replace("/models", str(volume))
    wait = wait.replace("sleep 5", "sleep 0.1")  # a pod looks every 5 s; the test need not wait so long
    waiting = subprocess.Popen(["sh", "-c", wait], stdout=subprocess.DEVNULL)
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            waiting.wait(timeout=1)
        assert waiting.returncode is None  # no marker yet: it waits
        (volume / "tiny-llava" / READY).touch()  # the Job's download done
        assert waiting.wait(timeout=30) == 0
    finally:
        waiting.kill()  # no shell left polling when the test failed
        waiting.wait()


def test_every_image_is_an_exact_tag_pulled_only_when_missing() -> None:
    for given in ({}, {"gpu": True}, {"tls": False, "model_source": "hub:a/b"}):
        for name, w in workloads(render(Options(**given))).items():
            pod = w["spec"]["template"]["spec"]
            for c in pod["containers"] + pod.get("initContainers", []):
                assert EXACT.match(c["image"]), (name, c["image"])
                assert c["imagePullPolicy"] == "IfNotPresent", name


def test_every_pod_has_its_own_certificate_and_prometheus_its_own() -> None:
    objects = render(Options(method="e+p+d"))
    for name, w in workloads(objects).items():
        volumes = {v["name"]: v for v in w["spec"]["template"]["spec"]["volumes"]}
        csi = volumes["tls"]["csi"]  # issued per pod at mount, never a Secret every pod shares
        attrs = csi["volumeAttributes"]
        assert (
            csi["driver"] == "csi.cert-manager.io"
            and attrs["csi.cert-manager.io/issuer-name"] == "trident-ca"
        )
        names = attrs["csi.cert-manager.io/dns-names"].split(",")
        assert "trident-member" in names, name
        if w["kind"] == "StatefulSet":  # peers dial these by their stable names
            assert names[0].startswith("${POD_NAME}.") and names[0].endswith(".${POD_NAMESPACE}.svc"), name
        duration = int(attrs["csi.cert-manager.io/duration"].rstrip("h"))
        assert 0 < int(attrs["csi.cert-manager.io/renew-before"].rstrip("h")) < duration
        files = {attrs[f"csi.cert-manager.io/{k}-file"] for k in ("ca", "certificate", "privatekey")}
        assert files == {"ca.pem", "cert.pem", "key.pem"}  # what common/tls.py reads
    secrets = {v["secret"]["secretName"] for w in workloads(objects).values()
               for v in w["spec"]["template"]["spec"]["volumes"] if "secret" in v}  # fmt: skip
    certs = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "Certificate"}
    assert certs["trident-ca"]["isCA"] and certs["trident-prometheus"]["usages"] == [
        "digital signature",
        "client auth",
    ]
    (monitor,) = [
        o for o in objects if o["kind"] == "ServiceMonitor" and o["metadata"]["name"] == "trident-workers"
    ]
    key = monitor["spec"]["endpoints"][0]["tlsConfig"]["keySecret"]["name"]
    assert key == certs["trident-prometheus"]["secretName"] and key not in secrets  # no pod holds it
