"""Closing a feature step on the collectors' watermarks (service/steps.py): the tracker's rules, the
ingest's check of the watermark, and end to end, a real server whose scorer closes a step as soon as
every node's watermark is past it, well before its grace period ends, and waits when a node promises
nothing."""

from __future__ import annotations

import asyncio
import datetime as dt
import queue
import threading
import time
import urllib.request

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from foreshock import schema as sch
from foreshock.collectors.collector import Collector
from foreshock.collectors.simulated import SimpleNodeModel, SimulatedSource
from foreshock.collectors.uplink import StreamingUplink, encode_table
from foreshock.service.scoring import NullScorer
from foreshock.service.server import Settings, SettingsError, build_server
from foreshock.service.steps import CloseHold, StepSchedule, StepTracker
from foreshock.v1 import telemetry_pb2 as tpb
from foreshock.v1 import telemetry_pb2_grpc
from support import Clock

S = 1_000_000_000
STEP = 60 * S
B = 29_000_000 * STEP   # a step boundary (Unix ns)
NOW = B                  # the server's clock in the tracker tests (only the unpromised rule reads it)


def _tracker(*nodes_at):
    t = StepTracker(STEP)
    t.closed(B - STEP)   # the scorer has closed everything before the step [B - STEP, B)
    for node, wm in nodes_at:
        t.note(node, wm, NOW)
    return t


def test_a_step_is_complete_when_every_reporting_node_has_promised_past_its_end():
    t = _tracker(("a", B - 30 * S), ("b", B - 30 * S))
    assert t.complete_boundary() is None
    assert t.note("a", B + S, NOW) is False                  # b still owes rows of the step
    assert t.note("b", B - 10 * S, NOW) is False
    assert t.note("b", B - 20 * S, NOW) is False             # a re-sent batch promises nothing new
    assert t.note("b", B, NOW) is True                       # the last one: the caller wakes the round
    assert t.complete_boundary() == B
    assert t.note("a", B + 2 * S, NOW) is False              # said once
    t.closed(B)
    assert t.complete_boundary() is None and t.stats()["boundary_ns"] == B + STEP
    # in the next step a and b already promised into it, and owe its rows
    assert t.stats()["waiting"] == 2
    t.note("a", B + STEP, NOW)
    assert t.note("b", B + STEP + S, NOW) is True and t.complete_boundary() == B + STEP


def test_a_silent_node_holds_the_early_close_back_and_then_no_longer_counts():
    t = _tracker(("a", B - 30 * S), ("dead", B - 30 * S))
    assert t.note("a", B + S, NOW) is False                  # "dead" reported in the step, then stopped
    t.closed(B)                                              # the grace period closed it
    t.note("a", B + 30 * S, NOW)
    assert t.note("a", B + STEP + S, NOW) is True            # dead's watermark is before the open step
    assert t.stats()["waiting"] == 0


def test_a_batch_without_a_watermark_turns_early_closes_off_for_two_steps():
    t = _tracker(("a", B - 30 * S), ("old", B - 30 * S))
    t.note("old", 0, NOW)                                    # an older collector: no promise
    t.note("old", B + S, NOW)
    assert t.note("a", B + S, NOW) is False and t.complete_boundary() is None
    t.closed(B)
    t.note("a", B + STEP + S, NOW + 2 * STEP)                 # two steps later on the server's clock
    assert t.note("old", B + STEP + S, NOW + 2 * STEP) is True


def test_the_tracker_is_bounded_and_waits_to_know_the_open_step():
    t = StepTracker(STEP, max_nodes=2)
    assert t.note("a", B + S, NOW) is False                  # no step open yet: the loop says which
    t.closed(B)
    assert t.stats()["waiting"] == 1
    t.note("b", B + 2 * S, NOW)
    assert t.note("c", B + 3 * S, NOW) is False and t.stats()["untracked_nodes"] == 1
    assert t.stats()["tracked_nodes"] == 2
    for _ in range(12):                                      # silent nodes are forgotten
        t.closed(t.stats()["boundary_ns"])
    assert t.stats()["tracked_nodes"] == 0
    with pytest.raises(ValueError, match="step_ns"):
        StepTracker(0)


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.mark.parametrize("scoring_process", [False, True], ids=["in-process", "worker"])
def test_the_service_closes_a_step_on_the_watermarks_not_after_the_grace_period(tmp_path, scoring_process):
    b = (time.time_ns() // STEP) * STEP - 10 * STEP    # a step boundary ten minutes ago
    clock = Clock(b - 20 * S)                          # the scoring rounds' clock stays before it
    plane = build_server(Settings.insecure_loopback(
        tmp_path / "state", scoring_clock=clock, scorer_grace_seconds=30.0, scoring_process=scoring_process,
        score_interval=0.05))
    plane.start()
    nodes = ["n0", "n1", "n2", "old"]
    ups = {n: StreamingUplink(plane.address, node=n, backoff_initial=0.1).start() for n in nodes}
    cols = {n: Collector(n, [SimulatedSource(n, node_model=SimpleNodeModel(n, gpus=2, hcas=2, seed=i))], None,
                         uplink=ups[n]) for i, n in enumerate(nodes)}

    def sweep(node, ts, next_ts):
        cols[node].sweep_once(ts, next_sweep_ns=next_ts)
        assert _wait(lambda: ups[node].stats()["acked"] >= ups[node].stats()["submitted"], 10)

    try:
        assert _wait(lambda: plane.scoring.steps.stats()["boundary_ns"] is not None)
        assert plane.scoring.steps.stats()["boundary_ns"] == b     # the step [b - 60 s, b) is open
        for n in ("n0", "n1", "n2"):
            sweep(n, b - 50 * S, b - 25 * S)
        for n in ("n0", "n1"):
            sweep(n, b - 25 * S, b + 5 * S)
        time.sleep(0.5)
        assert not plane.nodes.risk and plane.scoring.early_closes == 0   # n2 still owes the step rows
        sweep("n2", b - 25 * S, b + 5 * S)
        assert _wait(lambda: plane.scoring.steps.stats()["boundary_ns"] == b + STEP), plane.scoring.steps.stats()
        assert plane.scoring.early_closes == 1 and clock.now < b   # 50 s before the grace period ends
        assert not plane.nodes.risk        # closed, but a node's first step is not scored (ft.scoreable)
        # the streams were held for the closing round, once, and let go when it had acted
        assert _wait(lambda: not plane.hold.held, 5)
        assert (plane.hold.holds, plane.hold.expired) == (1, 0)
        if not scoring_process:
            assert plane.scorer._online.stats["late_rows"] == 0    # every row of the step was in it

        # The next step: a node whose collector promises nothing keeps it open until the grace period.
        for n in ("n0", "n1", "n2"):
            sweep(n, b + 5 * S, b + 35 * S)
        sweep("old", b + 5 * S, 0)
        for n in ("n0", "n1", "n2"):
            sweep(n, b + 35 * S, b + 65 * S)
        clock.now = b + 40 * S
        time.sleep(0.5)
        assert plane.scoring.early_closes == 1 and plane.scoring.steps.stats()["boundary_ns"] == b + STEP
        assert not plane.nodes.risk
        clock.now = b + STEP + 31 * S                     # now the grace period closes it
        assert _wait(lambda: set(plane.nodes.risk) == {"n0", "n1", "n2"}), plane.scoring.steps.stats()
        assert plane.scoring.steps.stats()["boundary_ns"] == b + 2 * STEP
        assert plane.scoring.early_closes == 1     # "old" (its first step: not scored) kept it open
        assert plane.hold.holds == 1 and not plane.hold.held   # a close by the grace period holds nothing
    finally:
        for u in ups.values():
            u.close(2.0)
        plane.stop(0)


def test_a_watermark_that_is_no_time_the_node_could_mean_is_ignored_and_counted(tmp_path):
    from foreshock.service.ingest import Ingest
    from foreshock.service.nodes import NodeBook
    now = time.time_ns()
    steps = StepTracker(STEP)
    steps.closed((now // STEP) * STEP)
    queued, woken = [], []
    ing = Ingest(NodeBook(), lambda p: queued.append(p) or len(queued), wake=woken.append, steps=steps,
                 clock=lambda: now)
    s = ing.open_session("peer", "*")
    gpu = SimpleNodeModel("n0", gpus=1, hcas=1, seed=0).sample(now)["gpu"]
    buf = encode_table("gpu", gpu)
    ing.accept(s, "n0", "c0", 1, [("gpu", 1, buf)], watermark_ns=now + 3600 * S)   # an hour ahead
    assert ing.bad_watermarks == 1 and steps.stats()["tracked_nodes"] == 0
    assert len(queued) == 1                                   # the rows themselves are taken
    ing.accept(s, "n0", "c0", 2, [("gpu", 1, buf)], watermark_ns=(now // STEP + 1) * STEP + S)
    assert ing.bad_watermarks == 1 and woken == []            # complete, but early closes are off: the
    assert steps.stats()["tracked_nodes"] == 1                # first batch promised nothing


class _Scorer:
    """A PredictorScorer's steps (60 s, a grace period of 0.25 s) without a model."""
    step_ns, grace_ns = STEP, 250_000_000
    model_version, horizon_seconds, manifest = "none", 0, {}


class _Recorder:
    """A pipeline that keeps the drains it is given and never answers (the test plays the worker)."""
    worker = None
    inline = False
    drain_interval = 10.0
    busy = answered = pending = False

    def __init__(self):
        self.drains = []

    def carry(self, name, table):
        return table

    def submit(self, drain):
        self.drains.append(drain)

    def answers(self):
        return []


def _worker_loop(clock):
    """The round scheduler with a pipeline that records, and a function that takes the drains it has
    submitted since the last call."""
    from foreshock.service.rounds import RoundScheduler
    pipeline = _Recorder()
    loop = RoundScheduler(_Scorer(), pipeline, clock=clock)

    def submitted():
        reqs, pipeline.drains = pipeline.drains, []
        return reqs
    return loop, submitted


def test_the_closing_request_takes_the_batches_up_to_the_completing_one_and_drains_follow_the_step():
    clock = Clock(B - 10 * S)
    loop, submitted = _worker_loop(clock)
    loop.run_round()                                   # the first round says which step is open
    (first,) = submitted()
    assert first.score and first.close_ns == B - STEP and loop.steps.boundary_ns == B
    for node in ("a", "b"):
        loop.steps.note(node, B - 30 * S, clock.now)
    loop.enqueue({"gpu": "a-1"})
    loop.run_round()
    assert submitted() == []                           # mid-step: drains keep their interval
    clock.now = B - 300_000_000                         # the step's last half second
    loop.run_round()
    (drain,) = submitted()
    assert not drain.score and drain.items == [{"gpu": "a-1"}]   # drained at once, to keep little for the close
    loop.steps.note("a", B + S, clock.now)              # a is done; one node of two still owes rows
    loop.enqueue({"gpu": "a-2"})
    loop.run_round()
    assert submitted() == []                           # nearly complete: the worker is kept free
    loop.enqueue({"gpu": "b-last"})                     # ingest queues a batch, then notes its watermark
    assert loop.steps.note("b", B + S, clock.now)
    loop.wake("step")
    loop.enqueue({"gpu": "a-next"})                     # after the mark: past the step's end (promised)
    loop.run_round("step")
    (close,) = submitted()
    assert close.score and close.close_ns == B and loop.early_closes == 1
    assert close.items == [{"gpu": "a-2"}, {"gpu": "b-last"}]
    assert list(loop._queue) == [{"gpu": "a-next"}] and loop.steps.boundary_ns == B + STEP


def test_a_step_closed_just_before_its_end_is_not_closed_again_when_its_grace_period_ends():
    clock = Clock(B - 10 * S)
    loop, submitted = _worker_loop(clock)
    loop.run_round()
    submitted()
    clock.now = B - 100_000_000                      # every node's last sweep of the step is in, 0.1 s early
    loop.steps.note("a", B + 900_000_000, clock.now)
    loop.wake("step")
    loop.run_round("step")
    (close,) = submitted()
    assert close.score and close.close_ns == B
    clock.now = B + _Scorer.grace_ns + 50_000_000     # the end of the step's grace period
    loop.run_round()
    assert [r for r in submitted() if r.score] == []   # nothing to close: the step is scored
    clock.now = B + STEP + _Scorer.grace_ns           # the next step's grace period ends, nobody completed it
    loop.run_round()
    (nxt,) = submitted()
    assert nxt.score and nxt.close_ns == B + STEP


def test_the_schedule_closes_by_the_grace_period_or_at_once_when_the_watermarks_complete_the_step():
    grace = 250_000_000
    sched = StepSchedule(STEP, grace)
    assert sched.due(B - 10 * S)              # nothing closed yet: the first round says which step is open
    assert sched.close(B - 10 * S, drained_all=True) == B - STEP
    sched.sent(B - STEP)
    assert sched.tracker.boundary_ns == B and not sched.due(B - S) and sched.next_due_ns(B - S) == B + grace
    assert sched.due(B + grace) and sched.eager(B - S) is None   # before the step's last half second
    sched.tracker.note("a", B - 30 * S, NOW)
    sched.tracker.note("b", B - 30 * S, NOW)
    assert sched.eager(B - S // 4) is True               # the step's last half second, both still owe rows
    sched.tracker.note("a", B + S, NOW)
    assert sched.eager(B - S // 4) is False              # one of two: nearly complete, the pipeline kept free
    sched.completed(queued=7)
    assert sched.tracker.note("b", B + S, NOW) and sched.due(B - S // 4)
    assert sched.batches_now(10, taken=3, due=True) == 4   # the batches queued before the step completed
    assert sched.close(B - S // 4, drained_all=False) == B - STEP and sched.early_closes == 0   # behind: waits
    assert sched.close(B - S // 4, drained_all=True) == B and sched.early_closes == 1
    sched.sent(B)
    assert sched.batches_now(10, taken=3, due=True) == 10 and not sched.due(B + grace)   # not closed again


def test_a_closing_drain_takes_the_closing_steps_rows_first():
    boundary = 1_000 * 60 * 10**9
    ts = np.array([boundary - 5 * 10**9, boundary + 10**9, boundary - 10**9, boundary + 3 * 10**9])
    gpu = pa.table({"ts": pa.array(ts).cast(pa.timestamp("ns", "UTC")), "node": ["n"] * 4, "gpu": [0, 0, 1, 1]})
    inv = pa.table({"ts": pa.array(ts[:1]).cast(pa.timestamp("ns", "UTC")), "node": ["n"]})
    old = pa.table({"ts": pa.array(ts[[0, 2]]).cast(pa.timestamp("ns", "UTC")), "node": ["n", "n"]})
    now, later = StepSchedule.rows_now([("gpu", gpu), ("inventory", inv), ("events", old)], boundary)
    assert [n for n, _ in now] == ["gpu", "inventory", "events"] and [n for n, _ in later] == ["gpu"]
    assert pc.cast(now[0][1].column("ts"), pa.int64()).to_pylist() == [ts[0], ts[2]]   # order kept
    assert pc.cast(later[0][1].column("ts"), pa.int64()).to_pylist() == [ts[1], ts[3]]
    # a scorer without steps (the null scorer): everything at once
    assert StepSchedule.rows_now([("gpu", gpu)], None) == ([("gpu", gpu)], [])


# -- the close hold ----------------------------------------------------------------------------------
@pytest.fixture
def event_loop_thread():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def _bound(hold, loop):
    async def bind():
        hold.bind(asyncio.get_running_loop())
    asyncio.run_coroutine_threadsafe(bind(), loop).result(5)
    return hold


def test_the_close_hold_pauses_waiters_until_released_from_another_thread(event_loop_thread):
    hold = _bound(CloseHold(2.0, resume_seconds=0.02), event_loop_thread)
    assert not hold.held
    asyncio.run_coroutine_threadsafe(hold.wait(), event_loop_thread).result(1)   # not held: at once
    hold.hold()                                      # from this thread, as the scoring thread does
    assert _wait(lambda: hold.held, 2)
    waiter = asyncio.run_coroutine_threadsafe(hold.wait(), event_loop_thread)
    hold.hold()                                      # a second wake for the same close: the same hold
    time.sleep(0.2)
    assert not waiter.done() and hold.holds == 1
    t0 = time.monotonic()
    hold.release()
    waiter.result(2)
    assert 0.015 <= time.monotonic() - t0 < 1.0      # after the resume delay, well before max_seconds
    assert (hold.holds, hold.expired) == (1, 0) and 0.2 <= hold.held_seconds < 1.5
    hold.release()                                   # a release with nothing held changes nothing
    assert not hold.held and hold.holds == 1


def test_a_close_hold_that_is_never_released_runs_out_and_is_counted(event_loop_thread):
    hold = _bound(CloseHold(0.3), event_loop_thread)
    hold.hold()
    assert _wait(lambda: hold.held, 2)
    t0 = time.monotonic()
    asyncio.run_coroutine_threadsafe(hold.wait(), event_loop_thread).result(3)
    assert 0.2 <= time.monotonic() - t0 < 2.0
    assert (hold.holds, hold.expired) == (1, 1) and not hold.held
    hold.hold()                                      # a late release of the first hold does not end the next
    assert _wait(lambda: hold.held, 2)
    hold._call(lambda: hold._release(1))
    time.sleep(0.1)
    assert hold.held and hold.holds == 2


def test_a_close_hold_of_zero_never_holds_and_a_bad_one_is_refused(event_loop_thread, tmp_path):
    off = _bound(CloseHold(0), event_loop_thread)
    off.hold()
    time.sleep(0.1)
    assert not off.held and off.holds == 0
    for bad in (-0.1, float("nan"), 6.0):
        with pytest.raises(ValueError, match="close hold"):
            CloseHold(bad)
        with pytest.raises(SettingsError, match="close_hold_seconds"):
            build_server(Settings.insecure_loopback(tmp_path / "s", scorer=NullScorer(), close_hold_seconds=bad))


def test_held_telemetry_waits_while_an_xid_on_another_stream_is_taken_and_acted_on(tmp_path):
    """A real server: while a close hold is on, a stream's next gpu sweep is not taken (not acked), an
    Xid 95 on another stream is acked and puts its node in alarm, and the release lets the held sweep
    through; the hold's metrics say so."""
    plane = build_server(Settings.insecure_loopback(tmp_path / "state", scorer=NullScorer(), close_hold_seconds=5.0,
                                                    metrics_listen="127.0.0.1:0"))
    plane.start()
    channel = grpc.insecure_channel(plane.address)
    stub = telemetry_pb2_grpc.TelemetryStub(channel)

    def open_stream(node):
        out: queue.Queue = queue.Queue()
        acks: queue.Queue = queue.Queue()
        calls = stub.StreamSweeps(iter(out.get, None), timeout=60)

        def read():
            try:
                for ack in calls:
                    acks.put(ack)
            except grpc.RpcError:
                pass   # the channel closes at the end of the test
        threading.Thread(target=read, daemon=True).start()
        return out, acks, calls

    def batch(node, seq, table, rows):
        return tpb.SweepBatch(node=node, collector_id=f"c-{node}", sequence=seq, tables=[
            tpb.TableRows(table=table, schema_version=1, arrow_ipc=encode_table(table, sch.to_table(table, rows)))])

    def gpu(node):
        return [{"ts": dt.datetime.now(dt.timezone.utc), "node": node, "gpu": 0, "gpu_lost": False}]

    try:
        gpu_out, gpu_acks, gpu_call = open_stream("n1")
        xid_out, xid_acks, xid_call = open_stream("n2")
        gpu_out.put(batch("n1", 1, "gpu", gpu("n1")))
        assert gpu_acks.get(timeout=10).acked_sequence == 1
        plane.hold.hold()                                        # as the scoring loop does when a step is complete
        assert _wait(lambda: plane.hold.held, 5)
        gpu_out.put(batch("n1", 2, "gpu", gpu("n1")))
        xid_out.put(batch("n2", 1, "events", [{
            "ts": dt.datetime.now(dt.timezone.utc), "node": "n2", "kind": "xid", "source": "kmsg",
            "severity": "fatal", "xid": 95, "gpu": 3, "message": "Uncontained: LTC TAG (0x2,0x0)"}]))
        assert xid_acks.get(timeout=10).acked_sequence == 1      # events never wait
        assert _wait(lambda: "n2" in plane.policy.alarms, 10)
        with pytest.raises(queue.Empty):
            gpu_acks.get(timeout=0.5)                            # the gpu sweep waits in its stream
        assert plane.ingest.accepted_batches == 2
        plane.hold.release()
        assert gpu_acks.get(timeout=10).acked_sequence == 2
        assert plane.ingest.accepted_batches == 3
        text = urllib.request.urlopen(f"http://127.0.0.1:{plane.metrics_port}/metrics", timeout=10).read().decode()
        values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                  if line.startswith("foreshock_ingest_close_hold")}
        assert values["foreshock_ingest_close_holds_total"] == 1
        assert values["foreshock_ingest_close_hold_expired_total"] == 0
        assert 0.5 <= values["foreshock_ingest_close_hold_seconds_total"] < 5
        gpu_out.put(None)
        xid_out.put(None)
    finally:
        channel.close()
        plane.stop(0)
