"""Prometheus histograms of where a request's time goes, stage by stage, as each instance sees it.

Names follow Prometheus' conventions (`trident_<stage>_<what>_<unit>`); every series carries the
instance and its roles. What each measures (docs/running.md, "Metrics"):

- `trident_<stage>_queue_seconds`: a stage task waited in its JetStream queue, from being stored
  to an instance taking it (decode: also until the instance had KV blocks free for it).
- `trident_<stage>_seconds`: the stage at the instance that took it. Encode: taken → features
  ready; prefill: features in hand → first token; decode: KV in place (or first token, where the
  same instance prefilled) → last token. Waiting inside the instance's batches counts here.
- `trident_{ep,pd}_transfer_seconds` / `_bytes`: pulling one request's image features (E→P) or
  KV (P→D); inline tensors that rode in the task count as bytes moved in no time. Label `path`:
  how they came (`path_label`): `host_local` (copied from the owner's memory on this host, GPU to
  GPU for GPU tensors), `stream` (over the transfer port), `inline`, or `mixed`.
- `trident_engine_step_seconds{kind}`: one engine iteration, by what its batch held.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import datetime

from prometheus_client import CollectorRegistry, Histogram

from common.roles import Role, StepKind
from common.transfer import TransferPath

SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BYTES = tuple(float(1 << k) for k in range(10, 33, 2))  # 1 KiB … 4 GiB, ×4
STEP_KINDS = tuple(StepKind)
HOPS = ("ep", "pd")


class StageMetrics:
    def __init__(self, registry: CollectorRegistry, instance: str, roles: str) -> None:
        labels = {"instance": instance, "roles": roles}

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = SECONDS):
            return Histogram(name, doc, list(labels), registry=registry, buckets=buckets).labels(**labels)

        self.queue = {
            role: histogram(f"trident_{role}_queue_seconds", f"Wait in the {role} queue until taken")
            for role in Role
        }
        self.run = {
            role: histogram(f"trident_{role}_seconds", f"The {role} stage at the instance that took it")
            for role in Role
        }
        self._labels = labels

        def by_path(name: str, doc: str, buckets: tuple[float, ...] = SECONDS):
            family = Histogram(name, doc, [*labels, "path"], registry=registry, buckets=buckets)
            for path in TransferPath:  # every path's series exists from the start, at zero
                family.labels(**labels, path=path)
            return family

        self.transfer = {
            hop: (
                by_path(f"trident_{hop}_transfer_seconds", f"One request's {hop.upper()} pull, by path"),
                by_path(f"trident_{hop}_transfer_bytes", f"Bytes of one {hop.upper()} pull, by path", BYTES),
            )
            for hop in HOPS
        }
        steps = Histogram(
            "trident_engine_step_seconds",
            "One engine iteration, by what its batch held",
            [*labels, "kind"],
            registry=registry,
            buckets=SECONDS,
        )
        self.steps = {kind: steps.labels(**labels, kind=kind) for kind in STEP_KINDS}

    @classmethod
    def unregistered(cls) -> StageMetrics:
        """Figures nobody scrapes (a handler test's context)."""
        return cls(CollectorRegistry(), "", "")

    def taken(self, role: Role, stored: datetime | None, at: float | None = None) -> None:
        """A task of `role` stored at `stored` (the broker's clock) was taken now."""
        if stored is not None:
            self.queue[role].observe(max(0.0, (time.time() if at is None else at) - stored.timestamp()))

    def ran(self, role: Role, marks: Mapping, start_stage, at: float | None = None) -> None:
        """A stage ended now; it began at `marks[start_stage]` (no sample without that mark)."""
        began = marks.get(start_stage)
        if began is not None:
            self.run[role].observe(max(0.0, (time.time() if at is None else at) - began))

    def transferred(
        self, hop: str, seconds: float, nbytes: int, path: str = TransferPath.STREAM.value
    ) -> None:
        """One request's pull on `hop` ("ep" or "pd"), by the path its tensors took (`path_label`)."""
        seconds_hist, bytes_hist = self.transfer[hop]
        seconds_hist.labels(**self._labels, path=path).observe(max(0.0, seconds))
        bytes_hist.labels(**self._labels, path=path).observe(nbytes)

    def step(self, kind: StepKind, seconds: float) -> None:
        """On the engine thread (a histogram is thread-safe)."""
        self.steps[kind].observe(seconds)


def path_label(paths: list[TransferPath]) -> str:
    """How one request's tensors came: the path all its pulled ones took (inline ones aside),
    `inline` when none was pulled, `mixed` when they took different ones."""
    pulled = {p for p in paths if p is not TransferPath.INLINE}
    if not pulled:
        return TransferPath.INLINE.value
    return pulled.pop().value if len(pulled) == 1 else "mixed"
