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
    args = parser.parse_args(argv)
    if args.full:
        args.nodes, args.days = TARGET_NODES, TARGET_DAYS

    from foreshock.simulator.batch import SimSettings, run
    from foreshock.simulator.topology import Topology

    out = tempfile.mkdtemp(prefix="bench-sim-")
    try:
        settings = SimSettings(topology=Topology(nodes=args.nodes), days=args.days, interval_s=60.0, seed=1)
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
    print(f"run: {args.nodes} nodes x {args.days:g} days at 60 s = {node_days:g} node-days, "
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
    return 0
