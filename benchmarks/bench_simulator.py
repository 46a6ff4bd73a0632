"""Simulator throughput, memory and disk: a measured run, extrapolated to 30 days of a 512-node cluster.

Target (issue 3): 30 days of 512 nodes (4,096 GPUs) at 60 s in under 10 minutes on this 2-core machine,
under 4 GB of memory and 5 GB on disk. The default run is a slice of it (--nodes/--days); `--full` runs
the target itself. Memory is the peak RSS of this process plus the largest worker process.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time

TARGET_NODES, TARGET_DAYS = 512, 30
HOUR_NS = 3600 * 10**9


def _hourly_features(root):
    """Per node-hour: the largest hourly delta of each error counter over the node's devices, the same in
    the two hours before, its change against the trailing 24 h, the hottest GPU and the node's
    utilisation against the cluster's."""
    import pandas as pd

    from foreshock.dataset import read_table

    specs = (("gpu", "gpu", ["ecc_corrected_volatile", "remapped_rows_correctable", "pcie_replay_counter"]),
             ("nvlink", "gpu", ["crc_flit_errors", "replay_errors"]),
             ("rdma_port", "device", ["symbol_error", "link_error_recovery", "local_ack_timeout_err", "link_downed",
                                      "req_cqe_error", "port_rcv_remote_physical_errors", "port_xmit_discards"]))
    parts, base = [], []
    for table, key, cols in specs:
        df = read_table(root, table, columns=["ts", "node", key, *cols]).to_pandas().sort_values(["node", key, "ts"])
        for c in cols:
            df["d_" + c] = df.groupby(["node", key])[c].diff().clip(lower=0).fillna(0)
        df["hour"] = df.ts.dt.floor("h")
        per_device = df.groupby(["node", key, "hour"])[["d_" + c for c in cols]].sum().reset_index()
        parts.append(per_device.groupby(["node", "hour"])[["d_" + c for c in cols]].max())
        base += ["d_" + c for c in cols]
    g = read_table(root, "gpu", columns=["ts", "node", "temperature_c", "utilization_pct"]).to_pandas()
    g["hour"] = g.ts.dt.floor("h")
    parts.append(g.groupby(["node", "hour"]).agg(temp_max=("temperature_c", "max"), util=("utilization_pct", "mean")))
    f = pd.concat(parts, axis=1).fillna(0).reset_index().sort_values(["node", "hour"])
    for c in base:
        trail = f.groupby("node")[c].transform(lambda s: s.shift(1).rolling(24, min_periods=1).mean()).fillna(0)
        f["trend_" + c] = f[c] - trail
        f["lag1_" + c] = f.groupby("node")[c].shift(1).fillna(0)
        f["lag2_" + c] = f.groupby("node")[c].shift(2).fillna(0)
    f["util_rel"] = f.util - f.groupby("hour").util.transform("median")
    return f.reset_index(drop=True), base


def quality(days: float = 20.0, nodes: int = 64, rate_scale: float = 80.0) -> int:
    """Does the default difficulty separate a naive threshold from a learned model? Label: a failure with
    a precursor on the node within 6 h; windows after a failure until repair, and before failures without
    a precursor, are left out. Fit on the first half of the span, score on the second."""
    import numpy as np
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.metrics import average_precision_score, precision_recall_fscore_support

    from foreshock.dataset import read_table
    from foreshock.simulator.batch import SimSettings, run
    from foreshock.simulator.faults import FaultSettings
    from foreshock.simulator.topology import Topology

    root = tempfile.mkdtemp(prefix="bench-sim-q-")
    try:
        run(SimSettings(topology=Topology(nodes=nodes, nodes_per_leaf=16, job_nodes=16), days=days, interval_s=300,
                        seed=9, faults=FaultSettings(rate_scale=rate_scale)), root)
        f, base = _hourly_features(root)
        incidents = read_table(root, "incidents").to_pandas()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    hours = f.hour.values.astype("datetime64[ns]").astype(np.int64)
    y, ignore = np.zeros(len(f), bool), np.zeros(len(f), bool)
    incident_of = np.full(len(f), -1)
    for k, inc in enumerate(incidents.itertuples()):
        for node in inc.affected_nodes:
            mine = f.node.values == node
            ahead = mine & (hours + HOUR_NS <= inc.ts.value) & (hours + HOUR_NS > inc.ts.value - 6 * HOUR_NS)
            if inc.has_precursor:
                y |= ahead
                incident_of[ahead] = k
            else:
                ignore |= ahead
            ignore |= mine & (hours + HOUR_NS > inc.ts.value) & (hours < inc.repaired_at.value + HOUR_NS)
    f, y, incident_of = f[~ignore].reset_index(drop=True), y[~ignore], incident_of[~ignore]
    fit = (f.hour < f.hour.min() + (f.hour.max() - f.hour.min()) / 2).values
    X = f.drop(columns=["node", "hour"]).to_numpy(dtype=float)

    def scores(truth, pred):
        p, r, f1, _ = precision_recall_fscore_support(truth, pred, average="binary", zero_division=0)
        return p, r, f1

    def per_incident(pred):
        """(share of precursor incidents flagged at least once in their 6 h, false alarms per 1,000 healthy node-hours)"""
        test = ~fit
        ids = set(incident_of[test & y])
        caught = set(incident_of[test & y & pred])
        healthy = test & ~y
        return len(caught) / max(len(ids), 1), 1000.0 * pred[healthy].sum() / max(healthy.sum(), 1)

    best = None
    for q in (99.0, 99.5, 99.9, 99.97):  # "any counter above its healthy q-th percentile", q fitted
        thr = {c: np.percentile(f.loc[fit & ~y, c], q) for c in base}
        pred = np.logical_or.reduce([f[c].to_numpy() > thr[c] for c in base])
        if best is None or scores(y[fit], pred[fit])[2] > best[0]:
            best = (scores(y[fit], pred[fit])[2], q, pred)
    p, r, f1 = scores(y[~fit], best[2][~fit])
    print(f"quality: {len(f):,} node-hours, {int(y.sum())} positive, {len(incidents)} incidents")
    caught, false = per_incident(best[2])
    print(f"naive threshold (q={best[1]}): precision {p:.2f} recall {r:.2f} F1 {f1:.2f}; "
          f"incidents caught {caught:.2f}, false alarms {false:.1f} per 1,000 healthy node-hours")
    model = HistGradientBoostingClassifier(max_iter=300, learning_rate=0.05, max_depth=4, class_weight="balanced",
                                           l2_regularization=1.0, random_state=0).fit(X[fit], y[fit])
    train = model.predict_proba(X[fit])[:, 1]
    cut = max(np.unique(np.round(train, 3)), key=lambda t: scores(y[fit], train >= t)[2])
    prob = model.predict_proba(X[~fit])[:, 1]
    p, r, f1l = scores(y[~fit], prob >= cut)
    full = np.zeros(len(f), bool)
    full[~fit] = prob >= cut
    caught, false = per_incident(full)
    print(f"learned (gradient boosting): precision {p:.2f} recall {r:.2f} F1 {f1l:.2f} "
          f"AP {average_precision_score(y[~fit], prob):.2f}; incidents caught {caught:.2f}, "
          f"false alarms {false:.1f} per 1,000 healthy node-hours")
    return 0


def _du(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench_simulator")
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--days", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--full", action="store_true", help="run the full 512-node, 30-day target")
    parser.add_argument("--world", choices=["clean", "random"], default="clean",
                        help="the simulated world (docs/simulator.md); random adds node types and collection noise")
    parser.add_argument("--quality", action="store_true",
                        help="also check a naive threshold against a learned model on simulated data (about a minute)")
    args = parser.parse_args(argv)
    if args.full:
        args.nodes, args.days = TARGET_NODES, TARGET_DAYS

    from foreshock.simulator.batch import SimSettings, run
    from foreshock.simulator.topology import Topology

    out = tempfile.mkdtemp(prefix="bench-sim-")
    try:
        settings = SimSettings(topology=Topology(nodes=args.nodes), days=args.days, interval_s=60.0, seed=1,
                               world=args.world)
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        ch0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        summary = run(settings, out, workers=args.workers)
        wall = time.perf_counter() - t0
        ch1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = time.process_time() - cpu0 + (ch1.ru_utime - ch0.ru_utime) + (ch1.ru_stime - ch0.ru_stime)
        disk = _du(out)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    self_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    node_days = args.nodes * args.days
    rows = sum(summary.rows.values())
    scale = TARGET_NODES * TARGET_DAYS / node_days
    print(f"run: {args.nodes} nodes x {args.days:g} days at 60 s, {args.world} world = {node_days:g} node-days, "
          f"{rows:,} rows, {summary.files_written:,} files, workers={args.workers or os.cpu_count()}")
    print(f"wall {wall:.1f} s ({node_days / wall:.1f} node-days/s, {rows / wall / 1e6:.2f} M rows/s); "
          f"CPU {cpu:.1f} s in all processes ({cpu / node_days * 1e3:.1f} ms per node-day); "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"disk {disk / 1e6:.1f} MB ({disk / node_days / 1e3:.0f} kB per node-day, "
          f"{disk / max(summary.rows['gpu'] + summary.rows['nvlink'] + summary.rows['rdma_port'], 1):.1f} B per per-GPU/HCA row)")
    print(f"peak RSS: parent {self_rss / 1e6:.0f} MB, largest worker {child_rss / 1e6:.0f} MB")
    print(f"incidents: {sum(summary.incidents.values())}, recoveries: {summary.recoveries}")
    est_time, est_disk = wall * scale, disk * scale
    mem = self_rss + child_rss * max(1, min(os.cpu_count() or 1, 16))
    cores = min(os.cpu_count() or 1, args.workers or os.cpu_count() or 1)
    print(f"512 nodes x 30 days {'(measured)' if args.full else '(extrapolated)'}: "
          f"{est_time / 60:.1f} min wall at this load, {cpu * scale / cores / 60:.1f} min of CPU per core "
          f"on {cores} cores (target < 10), {est_disk / 1e9:.2f} GB on disk (target < 5), "
          f"memory about {mem / 1e9:.2f} GB (target < 4; per-block, independent of span)")
    return quality() if args.quality else 0
