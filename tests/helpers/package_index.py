"""Whether pip reaches its package index from here (the offline bundle is built only where it can)."""

from __future__ import annotations

import subprocess
import sys


def index_reachable() -> bool:
    """Whether pip reaches its package index from here."""
    argv = [sys.executable, "-m", "pip", "index", "versions", "vine", "--disable-pip-version-check"]
    try:
        return subprocess.run(argv, capture_output=True, timeout=60).returncode == 0
    except subprocess.TimeoutExpired:
        return False
