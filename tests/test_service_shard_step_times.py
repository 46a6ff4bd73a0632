"""The jobs' step times in a sharded control plane (service/steptimefeed.py): the coordinator's Jobs API
accepts them, and each shard's scorer gets every rank's rows of the jobs with a node on it over its
Coordinator.ForwardAlarms stream, so its step-time features are the offline ones from the same rows."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from prometheus_client import generate_latest
from support import Clock, free_port, wait_until

from foreshock.predictor import features as ft
from foreshock.predictor import online, registry, synthetic
from foreshock.predictor import steptimes as stt
from foreshock.service.coordinator import CoordinatorSettings
from foreshock.service.domain import Job, Rank
from foreshock.service.forwarder import AlarmForwarder, ForwardSettings
from foreshock.service.scoring import PredictorScorer
from foreshock.service.server import Settings, build_server
from foreshock.service.steptimefeed import MAX_ROWS_PER_ACK, StepTimeRouter, decode, encode
from foreshock.service.steptimes import _rows
from foreshock.v1 import coordinator_pb2, coordinator_pb2_grpc
from foreshock.v1 import jobs_pb2 as pb
from foreshock.v1 import jobs_pb2_grpc

S = 1_000_000_000
STEP = ft.STEP_SECONDS * S
NODES = ["node-a", "node-b", "node-c", "node-d"]
SHARDS = {"shard-a": NODES[:2], "shard-b": NODES[2:]}
SLOW = "node-c"                       # rank 2, on shard-b
T = 5.0
COLUMNS = [ft.FEATURE_NAMES.index(f) for f in ("steptime_vs_job_5m", "steptime_vs_job_30m",
                                                 "steptime_slow_share_30m")]


def _job(nodes=NODES, job="job-1"):
    return Job(job, tuple(Rank(i, n) for i, n in enumerate(nodes)), spares=())


def _table(rank, node, samples, job="job-1"):
    return _rows(job, 1, rank, node, samples)


def _coordinator(tmp_path, **kw):
    plane = build_server(Settings.insecure_loopback(
        tmp_path / "coordinator", listen=f"127.0.0.1:{free_port()}", threshold=0.5,
        policy={"stale_seconds": 3600.0},
        coordinator=CoordinatorSettings(str(tmp_path / "lease"), lock_poll_seconds=0.05, **kw)))
    plane.start()
    assert wait_until(lambda: plane.leading, 10)
    return plane


def _register(address, nodes=NODES):
    with grpc.insecure_channel(address) as ch:
        jobs_pb2_grpc.JobsStub(ch).RegisterJob(pb.RegisterJobRequest(
            job_id="job-1", ranks=[pb.RankPlacement(rank=i, node=n) for i, n in enumerate(nodes)],
            spare_nodes=["node-s"], fallback=pb.FALLBACK_POLICY_SHRINK), timeout=T)


def _samples(minute, compute, n=8):
    """n steps of one rank, ending 5 s apart within feature step `minute`: (step, total, compute, end_ns)."""
    return [(k, 2.0, compute, minute * STEP + (5 + 5 * k) * S) for k in range(1, n + 1)]


def _compute(rank):
    return 1.5 if NODES[rank] == SLOW else 1.0 + 0.01 * rank


# -- the router and the wire format -----------------------------------------------------------------

def test_the_router_sends_a_jobs_rows_to_every_shard_of_its_nodes_bounded_and_counted():
    owner = {"node-a": "shard-a", "node-b": "shard-a", "node-c": "shard-b"}
    router = StepTimeRouter(owner.get, buffer_rows=1024)
    router.route(_table(0, "node-a", _samples(100, 1.0)), _job())
    router.route(_table(3, "node-d", _samples(100, 1.0)), _job())    # node-d: no shard known, its job's are
    assert router.waiting() == {"shard-a": 16, "shard-b": 16}
    router.route(_table(0, "x", _samples(100, 1.0)), _job(["x", "y"], job="job-2"))
    assert router.unrouted_rows == 8
    rows, more = router.take("shard-b")
    assert rows.num_rows == 16 and not more and set(rows.column("node").to_pylist()) == {"node-a", "node-d"}
    assert router.take("shard-b") == (None, False) and router.sent_rows == {"shard-b": 16}
    # a shard that does not ask: the oldest reports go past the bound, counted
    for _ in range(200):
        router.route(_table(1, "node-b", _samples(100, 1.0)), _job())
    assert router.waiting()["shard-a"] <= 1024 and router.dropped_rows["shard-a"] == 16 + 1600 - 1024
    rows, more = router.take("shard-a")
    assert rows.num_rows == 1024 and not more


def test_an_ack_carries_at_most_its_rows_and_says_more_wait():
    router = StepTimeRouter({"node-a": "a"}.get, buffer_rows=10 * MAX_ROWS_PER_ACK)
    big = _table(0, "node-a", _samples(100, 1.0, n=1000))
    for _ in range(20):
        router.route(big, _job())
    rows, more = router.take("a")
    assert rows.num_rows == 16_000 and more
    assert decode(encode(rows)).equals(rows)


@pytest.mark.parametrize("data, words", [
    (b"not arrow", "not an Arrow IPC stream"),
    (encode(pa.table({"node": ["n"], "nope": [1]})), "unknown columns"),
])
def test_bad_step_times_on_an_ack_are_refused_naming_why(data, words):
    with pytest.raises(ValueError, match=words):
        decode(data)


def test_the_forwarder_hands_an_acks_rows_to_the_scheduler_and_asks_again_while_more_wait():
    got = []
    fw = AlarmForwarder(ForwardSettings(("127.0.0.1:1",), "shard-a", totals_poll_seconds=30.0), model_version="m",
                        on_step_times=lambda name, rows: got.append((name, rows.num_rows)))
    fw._on_ack(coordinator_pb2.ForwardAck(epoch=fw.epoch, step_times=encode(_table(0, "node-a", _samples(9, 1.0))),
                                          step_times_pending=True))
    assert got == [("step_times", 8)] and fw.step_time_rows_received_total == 8
    assert fw._rows_ask_at <= time.monotonic()            # more wait: at once
    fw._on_ack(coordinator_pb2.ForwardAck(epoch=fw.epoch, step_times=b"junk"))
    assert fw.step_time_acks_refused_total == 1 and len(got) == 1
    assert fw._rows_ask_at > time.monotonic() + 20       # none more said: after the poll period


# -- a real sharded control plane ----------------------------------------------------------------------

def test_each_shards_scorer_judges_every_rank_of_its_jobs_as_offline(tmp_path, tiny_model_dir):
    """Coordinator + two shards on loopback ports, one job over both shards' nodes, one slow rank on
    shard-b: shard-b's scorer sees node-c slow, shard-a's its nodes at 1.0, each value the one
    predictor/steptimes.py computes from the same rows, and the features an unsharded scorer's."""
    model_dir = tiny_model_dir(tmp_path / "m")
    first = time.time_ns() // STEP - 10          # recent: the Jobs API refuses step ends a day old
    tables = {n: synthetic.node_tables(n, 15, seed=i, interval_s=20, t0_ns=first * STEP)
              for i, n in enumerate(NODES)}
    inv = synthetic.inventory(NODES, leaf_of=lambda i: f"leaf-{i // 2}", job_of=lambda i: "job-1",
                              t0_ns=first * STEP)
    clock = Clock(first * STEP)
    coordinator = _coordinator(tmp_path)
    shards = {}
    try:
        for name, nodes in SHARDS.items():
            scorer = PredictorScorer(model_dir, grace_seconds=2.0, share_totals=True)
            scorer.ingest("inventory", inv.filter(pc.is_in(inv.column("node"), pa.array(nodes))))
            plane = build_server(Settings.insecure_loopback(
                tmp_path / name, listen=f"127.0.0.1:{free_port()}", scorer=scorer, threshold=0.99,
                scoring_clock=clock,
                forward=ForwardSettings((coordinator.address,), name, summary_seconds=1.0,
                                        backoff_initial_seconds=0.05, backoff_max_seconds=0.3,
                                        totals_poll_seconds=0.1)))
            plane.start()
            shards[name] = (plane, scorer, nodes)
        whole = online.OnlineScorer(registry.load_model(model_dir), explain_top=0)
        whole.ingest("inventory", inv)

        def close(step):
            lo, hi = step * STEP, (step + 1) * STEP
            for n in NODES:
                for table, t in tables[n].items():
                    ts = pc.cast(t.column("ts"), pa.int64())
                    part = t.filter(pc.and_(pc.greater_equal(ts, lo), pc.less(ts, hi)))
                    whole.ingest(table, part)
                    for _, scorer, nodes in shards.values():
                        if n in nodes:
                            scorer._online.ingest(table, part)
            whole.score(hi + 6 * S)
            clock.now = hi + 3 * S
            assert wait_until(lambda: all(s._online._last_step == step for _, s, _ in shards.values()), 15)

        close(first)
        close(first + 1)            # a node's first step is not scored: its second is
        # the shards' risk summaries tell the coordinator where each node is
        assert wait_until(lambda: all(coordinator.coordinator.shard_of(n) for n in NODES), 15)
        assert [coordinator.coordinator.shard_of(n) for n in NODES] == ["shard-a"] * 2 + ["shard-b"] * 2
        _register(coordinator.address)
        minute = first + 2
        sent = []
        with grpc.insecure_channel(coordinator.address) as ch:
            stub = jobs_pb2_grpc.JobsStub(ch)
            for rank, node in enumerate(NODES):
                samples = _samples(minute, _compute(rank))
                steps = [pb.StepTime(step=k, step_seconds=t, compute_seconds=c, end_ns=e) for k, t, c, e in samples]
                reply = stub.ReportStepTimes(pb.ReportStepTimesRequest(job_id="job-1", rank=rank, node=node,
                                                                       steps=steps), timeout=T)
                assert reply.accepted == len(samples)
                sent.append(_table(rank, node, samples))
        rows = pa.concat_tables(sent)
        whole.ingest("step_times", rows)
        # every shard gets every rank's rows: the comparison needs them all
        assert wait_until(lambda: all(p.forwarder.step_time_rows_received_total == rows.num_rows
                                      for p, _, _ in shards.values()), 15)
        for k in range(stt.LAG_STEPS + 1):
            close(minute + k)       # the last reads the rows of `minute` (steptimes.LAG_STEPS)

        expected = {n: v for n, s, v in zip(*(lambda m: (m.node.tolist(), m.step.tolist(), m.values))(
            stt.node_minutes(rows))) if s == minute}
        assert set(expected) == set(NODES)
        for name, (plane, scorer, nodes) in shards.items():
            assert scorer._online.stats["late_step_times"] == 0
            for n in nodes:
                got = scorer._online.features_of(n)[COLUMNS]
                worst, slow, judged = expected[n]
                np.testing.assert_array_equal(got, np.float32([worst, worst, slow / judged]), err_msg=n)
                np.testing.assert_array_equal(got, whole.features_of(n)[COLUMNS], err_msg=n)
        assert shards["shard-b"][1]._online.features_of(SLOW)[COLUMNS[0]] > 1.2
        assert shards["shard-b"][1]._online.features_of("node-d")[COLUMNS[0]] == pytest.approx(1.0, abs=0.05)
        assert shards["shard-a"][1]._online.features_of("node-a")[COLUMNS[0]] == pytest.approx(1.0, abs=0.05)
        text = generate_latest(coordinator.registry).decode()
        assert 'foreshock_coordinator_step_time_rows_total{result="sent",shard="shard-b"} 32.0' in text
        text = generate_latest(shards["shard-a"][0].registry).decode()
        assert "foreshock_forwarder_step_time_rows_total 32.0" in text
    finally:
        for plane, _, _ in shards.values():
            plane.stop(0.5)
        coordinator.stop(0.5)


def test_a_shard_down_costs_the_jobs_api_nothing_and_its_rows_are_dropped_and_counted(tmp_path):
    coordinator = _coordinator(tmp_path, step_time_buffer_rows=1024)
    try:
        # shard-b tells the coordinator of its nodes, then goes down: nothing asks for its rows again
        with grpc.insecure_channel(coordinator.address) as ch:
            req = coordinator_pb2.ForwardRequest(shard="shard-b", epoch=1, model_version="m1", events=[
                coordinator_pb2.ShardEvent(sequence=i + 1, kind=coordinator_pb2.SHARD_EVENT_KIND_RISK, node=n,
                                           risk=0.01, ts_ns=time.time_ns())
                for i, n in enumerate(NODES)])
            acks = list(coordinator_pb2_grpc.CoordinatorStub(ch).ForwardAlarms(iter([req]), timeout=T))
            assert acks[-1].acked_sequence == len(NODES)
        _register(coordinator.address)
        minute = time.time_ns() // STEP - 1
        with grpc.insecure_channel(coordinator.address) as ch:
            stub = jobs_pb2_grpc.JobsStub(ch)
            for k in range(10):
                for rank, node in enumerate(NODES):
                    steps = [pb.StepTime(step=30 * k + j, step_seconds=2.0, compute_seconds=1.0,
                                         end_ns=minute * STEP + j * S) for j in range(1, 31)]
                    t0 = time.monotonic()
                    reply = stub.ReportStepTimes(pb.ReportStepTimesRequest(job_id="job-1", rank=rank, node=node,
                                                                           steps=steps), timeout=T)
                    assert reply.accepted == 30 and time.monotonic() - t0 < T
        router = coordinator.coordinator.step_times
        # 1,200 rows, 30 a report: the oldest 6 reports go
        assert router.waiting() == {"shard-b": 1020} and router.dropped_rows == {"shard-b": 180}
        text = generate_latest(coordinator.registry).decode()
        assert 'foreshock_coordinator_step_time_rows_total{result="dropped",shard="shard-b"} 180.0' in text
        assert 'foreshock_coordinator_step_time_rows_waiting{shard="shard-b"} 1020.0' in text
        # the shard back: it gets what waits, at most an ack's worth a time
        with grpc.insecure_channel(coordinator.address) as ch:
            req = coordinator_pb2.ForwardRequest(shard="shard-b", epoch=1, model_version="m1")
            (ack,) = list(coordinator_pb2_grpc.CoordinatorStub(ch).ForwardAlarms(iter([req]), timeout=T))
        assert decode(ack.step_times).num_rows == 1020 and not ack.step_times_pending
    finally:
        coordinator.stop(0.5)


def test_serve_refuses_a_step_time_buffer_smaller_than_a_report(tmp_path):
    run = subprocess.run([sys.executable, "-m", "foreshock.cli", "serve", "--insecure", "--no-model",
                          "--state", str(tmp_path), "--listen", "127.0.0.1:0", "--metrics-listen", "",
                          "--coordinator", "--lease-file", str(tmp_path / "lease")],
                         env={**os.environ, "FORESHOCK_SERVE_COORDINATOR_STEP_TIME_BUFFER_ROWS": "100"},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "coordinator_step_time_buffer_rows" in run.stderr, run.stderr[-1000:]
