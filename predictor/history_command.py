"""`foreshock history`: import a public fault trace as schema-v1 incidents, and score nodes by their history.

    foreshock history import --format infinitehbd TRACE.json --out DIR [--fleet-size 400]
    foreshock history score --data DIR --at TIME [--horizon-days 30] [--hardware-only] --json OUT
    foreshock history stats --data DIR [--span-days DAYS]

`import` writes the `incidents` table (and an `inventory` row per node seen) with foreshock.dataset's
writer, the layout `foreshock simulate` writes, plus DIR/history.json (predictor/history.py
METADATA_FILE: the fleet size, since a fault log names only the nodes that failed, and day 0).
`score` fits predictor/history.py's NodeHistoryModel on the events before TIME only and writes
{"scores": {node: P}, "default": P for a node with no history, ...}. TIME is ISO-8601
(2024-09-01T00:00Z) or a number of days since the dataset's day 0 (history.json, else the day of its
first incident). `stats` prints repair times and times between faults as JSON (history.py
fault_statistics; docs/goodput.md cites them). docs/predictor.md, "Node history score", has the
measured figures.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

FORMATS = ("infinitehbd",)
DEFAULT_FLEET_SIZE = {"infinitehbd": 400}  # the trace's README: 400 servers
MAX_LEFT_OUT_SHOWN = 10   # fault_end records left out, each named on stderr up to this many, then a count


def register(subparsers) -> None:
    p = subparsers.add_parser("history", help="node history (lemon node) score from a fault log",
                              description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="history_command", metavar="SUBCOMMAND")
    i = sub.add_parser("import", help="turn a public fault trace into schema-v1 incidents")
    i.add_argument("trace", help="the trace file")
    i.add_argument("--format", choices=FORMATS, required=True)
    i.add_argument("--out", required=True, help="dataset directory to write (must not hold incidents yet)")
    i.add_argument("--fleet-size", type=int, dest="fleet_size",
                   help="nodes in the cluster, failed or not (default for infinitehbd: 400)")
    i.set_defaults(run=run_import)
    s = sub.add_parser("score", help="P(a fault within the horizon) per node, from the incidents before --at")
    s.add_argument("--data", required=True, help="dataset directory with an incidents table")
    s.add_argument("--at", required=True, help="ISO-8601 time, or days since the dataset's day 0")
    s.add_argument("--horizon-days", type=float, default=30.0, dest="horizon_days")
    s.add_argument("--hardware-only", action="store_true", dest="hardware_only",
                   help="predict hardware faults only (history.py HARDWARE_CATEGORIES)")
    s.add_argument("--json", required=True, help="write the scores here")
    s.set_defaults(run=run_score)
    t = sub.add_parser("stats", help="repair time and time between faults of a fault log, as JSON")
    t.add_argument("--data", required=True, help="dataset directory with an incidents table")
    t.add_argument("--span-days", type=float, dest="span_days",
                   help="days the log covers (default: day 0 to its last event, rounded up)")
    t.set_defaults(run=run_stats)

    def usage(args, file_data) -> int:
        p.print_help()
        return 2

    p.set_defaults(run=usage)


def run_import(args, file_data) -> int:
    from foreshock import dataset, schema
    from foreshock.predictor import history

    fleet = args.fleet_size if args.fleet_size is not None else DEFAULT_FLEET_SIZE[args.format]
    out = Path(args.out)
    try:
        left_out: list[str] = []
        rows = history.read_infinitehbd(args.trace, left_out=left_out)
        nodes = sorted({r["node"] for r in rows})
        if fleet < len(nodes):
            raise history.HistoryError(f"--fleet-size {fleet} is smaller than the {len(nodes)} nodes of {args.trace}")
        if dataset.partition_files(out, "incidents"):
            raise history.HistoryError(f"{out} already holds an incidents table")
    except history.HistoryError as exc:
        print(f"foreshock history import: {exc}", file=sys.stderr)
        return 1
    writer = dataset.DatasetWriter(out, fsync=False, journal=False)
    day0 = history.INFINITEHBD_DAY0
    writer.write_table("incidents", schema.to_table("incidents", rows))
    writer.write_table("inventory", schema.to_table("inventory", [{"ts": day0, "node": n} for n in nodes]))
    history.write_metadata(out, fleet_size=fleet, day0=day0, source=str(Path(args.trace).resolve()), fmt=args.format)
    still_open = sum(r["repaired_at"] is None for r in rows)
    for line in left_out[:MAX_LEFT_OUT_SHOWN]:
        print(f"foreshock history import: {line}", file=sys.stderr)
    if len(left_out) > MAX_LEFT_OUT_SHOWN:
        print(f"foreshock history import: ... and {len(left_out) - MAX_LEFT_OUT_SHOWN} more fault_end records "
              "left out", file=sys.stderr)
    unpaired = f"; {len(left_out)} fault_end records with no open fault left out" if left_out else ""
    print(f"{args.trace}: {len(rows)} incidents on {len(nodes)} nodes (fleet of {fleet}; {still_open} still open"
          f"{unpaired}) -> {out}")
    return 0


def run_score(args, file_data) -> int:
    import pandas as pd

    from foreshock.predictor import history

    if not args.horizon_days > 0:
        print(f"foreshock history score: --horizon-days must be > 0, got {args.horizon_days}", file=sys.stderr)
        return 2
    try:
        scores, default, model, at = history.score_dataset(
            args.data, float(args.at) if _is_number(args.at) else args.at, horizon_days=args.horizon_days,
            hardware_only=args.hardware_only)
    except history.HistoryError as exc:
        print(f"foreshock history score: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"foreshock history score: --at {args.at!r}: not an ISO-8601 time or a number of days ({exc})",
              file=sys.stderr)
        return 2
    result = {
        "scores": scores,
        "default": default,
        "at": (model.day0_ + pd.Timedelta(days=at)).isoformat(),
        "at_days": at,
        "horizon_days": args.horizon_days,
        "hardware_only": args.hardware_only,
        "fleet_size": model.fleet_size,
        "model": {"half_life_days": model.half_life_days_, "other_fault_weight": model.other_weight_,
                  "prior_a": model.a_, "prior_b_days": model.b_, "training_cutoffs": len(model.cutoffs_),
                  "training_rows": model.n_training_rows_, "base_rate": model.base_rate_},
    }
    Path(args.json).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    top = sorted(result["scores"].items(), key=lambda kv: -kv[1])[:3]
    print(f"{len(scores)} nodes with history scored at day {at:.2f} (horizon {args.horizon_days:g} d); default "
          f"{result['default']:.3f}; highest " + ", ".join(f"{n} {p:.3f}" for n, p in top) + f" -> {args.json}")
    return 0


def run_stats(args, file_data) -> int:
    import numpy as np

    from foreshock.predictor import history

    try:
        log, fleet = history.load(args.data)
    except history.HistoryError as exc:
        print(f"foreshock history stats: {exc}", file=sys.stderr)
        return 1
    times = np.concatenate([log.start, log.end[np.isfinite(log.end)]])
    span = args.span_days if args.span_days is not None else float(np.ceil(times.max())) if len(times) else 0.0
    if not span > 0:
        print(f"foreshock history stats: --span-days must be > 0, got {span}", file=sys.stderr)
        return 2
    print(json.dumps(history.fault_statistics(log, fleet, span), indent=2))
    return 0


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False
