"""`python -m trident.bundle build [--dir .bundle]` where there is network (`trident bundle` is the
same), `python3 -m trident.bundle install [--dir .bundle] --target DIR` where there is none: it prints
the shell lines that put the bundle in use, for `eval`, and what it installed on stderr."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trident.bundle import DEFAULT_DIR, GPU_PYTHON, LIMIT_BYTES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trident.bundle", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="download the wheels and servers into DIR")
    build.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    build.add_argument(
        "--python", default=GPU_PYTHON, help=f"the target's Python, major.minor.micro (default {GPU_PYTHON})"
    )
    install = sub.add_parser("install", help="install DIR's bundle without network")
    install.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    install.add_argument("--target", type=Path, required=True, help="the folder for PYTHONPATH")
    args = ap.parse_args(argv)
    if args.command == "build":
        from trident.bundle.build import BundleError
        from trident.bundle.build import build as make

        try:
            manifest = make(args.dir, args.python)
        except BundleError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(describe(manifest, args.dir))
        return 0
    from trident.bundle.install import InstallError
    from trident.bundle.install import install as put

    try:
        done = put(args.dir, args.target)
    except InstallError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for name, version in done.versions.items():
        print(f"{name}: {version}", file=sys.stderr)
    print(done.shell(), end="")
    return 0


def describe(manifest: dict, folder: Path) -> str:
    """What the bundle holds, one wheel a line, and its size against the limit."""
    lines = [f"{w['file']}  {w['bytes'] / 2**20:.2f} MiB  ({w['why']})" for w in manifest["wheels"]]
    lines.append(
        f"{folder}: {len(manifest['wheels'])} wheels for Python {manifest['python']}, "
        f"{manifest['bytes'] / 2**20:.1f} MiB of at most {LIMIT_BYTES / 2**20:.0f} MiB"
    )
    if manifest["in_the_image"]:
        lines.append(f"left to the image: {', '.join(manifest['in_the_image'])}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
