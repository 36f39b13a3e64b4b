"""Where the model's checkpoint comes from on a first apply, with nothing made by hand beforehand.

- `make:PRESET` (the default, `make:tiny-llava`): every pod that loads the model writes the tiny
  random-weight checkpoint into a volume of its own before it starts (`trident make-model`, as
  compose's model-init does): seconds, no storage needed. The pipeline, not the answers.
- `image:REF`: every such pod copies the checkpoint from an image of yours holding it at /model
  (and a shell): the node keeps the image, so a second pod on it copies from local disk.
- `hub:REPO`: a Job downloads REPO from the Hugging Face hub once into a PersistentVolumeClaim
  (ReadWriteMany: the pods on every node read it), and every pod waits for the checkpoint to be
  complete before it starts. Needs the cluster to reach the hub (the Job's egress policy allows it).
"""

from __future__ import annotations

from dataclasses import dataclass

from trident.kubernetes.objects import container_security, labels, meta, pod_security

MOUNT = "/models"
READY = ".trident-ready"  # written last, once the checkpoint is whole: what a waiting pod looks for


@dataclass(frozen=True)
class ModelSource:
    kind: str  # make | image | hub
    what: str  # the preset, the image, the repository

    @classmethod
    def parse(cls, text: str) -> ModelSource:
        kind, sep, what = text.partition(":")
        if not sep or kind not in ("make", "image", "hub") or not what:
            raise ValueError(f"model source {text!r}: one of make:PRESET, image:REF, hub:REPO")
        return cls(kind, what)

    @property
    def shared(self) -> bool:
        """The checkpoint lives on a claim every pod mounts (written once by the Job)."""
        return self.kind == "hub"


def is_complete(path: str) -> str:
    """A shell test that succeeds once `path` holds a whole checkpoint (its marker, written last:
    a step cut short leaves none, and the next one starts again)."""
    return f"test -f {path}/{READY}"


def init_container(source: ModelSource, model: str, image: str) -> dict:
    """What runs before a pod that loads the model: writes or copies the checkpoint into its own
    volume, or waits for the Job to have written the shared one."""
    path = f"{MOUNT}/{model}"
    done = f"touch {path}/{READY}"
    if source.kind == "make":
        fill = f"trident make-model {path} --preset {source.what} --force && {done}"
        script = f"{is_complete(path)} || {{ rm -rf {path} && {fill}; }}"
    elif source.kind == "image":
        image = source.what
        fill = f"mkdir -p {path} && cp -a /model/. {path}/ && {done}"
        script = f"{is_complete(path)} || {{ rm -rf {path} && {fill}; }}"
    else:
        script = f"until {is_complete(path)}; do echo waiting for {path}; sleep 5; done"
    return {
        "name": "models",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", script],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "securityContext": container_security(),
        "resources": {"requests": {"cpu": "100m", "memory": "512Mi"},
                      "limits": {"cpu": "1", "memory": "2Gi"}},
        "volumeMounts": [{"name": "models", "mountPath": MOUNT, "readOnly": source.shared},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }  # fmt: skip


def volume(source: ModelSource, claim: str) -> dict:
    if source.shared:
        return {"name": "models", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    return {"name": "models", "emptyDir": {}}


def hub_objects(
    source: ModelSource, model: str, image: str, namespace: str, claim: str, size: str
) -> list[dict]:
    """The claim and the Job that fills it (only for `hub:`)."""
    if not source.shared:
        return []
    path = f"{MOUNT}/{model}"
    pvc = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": meta(claim, namespace, "models"),
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": size}}},
    }
    fetch = "from huggingface_hub import snapshot_download; "
    fetch += f'snapshot_download("{source.what}", local_dir="{path}")'
    download = f"{is_complete(path)} || {{ python -c '{fetch}' && touch {path}/{READY}; }}"
    container = {
        "name": "download",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["sh", "-c", download],
        "env": [{"name": "HF_HUB_OFFLINE", "value": "0"}, {"name": "HOME", "value": "/tmp"}],
        "securityContext": container_security(),
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "4Gi"}},
        "volumeMounts": [{"name": "models", "mountPath": MOUNT}, {"name": "tmp", "mountPath": "/tmp"}],
    }
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta("trident-models", namespace, "models"),
        "spec": {
            "backoffLimit": 6,
            "template": {
                "metadata": {"labels": labels("models")},
                "spec": {
                    "restartPolicy": "OnFailure",
                    "automountServiceAccountToken": False,
                    "securityContext": pod_security(),
                    "containers": [container],
                    "volumes": [
                        {"name": "models", "persistentVolumeClaim": {"claimName": claim}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                },
            },
        },
    }
    return [pvc, job]
