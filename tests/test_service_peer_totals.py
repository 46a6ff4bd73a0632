"""Job and site peer totals across shards through the coordinator (service/coordinator.py PeerTotalsBook,
service/forwarder.py put_totals / take_peer_totals): each shard's totals go up, the other shards' sums
come back on the acks, and the shard's scorer uses them."""

from __future__ import annotations


import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from support import wait_until
from test_predictor_shard_peers import NODES, SHARD_A, SHARD_B, _feed, _steps
from test_service_coordinator import _coordinator, _forwarder

from foreshock.predictor import features as ft
from foreshock.predictor import online, registry, synthetic
from foreshock.service.coordinator import MAX_TOTALS_STEPS, PeerTotalsBook, check_step_totals
from foreshock.service.errors import InvalidArgument
from foreshock.v1 import coordinator_pb2, coordinator_pb2_grpc

W = ft.TOTALS_WIDTH
STEP = ft.STEP_SECONDS * 1_000_000_000


def _row(count, value=1.0):
    k = len(ft.PEER_INPUTS)
    return np.r_[count, [value * count] * k, [count] * k]


def test_the_book_sums_the_other_shards_at_the_newest_step_all_have_sent():
    book = PeerTotalsBook()
    book.put("a", check_step_totals("a", [(10, [("job", "j1", _row(2))])]))
    assert book.others("a") is None                       # nobody else yet
    book.put("b", check_step_totals("b", [(10, [("job", "j1", _row(3)), ("site", "s", _row(3))])]))
    book.put("c", check_step_totals("c", [(10, [("job", "j1", _row(1))]), (11, [("job", "j1", _row(1))])]))
    step, sums = book.others("a")
    assert step == 10 and sums["job"]["j1"][0] == 4 and sums["site"]["s"][0] == 3
    assert book.others("a") is None                       # given once
    step, sums = book.others("c")                          # a and b: step 10 only
    assert step == 10 and sums["job"]["j1"][0] == 5
    # a shard that stops sending holds the others back only for the window
    for s in range(11, 11 + MAX_TOTALS_STEPS + 1):
        book.put("a", check_step_totals("a", [(s, [("job", "j1", _row(2))])]))
        book.put("c", check_step_totals("c", [(s, [("job", "j1", _row(1))])]))
    step, sums = book.others("a")
    assert step == 10 + MAX_TOTALS_STEPS + 1 and sums["job"]["j1"][0] == 1   # c alone: b is gone


@pytest.mark.parametrize("steps, words", [
    ([(10, [("leaf_switch", "leaf-1", _row(2))])], "group 'leaf_switch'"),
    ([(10, [("job", "j1", _row(2)[:-1])])], f"a totals row has {W}"),
    ([(10, [("job", "j1", np.r_[2, [1] * 6, [3] * 6])])], "nonzero counts"),
    ([(0, [("job", "j1", _row(2))])], "step 0"),
    ([(10, [("job", "j1", _row(2)), ("job", "j1", _row(2))])], "twice"),
    ([(s, []) for s in range(1, MAX_TOTALS_STEPS + 2)], "totals of 5 steps"),
])
def test_bad_totals_are_refused_naming_the_fault(steps, words):
    with pytest.raises(InvalidArgument, match=words):
        check_step_totals("a", steps)


def test_bad_totals_over_grpc_are_refused_and_apply_no_event(tmp_path):
    plane = _coordinator(tmp_path)
    try:
        req = coordinator_pb2.ForwardRequest(
            shard="shard-a", epoch=1, model_version="m1",
            events=[coordinator_pb2.ShardEvent(sequence=1, kind=coordinator_pb2.SHARD_EVENT_KIND_ALARM, node="n1",
                                                risk=0.9, ts_ns=1)],
            totals=[coordinator_pb2.StepTotals(step=5, groups=[coordinator_pb2.GroupTotals(
                group="job", name="j1", values=[1.0, 2.0])])])
        with grpc.insecure_channel(plane.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                list(coordinator_pb2_grpc.CoordinatorStub(ch).ForwardAlarms(iter([req]), timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "shard 'shard-a' totals of step 5, job 'j1'" in err.value.details()
        assert "n1" not in plane.policy.alarms and plane.coordinator.peer_totals.steps_received == {}
    finally:
        plane.stop(0.5)


def test_two_shards_scorers_get_each_others_totals_through_the_coordinator(tmp_path, tiny_model_dir):
    model = registry.load_model(tiny_model_dir(tmp_path / "m"))
    tables = {n: synthetic.node_tables(n, 12, seed=i, interval_s=20) for i, n in enumerate(NODES)}
    inv = synthetic.inventory(NODES, leaf_of=lambda i: f"leaf-{i // 2}", job_of=lambda i: "job-1")
    plane = _coordinator(tmp_path)
    shards = {}
    try:
        for name, nodes in (("shard-a", SHARD_A), ("shard-b", SHARD_B)):
            scorer = online.OnlineScorer(model, explain_top=0, share_totals=True)
            scorer.ingest("inventory", inv.filter(pc.is_in(inv.column("node"), pa.array(nodes))))
            fw = _forwarder(plane.address, shard=name)
            fw.start()
            shards[name] = (scorer, fw, nodes)
        for step in _steps(tables)[:3]:
            for scorer, fw, nodes in shards.values():
                peer = fw.take_peer_totals()
                if peer is not None:
                    scorer.set_remote_totals(*peer)
                scorer.score(_feed(scorer, tables, nodes, step))
                fw.put_totals(scorer.take_local_totals())
            book = plane.coordinator.peer_totals
            # the shard that sent first asks again until the other's totals of the step are in
            assert wait_until(lambda: all(fw._peer_step == step for _, fw, _ in shards.values()), 10)
        assert book.sums_sent == {"shard-a": 3, "shard-b": 3}
        scorer_a, fw_a, _ = shards["shard-a"]
        step, groups = fw_a.take_peer_totals()
        assert step == _steps(tables)[2] and groups["job"]["job-1"][0] == 2   # shard-b's two nodes
        assert fw_a.peer_totals_received_total >= 2 and fw_a.totals_sent_total == 3
        # the scorer used them: the second and third steps with shard-b's totals of the step before
        assert scorer_a.stats["remote_totals_used"] == 2 and scorer_a.stats["remote_totals_missing"] == 1
    finally:
        for _, fw, _ in shards.values():
            fw.stop(0)
        plane.stop(0.5)


def test_shard_servers_send_their_totals_and_score_with_the_others(tmp_path, tiny_model_dir):
    """Two shard instances (in-process scorers, rounds on a clock the test moves) forwarding to a real
    coordinator: each step's totals go up after the step closes, the other shard's come back and the
    next step's job peers use them (the scorer's counts and the metric say so)."""
    from support import Clock

    from foreshock.service.forwarder import ForwardSettings
    from foreshock.service.scoring import PredictorScorer
    from foreshock.service.server import Settings, build_server

    model_dir = tiny_model_dir(tmp_path / "m")
    tables = {n: synthetic.node_tables(n, 12, seed=i, interval_s=20) for i, n in enumerate(NODES)}
    inv = synthetic.inventory(NODES, leaf_of=lambda i: f"leaf-{i // 2}", job_of=lambda i: "job-1")
    steps = list(_steps(tables))[:3]
    clock = Clock(steps[0] * STEP)
    coordinator = _coordinator(tmp_path)
    shards = {}
    try:
        for name, nodes in (("shard-a", SHARD_A), ("shard-b", SHARD_B)):
            scorer = PredictorScorer(model_dir, grace_seconds=2.0, share_totals=True)
            scorer.ingest("inventory", inv.filter(pc.is_in(inv.column("node"), pa.array(nodes))))
            plane = build_server(Settings.insecure_loopback(
                tmp_path / name, scorer=scorer, threshold=0.99, scoring_clock=clock,
                forward=ForwardSettings((coordinator.address,), name, backoff_initial_seconds=0.05,
                                        backoff_max_seconds=0.3, totals_poll_seconds=0.1)))
            plane.start()
            shards[name] = (plane, scorer, nodes)
        for step in steps:
            for plane, scorer, nodes in shards.values():
                _feed(scorer._online, tables, nodes, step)   # rows of a step the rounds have not closed
            clock.now = (step + 1) * STEP + 3_000_000_000     # past the step's end and the grace
            assert wait_until(lambda: all(p.forwarder._peer_step == step for p, _, _ in shards.values()), 15)
        # One more round closes a step without rows, which uses the last step's sums: every step after
        # the first used the other shard's sums of the step before (lagged), the first had none (missing).
        clock.now += STEP
        assert wait_until(lambda: all(s.peer_stats()["used"] == 3 for _, s, _ in shards.values()), 15)
        plane_a, scorer_a, _ = shards["shard-a"]
        assert scorer_a.peer_stats() == {"used": 3, "lagged": 3, "missing": 1, "late": 0, "refused": 0}
        # sums that come after every step that could use them closed are counted, not refused
        scorer_a.set_peer_totals([(steps[0], {"job": {"job-1": [2.0] + [0.0] * (ft.TOTALS_WIDTH - 1)}})])
        assert scorer_a.peer_stats()["late"] == 1 and scorer_a.peer_stats()["refused"] == 0
        # the fourth step's totals go up too, after the scheduler has taken in its round
        book = coordinator.coordinator.peer_totals
        assert wait_until(lambda: book.steps_received == {"shard-a": 4, "shard-b": 4}, 15), book.steps_received
        from prometheus_client import generate_latest
        # the metric reads the round's outcome, which the scheduler takes in after score() returns
        lagged = 'foreshock_peer_totals_steps_total{result="lagged"} 3.0'
        assert wait_until(lambda: lagged in generate_latest(plane_a.registry).decode(), 15)
        sent = 'foreshock_forwarder_peer_totals_total{direction="sent"} 4.0'
        assert wait_until(lambda: sent in generate_latest(plane_a.registry).decode(), 15)
    finally:
        for plane, _, _ in shards.values():
            plane.stop(0.5)
        coordinator.stop(0.5)


def test_the_scoring_worker_sends_its_totals_and_takes_the_others(tmp_path, tiny_model_dir):
    """The same exchange when the scorer runs in the scoring worker process (serve's default with a model)."""
    from foreshock.service.worker import ScoringWorker, _encode, pack

    model_dir = tiny_model_dir(tmp_path / "m")
    tables = {n: synthetic.node_tables(n, 9, seed=i, interval_s=20) for i, n in enumerate(NODES)}
    inv = synthetic.inventory(NODES, leaf_of=lambda i: f"leaf-{i // 2}", job_of=lambda i: "job-1")
    steps = list(_steps(tables))[:3]
    worker = ScoringWorker(str(model_dir), grace_seconds=2.0, share_totals=True, timeout=60)
    worker.start()
    try:
        def drain(step, peer_totals):
            lo, hi = step * STEP, (step + 1) * STEP
            validated = [("inventory", _encode("inventory", inv.filter(pc.is_in(inv.column("node"),
                                                                                  pa.array(SHARD_A)))))]
            for name in tables["node-a"]:
                part = pa.concat_tables([tables[n][name] for n in SHARD_A])
                ts = pc.cast(part.column("ts"), pa.int64())
                validated.append((name, _encode(name, part.filter(pc.and_(pc.greater_equal(ts, lo),
                                                                          pc.less(ts, hi))))))
            return worker.call({"now_ns": hi + 3_000_000_000, "score": True, "validated": validated,
                                "close_ns": hi, "peer_totals": peer_totals, **pack([])})

        reply = drain(steps[0], [])
        assert reply["score_error"] == "" and reply["peer_stats"]["missing"] == 1
        ((step, groups),) = reply["score"][4]
        assert step == steps[0] and groups["job"]["job-1"][0] == 2 and "site-a" in groups["site"]
        other = {"job": {"job-1": groups["job"]["job-1"]}}               # as if shard B's were the same
        bad = {"job": {"job-1": [1.0, 2.0]}}
        reply = drain(steps[1], [(steps[0], bad), (steps[0], other)])
        assert reply["peer_stats"] == {"used": 1, "lagged": 1, "missing": 1, "late": 0, "refused": 1}
        assert [s for s, _ in reply["score"][4]] == [steps[1]]
    finally:
        worker.stop()
