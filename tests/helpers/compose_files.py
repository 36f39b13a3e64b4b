"""compose.yaml and its override files as data, and Compose's merge of an override over a base
(tests/test_compose.py, tests/test_gpu_deploy.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]


def read_compose_file(name: str) -> dict[str, Any]:
    """A compose file of the repository's root, parsed."""
    return yaml.safe_load((REPO / name).read_text())


def merge(base: Any, override: Any) -> Any:
    """Compose's merge of an override file, for what compose.gpu.yaml uses: mappings merge key by key,
    anything else is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return merged
    return copy.deepcopy(override)
