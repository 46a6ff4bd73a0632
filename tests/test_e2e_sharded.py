"""The sharded control plane end to end on loopback, every part a real process (issue 19, item 4): a
jobs coordinator and its standby, three shards of a six-leaf map forwarding to them, 300 simulated
nodes streaming to their shards (bench_service's load generator, one stream a node naming its leaf,
as collectors open them) with two real `foreshock collect` processes among them, and a real 4-rank
gloo training job (foreshock.migrator.example: the migrator in its training loop, three warm spares)
pointed at the coordinator and its standby. An Xid 95 on a node of the job ends in a directive,
through the coordinator, that moves that rank to a spare at a step boundary; then a shard is killed
and started again, its collectors hold their sweeps meanwhile and send every one of them to it once
it is back, and an Xid 95 on a node of that shard still moves its rank; then the coordinator leader
is killed, the standby takes over, and an Xid 95 on a third node moves its rank: one directive a
fault, none acted on twice, no rank restarted, every step of every rank run exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import Serve, free_port, wait_until

pytest.importorskip("torch")

from foreshock.migrator import example  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

HERE = Path(__file__).parent
REPO = HERE.parent
LEAVES = [f"leaf-{k:02d}" for k in range(6)]
SHARDS = {f"s-{i}": LEAVES[2 * i: 2 * i + 2] for i in range(3)}
NODES = [f"node-{i:03d}" for i in range(300)]
LEAF_OF = {n: LEAVES[i * len(LEAVES) // len(NODES)] for i, n in enumerate(NODES)}


def _env() -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("FORESHOCK_")}, "PYTHONUNBUFFERED": "1"}


def _generate(tmp: Path, name: str, address: str, nodes: list[str], seconds: float, fatal: dict[str, float]):
    return subprocess.Popen([sys.executable, "-m", "benchmarks.bench_service", "--generate", address, json.dumps(nodes),
                             str(seconds), json.dumps(fatal), "[]", str(tmp / f"{name}.json"),
                             json.dumps({n: LEAF_OF[n] for n in nodes})], cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


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


def _directives(address: str):
    """The job's directives as the coordinator at `address` has them; None if it does not answer."""
    import grpc

    from foreshock.v1 import jobs_pb2, jobs_pb2_grpc
    try:
        with grpc.insecure_channel(address) as ch:
            return list(jobs_pb2_grpc.JobsStub(ch).ListDirectives(
                jobs_pb2.ListDirectivesRequest(job_id="e2e"), timeout=5).directives)
    except grpc.RpcError:
        return None


def _directive(address: str, node: str, job, completed: bool = False, timeout: float = 60.0):
    """The directive moving the job off `node` (once the job acknowledged it COMPLETED, if asked)."""
    from foreshock.v1 import jobs_pb2

    def found():
        assert all(p.is_alive() or p.exitcode == 0 for p in job.processes.values()), \
            {n: p.exitcode for n, p in job.processes.items()}
        got = [d for d in _directives(address) or () if d.from_node == node]
        if got and (not completed or got[0].state == jobs_pb2.DIRECTIVE_STATE_COMPLETED):
            return got[0]
        return None
    got = wait_until(found, timeout, step=0.2)
    assert got, f"no {'completed ' if completed else ''}directive off {node}:\n{_listing(address)}"
    return got


def _steps(record: dict) -> list[int]:
    return sorted(int(s) for s in record["losses"])


def _uplink(metrics: str, name: str) -> float:
    """A collector's foreshock_collector_uplink_NAME, from its /metrics."""
    import urllib.request
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    (value,) = [float(ln.split()[-1]) for ln in text.splitlines()
                if ln.startswith(f"foreshock_collector_uplink_{name} ")]
    return value


def _accepted(shard: Serve) -> float:
    return shard.metric('foreshock_ingest_batches_total{result="accepted"}')


def test_a_fault_reaches_a_training_job_through_the_coordinator_across_a_shard_restart_and_a_takeover(tmp_path):
    lease = tmp_path / "lease"
    (tmp_path / "shards.toml").write_text("")
    started: list[Serve] = []
    others: list[subprocess.Popen] = []
    job = None
    try:
        # --no-fail-slow: four ranks and three spares share this machine's cores with everything else,
        # and a rank the scheduler slows would earn a fail-slow directive that no fault here caused.
        coordinator = ("--coordinator", "--lease-file", str(lease), "--no-fail-slow")
        leader = Serve(tmp_path / "coordinator", *coordinator)
        started.append(leader)
        standby = Serve(tmp_path / "coordinator", *coordinator)
        started.append(standby)
        assert "coordinator standby" in standby.banner and standby.ready() == 503 and leader.ready() == 200
        coordinators = f"{leader.address},{standby.address}"
        nodes_of = {name: [n for n in NODES if LEAF_OF[n] in leaves] for name, leaves in SHARDS.items()}

        # The job: ranks on a node of s-0 (the first fault), of s-1 (the shard restarted, the second
        # fault) and of s-2 (the fault after the takeover); a warm spare for each fault, on s-2. It
        # needs only the coordinators, so it starts while the shards do.
        first, second, third = nodes_of["s-0"][10], nodes_of["s-1"][10], nodes_of["s-2"][10]
        placement = [first, second, third, nodes_of["s-2"][11]]
        spares = nodes_of["s-2"][20:23]
        job = example.launch("e2e", placement, spares, steps=1_000_000, out_dir=tmp_path / "job",
                             service=coordinators, seed=3, step_sleep_s=0.05, transfer_timeout_s=30.0)

        addresses = {name: f"127.0.0.1:{free_port()}" for name in SHARDS}
        (tmp_path / "shards.toml").write_text("".join(
            f'[shards.{name}]\naddress = "{addresses[name]}"\nleaves = {json.dumps(leaves)}\n'
            for name, leaves in SHARDS.items()))

        def shard(name: str) -> Serve:
            return Serve(tmp_path / name, "--listen", addresses[name], "--shard", name, "--shard-map",
                         str(tmp_path / "shards.toml"), "--coordinator-address", coordinators,
                         "--forward-summary-seconds", "1", "--cooldown-seconds", "0")
        shards = {name: shard(name) for name in SHARDS}
        started += shards.values()

        # Training and reporting its steps before the first fault, so the switch step is set from them.
        job.wait_progress(10, timeout=60)

        # Two real collectors on s-1's leaves: the ones that must buffer and resume across its restart.
        collector_metrics = [f"127.0.0.1:{free_port()}" for _ in range(2)]
        for k in range(2):
            others.append(subprocess.Popen(
                [sys.executable, "-m", "foreshock", "collect", "--sources", "simulated", "--interval", "0.2",
                 "--metrics-listen", collector_metrics[k], "--node", f"collector-{k}", "--out", str(tmp_path / f"spool-{k}"),
                 "--sim-gpus", "1", "--sim-hcas", "1", "--shard-map", str(tmp_path / "shards.toml"),
                 "--leaf-switch", SHARDS["s-1"][k]], env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True))
        # `second` and `third` stream only once their faults are due: bench_service's generator starts
        # its sequences at 1, which a shard that took the node's sweeps before rightly takes for sweeps
        # sent again.
        before = {name: [n for n in nodes_of[name] if n not in (second, third)] for name in SHARDS}
        gens = [_generate(tmp_path, f"gen-{name}", addresses[name], before[name], 8.0,
                          {first: 3.0} if first in nodes_of[name] else {}) for name in SHARDS]
        others += gens
        d1 = _directive(leader.address, first, job)
        assert d1.to_node in spares
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

        # the job is back to four healthy ranks before the next fault: one evacuation at a time
        d1 = _directive(leader.address, first, job, completed=True)
        gen = _generate(tmp_path, "gen-after-restart", addresses["s-1"], [second], 4.0, {second: 1.0})
        others.append(gen)
        d2 = _directive(leader.address, second, job, completed=True)
        assert gen.wait(60) == 0, gen.stderr.read()[-2000:]

        # The leader dies (SIGKILL, its lease let go by the kernel); the standby takes over on its state.
        leader.proc.send_signal(signal.SIGKILL)
        leader.proc.wait(10)
        assert wait_until(lambda: standby.ready() == 200, 20), "the standby did not take over"
        gen = _generate(tmp_path, "gen-after-takeover", addresses["s-2"], [third], 4.0, {third: 1.0})
        others.append(gen)
        d3 = _directive(standby.address, third, job, completed=True)
        assert gen.wait(60) == 0, gen.stderr.read()[-2000:]

        # One directive a fault, none twice, every one carried out, across the restart and the takeover.
        listed = _directives(standby.address)
        assert sorted(d.from_node for d in listed) == sorted([first, second, third]), _listing(standby.address)
        assert {d.directive_id for d in listed} == {d1.directive_id, d2.directive_id, d3.directive_id}
        assert len({d1.to_node, d2.to_node, d3.to_node}) == 3

        stop_at = job.request_stop()
        codes = job.wait(timeout=60)
        records = {r["name"]: r for r in job.results()}
    finally:
        if job is not None:
            job.stop(grace=5)
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

    assert all(c == 0 for c in codes.values()), codes
    moves = {0: d1, 1: d2, 2: d3}
    # Rank 3 was never moved: one process ran every step and took part in each switch exactly once.
    stayed = records["rank3"]
    assert stayed["exit"] == "finished" and _steps(stayed) == list(range(stop_at))
    assert [c["directive"] for c in stayed["changes"]] == [d1.directive_id, d2.directive_id, d3.directive_id]
    curve: dict[tuple[int, int], float] = {}
    for rank, d in moves.items():
        leaving, spare = records[f"rank{rank}"], records[f"spare-{d.to_node}"]
        assert leaving["exit"] == "evacuate" and leaving["changes"][-1]["directive"] == d.directive_id
        # the spare picked up the rank at the step boundary where its process left off: no restart
        k = spare["joined_at_step"]
        assert _steps(leaving) == list(range(k)) and _steps(spare) == list(range(k, stop_at))
        assert set(spare["ranks"].values()) == {rank} and spare["exit"] == "finished"
    for rec in records.values():
        # each directive acted on once by every process that saw it
        seen = [c["directive"] for c in rec["changes"]]
        assert len(seen) == len(set(seen)), rec["name"]
        for step, loss in rec["losses"].items():
            key = (rec["ranks"][step], int(step))
            assert key not in curve, f"step {key} ran twice"
            curve[key] = loss
    assert set(curve) == {(r, s) for r in range(4) for s in range(stop_at)}
    finished = [r for r in records.values() if r["exit"] == "finished"]
    assert len(finished) == 4 and len({r["hashes"][str(stop_at)] for r in finished}) == 1
