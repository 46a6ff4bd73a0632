"""How many jobs' step reports the control plane's state store takes, and how long one waits.

`python -m benchmarks jobstore [--jobs 100,1000,5000] [--seconds 10] [--threads 6]`

The store (service/store.py) commits every write with an fsync under one lock: each job's ReportStep
(the migrator's `report_interval_s`, 5 s), the telemetry sequences of every collector once a second,
registrations, directives, acks. Here a JobDirectory over a StateStore in a temporary directory on
this machine's disk: N jobs registered, then for `--seconds` the ReportSteps N jobs send at one per
5 s each, spread evenly, made by `--threads` threads (the servicers' thread pool: asyncio's default,
min(32, CPUs + 4)), while another thread saves 1,000 collectors' sequences once a second as the
scoring thread does. Printed per N: the reports asked for and made per second, their latency (median,
99th percentile, maximum, from when each was due) and the sequences' commit time. A report made later
than due shows as latency: the store could not keep up.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time

import numpy as np

from foreshock.migrator.config import MigratorConfig
from foreshock.service import store as st
from foreshock.service.jobs import JobDirectory

REPORT_INTERVAL_S = MigratorConfig.report_interval_s   # how often each job's coordinator reports its step
COLLECTORS = 1000


def run(n_jobs: int, seconds: float, threads: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="foreshock-jobstore-") as tmp:
        store = st.StateStore(os.path.join(tmp, "state.sqlite3"))
        jobs = JobDirectory(store)
        with store.batch():      # one commit for the registrations: they are not what is measured
            for j in range(n_jobs):
                jobs.register(f"job-{j:05d}", [(0, f"node-{j:05d}", [0])], [])
        rate = n_jobs / REPORT_INTERVAL_S
        due = np.arange(int(rate * seconds)) / rate
        latencies = np.full(len(due), np.nan)
        commits: list[float] = []
        stop = threading.Event()
        next_i = iter(range(len(due)))
        take = threading.Lock()
        t0 = time.monotonic()

        def reporter():
            while True:
                with take:
                    i = next(next_i, None)
                if i is None:
                    return
                wait = t0 + due[i] - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                jobs.report_step(f"job-{i % n_jobs:05d}", i // n_jobs + 1, 1.0)
                latencies[i] = time.monotonic() - (t0 + due[i])

        def saver():
            seq = 0
            while not stop.wait(1.0):
                seq += 1
                s = time.monotonic()
                st.save_sequences(store, {f"collector-{c:04d}": seq for c in range(COLLECTORS)}, time.time_ns())
                commits.append(time.monotonic() - s)

        saving = threading.Thread(target=saver, daemon=True)
        saving.start()
        workers = [threading.Thread(target=reporter) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        took = time.monotonic() - t0
        stop.set()
        saving.join()
        store.close()
    return {"jobs": n_jobs, "asked_per_s": rate, "made_per_s": len(due) / max(took, seconds),
            "p50": float(np.nanmedian(latencies)), "p99": float(np.nanquantile(latencies, 0.99)),
            "max": float(np.nanmax(latencies)),
            "commit_median": float(np.median(commits)) if commits else float("nan"),
            "commit_max": float(np.max(commits)) if commits else float("nan")}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks jobstore")
    p.add_argument("--jobs", default="100,1000,5000", help="comma-separated numbers of jobs")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--threads", type=int, default=min(32, (os.cpu_count() or 1) + 4))
    args = p.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.1f}; one ReportStep per job every {REPORT_INTERVAL_S:g} s, "
          f"{args.threads} threads, {COLLECTORS} collectors' sequences saved once a second, {args.seconds:g} s each")
    print(f"{'jobs':>6} {'asked/s':>8} {'made/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
          f"{'seq commit ms (median, max)':>28}")
    for n in (int(x) for x in args.jobs.split(",")):
        r = run(n, args.seconds, args.threads)
        print(f"{r['jobs']:6d} {r['asked_per_s']:8.0f} {r['made_per_s']:8.0f} {1e3 * r['p50']:8.1f} "
              f"{1e3 * r['p99']:8.1f} {1e3 * r['max']:8.1f} {1e3 * r['commit_median']:14.1f}, {1e3 * r['commit_max']:.1f}",
              flush=True)
    return 0
