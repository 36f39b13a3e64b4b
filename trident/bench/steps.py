"""Steps of a check run in order under one deadline, each timed and recorded whether it passes,
fails or is skipped, without stopping the rest; the results are rewritten after every step, so a run
cut short keeps what it measured. A step that would start with less time left than it needs is
skipped, with the reason recorded, rather than run past the deadline."""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path


class Steps:
    def __init__(self, results: dict, out: Path, deadline_s: float) -> None:
        self.results, self.out = results, out
        self.start = time.monotonic()
        self.deadline = self.start + deadline_s

    def left(self) -> float:
        """Seconds until the deadline."""
        return self.deadline - time.monotonic()

    def run(self, name: str, fn: Callable[[], dict], need: float = 0.0, into: dict | None = None) -> dict:
        """`fn`'s figures under `name` in the results (or in `into`, a part of them): ok unless it
        raised or listed `failures`."""
        began = time.perf_counter()
        if self.left() < need:
            record = {
                "ok": False,
                "skipped": f"{self.left():.0f} s left of the deadline; it needs about {need:.0f} s",
            }
        else:
            try:
                figures = fn()
                record = {"ok": not figures.get("failures"), **figures}
            except Exception as exc:  # a failing step is a finding, recorded; the rest still run
                record = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:4000],
                          "trace": traceback.format_exc()[-3000:],
                          "notes": "\n".join(getattr(exc, "__notes__", ()))[-6000:]}  # fmt: skip
        record["seconds"] = round(time.perf_counter() - began, 1)
        (self.results if into is None else into)[name] = record
        state = "skipped" if "skipped" in record else ("ok" if record["ok"] else "FAILED")
        print(f"{name}: {state} in {record['seconds']} s ({self.left():.0f} s left)", flush=True)
        self.save()
        return record

    def save(self) -> None:
        self.results["seconds"] = round(time.monotonic() - self.start, 1)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.results, indent=2) + "\n")
