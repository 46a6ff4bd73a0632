"""Sampling interval: a model's budgets on one world as collectors at other intervals would have written it.

    .venv/bin/python -m benchmarks interval [--nodes 128] [--days 14] [--seed 661] [--model DIR] [--keep DIR]

Simulates the catalogue's random world with the real `foreshock simulate`, sampled every 60 s (the
feature step), and writes it again as other collectors would have: every 120 s, every 300 s, and with
the ports every 120 s and the NVLink links every 300 s while the other tables stay at 60 s (a writer
with one exporter per device kind). Each sampled table keeps the rows of every k-th 60 s sample round
(`round(ts / 60 s)` divisible by k); events, incidents, inventory and step times are kept whole, so
every version has the same devices, counters and failures. Each is evaluated with the model (the
shipped one by default) at its manifest's thresholds.

Printed for each version: the budgets' figures (benchmarks/worlds.py), and evaluate's
`telemetry_interval` (how often the nodes were sampled, overall and by table, and how many had their
deltas spread over the steps each sample covers: docs/predictor.md, "Telemetry interval") with its
warning. A history sampled less often than once a step should give about the 60 s version's node-days
and figures. The load average is printed with the figures. The world comes from this project's
simulator: this is a check of the features' sampling, not evidence of the model's recall. Results:
benchmarks/results/telemetry-interval-2026-12-07.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from benchmarks import worlds
from foreshock.predictor import signals

SAMPLE_ROUND_NS = worlds.INTERVAL_S * 1_000_000_000
SAMPLED_TABLES = tuple(t for t in signals.TABLES if t != "events")
# version name -> {table: keep one sample round in k}; a table not named keeps every row
VERSIONS = {
    "every 60 s": {},
    "every 120 s": {t: 2 for t in SAMPLED_TABLES},
    "every 300 s": {t: 5 for t in SAMPLED_TABLES},
    "ports 120 s, NVLink 300 s": {"rdma_port": 2, "nvlink": 5},
}


def thinned(src: Path, dst: Path, keep_one_in: dict[str, int]) -> None:
    """`src` copied to `dst` with each named table's rows kept at one sample round in k."""
    shutil.copytree(src, dst)
    for table, k in keep_one_in.items():
        for path in sorted(dst.glob(f"table={table}/**/*.parquet")):
            t = pq.read_table(path)
            rounds = np.round(t.column("ts").cast(pa.int64()).to_numpy() / SAMPLE_ROUND_NS).astype(np.int64)
            pq.write_table(t.filter(pa.array(rounds % k == 0)), path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_interval")
    worlds.add_world_arguments(parser, seed=661, keep_help="write the world here and keep it (reused when present)")
    args = parser.parse_args(argv)

    from foreshock.predictor import evaluate as ev
    from foreshock.predictor import offline

    with tempfile.TemporaryDirectory(prefix="bench-interval-") as tmp:
        world = (args.keep or Path(tmp)) / f"catalogue-{args.seed}-{args.nodes}n-{args.days:g}d"
        if not (world / "table=incidents").exists():
            took = worlds.simulate(world, nodes=args.nodes, days=args.days, seed=args.seed,
                                   start="2026-10-19T00:00:00Z")
            print(f"simulated the catalogue world in {took:.0f} s", flush=True)
        for name, keep_one_in in VERSIONS.items():
            data = world
            if keep_one_in:
                data = Path(tmp) / name.replace(" ", "-").replace(",", "")
                thinned(world, data, keep_one_in)
            t0 = time.perf_counter()
            rep = ev.evaluate_dataset(data, args.model)
            print(f"\nevaluated in {time.perf_counter() - t0:.0f} s, load average {os.getloadavg()[0]:.2f}")
            worlds.print_budgets(f"{name} (seed {args.seed})", rep)
            interval = rep["telemetry_interval"]
            print(f"  sampled: median {interval['median_seconds_between_samples']:g} s; less than once a step "
                  f"{interval['nodes_sampled_less_than_once_a_step']} of {interval['nodes']} nodes, spread "
                  f"{interval['of_those_spread_over_their_steps']}; entity steps filled "
                  f"{interval['entity_steps_filled_by_spreading']:,}")
            print("  by table: " + ", ".join(f"{t} {v['median_seconds_between_samples']:g} s"
                                             for t, v in interval["by_table"].items()))
            warning = offline.telemetry_interval_warning(interval)
            if warning:
                print(f"  {warning}")
            if data != world:
                shutil.rmtree(data)
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0
