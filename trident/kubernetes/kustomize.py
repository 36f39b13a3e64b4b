"""The committed kustomize tree (deploy/kubernetes), written from the same objects `trident kubernetes`
renders: a base (E+P+D on CPUs, one file per component), a component for GPUs, and an overlay per
method, on CPUs and on GPUs. `trident kubernetes --kustomize deploy/kubernetes` writes it;
tests/kubernetes/test_kustomize.py checks that the committed tree is what this writes and that
`kubectl kustomize` of every overlay gives exactly what `trident kubernetes` renders for it.

The overlays are strategic-merge patches: each holds only what differs from the base (the planner's
starting method; for GPUs the image, the device, one GPU and its toleration, the planner's unit).
Kustomize's merge puts a patch's items of a list merged by key (env, volumes) first; no such list's
order means anything here (no variable refers to another).
"""

from __future__ import annotations

from pathlib import Path

import yaml

from common.planner.types import METHOD_KINDS
from trident.kubernetes.options import Options
from trident.kubernetes.render import render, to_yaml

HEADER = "# Written by `trident kubernetes --kustomize deploy/kubernetes`: change the code, not this file.\n"
# Lists Kubernetes merges item by item, by this key (the API's patchMergeKey); any other list is
# replaced whole by a patch.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
}
BASE = Options()


def slug(method: str, gpu: bool) -> str:
    return method.replace("+", "-") + ("-gpu" if gpu else "")


def variants() -> list[Options]:
    """Every overlay's options: each method, on CPUs and on GPUs."""
    return [Options(method=m, gpu=g) for g in (False, True) for m in METHOD_KINDS]


def tree() -> dict[str, str]:
    """Every file of the tree: its path under the root, and its text."""
    base = render(BASE)
    gpu = render(Options(gpu=True))
    files: dict[str, str] = {}
    groups: dict[str, list[dict]] = {}
    for obj in base:
        groups.setdefault(obj["metadata"]["labels"]["app.kubernetes.io/component"], []).append(obj)
    for component, objects in groups.items():
        files[f"base/{component}.yaml"] = HEADER + to_yaml(objects)
    files["base/kustomization.yaml"] = kustomization("Kustomization", resources=[f"{c}.yaml" for c in groups])
    files |= patch_files("components/gpu", base, gpu, kind="Component")
    for o in variants():
        name = f"overlays/{slug(o.method, o.gpu)}"
        before = gpu if o.gpu else base
        files |= patch_files(
            name,
            before,
            render(o),
            resources=["../../base"],
            components=["../../components/gpu"] if o.gpu else [],
        )
    return files


def patch_files(
    folder: str, before: list[dict], after: list[dict], kind: str = "Kustomization", **fields: list[str]
) -> dict[str, str]:
    """A kustomization in `folder` patching `before` into `after`, one file per patched object."""
    old = {(o["kind"], o["metadata"]["name"]): o for o in before}
    if [(o["kind"], o["metadata"]["name"]) for o in after] != list(old):
        raise ValueError(f"{folder}: the variant's objects differ from the base's; a patch cannot add them")
    files, patches = {}, []
    for obj in after:
        change = diff(old[(obj["kind"], obj["metadata"]["name"])], obj)
        if change is None:
            continue
        where = {"name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"]}
        head = {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "metadata": where}
        name = f"patches/{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"
        files[f"{folder}/{name}"] = HEADER + to_yaml([{**head, **change}])
        patches.append({"path": name})
    files[f"{folder}/kustomization.yaml"] = kustomization(kind, **fields, patches=patches)
    return files


def kustomization(kind: str, **fields: list) -> str:
    version = "v1alpha1" if kind == "Component" else "v1beta1"
    body = {"apiVersion": f"kustomize.config.k8s.io/{version}", "kind": kind}
    body |= {k: v for k, v in fields.items() if v}
    return HEADER + yaml.safe_dump(body, sort_keys=False)


def diff(before: object, after: object, field: str = "") -> object | None:
    """What a strategic-merge patch must say to turn `before` into `after`; None if nothing."""
    if isinstance(before, dict) and isinstance(after, dict):
        out = {}
        for key, value in after.items():
            if key not in before:
                out[key] = value
            elif (change := diff(before[key], value, key)) is not None:
                out[key] = change
        for key in before.keys() - after.keys():
            out[key] = None  # a null removes the field
        return out or None
    if isinstance(before, list) and isinstance(after, list) and field in MERGE_KEYS and before != after:
        key = MERGE_KEYS[field]
        if all(isinstance(i, dict) and key in i for i in before + after):
            return _merge_list(before, after, key)
    return None if before == after else after


def _merge_list(before: list[dict], after: list[dict], key: str) -> list[dict]:
    old = {item[key]: item for item in before}
    if [i[key] for i in after if i[key] in old] != [
        i[key] for i in before if i[key] in {a[key] for a in after}
    ]:
        raise ValueError(f"a patch cannot reorder a list merged by {key}")
    out = []
    for item in after:
        if item[key] not in old:
            out.append(item)
        elif (change := diff(old[item[key]], item)) is not None:
            out.append({key: item[key], **change})
    gone = {i[key] for i in before} - {i[key] for i in after}
    out += [{key: k, "$patch": "delete"} for k in sorted(gone)]
    return out


def write(root: Path) -> list[Path]:
    """Write the tree under `root`, removing generated files it no longer has; the paths written."""
    files = tree()
    for old in root.glob("*/**/*.yaml"):
        if old.relative_to(root).as_posix() not in files and old.read_text().startswith(HEADER):
            old.unlink()
    written = []
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
