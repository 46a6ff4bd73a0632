"""What a directive's path through the jobs coordinator costs: the same load into one plain `foreshock
serve`, then into shards that forward to a coordinator (docs/scaling.md, "The jobs coordinator").

    .venv/bin/python -m benchmarks sharded [--nodes 200] [--seconds 130] [--shards 2] [--fatal 24] [--ramp 12] [--no-plain]

Each run is real processes on loopback, as `foreshock serve` runs them (a scoring worker each, the
small PCIe model benchmarks/bench_service.py trains, fsync on): the plain run one instance; the sharded
run a coordinator (`serve --coordinator --lease-file`) and `--shards` shards (`serve --shard s-I
--shard-map F --coordinator-address C`), the nodes split into four leaf switches a shard, each node's
stream naming its leaf as a collector does. bench_service's load generator sends 1 Hz sweeps per node
(one generator process per shard, two for the plain instance), an Xid 95 on `--fatal` victims spread
over the run and PCIe replays climbing on `--ramp` nodes; the job client (this process) registers one
job per victim where jobs register (the plain instance, or the coordinator) and watches its directives.

Printed per run: fatal (the sample that carries the Xid leaves the generator -> the directive at the job
client) and risk (the step's last sample, any node -> the directive) p50/p99/max, and the load average.
Through the coordinator a directive takes one more hop: the shard's round, its forwarder's batch to the
coordinator, the coordinator's transaction (the event and the directive commit together) and policy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import bench_service as bs

LEAVES_PER_SHARD = 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(tmp: Path, name: str, *flags: str) -> tuple[subprocess.Popen, int]:
    """`foreshock serve` (insecure, loopback) with its log in tmp/NAME.log; its gRPC port once it serves."""
    log = tmp / f"{name}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORESHOCK_")}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "foreshock", "serve", "--insecure", "--metrics-listen", "",
                                 "--state", str(tmp / f"{name}-state"), *flags],
                                stdout=out, stderr=subprocess.STDOUT, env={**env, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + bs.SERVICE_START_SECONDS
    while not (m := re.search(r"listening on 127\.0\.0\.1:(\d+)", log.read_text(errors="replace"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{name} did not start:\n{log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.1)
    return proc, int(m.group(1))


def run(model: Path, *, sharded: bool, n_nodes: int, seconds: float, shards: int, fatal: int, ramp: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-sharded-"))
    procs: list[subprocess.Popen] = []
    gens: list[subprocess.Popen] = []
    try:
        nodes = [f"node-{i:05d}" for i in range(n_nodes)]
        n_leaves = LEAVES_PER_SHARD * shards
        leaf_of = {n: f"leaf-{i * n_leaves // n_nodes:02d}" for i, n in enumerate(nodes)}
        # Victims and spares taken across the whole range, so that every shard has its share of each.
        stride = max(1, n_nodes // (fatal + ramp) // 2)
        victims = nodes[::stride][:fatal + ramp]
        others = [n for n in nodes if n not in set(victims)]
        spares = others[::max(1, len(others) // (fatal + ramp))][:fatal + ramp]
        fatal_nodes, ramp_nodes = victims[:fatal], victims[fatal:]
        fatal_at = {n: 6.0 + (seconds - 15) * i / max(1, fatal) for i, n in enumerate(fatal_nodes)}
        serve_flags = ["--model", str(model), "--cooldown-seconds", "0"]
        targets: list[tuple[str, list[str]]] = []   # (address, its nodes)
        if sharded:
            coordinator, cport = start_serve(tmp, "coordinator", "--listen", "127.0.0.1:0", "--coordinator",
                                             "--lease-file", str(tmp / "lease"), "--threshold", "0.5",
                                             "--cooldown-seconds", "0")
            procs.append(coordinator)
            jobs_address = f"127.0.0.1:{cport}"
            ports = [_free_port() for _ in range(shards)]
            shard_leaves = [[f"leaf-{k:02d}" for k in range(s * LEAVES_PER_SHARD, (s + 1) * LEAVES_PER_SHARD)]
                            for s in range(shards)]
            (tmp / "shards.toml").write_text("".join(
                f'[shards.s-{s}]\naddress = "127.0.0.1:{ports[s]}"\nleaves = {json.dumps(shard_leaves[s])}\n'
                for s in range(shards)))
            for s in range(shards):
                proc, _ = start_serve(tmp, f"shard-{s}", "--listen", f"127.0.0.1:{ports[s]}", *serve_flags,
                                      "--shard", f"s-{s}", "--shard-map", str(tmp / "shards.toml"),
                                      "--coordinator-address", jobs_address, "--forward-summary-seconds", "1")
                procs.append(proc)
                targets.append((f"127.0.0.1:{ports[s]}", [n for n in nodes if leaf_of[n] in shard_leaves[s]]))
        else:
            proc, port = start_serve(tmp, "plain", "--listen", "127.0.0.1:0", *serve_flags)
            procs.append(proc)
            jobs_address = f"127.0.0.1:{port}"
            targets = [(jobs_address, nodes[: n_nodes // 2]), (jobs_address, nodes[n_nodes // 2:])]
        received, close_jobs = bs.job_client(jobs_address, fatal_nodes + ramp_nodes, spares, seconds + 120)
        outs = []
        for i, (address, mine) in enumerate(targets):
            outs.append(tmp / f"gen{i}.json")
            gens.append(subprocess.Popen([sys.executable, "-m", "benchmarks.bench_service", "--generate", address,
                                          json.dumps(mine), str(seconds),
                                          json.dumps({n: a for n, a in fatal_at.items() if n in mine}),
                                          json.dumps([n for n in ramp_nodes if n in mine]), str(outs[-1]),
                                          json.dumps({n: leaf_of[n] for n in mine} if sharded else {})]))
        load = []
        while any(g.poll() is None for g in gens):
            load.append(os.getloadavg()[0])
            time.sleep(2.0)
        time.sleep(2.0)   # the last victims' directives
        close_jobs()
        gen = [json.loads(o.read_text()) for o in outs]
        fatal_lat, risk_complete, _, _, _ = bs.latencies(gen, received, ramp_nodes)
        return {"sharded": sharded, "nodes": n_nodes, "shards": shards if sharded else 1,
                "fatal_ms": sorted(x * 1e3 for x in fatal_lat), "fatal_expected": len(fatal_nodes),
                "risk_ms": sorted(x * 1e3 for x in risk_complete), "risk_expected": len(ramp_nodes),
                "sent": sum(g["sent"] for g in gen), "acked": sum(g["acked"] for g in gen),
                "stream_errors": sum(len(g.get("stream_errors", [])) for g in gen),
                "load_1m_mean_max": (sum(load) / len(load), max(load)) if load else None}
    finally:
        for g in gens:
            if g.poll() is None:
                g.kill()
                g.wait()
        bs.stop_services(procs)
        shutil.rmtree(tmp, ignore_errors=True)


def report(r: dict) -> None:
    f, k = r["fatal_ms"], r["risk_ms"]
    what = f"{r['shards']} shards + coordinator" if r["sharded"] else "one plain instance"
    print(f"{what}, {r['nodes']} nodes: sent {r['sent']}, acked {r['acked']}, stream errors {r['stream_errors']}; "
          f"load average (1 min) mean/max {r['load_1m_mean_max'][0]:.1f}/{r['load_1m_mean_max'][1]:.1f}")
    print(f"  fatal sample -> directive at the job client: {len(f)}/{r['fatal_expected']}, p50 {bs._pct(f, 50):.0f} ms, "
          f"p99 {bs._pct(f, 99):.0f} ms, max {max(f) if f else float('nan'):.0f} ms")
    print(f"  risk (step's last sample -> directive): {len(k)}/{r['risk_expected']}, p50 {bs._pct(k, 50):.0f} ms, "
          f"p99 {bs._pct(k, 99):.0f} ms, max {max(k) if k else float('nan'):.0f} ms")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench sharded")
    p.add_argument("--nodes", type=int, default=200)
    p.add_argument("--seconds", type=float, default=130.0,
                   help="130 s: two step closes, so the ramp nodes' crossing close is one after their first "
                        "(a node's first step is not scored)")
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--fatal", type=int, default=24, help="fatal victims, spread over the run (24)")
    p.add_argument("--ramp", type=int, default=12, help="nodes whose risk climbs over the threshold (12)")
    p.add_argument("--plain", action=argparse.BooleanOptionalAction, default=True,
                   help="the plain instance's run first (--no-plain: the sharded run only; with --shards 1, "
                        "against an earlier plain run, it isolates the coordinator's hop)")
    args = p.parse_args(argv)
    if not 1 <= args.shards <= 16 or args.nodes < 2 * (args.fatal + args.ramp):
        p.error("--shards in [1, 16], and --nodes at least twice the victims (each has a spare)")
    print(f"# uptime before: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    tmp = Path(tempfile.mkdtemp(prefix="bench-sharded-model-"))
    try:
        model = bs.train_model(tmp / "model")
        for sharded in (False, True) if args.plain else (True,):
            report(run(model, sharded=sharded, n_nodes=args.nodes, seconds=args.seconds, shards=args.shards,
                       fatal=args.fatal, ramp=args.ramp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"# uptime after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
