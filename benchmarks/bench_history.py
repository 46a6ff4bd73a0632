"""Node history score on the real InfiniteHBD fault trace, against the published baselines.

Rolling origin: at each weekly cut-off T the model is fitted on the trace before T only (its own
training cut-offs' label windows close before T) and scores the whole fleet (400 servers, the never
failed ones as zero-history nodes); the label is a fault of the node in (T, T + 30 days]. Choices (the
estimator, its grids of half-lives and weights) were made on the selection cut-offs, day 70-119 (label
windows end by day 149); the figures that count are the report cut-offs, day 160-216, whose label
windows end by day 246, inside the 250 days this project holds. Baselines: the fault count of the last
90 days (the trace README's published analysis) and an exponentially decayed count (half-life 30
days). Results: benchmarks/results/history-2026-12-03.md.

    python -m benchmarks history [--trace FILE] [--period select|report]
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

TRACE = (Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "infinitehbd-trace"
         / "fault_trace_days_0_250.json")
HORIZON_DAYS = 30.0
PERIODS = {"select": np.arange(70.0, 120.0 + 1e-9, 7.0), "report": np.arange(160.0, 220.0 + 1e-9, 7.0)}


def evaluate(log, fleet_size: int, cutoffs, *, hardware_only: bool) -> dict[str, dict[str, list[float]]]:
    from sklearn.metrics import roc_auc_score

    from foreshock.predictor import history as h

    out: dict[str, dict[str, list[float]]] = {}
    for at in cutoffs:
        nodes, y = h.labelled_population(log, fleet_size, at, HORIZON_DAYS, hardware_only)
        model = h.NodeHistoryModel(horizon_days=HORIZON_DAYS, fleet_size=fleet_size,
                                   hardware_only=hardware_only).fit(log, at)
        scores = {
            "count_90d": h.count_score(log, nodes, at, 90.0, hardware_only),
            "decayed_30d": h.decayed_count_score(log, nodes, at, 30.0, hardware_only),
            "model": model.predict_proba(log, nodes, at),
        }
        for name, s in scores.items():
            row = out.setdefault(name, {"auc": [], "lift": [], "at": []})
            row["auc"].append(roc_auc_score(y, s))
            row["lift"].append(h.top_lift(s, y, 0.05))
            row["at"].append(at)
        base = out.setdefault("_base", {"rate": [], "choice": []})
        base["rate"].append(float(y.mean()))
        base["choice"].append((model.half_life_days_, model.other_weight_))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_history")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--period", choices=sorted(PERIODS), default="report")
    args = parser.parse_args(argv)
    if not args.trace.exists():
        print(f"trace {args.trace} not found (../shared/datasets/infinitehbd-trace): skipped")
        return 0

    import pandas as pd

    from foreshock.predictor import history as h

    log = h.FaultLog.from_incidents(pd.DataFrame(h.read_infinitehbd(args.trace)), h.INFINITEHBD_DAY0)
    fleet = h.INFINITEHBD_FLEET_SIZE
    cutoffs = PERIODS[args.period]
    print(f"trace {args.trace.name}: {len(log.start)} faults on {len(set(log.node))} of {fleet} nodes; "
          f"{args.period} cut-offs day {cutoffs[0]:g}..{cutoffs[-1]:g} every 7 d, horizon {HORIZON_DAYS:g} d")
    for hardware_only in (False, True):
        res = evaluate(log, fleet, cutoffs, hardware_only=hardware_only)
        kind = "hardware faults" if hardware_only else "all faults"
        print(f"\n{kind}: base rate {np.mean(res['_base']['rate']):.3f} (mean over cut-offs)")
        print(f"{'score':12} {'ROC-AUC':>8} {'min':>6} {'max':>6} {'top-5% lift':>12} {'min':>6} {'max':>6}")
        for name in ("count_90d", "decayed_30d", "model"):
            r = res[name]
            print(f"{name:12} {np.mean(r['auc']):8.3f} {min(r['auc']):6.3f} {max(r['auc']):6.3f} "
                  f"{np.mean(r['lift']):12.2f} {min(r['lift']):6.2f} {max(r['lift']):6.2f}")
        rows = zip(res["model"]["at"], res["count_90d"]["auc"], res["decayed_30d"]["auc"], res["model"]["auc"],
                   res["_base"]["choice"])
        print("per cut-off (day: AUC count / decayed / model, the model's half-life d and other-fault weight):",
              ", ".join(f"{at:g}: {a:.2f}/{b:.2f}/{c:.2f} h{hl:g} w{w:g}" for at, a, b, c, (hl, w) in rows))
    print(f"\nload average {os.getloadavg()[0]:.2f}")
    return 0
