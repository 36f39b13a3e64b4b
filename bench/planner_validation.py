"""The planner's predictions against real runs on this machine (issue 16, "a planner whose predictions hold").

    python bench/planner_validation.py [--presets small-llava] [--methods e+p+d,ep+d,ed+p]
                                       [--rates 1,2,3,4,5] [--requests 30] [--repeats 3]
                                       [--calibration-load N] [--calibration-rate R] [--shape mix]
                                       [--out .trident/validation]
                                       [--turns T --system-prompt-tokens K --think-time S --image-prob P]
    python bench/planner_validation.py --replay .trident/validation [--recalibrate] [--sensitivity 1.05]

For each preset and method a real deployment (one instance per kind, nats-server, redis-server) is
started and calibrated as the planner service calibrates itself (trident/bench/validation.py: the
instances' steps in service under a calibration load, and the fixed costs from unloaded
requests). Then a 50 % text / 50 % one-image workload (`--shape mix`; `--shape text` is its
text-only half) is sent at each rate, the whole sweep
`--repeats` times over with requests of the same sizes (each run's images its own). With
`--turns` (or a shared system prompt) the requests are instead turns of conversations that resend
their history, and each is replayed with the cached tokens its trace record reports (issue 26:
"the planner's simulator counts cached tokens, so its predictions hold on the multi-turn
workload"); `--requests` counts turns. Each figure
is the median over the repeats, with their spread beside it:

* TTFT p50/p90 and TBT p90 (the median over requests of each one's p90), measured by the gateway
  and predicted by the simulator for the same requests;
* goodput: the highest rate at which --attainment of the requests meet both SLOs, read between
  the swept rates (`goodput`), measured in each repeat and predicted from the simulated sweep;
* the pick: the method with the highest predicted goodput, as the planner chooses, against the
  measured best of each repeat: within one sweep step of it, or not.

The goals (issue 16): predicted TTFT p90, TBT p90 and goodput within 20 % of the measured median;
the pick's predicted goodput within 20 % of its measured goodput; the pick within one sweep step
of the measured best in every repeat. A table goes to stdout; the last line is one JSON object with
every comparison, the largest errors and which goals were met. The requests with their measured
latencies and the calibration are kept under --out; `--replay` predicts them again with the
simulator as it is now, without measuring again, and with `--recalibrate` calibrated again from
the data the calibration was found from (the CI test holds a recorded run this way).
`--sensitivity K` replays once more with every stage's steps K times as long and reports how far
each predicted TTFT p90 and TBT p90 moves: how exact the calibration must be for a figure to hold.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from common.checkpoints import is_checkpoint_dir, write_checkpoint
from common.planner.workloads import SHAPES
from common.stats import SLO
from trident.bench.repeat import Repeats
from trident.bench.validation import Comparison, Run, replay_folder, save, summary
from trident.bench.validation_run import Validation, validate


def _cell(name: str, c: Comparison) -> str:
    low, high = c.spread[name]
    error = c.errors.get(name, 0.0)
    return (
        f"{name} {c.measured[name] * 1000:6.1f} [{low * 1000:.0f}–{high * 1000:.0f}] / "
        f"{c.predicted[name] * 1000:6.1f} ms ({error:+.0%})"
    )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="small-llava")
    ap.add_argument("--methods", default="e+p+d,ep+d,ed+p")
    ap.add_argument("--rates", default="1,2,3,4,5", help="requests/s, ascending, evenly spaced")
    ap.add_argument("--requests", type=int, default=30, help="per rate and repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--calibration-load",
        type=int,
        help="requests at the middle rate whose steps the calibration fits, before measuring "
        "(default: --requests)",
    )
    ap.add_argument(
        "--calibration-rate",
        type=float,
        help="the calibration load's rate (default: the middle of --rates); below capacity, as a "
        "deployment's planner calibrates on the load it serves",
    )
    ap.add_argument(
        "--shape",
        default="mix",
        choices=sorted(SHAPES),
        help="the requests' shape (common/planner/workloads.py): mix is half text, half one image",
    )
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument(
        "--turns",
        type=int,
        default=1,
        help="over 1: conversations of this many turns, each resending its history (rates count turns)",
    )
    ap.add_argument(
        "--system-prompt-tokens", type=int, default=0, help="a system prompt every request shares"
    )
    ap.add_argument(
        "--think-time", type=float, default=0.0, help="mean seconds between an answer and the next turn"
    )
    ap.add_argument("--image-prob", type=float, default=0.0, help="the chance a later turn adds an image")
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--tbt-slo", type=float, default=0.2)
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--out", type=Path, default=Path(".trident/validation"), help="measurements kept here")
    ap.add_argument("--replay", type=Path, help="predict again what --out kept, without running anything")
    ap.add_argument(
        "--recalibrate",
        action="store_true",
        help="with --replay: calibrate again from the data kept, as the code now does",
    )
    ap.add_argument(
        "--sensitivity",
        type=float,
        metavar="K",
        help="with --replay: also predict with every stage's steps K times as long, and report how "
        "far each latency prediction moves",
    )
    args = ap.parse_args()
    if args.sensitivity is not None and not (args.replay and args.sensitivity > 0):
        ap.error("--sensitivity takes a positive K, and --replay")
    return args


def main() -> None:
    args = parse_args()
    slo = SLO(args.ttft_slo, args.tbt_slo, args.attainment)
    runs = list(replayed(args.replay, args.recalibrate) if args.replay else measured(args, slo))
    report = summary(runs, slo)
    print_runs(runs, report)
    if args.sensitivity is not None:
        report["sensitivity"] = sensitivity(args.replay, args.recalibrate, args.sensitivity, runs)
    print(json.dumps(report))


def print_runs(runs: list[Run], report: dict) -> None:
    """Each run's calibration, its comparisons rate by rate and its goodput; then the pick."""
    for preset, method, calibration, comparisons in runs:
        service = calibration.get("service", {})
        print(f"{preset} {method}: service factors {service.get('factors')} jitter {service.get('jitter')}")
        for c in comparisons:
            cells = "  ".join(_cell(k, c) for k in ("ttft_p50", "ttft_p90", "tbt_p90"))
            att = f"attainment {c.measured['attainment']:.0%}/{c.predicted['attainment']:.0%}"
            print(f"  {c.rate:5.2f} req/s  {cells}  {att}")
        g = report["goodput"][f"{preset} {method}"]
        print(
            f"  goodput measured {g['measured']} (median {g['measured_median']}), predicted {g['predicted']}"
        )
    pick = report["pick"]
    print(
        f"pick {pick['system']}: predicted {pick['predicted']} req/s, measured {pick['measured_median']} "
        f"({pick['error']:+.0%}); measured best by repeat {pick['best_by_repeat']}, "
        f"within one step: {pick['within_one_step']}"
    )


def sensitivity(root: Path, recalibrated: bool, slower: float, runs: list[Run]) -> dict:
    """Each rate's predicted TTFT p90 and TBT p90 with every stage's steps `slower` times as long,
    relative to the predictions as calibrated."""
    rows = []
    for (preset, method, _, base), (_, _, _, moved) in zip(
        runs, replayed(root, recalibrated, slower), strict=True
    ):
        for b, m in zip(base, moved, strict=True):
            change = {
                k: round(m.predicted[k] / b.predicted[k] - 1, 4) if b.predicted[k] > 0 else 0.0
                for k in ("ttft_p90", "tbt_p90")
            }
            rows.append({"system": f"{preset} {method}", "rate": b.rate, **change})
            print(
                f"steps {slower:g}x: {preset} {method} {b.rate:5.2f} req/s  TTFT p90 "
                f"{change['ttft_p90']:+.0%}  TBT p90 {change['tbt_p90']:+.0%}"
            )
    return {"slower": slower, "changes": rows}


def measured(args: argparse.Namespace, slo: SLO) -> Iterator[Run]:
    """Each preset and method run for real, its measurements saved under --out as they come."""
    rates = [float(x) for x in args.rates.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            model = Path(tmp) / preset
            if not is_checkpoint_dir(model):
                write_checkpoint(model, preset, seed=0)
            for method in args.methods.split(","):
                workdir = Path(tmp) / f"{preset}-{method.replace('+', '-')}"
                workdir.mkdir()
                run = Validation(
                    method,
                    rates,
                    args.requests,
                    slo,
                    repeats=args.repeats,
                    max_output=args.max_output,
                    calibration_load=args.calibration_load,
                    calibration_rate=args.calibration_rate,
                    shape=args.shape,
                    turns=turns(args),
                )
                calibration, comparisons = validate(model, workdir, run)
                save(
                    args.out / f"{preset}-{method.replace('+', '-')}",
                    preset,
                    method,
                    calibration,
                    comparisons,
                )
                yield preset, method, calibration, comparisons


def turns(args: argparse.Namespace) -> Repeats | None:
    """The repeating workload asked for (trident/bench/repeat.py), or None for single requests."""
    if args.turns <= 1 and not args.system_prompt_tokens:
        return None
    return Repeats(
        system_tokens=args.system_prompt_tokens,
        turns=args.turns,
        think_time=args.think_time,
        image_prob=args.image_prob,
        seed=1,
    )


def replayed(root: Path, recalibrated: bool = False, slower: float = 1.0) -> Iterator[Run]:
    """What `save` kept, predicted again by today's simulator with the calibration then found."""
    folders = sorted(p.parent for p in root.glob("*/calibration.json"))
    if not folders:
        sys.exit(f"nothing to replay under {root}: run without --replay first")
    for folder in folders:
        yield replay_folder(folder, recalibrated=recalibrated, slower=slower)  # at its SLOs


if __name__ == "__main__":
    main()
