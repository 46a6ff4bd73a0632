"""The evacuation policy over the real store, job directory, node book and decision log: risk arrays in,
directives and logged decisions out (hysteresis, persistence, cool-down, concurrency, spares, blast
radius, fabric incidents, the switch step)."""

from __future__ import annotations

import sqlite3

import numpy as np
import pytest

from foreshock.service.decisions import DecisionLog, incident_rows, read_decisions
from foreshock.service.jobs import JobDirectory, new_directive
from foreshock.service.nodes import FatalEvent, NodeBook, Topology
from foreshock.service.policy import EVIDENCE_REASON, EvacuationPolicy, PolicySettings
from foreshock.service.domain import AckPhase, DirectiveKind, DirectiveState
from foreshock.service.store import StateStore
from support import Clock

S = 1_000_000_000
T0 = 1_800_000_000 * S
NODES = [f"n{i:02d}" for i in range(16)]          # leaves: l0 = n00..n03, l1 = n04..n07, ...


@pytest.fixture
def world(tmp_path):
    clock = Clock(T0)
    store = StateStore(tmp_path / "state.sqlite3", clock=clock)
    jobs = JobDirectory(store, clock=clock)
    nodes = NodeBook()
    for i, n in enumerate(NODES):
        nodes.set_topology(n, Topology(site="s0" if i < 12 else "s1", leaf_switch=f"l{i // 4}"))
        nodes.seen(n, T0)
    decisions = DecisionLog(tmp_path / "decisions", fsync=False, clock=clock)

    def make(**kw):
        return EvacuationPolicy(PolicySettings(**{"threshold": 0.5, "cooldown_seconds": 60, **kw}),
                                nodes, jobs, decisions)
    # job A on n00..n05 (one rank each), spares on three leaves
    jobs.register("A", [(i, NODES[i], [0]) for i in range(6)], ["n03x", "n08", "n12"], current_step=1000)
    store.report_step("A", 1000, 0.5)
    yield clock, store, jobs, nodes, decisions, make
    store.close()


def _risk(values: dict[str, float]) -> np.ndarray:
    return np.array([values.get(n, 0.01) for n in NODES])


def test_risk_alarm_evacuates_to_a_spare_on_another_leaf_at_a_step_ahead(world, tmp_path):
    clock, store, jobs, nodes, decisions, make = world
    policy = make()
    nodes.set_topology("n03x", Topology(site="s0", leaf_switch="l0"))
    (d,) = _round(policy, nodes, clock.now, NODES, _risk({"n01": 0.9}))
    assert (d.kind, d.ranks, d.from_node) == (DirectiveKind.EVACUATE, (1,), "n01")
    assert d.to_node == "n08"                 # other leaf first, then lowest name
    assert d.at_step >= 1000 + 20             # lead 10 s at 0.5 s a step
    assert "risk 0.9 above threshold 0.5" in d.reason
    # The next round, still above: nothing new (one active directive per job and node).
    assert _round(policy, nodes, clock.now + S, NODES, _risk({"n01": 0.95})) == []
    decisions.flush()
    log = read_decisions(tmp_path / "decisions").to_pylist()
    kinds = [r["kind"] for r in log]
    assert kinds == ["alarm", "evacuate"]
    assert log[1]["directive_id"] == d.directive_id and log[1]["to_node"] == "n08"


def test_hysteresis_and_persistence(world):
    clock, store, jobs, nodes, decisions, make = world
    policy = make(sustain_seconds=5, clear_below=0.3)
    assert _round(policy, nodes, clock.now, NODES, _risk({"n02": 0.6})) == []
    assert "n02" in policy.alarms
    # Dips under the threshold but not under clear_below: the alarm holds, and its age counts.
    assert _round(policy, nodes, clock.now + 3 * S, NODES, _risk({"n02": 0.4})) == []
    assert "n02" in policy.alarms
    (d,) = _round(policy, nodes, clock.now + 6 * S, NODES, _risk({"n02": 0.55}))
    assert d.from_node == "n02"
    # A second node that blips above and falls under clear_below never acts.
    assert _round(policy, nodes, clock.now + 7 * S, NODES, _risk({"n02": 0.55, "n04": 0.7})) == []
    assert _round(policy, nodes, clock.now + 8 * S, NODES, _risk({"n02": 0.55, "n04": 0.1})) == []
    assert "n04" not in policy.alarms


def test_risk_alarms_are_counted_once_per_crossing_and_fatal_ones_not_at_all(world):
    clock, store, jobs, nodes, decisions, make = world
    policy = make(clear_below=0.3, sustain_seconds=3600)
    for k, r in enumerate((0.6, 0.4, 0.7, 0.2, 0.8)):       # held through 0.4, cleared at 0.2, raised again
        _round(policy, nodes, clock.now + k * S, NODES, _risk({"n10": r}))
    assert policy.risk_alarms_raised == 2
    nodes.record_fatal(FatalEvent("n11", clock.now + 5 * S, "xid", "Xid 79 on GPU 3", clock.now + 5 * S))
    _round(policy, nodes, clock.now + 6 * S, NODES, _risk({"n10": 0.8}))
    assert "n11" in policy.alarms and policy.risk_alarms_raised == 2
    assert policy.alarms_raised == {"risk": 2, "hard_evidence": 0} and policy.alarms["n11"].cause == "fatal"


def test_hard_evidence_alarms_whatever_the_risk_and_holds_while_it_lasts(world, tmp_path):
    clock, store, jobs, nodes, decisions, make = world
    policy = make(clear_below=0.3)
    low = _risk({})
    why = {"n01": "NVLink links down on the worst GPU: 1 links now"}
    nodes.update_risk(NODES, low, [[] for _ in NODES], clock.now)
    (d,) = policy.evaluate(clock.now, NODES, low, why)
    assert d.from_node == "n01" and d.reason == "hard evidence: " + why["n01"]
    assert policy.risk_alarms_raised == 1 and policy.alarms_raised == {"risk": 0, "hard_evidence": 1}
    # the risk stays under clear_below: the alarm holds while the evidence does, and clears after
    policy.evaluate(clock.now + S, NODES, low, why)
    assert policy.alarms["n01"].evidence
    policy.evaluate(clock.now + 2 * S, NODES, low, {})
    assert "n01" not in policy.alarms
    decisions.flush()
    log = read_decisions(tmp_path / "decisions").to_pylist()
    assert [r["kind"] for r in log if r["node"] == "n01"][:1] == ["alarm"]
    assert log[0]["reason"] == "hard evidence: " + why["n01"]
    assert [r["kind"] for r in log][-1] == "cleared"
    # the same alarm decided by a shard and forwarded (the jobs coordinator's policy): its reason is kept
    jobs.register("B", [(0, "n09", [0])], ["n13"], current_step=10)
    policy.raise_alarm("n09", clock.now + 3 * S, 0.01, EVIDENCE_REASON + why["n01"] + " (shard s1)")
    (d,) = policy.evaluate(clock.now + 3 * S)
    assert d.from_node == "n09" and d.reason == EVIDENCE_REASON + why["n01"] + " (shard s1)"


def test_a_threshold_at_its_cap_is_reached_by_no_risk_and_hard_evidence_still_alarms(world):
    clock, store, jobs, nodes, decisions, make = world
    policy = make(threshold=1.0)
    saturated = _risk({"n01": 1.0, "n02": 1.0})
    nodes.update_risk(NODES, saturated, [[] for _ in NODES], clock.now)
    policy.evaluate(clock.now, NODES, saturated, {"n02": "PCIe lanes below the link's maximum width: 8 lanes now"})
    assert sorted(policy.alarms) == ["n02"] and policy.alarms["n02"].evidence


def test_max_concurrent_then_cooldown(world):
    clock, store, jobs, nodes, decisions, make = world
    policy = make()
    ds = _round(policy, nodes, clock.now, NODES, _risk({"n00": 0.9, "n04": 0.8}))
    assert [d.from_node for d in ds] == ["n00"]          # the riskiest first; limit 1 per job
    assert [r["kind"] for r in decisions.buffered()][-1] == "deferred_max_concurrent"
    # The first completes; the second is issued in the next round.
    clock.now += S
    jobs.ack("A", ds[0].directive_id, 0, AckPhase.COMPLETED, "", 1.0)
    (d2,) = _round(policy, nodes, clock.now, NODES, _risk({"n00": 0.9, "n04": 0.8}))
    assert d2.from_node == "n04"
    jobs.ack("A", d2.directive_id, 4, AckPhase.FAILED, "spare died", 1.0)
    # n04 failed over; it is still hot but in cool-down (60 s) after its last directive.
    clock.now += 10 * S
    assert _round(policy, nodes, clock.now, NODES, _risk({"n04": 0.8})) == []
    assert decisions.buffered()[-1]["kind"] == "cooldown"
    clock.now += 61 * S
    (d3,) = _round(policy, nodes, clock.now, NODES, _risk({"n04": 0.8}))
    assert d3.from_node == "n04" and d3.directive_id != d2.directive_id


def test_fatal_event_acts_at_once_and_ignores_cooldown(world):
    clock, store, jobs, nodes, decisions, make = world
    policy = make(sustain_seconds=30)
    nodes.record_fatal(FatalEvent("n05", clock.now, "xid", "Xid 79 on GPU 3", clock.now))
    (d,) = _round(policy, nodes, clock.now, NODES, _risk({}))
    assert d.from_node == "n05" and "fatal Xid 79 on GPU 3" in d.reason
    rows = incident_rows(read_decisions_buffer(decisions))
    assert rows.column("category").to_pylist() == ["fatal_event"]


def test_a_directive_decided_before_a_move_completed_is_not_issued_after_it(world):
    """A round reads the jobs, then the active directives: a move that completes in between leaves the
    round a placement with the rank still on the failed node and no active directive for it. The
    store refuses a directive decided on a placement that has since changed (its generation), so the
    rank that already left is not evacuated again, and the next round decides on the new placement."""
    clock, store, jobs, nodes, decisions, make = world
    policy = make(sustain_seconds=30)
    nodes.record_fatal(FatalEvent("n05", clock.now, "xid", "Xid 79 on GPU 3", clock.now))
    before = store.job("A")                                   # what a round read first
    (d,) = _round(policy, nodes, clock.now, NODES, _risk({}))
    jobs.ack("A", d.directive_id, 5, AckPhase.COMPLETED, "", 1.0)
    heard = []
    jobs.subscribe("A", heard.append)
    late = new_directive(before, kind=DirectiveKind.EVACUATE, ranks=(5,), from_node="n05", to_node="n12",
                         at_step=1020, now_ns=clock.now, deadline_seconds=60, reason="fatal", risk=1.0,
                         signals=(), origin="policy")
    assert jobs.issue(late) == (None, False)
    assert heard == [] and [x.directive_id for x in store.directives()] == [d.directive_id]
    # the fatal alarm stands, and rounds on the new placement issue nothing: n05 runs no rank now
    clock.now += 61 * S
    assert _round(policy, nodes, clock.now, NODES, _risk({})) == []


def read_decisions_buffer(decisions):
    import pyarrow as pa

    from foreshock.service.decisions import DECISION_SCHEMA
    return pa.Table.from_pylist(decisions.buffered(), schema=DECISION_SCHEMA)


def test_spares_skip_suspect_leaves_risky_stale_and_busy_nodes(world):
    clock, store, jobs, nodes, decisions, make = world
    policy = make()
    # Two alarmed nodes under l2 make it suspect: spare n08 (on l2) is refused; n12 is risky; n03x stale.
    nodes.set_topology("n03x", Topology(site="s0", leaf_switch="l0"))
    nodes.seen("n03x", clock.now - 120 * S)
    risk = _risk({"n01": 0.9, "n09": 0.9, "n10": 0.9, "n12": 0.45})
    (d,) = _round(policy, nodes, clock.now, NODES, risk)
    assert d.from_node == "n01" and d.kind == DirectiveKind.CHECKPOINT_EXIT, (d.to_node, d.reason)
    assert "n08: under suspect leaf l2" in d.reason and "n12: risk 0.45" in d.reason
    assert "n03x: telemetry stale" in d.reason


def test_a_fault_spanning_a_leaf_is_a_fabric_incident_not_four_evacuations(world, tmp_path):
    clock, store, jobs, nodes, decisions, make = world
    policy = make()
    risk = _risk({"n00": 0.9, "n01": 0.9, "n02": 0.8, "n03": 0.85})
    assert _round(policy, nodes, clock.now, NODES, risk) == []
    assert ("leaf_switch", "l0") in policy.incidents
    assert store.directives() == []
    kinds = [r["kind"] for r in decisions.buffered()]
    assert "fabric_incident" in kinds and "held_fabric_incident" in kinds
    # It clears when the leaf recovers.
    _round(policy, nodes, clock.now + S, NODES, _risk({}))
    assert policy.incidents == {}
    assert decisions.buffered()[-1]["kind"] == "fabric_incident_cleared" or \
        "fabric_incident_cleared" in [r["kind"] for r in decisions.buffered()]
    decisions.flush()
    inc = incident_rows(read_decisions(tmp_path / "decisions"))
    (row,) = inc.to_pylist()
    assert row["scope"] == "switch" and sorted(row["affected_nodes"]) == ["n00", "n01", "n02", "n03"]


def test_drain_ignores_limits_and_is_idempotent(world):
    clock, store, jobs, nodes, decisions, make = world
    policy = make()
    (a,) = policy.drain("n02", "bios update", clock.now)
    (b,) = policy.drain("n03", "bios update", clock.now)   # over max_concurrent: an operator's call
    assert a.directive_id != b.directive_id and {a.to_node, b.to_node} == {"n08", "n12"}
    assert a.to_node != b.to_node                            # one spare never takes two evacuations
    (again,) = policy.drain("n02", "", clock.now)
    assert again.directive_id == a.directive_id
    assert len(store.directives(active_only=True)) == 2
    assert store.directive(a.directive_id).state == DirectiveState.PENDING


def test_policy_settings_are_checked():
    with pytest.raises(ValueError, match="threshold"):
        PolicySettings(threshold=1.5)
    with pytest.raises(ValueError, match="clear_below"):
        PolicySettings(threshold=0.4, clear_below=0.6)


def _round(policy, nodes, now, names, risk):
    """What the server does after a scoring round: publish the risk, then run the policy."""
    nodes.update_risk(names, risk, [[] for _ in names], now)
    return policy.evaluate(now, names, risk)


def test_a_rounds_directives_are_one_commit_and_announced_only_after_it(world):
    clock, store, jobs, nodes, decisions, make = world
    jobs.register("B", [(0, "n09", [0])], ["n13"], current_step=10)
    policy = make(default_max_concurrent=4)
    heard, commits = [], []
    jobs.subscribe("A", lambda d: heard.append((d.from_node, store._depth)))
    jobs.subscribe("B", lambda d: heard.append((d.from_node, store._depth)))
    store._db.set_trace_callback(lambda sql: commits.append(sql) if sql == "COMMIT" else None)
    issued = _round(policy, nodes, clock.now, NODES, _risk({"n01": 0.9, "n02": 0.8, "n09": 0.7}))
    store._db.set_trace_callback(None)
    assert sorted(d.from_node for d in issued) == ["n01", "n02", "n09"]
    assert len(commits) == 1                               # one fsync for the round, not three
    assert sorted(heard) == [("n01", 0), ("n02", 0), ("n09", 0)]   # heard after the commit


def test_a_batch_that_fails_stores_and_announces_nothing(world):
    clock, store, jobs, nodes, decisions, make = world
    heard = []
    jobs.subscribe("A", heard.append)
    job = store.job("A")
    with pytest.raises(RuntimeError, match="disk gone"):
        with jobs.issuing():
            jobs.issue(new_directive(job, kind=DirectiveKind.EVACUATE, ranks=(1,), from_node="n01", to_node="n08",
                                     at_step=1020, now_ns=clock.now, deadline_seconds=60, reason="test", risk=0.9,
                                     signals=(), origin="policy"))
            raise RuntimeError("disk gone")
    assert heard == [] and store.directives() == []
    # a failed write inside a batch undoes only itself (a savepoint); the batch goes on
    with jobs.issuing():
        with pytest.raises(sqlite3.IntegrityError):
            with store._tx() as db:
                db.execute("INSERT INTO jobs VALUES ('A', 1, '[]', 0, 0, 0, 0, 0, 0)")   # A exists
        stored, created = jobs.issue(new_directive(
            job, kind=DirectiveKind.EVACUATE, ranks=(1,), from_node="n01", to_node="n08", at_step=1020,
            now_ns=clock.now, deadline_seconds=60, reason="test", risk=0.9, signals=(), origin="policy"))
    assert created and [x.directive_id for x in heard] == [stored.directive_id]
    assert [x.directive_id for x in store.directives()] == [stored.directive_id]
