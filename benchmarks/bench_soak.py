"""Memory over time: a control plane fed N simulated nodes for an hour, the RSS of every process sampled.

    .venv/bin/python -m benchmarks soak [--nodes 2048] [--minutes 60] [--sample-seconds 10] [--csv FILE]

The service and its feeders are the service benchmark's (benchmarks/bench_service.py): the service as
`foreshock serve` builds it (its scoring worker a separate process, the decision log, the scorer's
checkpoint every 300 s) on loopback, and two load generator processes, one gRPC stream per node and a
sweep a second each, as collectors send them, with no faults and no ramps. Every --sample-seconds this
process reads VmRSS (/proc/PID/status) of the service, its worker, both generators and itself, the
load average and the service's accepted-batch counter; and RssAnon, VmRSS less the pages of mapped
files, which the kernel drops and reads back as the page cache needs (on a busy machine VmRSS falls
and climbs with them): RssAnon is the one that shows a leak.

Printed: per process, RSS at the start, half-way and at the end, and the least-squares slope in MiB/min
over the second half and over the whole run. The feature windows are 30 minutes long, so they fill in
the first half of an hour's run: a slope over the second half that is not about zero is a leak. The run
works in a temporary directory that it removes and stops every process it started, whatever happens
(Ctrl-C included: it prints what it sampled so far).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import bench_service as bs

IN_ALL = False   # an hour: `python -m benchmarks` (make bench) runs it only when named
ACCEPTED = 'foreshock_ingest_batches_total{result="accepted"}'


def rss_mib(pid: int) -> tuple[float, float]:
    """Resident set size (VmRSS) and its anonymous part (RssAnon) in MiB; nan once the process has gone.
    VmRSS also counts the pages of mapped files (numpy's, pyarrow's, sklearn's libraries: 170-260 MiB
    here), which the kernel drops and reads back as the page cache needs: RssAnon is the heap."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan"), float("nan")
    kib = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in status.splitlines())
           if k in ("VmRSS", "RssAnon")}
    return kib.get("VmRSS", float("nan")) / 1024, kib.get("RssAnon", float("nan")) / 1024


def slope_per_minute(seconds, values) -> float:
    """Least-squares slope of values (MiB) over time (s), in MiB a minute; nan without two samples."""
    t = np.asarray(seconds, float)
    v = np.asarray(values, float)
    keep = ~np.isnan(v)
    if keep.sum() < 2 or np.ptp(t[keep]) == 0:
        return float("nan")
    return float(np.polyfit(t[keep] / 60.0, v[keep], 1)[0])


def summarize(rows: list[dict], names: list[str], seconds: float) -> list[dict]:
    """Per process: RSS at the first sample of the feed, the one nearest half-way, the last, and the slopes over the
    samples from half-way on and over all of them."""
    # From the first sample with telemetry accepted: before it the generators are still encoding.
    rows = rows[next((i for i, r in enumerate(rows) if r.get("accepted", 0) > 0), 0):]
    t = np.array([r["elapsed_s"] for r in rows], float)
    half = seconds / 2
    mid = int(np.argmin(np.abs(t - half))) if len(t) else 0
    late = t >= half
    out = []
    for name in names:
        v = np.array([r[name] for r in rows], float)
        out.append({"process": name, "start": v[0] if len(v) else float("nan"),
                    "mid": v[mid] if len(v) else float("nan"), "end": v[-1] if len(v) else float("nan"),
                    "slope_late": slope_per_minute(t[late], v[late]), "slope_all": slope_per_minute(t, v)})
    return out


def _sample(server, gens, worker_pids: list[int]) -> dict:
    workers = bs.children(server.pid)
    if workers and workers != worker_pids[-1:]:
        worker_pids.extend(workers)
    pids = {"service": [server.pid], "worker": workers, **{f"feeder {i + 1}": [g.pid] for i, g in enumerate(gens)},
            "measurer": [os.getpid()]}
    row = {"load1": os.getloadavg()[0]}
    for name, ps in pids.items():
        mem = [rss_mib(p) for p in ps] or [(float("nan"), float("nan"))]
        row[name] = sum(m[0] for m in mem)
        row[f"{name} anon"] = sum(m[1] for m in mem)
    return row


def soak(n_nodes: int, seconds: float, every: float, csv_path: str | None) -> int:
    names = ["service", "worker", "feeder 1", "feeder 2", "measurer"]
    rows: list[dict] = []
    worker_pids: list[int] = []
    gen_results: list[dict] = []
    interrupted = False
    failed = ""
    csv_fh = open(csv_path, "w", newline="") if csv_path else None
    writer = csv.DictWriter(csv_fh, ["elapsed_s", "load1", "accepted", *names, *(f"{n} anon" for n in names)]) \
        if csv_fh else None
    if writer:
        writer.writeheader()
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp_name:
        tmp = Path(tmp_name)
        gens: list = []
        server = None
        try:
            server, ports = bs.start_service(tmp)
            nodes = [f"node-{i:05d}" for i in range(n_nodes)]
            gens, outs = bs.start_generators(tmp, f"127.0.0.1:{ports['port']}", nodes, seconds, {}, [])
            t0 = time.monotonic()
            # The generators stop sending after `seconds` and a setup of a few seconds; past this the
            # run has hung.
            deadline = t0 + seconds + 300
            next_at = t0
            last_print = -1e9
            while any(g.poll() is None for g in gens):
                if server.poll() is not None:
                    raise RuntimeError(f"the service exited with status {server.returncode} mid-run")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the generators were still running {seconds + 300:.0f} s after they started")
                row = _sample(server, gens, worker_pids)
                try:
                    row["accepted"] = bs._metrics(ports["metrics"], [ACCEPTED])[0]
                except OSError:
                    row["accepted"] = float("nan")
                row["elapsed_s"] = round(time.monotonic() - t0, 1)
                rows.append(row)
                if writer:
                    writer.writerow({k: (f"{v:.2f}" if isinstance(v, float) else v) for k, v in row.items()})
                    csv_fh.flush()
                if row["elapsed_s"] - last_print >= 300:
                    last_print = row["elapsed_s"]
                    print(f"  {row['elapsed_s'] / 60:5.1f} min  load {row['load1']:.1f}  accepted {row['accepted']:.0f}  "
                          + "  ".join(f"{n} {row[n]:.0f} ({row[n + ' anon']:.0f} anon)" for n in names) + " MiB",
                          flush=True)
                next_at += every
                time.sleep(max(0.0, next_at - time.monotonic()))
            gen_results = [json.loads(o.read_text()) for o in outs if o.exists()]
        except KeyboardInterrupt:
            interrupted = True
        except RuntimeError as exc:
            failed = str(exc)
        finally:
            if server is not None:
                bs.stop_processes(gens, server)
            if csv_fh:
                csv_fh.close()
    if failed:
        print(f"FAILED: {failed}")
    report(rows, names, seconds, n_nodes, worker_pids, gen_results, interrupted)
    return 130 if interrupted else 1 if failed else 0


def feed_figures(rows: list[dict], n_nodes: int, seconds: float) -> dict:
    """Accepted batches a second over the second half and over the worst sampling interval of it: the
    nodes the service actually took in, against the offered n_nodes a second."""
    late = [r for r in rows if r["elapsed_s"] >= seconds / 2 and r["accepted"] == r["accepted"]]
    if len(late) < 2:
        return {"late_per_s": float("nan"), "worst_per_s": float("nan")}
    rates = [(b["accepted"] - a["accepted"]) / (b["elapsed_s"] - a["elapsed_s"]) for a, b in zip(late, late[1:])]
    return {"late_per_s": (late[-1]["accepted"] - late[0]["accepted"]) / (late[-1]["elapsed_s"] - late[0]["elapsed_s"]),
            "worst_per_s": min(rates)}


def report(rows, names, seconds, n_nodes, worker_pids, gen_results, interrupted) -> None:
    if not rows:
        print("no samples")
        return
    ran = rows[-1]["elapsed_s"]
    seconds = min(seconds, ran) if interrupted else seconds
    print(f"{n_nodes} nodes, {len(rows)} samples over {ran / 60:.1f} min{' (interrupted)' if interrupted else ''}; "
          f"worker pids {worker_pids} ({max(0, len(worker_pids) - 1)} restarts)")
    load = [r["load1"] for r in rows]
    print(f"load average (1 min) min {min(load):.1f} mean {np.mean(load):.1f} max {max(load):.1f}")
    f = feed_figures(rows, n_nodes, seconds)
    print(f"accepted over the second half {f['late_per_s']:.0f} batches/s of {n_nodes} offered "
          f"(worst sampling interval {f['worst_per_s']:.0f}/s)")
    if gen_results:
        sent = sum(g["sent"] for g in gen_results)
        print(f"generators sent {sent} ({sent / (n_nodes * seconds):.1%} of {n_nodes} x {seconds:.0f} s), acked "
              f"{sum(g['acked'] for g in gen_results)}, rejected {sum(g['rejected'] for g in gen_results)}, "
              f"streams reopened {sum(g.get('reopened', 0) for g in gen_results)}, ack round trip p50 "
              f"{max(g['ack_rtt_p50_ms'] for g in gen_results):.1f} ms p99 {max(g['ack_rtt_p99_ms'] for g in gen_results):.1f} ms")
    for what, cols in (("VmRSS", names), ("RssAnon", [f"{n} anon" for n in names])):
        print(f"\n| process ({what}) | start (MiB) | at {seconds / 120:.3g} min | end | slope, second half (MiB/min) "
              f"| slope, whole run |")
        print("|---|---:|---:|---:|---:|---:|")
        for s in summarize(rows, cols, seconds):
            print(f"| {s['process']} | {s['start']:.0f} | {s['mid']:.0f} | {s['end']:.0f} | {s['slope_late']:+.2f} | "
                  f"{s['slope_all']:+.2f} |")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench soak")
    p.add_argument("--nodes", type=int, default=2048)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--sample-seconds", type=float, default=10.0)
    p.add_argument("--csv", default=None, help="write every sample here")
    args = p.parse_args(argv)
    print(f"# soak: {args.nodes} nodes for {args.minutes:g} min, RSS every {args.sample_seconds:g} s; "
          f"service, worker, 2 generators and this process share {os.cpu_count()} CPUs", flush=True)
    return soak(args.nodes, args.minutes * 60, args.sample_seconds, args.csv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
