"""The committed kustomize tree (deploy/kubernetes) is what `trident kubernetes --kustomize` writes,
and `kubectl kustomize` of every overlay gives exactly the objects `trident kubernetes` renders for
its method, on CPUs and on GPUs (up to the order of lists merged by key, which kustomize's merge
puts patch items first in; no such order means anything here)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from trident.kubernetes.kustomize import MERGE_KEYS, slug, tree, variants, write
from trident.kubernetes.render import render

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def test_the_committed_tree_is_what_the_code_writes(tmp_path: Path) -> None:
    files = tree()
    committed = {
        p.relative_to(ROOT).as_posix(): p.read_text() for p in ROOT.glob("*/**/*.yaml") if p.is_file()
    }
    stale = sorted(n for n in files.keys() & committed.keys() if files[n] != committed[n])
    assert stale == [], f"{stale} differ: run `trident kubernetes --kustomize deploy/kubernetes`"
    assert sorted(files.keys() - committed.keys()) == [] and sorted(committed.keys() - files.keys()) == []
    written = write(tmp_path)
    assert {p.relative_to(tmp_path).as_posix() for p in written} == set(files)


def canonical(value: object, field: str = "") -> object:
    if isinstance(value, dict):
        return {k: canonical(v, k) for k, v in value.items()}
    if isinstance(value, list):
        items = [canonical(i) for i in value]
        key = MERGE_KEYS.get(field)
        if key and all(isinstance(i, dict) and key in i for i in items):
            items.sort(key=lambda i: i[key])
        return items
    return value


def objects(items: list[dict]) -> dict[tuple[str, str], object]:
    return {(o["kind"], o["metadata"]["name"]): canonical(o) for o in items}


@pytest.mark.slow  # eight kubectl runs, ~40 s on a busy machine: `make test`, not the fast tier
@pytest.mark.parametrize("options", variants(), ids=[slug(o.method, o.gpu) for o in variants()])
def test_kubectl_kustomize_renders_each_overlay_as_trident_renders_it(options) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl is missing: the machine image carries it (`kubectl kustomize`)")
    folder = ROOT / "overlays" / slug(options.method, options.gpu)
    run = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got, want = objects(list(yaml.safe_load_all(run.stdout))), objects(render(options))
    assert got.keys() == want.keys()
    assert [k for k in want if got[k] != want[k]] == []
