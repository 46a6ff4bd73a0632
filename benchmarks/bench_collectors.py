"""Collector CPU per sweep and Parquet volume: `python -m benchmarks collectors [--quick]`.

Figures:
1. CPU time (process_time) of one sweep of the rdma+netdev sources over ../shared/fixtures/procfs (the
   tree node_exporter's infiniband+netclass collectors scrape in ~2 ms here), Parquet writing amortised
   in: sweeps run at a simulated 1 Hz into a DatasetWriter that rotates every 300 s, so every 300th sweep
   pays for writing the interval's files. Median of per-sweep CPU, and the mean including the writes.
2. The same over a synthetic 8-HCA node: a sysfs tree with 8 mlx5 HCAs (the fixture's mlx5_0 copied) and
   8 interfaces, plus 8 GPUs through FakeNvml (the NVML side is the fake's cost, not the driver's).
3. The simulated source (8 GPUs, 8 HCAs) alone, and its Parquet bytes per node-hour at 1 Hz.
Targets (issue 2): <= half node_exporter's ~2 ms per fixture scrape; < 5 MB per node-hour.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("FORESHOCK_SHARED", REPO.parent / "shared"))
FIXTURE = SHARED / "fixtures" / "procfs" / "sys"
T0 = 1_780_000_000 * 10**9


class FakeClock:
    def __init__(self):
        self.now = T0 / 1e9

    def __call__(self):
        return self.now


def run_sweeps(make_sources, n: int, out: Path, rotate: float = 300.0) -> dict:
    from foreshock.collectors.collector import Collector
    from foreshock.dataset import DatasetWriter

    clock = FakeClock()
    writer = DatasetWriter(out, rotate_seconds=rotate, fsync=False, clock=clock)
    col = Collector("bench", make_sources(), writer)
    for k in range(3):  # warm-up: scans, first allocations
        col.sweep_once(T0 - (3 - k) * 10**9)
    writer.flush()
    per = []
    total0 = time.process_time()
    for k in range(n):
        clock.now = (T0 + k * 10**9) / 1e9
        t0 = time.process_time()
        col.sweep_once(T0 + k * 10**9)
        per.append(time.process_time() - t0)
    writer.flush()
    total = time.process_time() - total0
    snap = col.snapshot()
    col.close()
    return {"median_ms": statistics.median(per) * 1e3, "mean_ms": total / n * 1e3,
            "p99_ms": sorted(per)[int(0.99 * (n - 1))] * 1e3, "bytes": snap.bytes_written,
            "files": snap.files_written, "errors": sum(s.errors for s in snap.sources.values())}


def synthetic_tree(root: Path, hcas: int = 8, ifaces: int = 8) -> Path:
    sysfs = root / "sys"
    ib = sysfs / "class" / "infiniband"
    for i in range(hcas):
        shutil.copytree(FIXTURE / "class" / "infiniband" / "mlx5_0", ib / f"mlx5_{i}")
        (ib / f"mlx5_{i}" / "ports" / "1" / "rate").chmod(0o644)
        (ib / f"mlx5_{i}" / "ports" / "1" / "rate").write_text("400 Gb/sec (4X NDR)\n")
    net = sysfs / "class" / "net"
    for i in range(ifaces):
        d = net / f"ib{i}"
        shutil.copytree(FIXTURE / "class" / "net" / "eth0", d, ignore=shutil.ignore_patterns("ecn"))
        (d / "statistics").mkdir()
        from foreshock import schema as sch
        for name in sch.NETDEV_STATISTICS:
            (d / "statistics" / name).write_text(f"{1000 + i}\n")
    return sysfs


def main(argv: list[str]) -> int:
    from foreshock.collectors.netdev import NetdevSource
    from foreshock.collectors.nvml import FakeNvml, NvmlSource
    from foreshock.collectors.rdma import RdmaSource
    from foreshock.collectors.simulated import SimulatedSource

    quick = "--quick" in argv
    n = 600 if quick else 1800
    if not FIXTURE.is_dir():
        print(f"fixture missing: {FIXTURE}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        fx = run_sweeps(lambda: [RdmaSource("bench", sysfs=str(FIXTURE)), NetdevSource("bench", sysfs=str(FIXTURE))],
                        n, tmp / "fx")
        print(f"fixture tree (rdma+netdev, 4 IB ports, 1 iface), {n} sweeps at 1 Hz, rotate 300 s:")
        print(f"  CPU per sweep: median {fx['median_ms']:.3f} ms, p99 {fx['p99_ms']:.3f} ms, "
              f"mean incl. Parquet writes {fx['mean_ms']:.3f} ms  (target <= 1.0 ms; node_exporter ~2 ms)")
        sysfs = synthetic_tree(tmp / "synth")
        syn = run_sweeps(lambda: [RdmaSource("bench", sysfs=str(sysfs)), NetdevSource("bench", sysfs=str(sysfs)),
                                  NvmlSource("bench", backend=FakeNvml.hopper(8), xid_events=False)],
                         n // 2, tmp / "syn")
        print("synthetic 8-GPU (FakeNvml, 18 links each) / 8-HCA sysfs node, rdma+netdev+nvml:")
        print(f"  CPU per sweep: median {syn['median_ms']:.3f} ms, p99 {syn['p99_ms']:.3f} ms, "
              f"mean incl. Parquet writes {syn['mean_ms']:.3f} ms")
        hour = 3600 if not quick else 1200
        sim = run_sweeps(lambda: [SimulatedSource("bench", gpus=8, hcas=8)], hour, tmp / "sim")
        per_hour = sim["bytes"] * 3600 / hour
        print(f"simulated 8-GPU/8-HCA node, {hour} sweeps at 1 Hz:")
        print(f"  CPU per sweep: median {sim['median_ms']:.3f} ms, mean incl. Parquet writes {sim['mean_ms']:.3f} ms")
        print(f"  Parquet: {per_hour / 1e6:.2f} MB per node-hour ({sim['files']} files for {hour} s)  "
              f"(target < 5 MB)")
        errors = fx["errors"] + syn["errors"] + sim["errors"]
        if errors:
            print(f"  source errors during the runs: {errors}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
