"""The jobs' step times in a sharded control plane (service/steptimefeed.py): the coordinator's Jobs API
accepts them, and each shard's scorer gets every rank's rows of the jobs with a node on it over its
Coordinator.ForwardAlarms stream, so its step-time features are the offline ones from the same rows; a
node the coordinator has not heard of yet has its job's rows held until its shard names it."""

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
from test_service_coordinator import _coordinator

from foreshock.predictor import features as ft
from foreshock.predictor import online, registry, synthetic
from foreshock.predictor import steptimes as stt
from foreshock.service.coordinator import CoordinatorSettings
from foreshock.service.domain import Job, Rank
from foreshock.service.forwarder import AlarmForwarder, ForwardSettings
from foreshock.service.scoring import PredictorScorer
from foreshock.service.server import Settings, build_server
from foreshock.service.steptimefeed import MAX_HOLD_SECONDS, MAX_ROWS_PER_ACK, StepTimeRouter, decode, encode
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

def _report(address, samples_of):
    """Every rank of job-1 (rank i on NODES[i]) reports `samples_of(rank, node)` to the Jobs API at
    `address`, each accepted whole; the rows the service archives for them, as one table."""
    sent = []
    with grpc.insecure_channel(address) as ch:
        stub = jobs_pb2_grpc.JobsStub(ch)
        for rank, node in enumerate(NODES):
            samples = samples_of(rank, node)
            steps = [pb.StepTime(step=k, step_seconds=t, compute_seconds=c, end_ns=e) for k, t, c, e in samples]
            reply = stub.ReportStepTimes(pb.ReportStepTimesRequest(job_id="job-1", rank=rank, node=node,
                                                                   steps=steps), timeout=T)
            assert reply.accepted == len(samples)
            sent.append(_table(rank, node, samples))
    return pa.concat_tables(sent)


def _start_shards(shards, tmp_path, model_dir, coordinator, clock, inventory=None):
    """Start a control plane per SHARDS entry, forwarding to `coordinator`, into `shards` (name ->
    (plane, scorer, nodes)) as each starts, so that the caller's cleanup stops every one started."""
    for name, nodes in SHARDS.items():
        scorer = PredictorScorer(model_dir, grace_seconds=2.0, share_totals=True)
        if inventory is not None:
            scorer.ingest("inventory", inventory.filter(pc.is_in(inventory.column("node"), pa.array(nodes))))
        plane = build_server(Settings.insecure_loopback(
            tmp_path / name, listen=f"127.0.0.1:{free_port()}", scorer=scorer, threshold=0.99,
            scoring_clock=clock,
            forward=ForwardSettings((coordinator.address,), name, summary_seconds=1.0,
                                    backoff_initial_seconds=0.05, backoff_max_seconds=0.3,
                                    totals_poll_seconds=0.1)))
        plane.start()
        shards[name] = (plane, scorer, nodes)


def test_the_router_sends_a_jobs_rows_to_every_shard_of_its_nodes_bounded_and_counted():
    owner = {"node-a": "shard-a", "node-b": "shard-a", "node-c": "shard-b"}
    router = StepTimeRouter(owner.get, buffer_rows=1024)
    router.route(_table(0, "node-a", _samples(100, 1.0)), _job())
    router.route(_table(3, "node-d", _samples(100, 1.0)), _job())    # node-d: no shard known, its job's are
    assert router.waiting() == {"shard-a": 16, "shard-b": 16}
    router.route(_table(0, "x", _samples(100, 1.0)), _job(["x", "y"], job="job-2"))
    assert router.waiting() == {"shard-a": 16, "shard-b": 16} and router.held() == 16 + 8
    assert router.unrouted_rows == {"expired": 0, "full": 0}
    rows, more = router.take("shard-b")
    assert rows.num_rows == 16 and not more and set(rows.column("node").to_pylist()) == {"node-a", "node-d"}
    assert router.take("shard-b") == (None, False) and router.sent_rows == {"shard-b": 16}
    # a shard that does not ask: the oldest reports go past the bound, counted
    for _ in range(200):
        router.route(_table(1, "node-b", _samples(100, 1.0)), _job())
    assert router.waiting()["shard-a"] <= 1024 and router.dropped_rows["shard-a"] == 16 + 1600 - 1024
    rows, more = router.take("shard-a")
    assert rows.num_rows == 1024 and not more


def test_a_nodes_rows_wait_for_its_shard_and_go_to_it_once_bounded_in_rows_and_age():
    owner, now = {"node-a": "shard-a", "node-b": "shard-a"}, [0.0]
    router = StepTimeRouter(owner.get, hold_rows=1024, hold_seconds=60.0, monotonic=lambda: now[0])
    router.route(_table(0, "node-a", _samples(100, 1.0)), _job())    # node-c, node-d: no shard known yet
    router.route(_table(2, "node-c", _samples(100, 1.0)), _job())
    assert router.waiting() == {"shard-a": 16} and router.held() == 16
    # shard-b's events name node-c: it gets every rank's rows of the job so far
    owner["node-c"] = "shard-b"
    router.placed("shard-b", ["node-c", "node-s"])
    assert router.waiting() == {"shard-a": 16, "shard-b": 16} and router.released_rows == {"shard-b": 16}
    assert router.held() == 16                                       # node-d still waits on them
    router.route(_table(3, "node-d", _samples(100, 1.0)), _job())    # node-c's shard is known now
    assert router.waiting() == {"shard-a": 24, "shard-b": 24} and router.held() == 24
    # node-d is shard-a's, which had them all: nothing twice
    owner["node-d"] = "shard-a"
    router.placed("shard-a", ["node-d"])
    assert router.waiting() == {"shard-a": 24, "shard-b": 24} and router.held() == 0
    assert router.released_rows == {"shard-b": 16}
    rows, more = router.take("shard-b")
    assert rows.num_rows == 24 and not more
    assert sorted(rows.column("node").to_pylist()) == ["node-a"] * 8 + ["node-c"] * 8 + ["node-d"] * 8
    # a node whose shard is not heard of in time: its job's rows go, counted
    router.route(_table(0, "x", _samples(100, 1.0)), _job(["x", "y"], job="job-2"))
    now[0] = 59.0
    router.route(_table(1, "y", _samples(100, 1.0)), _job(["x", "y"], job="job-2"))
    now[0] = 60.0
    assert router.held() == 8 and router.unrouted_rows == {"expired": 8, "full": 0}
    router.placed("shard-a", ["x"])
    assert router.take("shard-a")[0].column("node").to_pylist() == [
        n for n in ("node-a", "node-c", "node-d", "y") for _ in range(8)]
    assert router.held() == 8                                        # y waits on them still
    # past the bound the oldest go, counted
    for _ in range(200):
        router.route(_table(1, "y", _samples(100, 1.0)), _job(["x", "y"], job="job-3"))
    assert router.held() == 1024 and router.unrouted_rows == {"expired": 8, "full": 8 + 1600 - 1024}
    # holding off: counted at once
    off = StepTimeRouter(owner.get, hold_seconds=0)
    off.route(_table(0, "x", _samples(100, 1.0)), _job(["x", "node-a"], job="job-2"))
    assert off.held() == 0 and off.unrouted_rows == {"expired": 8, "full": 0} and off.waiting() == {"shard-a": 8}


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
        _start_shards(shards, tmp_path, model_dir, coordinator, clock, inventory=inv)
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
        # two minutes of the job's steps (the share is known from a second judged minute on:
        # features.SLOW_SHARE_MIN_STEPS), each reported while it is the minute being collected
        parts = []
        for j in range(2):
            parts.append(_report(coordinator.address, lambda rank, node: [
                (8 * j + k, t, c, e) for k, t, c, e in _samples(minute + j, _compute(rank))]))
            whole.ingest("step_times", parts[-1])
            if j == 0:
                close(minute)
        rows = pa.concat_tables(parts)
        # every shard gets every rank's rows: the comparison needs them all
        assert wait_until(lambda: all(p.forwarder.step_time_rows_received_total == rows.num_rows
                                      for p, _, _ in shards.values()), 15)
        for k in range(1, stt.LAG_STEPS + 2):
            close(minute + k)       # the last reads the rows of `minute` + 1 (steptimes.LAG_STEPS)

        judged_rows = stt.node_minutes(rows)
        expected = {}
        for n, step, v in zip(judged_rows.node.tolist(), judged_rows.step.tolist(), judged_rows.values):
            expected.setdefault(n, {})[step] = v
        assert set(expected) == set(NODES) and all(set(v) == {minute, minute + 1} for v in expected.values())
        for name, (plane, scorer, nodes) in shards.items():
            assert scorer._online.stats["late_step_times"] == 0
            for n in nodes:
                got = scorer._online.features_of(n)[COLUMNS]
                (w0, s0, j0), (w1, s1, j1) = expected[n][minute], expected[n][minute + 1]
                np.testing.assert_array_equal(got, np.float32([w1, max(w0, w1), (s0 + s1) / (j0 + j1)]), err_msg=n)
                np.testing.assert_array_equal(got, whole.features_of(n)[COLUMNS], err_msg=n)
        assert shards["shard-b"][1]._online.features_of(SLOW)[COLUMNS[2]] == 1.0
        assert shards["shard-b"][1]._online.features_of(SLOW)[COLUMNS[0]] > 1.2
        assert shards["shard-b"][1]._online.features_of("node-d")[COLUMNS[0]] == pytest.approx(1.0, abs=0.05)
        assert shards["shard-a"][1]._online.features_of("node-a")[COLUMNS[0]] == pytest.approx(1.0, abs=0.05)
        text = generate_latest(coordinator.registry).decode()
        assert f'foreshock_coordinator_step_time_rows_total{{result="sent",shard="shard-b"}} {rows.num_rows}.0' in text
        text = generate_latest(shards["shard-a"][0].registry).decode()
        assert f"foreshock_forwarder_step_time_rows_total {rows.num_rows}.0" in text and rows.num_rows == 64
    finally:
        for plane, _, _ in shards.values():
            plane.stop(0.5)
        coordinator.stop(0.5)


def test_a_new_nodes_rows_wait_at_the_coordinator_until_its_shard_names_it(tmp_path, tiny_model_dir):
    """node-c and node-d are new: their telemetry starts with their job, so the coordinator learns that
    shard-b has them only from shard-b's risk summary, after the round that first scores them, which
    closes their second minute. Their job's rows of both minutes wait at the coordinator and then go to
    shard-b: the second minute's in time, judged as offline judges the same rows; the first minute's
    after the scorer closed the minute after it, so they are counted late there. (shard-a's nodes were
    known, so shard-a got every row at once; before the hold, shard-b got none.)"""
    model_dir = tiny_model_dir(tmp_path / "m")
    first = time.time_ns() // STEP - 10
    new = first + 2                                   # node-c and node-d's first minute
    t0 = {n: (first if n in SHARDS["shard-a"] else new) for n in NODES}
    tables = {n: synthetic.node_tables(n, 18 - 3 * (t0[n] - first), seed=i, interval_s=20, t0_ns=t0[n] * STEP)
              for i, n in enumerate(NODES)}
    inv = {n: synthetic.inventory([n], leaf_of=lambda i, n=n: f"leaf-{NODES.index(n) // 2}",
                                  job_of=lambda i: "job-1", t0_ns=t0[n] * STEP) for n in NODES}
    clock = Clock(first * STEP)
    coordinator = _coordinator(tmp_path)
    shards = {}
    try:
        _start_shards(shards, tmp_path, model_dir, coordinator, clock)
        whole = online.OnlineScorer(registry.load_model(model_dir), explain_top=0)

        def close(step):
            lo, hi = step * STEP, (step + 1) * STEP
            running = []
            for n in NODES:
                if step < t0[n]:
                    continue
                owner = next(s for _, s, nodes in shards.values() if n in nodes)
                if step == t0[n]:
                    for scorer in (whole, owner._online):
                        scorer.ingest("inventory", inv[n])
                for table, t in tables[n].items():
                    ts = pc.cast(t.column("ts"), pa.int64())
                    part = t.filter(pc.and_(pc.greater_equal(ts, lo), pc.less(ts, hi)))
                    whole.ingest(table, part)
                    owner._online.ingest(table, part)
                running.append(owner)
            whole.score(hi + 6 * S)
            clock.now = hi + 3 * S
            assert wait_until(lambda: all(s._online._last_step == step for s in running), 15)

        def report(minute, slow):
            rows = _report(coordinator.address, lambda rank, node: [
                (8 * (minute - new) + k, t, c, e)     # the job's training steps go on
                for k, t, c, e in _samples(minute, 1.5 if node == slow else 1.0 + 0.01 * rank)])
            whole.ingest("step_times", rows)
            return rows

        close(first)
        close(first + 1)
        coord = coordinator.coordinator
        assert wait_until(lambda: coord.shard_of("node-a") and coord.shard_of("node-b"), 15)
        _register(coordinator.address)
        # the job starts with node-c and node-d's telemetry; node-c is slow from its second minute
        first_rows = report(new, slow=None)
        close(new)                                    # node-c and node-d's first minute is not scored
        second_rows = report(new + 1, slow=SLOW)
        assert coord.shard_of("node-c") is None and coord.shard_of("node-d") is None
        rows = pa.concat_tables([first_rows, second_rows])
        shard_a, shard_b = (shards[n][0] for n in SHARDS)
        assert wait_until(lambda: shard_a.forwarder.step_time_rows_received_total == rows.num_rows, 15)
        text = generate_latest(coordinator.registry).decode()
        assert f"foreshock_coordinator_step_time_rows_held {rows.num_rows}.0" in text
        assert shard_b.forwarder.step_time_rows_received_total == 0
        close(new + 1)                                # scored now: the risk summary names them
        assert wait_until(lambda: shard_b.forwarder.step_time_rows_received_total == rows.num_rows, 15)
        assert coord.shard_of("node-c") == coord.shard_of("node-d") == "shard-b"
        text = generate_latest(coordinator.registry).decode()
        assert f'foreshock_coordinator_step_time_rows_released_total{{shard="shard-b"}} {rows.num_rows}.0' in text
        assert "foreshock_coordinator_step_time_rows_held 0.0" in text
        assert 'foreshock_coordinator_step_time_rows_unrouted_total{reason="expired"} 0.0' in text
        assert f'foreshock_coordinator_step_time_rows_total{{result="sent",shard="shard-b"}} {rows.num_rows}.0' in text
        for k in range(stt.LAG_STEPS):
            close(new + 2 + k)      # the last reads the rows of new + 1 (steptimes.LAG_STEPS)
        # the scorer took them with the drain before it closed new + 2: new's were late by then
        b = shards["shard-b"][1]._online
        assert b.stats["late_step_times"] == first_rows.num_rows
        assert b.stats["rows_step_times"] == second_rows.num_rows

        # its nodes' features: offline's values of their second minute, from the same rows
        judged = stt.node_minutes(rows)
        offline = {(n, s): v for n, s, v in zip(judged.node.tolist(), judged.step.tolist(), judged.values)}
        for n in SHARDS["shard-b"]:
            worst, slow, judged_steps = offline[(n, new + 1)]
            # one judged minute: the share not known yet (features.SLOW_SHARE_MIN_STEPS)
            np.testing.assert_array_equal(b.features_of(n)[COLUMNS], np.float32([worst, worst, np.nan]), err_msg=n)
        assert b.features_of(SLOW)[COLUMNS[0]] > 1.2
        # without their first minute, which offline (and a scorer given the rows in time) has: 8 more
        # judged steps of node-c's, none slow, and a second judged minute in the 30-minute share
        assert offline[(SLOW, new)][1:] == pytest.approx([0, 8])
        assert np.isnan(b.features_of(SLOW)[COLUMNS[2]]) and whole.features_of(SLOW)[COLUMNS[2]] == 0.5
        # shard-a had every row in time: its nodes' features are one unsharded scorer's
        a = shards["shard-a"][1]._online
        assert a.stats["late_step_times"] == 0
        for n in SHARDS["shard-a"]:
            np.testing.assert_array_equal(a.features_of(n)[COLUMNS], whole.features_of(n)[COLUMNS], err_msg=n)
            assert a.features_of(n)[COLUMNS[0]] == pytest.approx(1.0, abs=0.05)
    finally:
        for plane, _, _ in shards.values():
            plane.stop(0.5)
        coordinator.stop(0.5)


def test_a_shard_down_costs_the_jobs_api_nothing_and_its_rows_are_dropped_and_counted(tmp_path):
    coordinator = _coordinator(tmp_path, coordinator_settings={"step_time_buffer_rows": 1024})
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


@pytest.mark.parametrize("key, value", [
    ("coordinator_step_time_buffer_rows", "100"),       # smaller than a report
    ("coordinator_step_time_hold_seconds", "121"),      # past the scorer's window: late at any shard
])
def test_serve_refuses_step_time_settings_out_of_range(tmp_path, key, value):
    run = subprocess.run([sys.executable, "-m", "foreshock.cli", "serve", "--insecure", "--no-model",
                          "--state", str(tmp_path), "--listen", "127.0.0.1:0", "--metrics-listen", "",
                          "--coordinator", "--lease-file", str(tmp_path / "lease")],
                         env={**os.environ, f"FORESHOCK_SERVE_{key.upper()}": value},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and key in run.stderr, run.stderr[-1000:]


@pytest.mark.parametrize("kw, words", [
    ({"step_time_hold_seconds": MAX_HOLD_SECONDS + 1}, "step_time_hold_seconds"),
    ({"step_time_hold_seconds": -1.0}, "step_time_hold_seconds"),
    ({"step_time_hold_rows": 1000}, "step_time_hold_rows"),
])
def test_coordinator_settings_refuse_a_hold_out_of_range(tmp_path, kw, words):
    with pytest.raises(ValueError, match=words):
        CoordinatorSettings(str(tmp_path / "lease"), **kw)
    assert MAX_HOLD_SECONDS == (stt.OPEN_STEPS + 1) * ft.STEP_SECONDS
