"""Closing a feature step on the collectors' watermarks (service/steps.py): the tracker's rules, the
ingest's check of the watermark, and end to end, a real server whose scorer closes a step as soon as
every node's watermark is past it, well before its grace period ends, and waits when a node promises
nothing."""

from __future__ import annotations

import time

import pytest

from foreshock.collectors.collector import Collector
from foreshock.collectors.simulated import SimpleNodeModel, SimulatedSource
from foreshock.collectors.uplink import StreamingUplink
from foreshock.service.server import Settings, build_server
from foreshock.service.steps import StepTracker

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


class Clock:
    def __init__(self, now):
        self.now = now

    def __call__(self):
        return self.now


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
        assert _wait(lambda: set(plane.nodes.risk) == {"n0", "n1", "n2"}), plane.scoring.steps.stats()
        assert plane.scoring.early_closes == 1 and clock.now < b   # 50 s before the grace period ends
        assert plane.scoring.steps.stats()["boundary_ns"] == b + STEP
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
        assert "old" not in plane.nodes.risk
        clock.now = b + STEP + 31 * S                     # now the grace period closes it
        assert _wait(lambda: "old" in plane.nodes.risk), plane.scoring.steps.stats()
        assert plane.scoring.early_closes == 1
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
    from foreshock.collectors.uplink import encode_table
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

    def next_due_ns(self, now_ns):
        return (now_ns // STEP + 1) * STEP + self.grace_ns

    def step_boundary_ns(self, now_ns):
        return ((now_ns - self.grace_ns) // STEP) * STEP


def test_the_closing_request_takes_the_batches_up_to_the_completing_one_and_drains_follow_the_step():
    from foreshock.service.worker import RemoteScoringLoop
    clock = Clock(B - 10 * S)
    loop = RemoteScoringLoop(_Scorer(), worker=None, clock=clock, drain_interval=10.0)

    def submitted():
        reqs = list(loop._feed_q)
        loop._feed_q.clear()
        loop._busy = False   # no feeder thread here: the test plays the worker's answer
        return reqs

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
