"""Offline feature building on each executor (predictor/executors.py): wall time, CPU time and peak memory
per process for a simulated cluster, and the arithmetic for a big one (docs/scaling.md).

    python -m benchmarks executors [--nodes 512] [--days 7] [--data DIR] [--workers 2]

The cluster is simulated once (`foreshock simulate --world random`, kept when --data names a folder
that does not exist yet, reused when it does) and its features built with the local process pool,
then with Ray tasks on a local Ray instance of the same CPU count. Memory: the peak RSS (VmHWM) of
this process and of each worker process, sampled from /proc while the build runs; CPU: this process
plus its workers (user + system). Issue 18's targets: the same features on both (tests check it bit for
bit), memory per task bounded by one node partition.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from foreshock.predictor import offline

TARGET_NODES, TARGET_DAYS = 12_500, 90
IN_ALL = False   # a 512-node simulation and two builds: about 10 minutes; run it by name
WORKER_MARKERS = ("ray::", "multiprocessing.spawn", "from multiprocessing")


class ProcessSampler:
    """Every `period_s`: VmHWM and CPU ticks of this process and of the worker processes (by cmdline)."""

    def __init__(self, period_s: float = 0.5):
        self.period_s = period_s
        self.peak_kb: dict[int, int] = {}
        self.cpu_ticks: dict[int, tuple[int, int]] = {}     # pid -> (first, last) utime+stime
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self):
        while not self._stop.wait(self.period_s):
            self._sample()

    def _sample(self):
        me = os.getpid()
        stats: dict[int, list[str]] = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                try:
                    stats[int(entry.name)] = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
        # this process's descendants only: the machine runs other people's pools too
        children: dict[int, list[int]] = {}
        for pid, stat in stats.items():
            children.setdefault(int(stat[1]), []).append(pid)
        mine, todo = set(), [me]
        while todo:
            pid = todo.pop()
            mine.add(pid)
            todo.extend(children.get(pid, ()))
        for pid in mine:
            try:
                if pid != me:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    if not any(m in cmd for m in WORKER_MARKERS):
                        continue
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            stat = stats[pid]
            hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
            self.peak_kb[pid] = max(self.peak_kb.get(pid, 0), hwm)
            ticks = int(stat[11]) + int(stat[12])
            first = self.cpu_ticks.get(pid, (ticks, ticks))[0]
            self.cpu_ticks[pid] = (first, ticks)

    def worker_cpu_s(self) -> float:
        hz = os.sysconf("SC_CLK_TCK")
        return sum(last - first for pid, (first, last) in self.cpu_ticks.items() if pid != os.getpid()) / hz

    def worker_peaks_mb(self) -> list[float]:
        return sorted((kb / 1024 for pid, kb in self.peak_kb.items() if pid != os.getpid()), reverse=True)


def build(data: Path, executor: str, workers: int) -> dict:
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    nodes = 0
    node_days = 0.0
    with ProcessSampler() as sampler:
        with offline.FeatureBuilder(data, workers=workers, executor=executor) as fb:
            for nf in fb:
                nodes += 1
                node_days += len(nf.steps) * offline.STEP_NS / 86_400e9
    wall = time.perf_counter() - t0
    parent_cpu = time.process_time() - cpu0
    workers_cpu = sampler.worker_cpu_s()
    peaks = sampler.worker_peaks_mb()
    return {"executor": executor, "wall_s": wall, "cpu_s": parent_cpu + workers_cpu, "parent_cpu_s": parent_cpu,
            "workers_cpu_s": workers_cpu, "parent_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "worker_peak_mb": peaks[0] if peaks else 0.0, "worker_processes": len(peaks), "nodes": nodes,
            "node_days": node_days}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench_executors")
    ap.add_argument("--nodes", type=int, default=512)
    ap.add_argument("--days", type=int, default=7)
    ap.add_argument("--data", default=None, help="the simulated cluster: reused when it exists, else kept there")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--executors", default="local,ray")
    args = ap.parse_args(argv)
    tmp = None
    data = Path(args.data) if args.data else Path(tmp := tempfile.mkdtemp(prefix="bench-exec-")) / "d"
    try:
        if not data.exists():
            t0 = time.perf_counter()
            cmd = [sys.executable, "-m", "foreshock.cli", "simulate", "--world", "random", "--nodes", str(args.nodes),
                   "--days", str(args.days), "--interval", "60", "--seed", "18", "--rate-scale", "5",
                   "--out", str(data)]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            print(f"simulated {args.nodes} nodes x {args.days} days in {time.perf_counter() - t0:.0f} s -> {data}")
        load = os.getloadavg()
        print(f"load average before: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.workers} workers")
        print(f"{'executor':9} {'nodes':>6} {'node-days':>9} {'wall s':>7} {'CPU s':>7} {'parent CPU s':>12} "
              f"{'parent peak MB':>14} {'worker peak MB':>14} {'workers':>7} {'CPU s / node-day':>16}")
        rows = []
        for kind in args.executors.split(","):
            r = build(data, kind, args.workers)
            rows.append(r)
            print(f"{kind:9} {r['nodes']:6d} {r['node_days']:9.0f} {r['wall_s']:7.1f} {r['cpu_s']:7.1f} "
                  f"{r['parent_cpu_s']:12.1f} {r['parent_peak_mb']:14.0f} {r['worker_peak_mb']:14.0f} "
                  f"{r['worker_processes']:7d} {r['cpu_s'] / max(r['node_days'], 1e-9):16.3f}", flush=True)
        load = os.getloadavg()
        print(f"load average after: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
        for r in rows:
            per = r["workers_cpu_s"] / max(r["node_days"], 1e-9)
            total_h = per * TARGET_NODES * TARGET_DAYS / 3600
            print(f"{r['executor']}: workers' CPU {per:.3f} s per node-day -> {TARGET_NODES:,} nodes x {TARGET_DAYS} days "
                  f"= {total_h:,.0f} CPU-hours: {total_h / 64:,.1f} h on 64 worker CPUs, {total_h / 512:,.2f} h on 512 "
                  f"(the parent's per-step reduction, {r['parent_cpu_s'] / max(r['node_days'], 1e-9):.3f} s per "
                  "node-day, stays on one machine)")
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0
