"""The sharded control plane end to end on loopback, every part a real process (issue 19, item 4): a
jobs coordinator and its standby, three shards of a six-leaf map forwarding to them, 300 simulated
nodes streaming to their shards (bench_service's load generator, one stream a node naming its leaf,
as collectors open them) with two real `foreshock collect` processes among them, and a 4-rank job
whose ranks are 4 processes of the migrator's ServiceClient (registering, watching, acknowledging;
no torch world: the directive's path is what is tested here, the world change is the migrator's own
tests'). An Xid 95 on one node of the job ends in a directive every rank sees, through the
coordinator; then a shard is killed and started again, its collectors hold their sweeps meanwhile
and send every one of them to it once it is back, and a second Xid 95, on a node of that shard,
still ends in a directive to the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from support import Serve, wait_until

HERE = Path(__file__).parent
REPO = HERE.parent
LEAVES = [f"leaf-{k:02d}" for k in range(6)]
SHARDS = {f"s-{i}": LEAVES[2 * i: 2 * i + 2] for i in range(3)}
NODES = [f"node-{i:03d}" for i in range(300)]
LEAF_OF = {n: LEAVES[i * len(LEAVES) // len(NODES)] for i, n in enumerate(NODES)}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("FORESHOCK_")}, "PYTHONUNBUFFERED": "1"}


def _generate(tmp: Path, name: str, address: str, nodes: list[str], seconds: float, fatal: dict[str, float]):
    return subprocess.Popen([sys.executable, "-m", "benchmarks.bench_service", "--generate", address, json.dumps(nodes),
                             str(seconds), json.dumps(fatal), "[]", str(tmp / f"{name}.json"),
                             json.dumps({n: LEAF_OF[n] for n in nodes})], cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


class Rank:
    """One rank's process (tests/e2e_rank.py) and the directives it printed, read on a thread."""

    def __init__(self, service: str, rank: int, nodes: list[str], spares: list[str]):
        self.proc = subprocess.Popen([sys.executable, str(HERE / "e2e_rank.py"), service, str(rank), ",".join(nodes),
                                      ",".join(spares)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=_env())
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def directives(self) -> list[tuple[str, str]]:
        return [tuple(ln.split()[2:4]) for ln in self.lines if ln.startswith("directive ")]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _listing(*addresses: str) -> str:
    """The job's directives as the leading coordinator has them, for a failure's message."""
    import grpc

    from foreshock.v1 import jobs_pb2, jobs_pb2_grpc
    for address in addresses:
        try:
            with grpc.insecure_channel(address) as ch:
                got = jobs_pb2_grpc.JobsStub(ch).ListDirectives(jobs_pb2.ListDirectivesRequest(job_id="e2e"), timeout=5)
                return "\n".join(f"{d.directive_id} {d.from_node}->{d.to_node} state {d.state} {d.reason}"
                                 for d in got.directives)
        except grpc.RpcError:
            continue
    return "no coordinator answered"


def _uplink(metrics: str, name: str) -> float:
    """A collector's foreshock_collector_uplink_NAME, from its /metrics."""
    import urllib.request
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    (value,) = [float(ln.split()[-1]) for ln in text.splitlines()
                if ln.startswith(f"foreshock_collector_uplink_{name} ")]
    return value


def _accepted(shard: Serve) -> float:
    return shard.metric('foreshock_ingest_batches_total{result="accepted"}')


@pytest.mark.slow
def test_a_fault_reaches_the_job_through_the_coordinator_and_a_restarted_shard_still_protects_it(tmp_path):
    lease = tmp_path / "lease"
    (tmp_path / "shards.toml").write_text("")
    started: list[Serve] = []
    ranks: list[Rank] = []
    others: list[subprocess.Popen] = []
    try:
        leader = Serve(tmp_path / "coordinator", "--coordinator", "--lease-file", str(lease))
        started.append(leader)
        standby = Serve(tmp_path / "coordinator", "--coordinator", "--lease-file", str(lease))
        started.append(standby)
        assert "coordinator standby" in standby.banner and standby.ready() == 503 and leader.ready() == 200
        coordinators = f"{leader.address},{standby.address}"
        addresses = {name: f"127.0.0.1:{_free_port()}" for name in SHARDS}
        (tmp_path / "shards.toml").write_text("".join(
            f'[shards.{name}]\naddress = "{addresses[name]}"\nleaves = {json.dumps(leaves)}\n'
            for name, leaves in SHARDS.items()))

        def shard(name: str) -> Serve:
            return Serve(tmp_path / name, "--listen", addresses[name], "--shard", name, "--shard-map",
                         str(tmp_path / "shards.toml"), "--coordinator-address", coordinators,
                         "--forward-summary-seconds", "1", "--cooldown-seconds", "0")
        shards = {name: shard(name) for name in SHARDS}
        started += shards.values()
        nodes_of = {name: [n for n in NODES if LEAF_OF[n] in leaves] for name, leaves in SHARDS.items()}

        # The job: ranks on a node of s-0 (the first fault), of s-1 (the shard restarted, the second
        # fault) and of s-2; its spares on s-2.
        first, second = nodes_of["s-0"][10], nodes_of["s-1"][10]
        placement = [first, second, nodes_of["s-2"][10], nodes_of["s-2"][11]]
        spares = nodes_of["s-2"][20:22]
        ranks = [Rank(coordinators, r, placement, spares) for r in range(4)]
        assert wait_until(lambda: all("watching" in r.lines for r in ranks), 30), [r.proc.stderr for r in ranks]

        # Two real collectors on s-1's leaves: the ones that must buffer and resume across its restart.
        collector_metrics = [f"127.0.0.1:{_free_port()}" for _ in range(2)]
        for k in range(2):
            others.append(subprocess.Popen(
                [sys.executable, "-m", "foreshock", "collect", "--sources", "simulated", "--interval", "0.2",
                 "--metrics-listen", collector_metrics[k], "--node", f"collector-{k}", "--out", str(tmp_path / f"spool-{k}"),
                 "--sim-gpus", "1", "--sim-hcas", "1", "--shard-map", str(tmp_path / "shards.toml"),
                 "--leaf-switch", SHARDS["s-1"][k]], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True))
        # `second` streams from after the restart only: bench_service's generator starts its sequences
        # at 1, which a shard that took the node's sweeps before rightly takes for sweeps sent again.
        before = {name: [n for n in nodes_of[name] if n != second] for name in SHARDS}
        gens = [_generate(tmp_path, f"gen-{name}", addresses[name], before[name], 8.0,
                          {first: 3.0} if first in nodes_of[name] else {}) for name in SHARDS]
        others += gens
        assert wait_until(lambda: all(r.directives() for r in ranks), 30), "no directive for the first fault"
        (seen,) = {r.directives()[0] for r in ranks}   # every rank, the same directive
        assert seen[0] == first and seen[1] in spares
        for g in gens:
            assert g.wait(60) == 0, g.stderr.read()[-2000:]
        for name, s in shards.items():   # every shard took its nodes' sweeps: nothing was redirected
            assert _accepted(s) >= len(before[name]) * 5, name

        # s-1 dies (no drain: SIGKILL) and starts again on its state; its collectors buffer meanwhile.
        acked_before = [_uplink(m, "acked_sweeps_total") for m in collector_metrics]
        shards["s-1"].proc.send_signal(signal.SIGKILL)
        shards["s-1"].proc.wait(10)
        assert wait_until(lambda: all(_uplink(m, "queued_sweeps") >= 3 for m in collector_metrics), 20), \
            "the collectors did not hold their sweeps while their shard was down"
        held = [_uplink(m, "queued_sweeps") for m in collector_metrics]
        restarted = shard("s-1")
        started.append(restarted)
        # Resumed: everything held was sent to the restarted shard and acknowledged, nothing dropped.
        assert wait_until(lambda: all(_uplink(m, "acked_sweeps_total") >= a + h
                                      for m, a, h in zip(collector_metrics, acked_before, held)), 30), \
            "the collectors did not resume into s-1"
        assert [_uplink(m, "dropped_sweeps_total") for m in collector_metrics] == [0, 0]
        assert _accepted(restarted) >= sum(held)
        assert all(p.poll() is None for p in others[:2]), "a collector gave up while its shard was down"

        gen = _generate(tmp_path, "gen-after", addresses["s-1"], [second], 6.0, {second: 2.0})
        others.append(gen)
        assert wait_until(lambda: all(len(r.directives()) >= 2 for r in ranks), 30), \
            "no directive for the fault after the restart"
        assert {r.directives()[1][0] for r in ranks} == {second}, _listing(leader.address, standby.address)
        assert all(len({d for d in r.directives()}) == len(r.directives()) for r in ranks)   # none twice
        assert gen.wait(60) == 0, gen.stderr.read()[-2000:]
    finally:
        for r in ranks:
            r.stop()
        for p in others:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in others:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for s in reversed(started):
            s.kill()
