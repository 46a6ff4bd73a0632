"""Predictor benchmarks: online scoring rounds at 10,000 nodes, offline feature throughput, training.

    .venv/bin/python -m benchmarks predictor [--nodes 10000] [--rounds 5] [--model DIR]
                                             [--train-data DIR] [--eval-data DIR] [--drains-only]

* online: an OnlineScorer with the shipped default model (or --model) is fed one step of schema-v1
  rows (gpu, nvlink, rdma_port, host_net) for every node each round, through the real ingest path,
  after 32 warm-up steps (the windows full); most nodes quiet, one in ten with errors (_Cluster);
  the figures are ingest time per round and the scoring round, `score()` (close the step, features,
  predict, explain the riskiest 16), wall and CPU time, then the same parts timed apart, rounds that
  start after 0.5 s idle, and prediction on 1 and 2 threads (`--threads`, LoadedModel.threads). Target:
  a scoring round under 50 ms at 10,000 nodes. The load average is printed with the figures: the machine is shared.
* with step times (`--steps-per-minute`, default 6; 0: none): judging a minute's rows alone, and
  where they are judged (bench_step_time_judging): on the scorer's judging thread against its own
  thread, the minute's rows in drains with pauses between, as the service takes them.
* drains: the online ingest of one drain (40 nodes' sweeps, every node's) into a scorer that carries
  the last sample of every entity of a 2,048-node cluster (`--drain-nodes`; `--drains-only`).
* offline: base signals + features of one 8-GPU/8-HCA node-day (synthetic rows), in node-days per second.
* --train-data DIR: `foreshock train` on that dataset (wall time, and the peak of the summed RSS of
  the command and its feature workers, sampled; target: 30 days of 512 nodes in under 15 minutes
  and 8 GB). --eval-data DIR: `foreshock evaluate` figures on it.
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

import numpy as np
import pyarrow as pa

from foreshock import schema as sch
from foreshock.predictor import features as ft
from foreshock.predictor import offline, online, registry, signals, synthetic
from foreshock.predictor import steptimes as stt

STEP_NS = ft.STEP_SECONDS * 1_000_000_000
WARMUP_STEPS = 32
JOB_NODES = 512   # the nodes of one job in the online benchmark's cluster (and its inventory)
IDLE_BEFORE_ROUND_S = 0.5   # the pause before each of the online benchmark's idle-start rounds


class _Cluster:
    """One step of schema-v1 rows for every node, each step, with counters that run on across steps.

    Not every node alike (a tree walk over identical rows would be unrealistically predictable): most
    nodes are quiet (error counters still), one in ten has errors at its own rate (log-normal over
    three decades, Poisson each step, per GPU and HCA), every node has its own traffic level and GPU
    temperatures, with per-step noise. With `steps_per_minute`, every node also runs one rank per GPU of
    a synchronous job of JOB_NODES nodes, each rank reporting that many training steps a minute
    (`step_times` rows, as the service hands its scorer what the Jobs API accepted), one rank in a
    thousand 1.5 times slower than its peers in its compute part.
    """

    def __init__(self, nodes: list[str], rng, gpus=8, hcas=8, steps_per_minute: int = 0):
        n = len(nodes)
        self.nodes, self.rng, self.gpus, self.hcas = nodes, rng, gpus, hcas
        self.steps_per_minute = steps_per_minute
        self.slow_rank = rng.random(n * gpus) < 0.001
        erroring = rng.random(n) < 0.1
        self.err_rate = np.where(erroring, rng.lognormal(0.0, 2.0, n), 0.0)       # errors per step
        self.traffic = rng.lognormal(0.0, 0.3, n) * 5e7                              # KiB per step
        self.temp = rng.normal(60.0, 4.0, n * gpus)
        self.cum = {k: np.zeros(n * (hcas if k == "symbol" else gpus), np.uint64)
                    for k in ("ecc", "pcie", "crc", "replay", "symbol")}
        self.tx = np.zeros(n * gpus, np.uint64)
        self.ib = np.zeros(n * hcas, np.uint64)
        self.tcp_out = np.zeros(n, np.int64)
        self.tcp_re = np.zeros(n, np.int64)

    def tables(self, step: int) -> dict[str, pa.Table]:
        nodes, rng, gpus, hcas = self.nodes, self.rng, self.gpus, self.hcas
        n = len(nodes)
        ts = np.int64(step * STEP_NS + 20 * 10**9)
        for k, per in (("ecc", gpus), ("pcie", gpus), ("crc", gpus), ("replay", gpus), ("symbol", hcas)):
            self.cum[k] += rng.poisson(np.repeat(self.err_rate, per) / per).astype(np.uint64)
        noise = 1.0 + 0.05 * rng.standard_normal(n)
        self.tx += np.repeat(self.traffic * noise / gpus, gpus).astype(np.uint64)
        self.ib += np.repeat(self.traffic * noise * 1024 / hcas, hcas).astype(np.uint64)
        self.tcp_out += (self.traffic * noise / 10).astype(np.int64)
        self.tcp_re += rng.poisson(self.err_rate + 0.5)
        node_g = np.repeat(np.array(nodes, dtype=object), gpus)
        gpu_idx = np.tile(np.arange(gpus, dtype=np.int16), n)
        ts_g = pa.array(np.full(n * gpus, ts)).cast(sch.TS)
        gpu = pa.table({"ts": ts_g, "node": pa.array(node_g, pa.string()), "gpu": gpu_idx,
                        "temperature_c": (self.temp + rng.standard_normal(n * gpus)).astype(np.float32),
                        "ecc_corrected_volatile": self.cum["ecc"].copy(),
                        "pcie_replay_counter": self.cum["pcie"].copy(),
                        "pcie_link_width": np.full(n * gpus, 16, np.int8), "pcie_link_width_max": np.full(n * gpus, 16, np.int8),
                        "gpu_lost": np.zeros(n * gpus, bool)})
        nvl = pa.table({"ts": ts_g, "node": pa.array(node_g, pa.string()), "gpu": gpu_idx,
                        "crc_flit_errors": self.cum["crc"].copy(), "replay_errors": self.cum["replay"].copy(),
                        "tx_kib": self.tx.copy(), "rx_kib": self.tx.copy(),
                        "links_up": np.full(n * gpus, 18, np.int16), "links_total": np.full(n * gpus, 18, np.int16)})
        node_h = np.repeat(np.array(nodes, dtype=object), hcas)
        rd = pa.table({"ts": pa.array(np.full(n * hcas, ts)).cast(sch.TS), "node": pa.array(node_h, pa.string()),
                       "device": pa.array([f"mlx5_{i}" for i in range(hcas)] * n), "port": np.ones(n * hcas, np.int16),
                       "state": np.full(n * hcas, 4, np.int8), "phys_state": np.full(n * hcas, 5, np.int8),
                       "symbol_error": self.cum["symbol"].copy(),
                       "port_xmit_bytes": self.ib.copy(), "port_rcv_bytes": self.ib.copy()})
        hn = pa.table({"ts": pa.array(np.full(n, ts)).cast(sch.TS), "node": pa.array(nodes, pa.string()),
                       "Tcp_OutSegs": self.tcp_out.copy(), "Tcp_RetransSegs": self.tcp_re.copy()})
        out = {"gpu": gpu, "nvlink": nvl, "rdma_port": rd, "host_net": hn}
        if self.steps_per_minute:
            out["step_times"] = self.step_times(step)
        return out

    def step_times(self, step: int) -> pa.Table:
        """The step_times rows of every rank's training steps that end in this step."""
        n, gpus, k = len(self.nodes), self.gpus, self.steps_per_minute
        ranks = n * gpus
        node_i = np.arange(ranks) // gpus
        step_s = ft.STEP_SECONDS / k
        compute = 0.7 * step_s * (1.0 + 0.01 * self.rng.standard_normal((k, ranks)))
        compute[:, self.slow_rank] *= 1.5
        # synchronous: every rank's whole step waits for the slowest compute part of its step
        total = np.broadcast_to(compute.max(axis=1, keepdims=True) + 0.2 * step_s, compute.shape)
        ends = step * STEP_NS + ((np.arange(k) + 1) * step_s * 1e9).astype(np.int64) - 1
        names = np.array(self.nodes, dtype=object)
        jobs = np.array([f"job-{i // JOB_NODES}" for i in range(n)], dtype=object)
        return pa.table({
            "ts": pa.array(np.repeat(ends, ranks)).cast(sch.TS),
            "node": pa.array(np.tile(names[node_i], k), pa.string()),
            "job": pa.array(np.tile(jobs[node_i], k), pa.string()),
            "generation": pa.array(np.zeros(k * ranks, np.int64)),
            "rank": pa.array(np.tile((node_i % JOB_NODES) * gpus + np.arange(ranks) % gpus, k).astype(np.int32)),
            "step": pa.array(np.repeat(step * k + np.arange(k), ranks).astype(np.int64)),
            "step_seconds": pa.array(total.ravel()), "compute_seconds": pa.array(compute.ravel())})


def _load() -> str:
    return "load average " + " ".join(f"{v:.2f}" for v in os.getloadavg())


def _med(values) -> float:
    return 1000 * float(np.median(values))


def bench_online(n_nodes: int, rounds: int, model, threads: int = 1, steps_per_minute: int = 0) -> None:
    rng = np.random.default_rng(0)
    nodes = [f"node-{i:05d}" for i in range(n_nodes)]
    model.threads = threads
    scorer = online.OnlineScorer(model, max_nodes=max(n_nodes, 1), max_pending_rows=10 * 20 * n_nodes)
    scorer.set_inventory(synthetic.inventory(nodes, leaf_of=lambda i: f"leaf-{i // 32}", job_of=lambda i: f"job-{i // JOB_NODES}"))
    step0 = 29_666_000
    cluster = _Cluster(nodes, rng, steps_per_minute=steps_per_minute)
    # warm up past the longest window (30 steps), so the rounds timed are the steady state's
    for r in range(WARMUP_STEPS):
        for name, t in cluster.tables(step0 + r).items():
            scorer.ingest(name, t)
        scorer.score((step0 + r + 1) * STEP_NS + 6 * 10**9)
    step0 += WARMUP_STEPS
    ingest_s, round_s, round_cpu, parts = [], [], [], []
    per_round = f", {n_nodes * 8 * steps_per_minute:,} step_times rows a round" if steps_per_minute else ""
    waited = scorer.stats["step_times_round_waited"]
    print(f"online, {n_nodes} nodes (8 GPUs, 8 HCAs each{per_round}), {rounds} rounds, {_load()}:")
    for r in range(2 * rounds + 1):
        tables = cluster.tables(step0 + r)
        t0 = time.perf_counter()
        for name, t in tables.items():
            scorer.ingest(name, t)
        t1 = time.perf_counter()
        now = (step0 + r + 1) * STEP_NS + 6 * 10**9
        if r % 2:
            # the round as the service runs it
            c0, w0 = time.process_time(), time.perf_counter()
            batch = scorer.score(now)
            w1, c1 = time.perf_counter(), time.process_time()
            assert len(batch) == n_nodes
            round_s.append(w1 - w0)
            round_cpu.append(c1 - c0)
        else:
            # the same round in parts: close the step and compute features, predict, explain
            a0 = time.perf_counter()
            scorer.advance(now)
            a1 = time.perf_counter()
            X = scorer._features[scorer._scored]
            p = model.probability(X)
            a2 = time.perf_counter()
            top = np.argsort(-p)[:16]
            from foreshock.predictor import explain
            explain.explain(model.probability, X[top], p[top], scorer.reference)
            a3 = time.perf_counter()
            parts.append((a1 - a0, a2 - a1, a3 - a2))
        ingest_s.append(t1 - t0)
    parts = np.array(parts)
    if steps_per_minute:
        # back to back here: the judging thread has only the rest of the ingest to run beside
        # (bench_step_time_judging gives it the pauses between a service's drains)
        whole = [ingest_s[r] + round_s[r // 2] for r in range(1, 2 * rounds + 1, 2)]
        rows = tables["step_times"]
        judge = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            stt.node_minutes(rows)
            judge.append(time.perf_counter() - t0)
        print(f"  step times: judging a minute's {rows.num_rows:,} rows alone {_med(judge):.0f} ms; ingest + "
              f"scoring round a minute {_med(whole):.0f} ms; rounds that waited for the judging "
              f"{scorer.stats['step_times_round_waited'] - waited} of {2 * rounds + 1}; {_load()}")
    print(f"  ingest per round (one step of {'+'.join(tables)} rows, {sum(t.num_rows for t in tables.values()):,} "
          f"rows, reduced to per-step signals as they arrive): median {_med(ingest_s):.0f} ms")
    print(f"  scoring round (score(): close the step, features, predict, explain top 16): median "
          f"{_med(round_s):.0f} ms wall, {_med(round_cpu):.0f} ms CPU, best {1000 * min(round_s):.0f} ms; "
          f"target < 50 ms")
    print(f"  its parts: close the step + features {_med(parts[:, 0]):.0f} ms, predict {_med(parts[:, 1]):.0f} ms "
          f"({threads} thread{'s' if threads > 1 else ''}), explain top 16 {_med(parts[:, 2]):.0f} ms")
    # the rounds above follow their ingest at once; a service's round follows whatever the minute left
    # idle, and on a shared virtual machine the first milliseconds after an idle spell run slower
    # (benchmarks/results/predictor-round-2026-12-07.md)
    idle = []
    step0 += 2 * rounds + 1
    for r in range(rounds):
        for name, t in cluster.tables(step0 + r).items():
            scorer.ingest(name, t)
        time.sleep(IDLE_BEFORE_ROUND_S)
        w0 = time.perf_counter()
        scorer.score((step0 + r + 1) * STEP_NS + 6 * 10**9)
        idle.append(time.perf_counter() - w0)
    print(f"  scoring round after {IDLE_BEFORE_ROUND_S} s idle: median {_med(idle):.0f} ms wall, best "
          f"{1000 * min(idle):.0f} ms; {_load()}")
    # prediction alone: the fast path on 1 and 2 threads, and the estimator's own predict_proba
    X = scorer._features[scorer._scored]
    fast = {}
    for th in (1, 2):
        model.threads = th
        ts = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            model.probability(X)
            ts.append(time.perf_counter() - t0)
        fast[th] = _med(ts)
    model.threads = threads
    t0 = time.perf_counter()
    model.estimator.predict_proba(model.model_columns(X))   # the estimator reads its own columns
    tp = time.perf_counter() - t0
    fast_path = model.fast_predictor
    kind = ("no fast path for this estimator" if fast_path is None else
            "compiled tree walk" if fast_path.compiled else "binned fast path, numba missing")
    print(f"  predict {n_nodes} nodes ({kind}): {fast[1]:.0f} ms on 1 thread, {fast[2]:.0f} ms on 2; "
          f"the estimator's predict_proba {1000 * tp:.0f} ms; {_load()}")
    # the checkpoint the service writes every scorer_checkpoint_seconds and at a stop, and reads at start
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scorer-state.npz"
        t0 = time.perf_counter()
        size = scorer.save_state(path)
        t1 = time.perf_counter()
        online.OnlineScorer(model, max_nodes=max(n_nodes, 1)).restore_state(path)
        t2 = time.perf_counter()
    print(f"  scorer checkpoint of {n_nodes} nodes: {size / 1e6:.1f} MB, written (with fsync) in "
          f"{1000 * (t1 - t0):.0f} ms, restored in {1000 * (t2 - t1):.0f} ms; {_load()}")
    scorer.close()
    bench_score_level(n_nodes)


def bench_score_level(n_nodes: int, hours: int = 25) -> None:
    """The control plane's fleet score level (predictor/fleetlevel.py) fed a day of rounds, one a minute:
    a round, the round that opens an hour, and its state saved and restored."""
    import tempfile
    from pathlib import Path

    from foreshock.predictor import fleetlevel
    rng = np.random.default_rng(0)
    nodes = [f"node-{i:05d}" for i in range(n_nodes)]
    level = fleetlevel.FleetLevel(0.001)
    rounds, opens = [], []
    for k in range(hours * 60):
        p = rng.random(n_nodes) * 0.01
        t0 = time.perf_counter()
        opened = level.observe(k * 60 * 10**9, nodes, p)
        (opens if opened else rounds).append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "score-level.npz"
        t0 = time.perf_counter()
        level.save(path, "bench")
        t1 = time.perf_counter()
        fleetlevel.FleetLevel(0.001).restore(path, "bench")
        t2 = time.perf_counter()
        size = path.stat().st_size
    print(f"  the fleet's score level, {n_nodes} nodes: a round {_med(rounds):.2f} ms, the round that opens an hour "
          f"{_med(opens):.1f} ms (max {1000 * max(opens):.1f}); a day's state {size / 1e6:.1f} MB, saved (with fsync) "
          f"in {1000 * (t1 - t0):.0f} ms, restored in {1000 * (t2 - t1):.0f} ms; {_load()}")


def bench_step_time_judging(n_nodes: int, model, steps_per_minute: int, minutes: int = 10, drains: int = 10,
                            pause_s: float = 0.05, warmup: int = 6) -> None:
    """Where the step times are judged: on the scorer's judging thread (the default) against its own
    thread (step_time_thread=False), two scorers fed the same rows in turn, in the same process and
    under the same load. Each minute's tables come in `drains` parts (slices of their rows), with
    `pause_s` between (the service drains once a second and scores once a minute: the judging thread
    runs in those pauses); then the round. Per minute: the scorer thread's time (ingest + round), its
    longest drain, and the process's CPU time."""
    nodes = [f"node-{i:05d}" for i in range(n_nodes)]
    cluster = _Cluster(nodes, np.random.default_rng(0), steps_per_minute=steps_per_minute)
    inventory = synthetic.inventory(nodes, leaf_of=lambda i: f"leaf-{i // 32}", job_of=lambda i: f"job-{i // JOB_NODES}")
    scorers = {}
    for threaded in (True, False):
        scorers[threaded] = online.OnlineScorer(model, max_nodes=n_nodes, max_pending_rows=10 * 20 * n_nodes,
                                                step_time_thread=threaded)
        scorers[threaded].set_inventory(inventory)
    figures: dict[bool, list] = {True: [], False: []}
    step0 = 29_666_000
    for r in range(warmup + minutes):
        tables = cluster.tables(step0 + r)
        parts = [[(name, t.slice(i * t.num_rows // drains, (i + 1) * t.num_rows // drains - i * t.num_rows // drains))
                  for name, t in tables.items()] for i in range(drains)]
        for threaded in ((True, False) if r % 2 else (False, True)):
            scorer = scorers[threaded]
            longest, ingest_s = 0.0, 0.0
            c0 = time.process_time()
            for part in parts:
                t0 = time.perf_counter()
                for name, t in part:
                    scorer.ingest(name, t)
                took = time.perf_counter() - t0
                ingest_s, longest = ingest_s + took, max(longest, took)
                time.sleep(pause_s)
            t0 = time.perf_counter()
            scorer.score((step0 + r + 1) * STEP_NS + 6 * 10**9)
            round_s = time.perf_counter() - t0
            if r >= warmup:
                figures[threaded].append((ingest_s + round_s, longest, round_s, time.process_time() - c0))
    print(f"step-time judging, {n_nodes} nodes, {n_nodes * 8 * steps_per_minute:,} step_times rows a minute in "
          f"{drains} drains {1000 * pause_s:.0f} ms apart, {minutes} minutes each way, in turn; {_load()}:")
    for threaded, label in ((True, "on the judging thread"), (False, "on the scorer's thread")):
        f = np.array(figures[threaded])
        print(f"  {label}: ingest + round a minute median {_med(f[:, 0]):.0f} ms, the longest drain median "
              f"{_med(f[:, 1]):.0f} ms (worst {1000 * f[:, 1].max():.0f}), round {_med(f[:, 2]):.0f} ms, process CPU "
              f"{_med(f[:, 3]):.0f} ms; rounds that waited for the judging "
              f"{scorers[threaded].stats['step_times_round_waited']}")
        scorers[threaded].close()
    print(f"  {_load()}")


def bench_drains(n_nodes: int, model, sizes=(40, 2048), repeats: int = 7) -> None:
    """The online scorer's ingest of one drain as the service's worker hands it over: a few nodes'
    sweeps (the closing request in a step's last second) or every node's, into a scorer that already
    carries the last sample of every entity of the cluster."""
    rng = np.random.default_rng(1)
    nodes = [f"node-{i:05d}" for i in range(n_nodes)]
    # every drain is a step of its own, none closed: the pending-rows bound holds them all
    scorer = online.OnlineScorer(model, max_nodes=n_nodes, max_pending_rows=25 * n_nodes * (len(sizes) * repeats + 1))
    cluster = _Cluster(nodes, rng)
    step = 29_666_000
    for name, t in cluster.tables(step).items():
        scorer.ingest(name, t)
    figures = []
    for size in sizes:
        times = []
        for r in range(repeats):
            step += 1
            tables = cluster.tables(step)
            first = (r * size) % max(1, n_nodes - size + 1)
            part = {}
            for name, t in tables.items():
                per = t.num_rows // n_nodes                # rows a node has in this table
                part[name] = t.slice(first * per, size * per)
            t0 = time.perf_counter()
            for name, t in part.items():
                scorer.ingest(name, t)
            times.append(time.perf_counter() - t0)
        figures.append(f"{size:,} nodes' sweeps {_med(times):.1f} ms")
    print(f"online ingest of one drain into a scorer carrying {n_nodes:,} nodes (gpu+nvlink+rdma_port+host_net), "
          f"median of {repeats}: " + ", ".join(figures) + f"; {_load()}")


def bench_offline() -> None:
    tables = synthetic.node_tables("node-x", 1440, hcas=8)
    t0 = time.perf_counter()
    base = signals.node_base_signals(tables)
    t1 = time.perf_counter()
    steps, x, present = offline.densify(base)
    full = ft.all_signals(x, np.full((len(x), ft.PEER_WIDTH), np.nan), stt.empty_values(len(x)))[None]
    ft.compute(full, steps, ft.FeatureState.empty(1))
    t2 = time.perf_counter()
    print(f"offline, one 8-GPU/8-HCA node-day at 60 s: base signals {t1 - t0:.2f} s, features {t2 - t1:.2f} s "
          f"({1 / (t2 - t0):.1f} node-days/s; 512 nodes x 30 days ~ {512 * 30 * (t2 - t0) / 60:.0f} min at this rate)")


def _tree_rss_mb(pid: int) -> float:
    """The summed RSS of a process and its descendants (the feature workers), from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as fh:
                parts = fh.read().rsplit(")", 1)[1].split()
            children.setdefault(int(parts[1]), []).append(int(d))
            rss[int(d)] = int(parts[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo.extend(children.get(p, []))
    return total / 2**20


def _run(cmd: list[str]) -> tuple[float, float, float, float, str]:
    """(wall s, peak summed RSS MB of the process tree, peak RSS MB of the largest process,
    CPU s of the tree (user + system, workers included), stdout)."""
    t0 = time.perf_counter()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    before = r0.ru_maxrss
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0.0]

    def sample():
        while proc.poll() is None:
            peak[0] = max(peak[0], _tree_rss_mb(proc.pid))
            time.sleep(0.5)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    rss = max(r1.ru_maxrss, before) / 1024
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if proc.returncode:
        print(err[-2000:], file=sys.stderr)
    return wall, peak[0], rss, cpu, out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench_predictor")
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--model", default=None)
    ap.add_argument("--train-data", default=None)
    ap.add_argument("--eval-data", default=None)
    ap.add_argument("--threads", type=int, default=registry.predict_threads(),
                    help="prediction threads in the scoring round (default: LoadedModel's)")
    ap.add_argument("--drain-nodes", type=int, default=2048,
                    help="cluster size for the drain ingest figures (the service benchmark's)")
    ap.add_argument("--drains-only", action="store_true", help="only the drain ingest figures")
    ap.add_argument("--steps-per-minute", type=int, default=6,
                    help="training steps a minute each node's 8 ranks report to the online scorer (0: no step "
                         "times; default 6, a 10 s step)")
    args = ap.parse_args(argv)
    try:
        model = registry.load_model(args.model)
        print(f"model: {model.path} ({model.version})")
    except registry.ModelError as exc:
        print(f"no usable model ({exc}); using a tiny random one")
        tiny = tempfile.TemporaryDirectory(prefix="bench-tiny-model-")   # removed when main returns
        model = registry.load_model(synthetic.tiny_model_dir(Path(tiny.name) / "m"))
    if args.drains_only:
        bench_drains(args.drain_nodes, model)
        return 0
    bench_online(args.nodes, args.rounds, model, args.threads, args.steps_per_minute)
    if args.steps_per_minute:
        bench_step_time_judging(args.nodes, model, args.steps_per_minute, minutes=2 * args.rounds)
    bench_drains(args.drain_nodes, model)
    bench_offline()
    exe = [sys.executable, "-m", "foreshock.cli"]
    if args.train_data:
        out_dir = tempfile.mkdtemp(prefix="bench-model-")
        print(f"train on {args.train_data} ({offline.feature_workers()} feature workers), {_load()}:", flush=True)
        wall, tree, rss, cpu, out = _run(exe + ["train", "--data", args.train_data, "--out", out_dir])
        print(f"  {wall:.0f} s wall, {cpu:.0f} s CPU (all processes), peak memory {tree:.0f} MB (all "
              f"processes), largest process {rss:.0f} MB; {_load()}\n{out}")
        try:
            import json
            secs = json.loads((Path(out_dir) / "manifest.json").read_text())["training"]["seconds"]
            print(f"  the manifest's phases: {secs}")
        except (OSError, KeyError, ValueError):
            pass
        shutil.rmtree(out_dir, ignore_errors=True)
    if args.eval_data:
        wall, tree, rss, cpu, out = _run(exe + ["evaluate", "--data", args.eval_data] + (["--model", args.model] if args.model else []))
        print(f"evaluate on {args.eval_data}: {wall:.0f} s wall, peak memory {tree:.0f} MB (all processes)\n{out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
