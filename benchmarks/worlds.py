"""Simulated worlds for the predictor's benchmarks (bench_shift, bench_interval): one made with the real
`foreshock simulate` at the failure rate and recovery ratio those benchmarks share, and a model's
figures at its budgets printed from `foreshock evaluate`'s report (predictor/evaluate.py)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RATE_SCALE, RECOVERY_RATIO = 5.0, 0.2
INTERVAL_S = 60   # seconds between a world's samples: the predictor's feature step
BUDGETS = ("1.0", "2.0", "5.0")


def add_world_arguments(parser, *, seed: int, keep_help: str) -> None:
    """The world's size, seed, the model to evaluate and where to keep the world: the options every
    benchmark of simulated worlds takes."""
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--days", type=float, default=14.0)
    parser.add_argument("--seed", type=int, default=seed)
    parser.add_argument("--model", default=None, help="model directory (default: the shipped model)")
    parser.add_argument("--keep", type=Path, default=None, help=keep_help)


def simulate(out: Path, *, nodes: int, days: float, seed: int, scenario: Path | None = None,
             start: str = "2026-10-05T00:00:00Z") -> float:
    """The catalogue's random world (or `scenario`'s) at RATE_SCALE x the failure rate, into `out`;
    returns the seconds it took."""
    cmd = [sys.executable, "-m", "foreshock", "simulate", "--nodes", str(nodes), "--days", str(days),
           "--seed", str(seed), "--rate-scale", str(RATE_SCALE), "--recovery-ratio", str(RECOVERY_RATIO),
           "--interval", str(INTERVAL_S), "--start", start, "--out", str(out), "--log-level", "WARNING"]
    cmd += ["--scenario", str(scenario)] if scenario else ["--world", "random"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def print_budgets(name: str, rep: dict) -> None:
    """Recall of precursor failures, median lead and false evacuations per 1,000 node-days at each of
    BUDGETS, for the model, the DCGM-style rule and the fleet-calibrated model."""
    print(f"{name}: {rep['nodes']} nodes, {rep['node_days']:.0f} node-days, "
          f"{rep['at_budgets'][BUDGETS[0]]['model']['incidents_precursor']} precursor failures")
    print(f"  {'budget':>6} {'predictor':18} {'recall':>7} {'lead min':>9} {'FE/1k':>7}")
    for b in BUDGETS:
        rows = [(who, rep["at_budgets"][b].get(who)) for who in ("model", "rule")]
        rows.append(("fleet-calibrated", (rep.get("fleet_calibrated") or {}).get("at_budgets", {}).get(b)))
        for who, r in rows:
            if not r:
                continue
            lead = r["median_lead_minutes"]   # NaN where nothing was caught
            print(f"  {float(b):6g} {who:18} {r['incident_recall_precursor']:7.0%} "
                  f"{'-' if np.isnan(lead) else f'{lead:.1f}':>9} {r['false_evacuations_per_1000_node_days']:7.2f}")
