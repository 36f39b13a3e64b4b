"""Ablations as the papers run them, each as goodput and TTFT/TBT p50/p90 in one table.

    python bench/ablations.py [--preset small-llava] [--sweep 0.75:1.75:0.25] [--duration 25]
                              [--ttft-slo 2] [--tbt-slo 0.2] [--with-epd] [--epd-token-cap N]
                              [--only NAMES] [--out .trident/ablations]

1. Batching (seed 000 §5.3), on a TextCaps-shaped workload: the planner's pick, evenly split
   E+P+D with the stage-level batcher (Algorithm 1), and the same E+P+D with `prefill-first`
   (vLLM v0) and `decode-first` (Sarathi-style) batching instead; EPD with each policy too, where
   one instance runs every stage and the batcher has the most to decide.
2. Transfer (seed 002 Table 2), on the same workload: E+P+D as shipped, without feature prefetch
   (TRIDENT_PREFETCH=0: a prefill instance pulls an image's features only when it would run the
   request), with the KV cache sent as one transfer instead of groups of layers, and with the KV
   streamed while the prefill step runs instead of exported after it (TRIDENT_KV_STREAM=1).
3. Overlap (seed 002 §3.3), with `--overlap LENGTHS` instead of the tables above: the share of the
   P→D transfer hidden behind the prefill, by prompt length (trident/bench/kv_overlap.py says how).

Every system runs alone on the machine, one after another, under the same requests
(`trident bench compare` machinery); E+P+D as shipped is run once and appears in both tables. The
EPD rows run only with `--with-epd`; `--epd-token-cap N` adds EPD with its token budget capped at
N (TRIDENT_TOKEN_BUDGET), for a host where steps run slower in service than the start-up profile
that sized them. The last line is one JSON object: each table's goodputs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from common.checkpoints import is_checkpoint_dir, write_checkpoint
from common.protocol import KvWire
from common.stats import SLO
from trident.bench import kv_overlap
from trident.bench.compare import PLANNER, Bench, Comparison, System, compare, table
from trident.bench.machine import single_thread_gflops
from trident.bench.progress import progress_reporter
from trident.bench.sweep import LoadSpec, parse_rates

ONE_TRANSFER = "1000000"  # layers per KV transfer: more than any model has, so all in one


BATCHING = ["e+p+d", PLANNER, "e+p+d prefill-first", "e+p+d decode-first"]
BATCHING_EPD = ["epd", "epd prefill-first", "epd decode-first"]
TRANSFER = ["e+p+d", "e+p+d no prefetch", "e+p+d one KV transfer", "e+p+d KV after prefill"]


def epd_capped(cap: int) -> System:
    return System(f"epd token budget <= {cap}", method="epd", env={"TRIDENT_TOKEN_BUDGET": str(cap)})


def systems(with_epd: bool, epd_token_cap: int | None = None) -> list[System]:
    """Every system of both tables once, the shared E+P+D first (the planner plans from it)."""
    chosen = [
        System("e+p+d", method="e+p+d"),
        System(PLANNER),
        System("e+p+d prefill-first", method="e+p+d", env={"TRIDENT_POLICY": "prefill-first"}),
        System("e+p+d decode-first", method="e+p+d", env={"TRIDENT_POLICY": "decode-first"}),
        System("e+p+d no prefetch", method="e+p+d", env={"TRIDENT_PREFETCH": "0"}),
        System("e+p+d one KV transfer", method="e+p+d", env={"TRIDENT_KV_LAYER_GROUP": ONE_TRANSFER}),
        System("e+p+d KV after prefill", method="e+p+d", env={"TRIDENT_KV_STREAM": "0"}),
    ]
    if with_epd:
        chosen += [
            System("epd", method="epd"),
            System("epd prefill-first", method="epd", env={"TRIDENT_POLICY": "prefill-first"}),
            System("epd decode-first", method="epd", env={"TRIDENT_POLICY": "decode-first"}),
        ]
        if epd_token_cap:
            chosen.append(epd_capped(epd_token_cap))
    return chosen


def subset(result: Comparison, names: list[str]) -> Comparison:
    part = Comparison(result.slo, result.load)
    part.results = [r for name in names for r in result.results if r.name == name]
    part.notes = {k: v for k, v in result.notes.items() if k in names}
    return part


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-llava")
    ap.add_argument("--model", type=Path, help="a checkpoint directory instead of a preset")
    ap.add_argument("--workload", default="textcaps")
    ap.add_argument("--arrivals", default="poisson")
    ap.add_argument("--sweep", default="0.75:1.75:0.25")
    ap.add_argument("--duration", type=float, default=25.0)
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--tbt-slo", type=float, default=0.2)
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--image-size", default="336x336")
    ap.add_argument("--with-epd", action="store_true", help="also EPD under each batching policy")
    ap.add_argument("--epd-token-cap", type=int, help="with --with-epd: also EPD with τt capped at this")
    ap.add_argument(
        "--only", help="comma-separated system names to run (e.g. the EPD rows, added to an earlier run)"
    )
    ap.add_argument("--out", type=Path, default=Path(".trident/ablations"))
    ap.add_argument(
        "--overlap",
        metavar="LENGTHS",
        help="only the overlap table, at these prompt lengths (e.g. 128,512,2000)",
    )
    ap.add_argument("--repeats", type=int, default=3, help="with --overlap: runs per length")
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    model = args.model or Path(".trident/models") / args.preset
    if args.model is None and not is_checkpoint_dir(model):
        write_checkpoint(model, args.preset, seed=0)
    if args.overlap:
        overlap(model, [int(x) for x in args.overlap.split(",")], args.repeats)
        return
    slo = SLO(args.ttft_slo, args.tbt_slo)
    load = LoadSpec(
        rates=parse_rates(None, args.sweep),
        duration=args.duration,
        workload=args.workload,
        arrivals=args.arrivals,
        max_output_tokens=args.max_output_tokens,
    )
    size = tuple(int(x) for x in args.image_size.split("x"))
    chosen = systems(args.with_epd, args.epd_token_cap)
    if args.only:
        wanted = {name.strip() for name in args.only.split(",")}
        if unknown := wanted - {s.name for s in chosen}:
            ap.error(f"--only names systems not in this run: {sorted(unknown)}")
        chosen = [s for s in chosen if s.name in wanted]
    result = compare(chosen, model, Bench(load, slo, args.out, image_size=size), progress_reporter)
    epd_rows = BATCHING_EPD + ([epd_capped(args.epd_token_cap).name] if args.epd_token_cap else [])
    tables = {"batching": BATCHING + (epd_rows if args.with_epd else []), "transfer": TRANSFER}
    report = {}
    for name, names in tables.items():
        part = subset(result, names)
        print(f"\n## {name}\n\n{table(part)}", flush=True)
        report[name] = {"goodput": part.goodputs(), "notes": part.notes}
    print(json.dumps({"slo": {"ttft": slo.ttft, "tbt": slo.tbt}, "load": load.describe(), **report}))


def overlap(model: Path, lengths: list[int], repeats: int) -> None:
    """The overlap table alone: how much of each prompt length's KV transfer the prefill hides."""
    rate = single_thread_gflops()
    rows = asyncio.run(
        kv_overlap.measure(kv_overlap.Prefill(model, group=4, wire=KvWire.NATIVE), lengths, repeats)
    )
    print(f"## overlap\n\n{kv_overlap.table(rows)}", flush=True)
    print(json.dumps({"matmul_gflops": round(rate, 1), "overlap": rows}))


if __name__ == "__main__":
    main()
