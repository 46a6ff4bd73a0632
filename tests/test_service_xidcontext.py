"""Xids read in context (service/xidcontext.py): replayed kernel logs of the documented cases through real
collectors (the kmsg source over per-node log files, the streaming uplink) into a real control plane on a
loopback port, and the policy's decisions on its own clock: the same Xid on many nodes of one job or
NVLink domain at its end is one job event and alarms no node; alone on one node it alarms that node,
at most a window later; Xids that are never collateral act at once; 162 cancels an outstanding 163."""

from __future__ import annotations

import functools
import json
import time

import grpc
import pytest
from prometheus_client import generate_latest

from foreshock import schema as sch
from foreshock import xid as xidcat
from foreshock.collectors.collector import Collector
from foreshock.collectors.kmsg import KmsgSource
from foreshock.collectors.uplink import StreamingUplink
from foreshock.service import xidcontext
from foreshock.service.decisions import DecisionLog, read_decisions
from foreshock.service.ingest import Ingest
from foreshock.service.jobs import JobDirectory
from foreshock.service.nodes import NodeBook, Topology
from foreshock.service.policy import EvacuationPolicy, PolicySettings
from foreshock.service.scoring import NullScorer
from foreshock.service.server import Settings, SettingsError, build_server
from foreshock.service.store import StateStore
from foreshock.service.xidcontext import need
from foreshock.v1 import jobs_pb2 as jpb
from foreshock.v1 import jobs_pb2_grpc
from support import Clock, wait_until

T = 10
S = 1_000_000_000


_wait = functools.partial(wait_until, timeout=30.0)


def _xid(pci: str, code: int, message: str, pid: int = 4242) -> str:
    return f"NVRM: Xid (PCI:{pci}): {code}, pid={pid}, name=python3, {message}"


class Nodes:
    """One real collector per node: the kmsg source over the node's kernel log, streaming to the plane."""

    def __init__(self, tmp_path, address, names, boot_ns):
        self.tmp_path, self.boot_ns = tmp_path, boot_ns
        self.collectors = {}
        for node in names:
            (tmp_path / f"{node}.log").write_text("")
            up = StreamingUplink(address, node=node, backoff_initial=0.1, ack_timeout=15).start()
            self.collectors[node] = Collector(node, [KmsgSource(node, path=str(tmp_path / f"{node}.log"),
                                                                boot_ns=boot_ns)], None, uplink=up)

    def log(self, node: str, uptime_s: float, message: str) -> None:
        with open(self.tmp_path / f"{node}.log", "a") as fh:
            fh.write(f"[{uptime_s:12.6f}] {message}\n")

    def sweep(self) -> None:
        ts = time.time_ns()
        for c in self.collectors.values():
            c.sweep_once(ts)

    def close(self) -> None:
        for c in self.collectors.values():
            c.close()
            c.uplink.close(1.0)


@pytest.fixture
def plane_settings():
    return {"scorer": NullScorer(), "decision_flush_seconds": 0.0}


def _decisions(plane) -> list[dict]:
    plane.decisions.flush()
    return read_decisions(plane.state_dir / "decisions").to_pylist()


def _job_events(plane) -> list[dict]:
    return [r for r in _decisions(plane) if r["kind"] == "xid_job_event"]


def test_teardown_of_a_77_node_job_is_one_job_event_per_xid_and_the_same_xid_alone_alarms(plane, tmp_path):
    # GB300 NVL72: one crashed multi-node job; its 77 healthy nodes in 11 racks log Xid 45 at teardown,
    # and (the harder case) Xid 79 as well, all within 2 s. Then Xid 79 alone on a node of another job.
    big = [f"rack{n % 11:02d}-node{n:03d}" for n in range(77)]
    small, spare = ["small-0", "small-1"], "spare-0"
    boot = time.time_ns() - 1000 * S
    with grpc.insecure_channel(plane.address) as ch:
        jobs = jobs_pb2_grpc.JobsStub(ch)
        jobs.RegisterJob(jpb.RegisterJobRequest(
            job_id="crashed", ranks=[jpb.RankPlacement(rank=i, node=n, gpus=[0]) for i, n in enumerate(big)]),
            timeout=T)
        jobs.RegisterJob(jpb.RegisterJobRequest(
            job_id="small", ranks=[jpb.RankPlacement(rank=i, node=n, gpus=[0]) for i, n in enumerate(small)],
            spare_nodes=[spare], current_step=10), timeout=T)
        nodes = Nodes(tmp_path, plane.address, big + small + [spare], boot)
        try:
            for i, node in enumerate(big):
                t = 990 + i * 0.02
                nodes.log(node, t, _xid("0000:07:00", 45, "Ch 00000001 caused by previous Xid 79", pid=1000 + i))
                nodes.log(node, t + 0.001, _xid("0000:07:00", 79, "GPU has fallen off the bus."))
            nodes.sweep()
            assert _wait(lambda: len(_job_events(plane)) == 2)
            events = {json.loads(r["details"])["xid"]: r for r in _job_events(plane)}
            assert set(events) == {45, 79}
            for ev in events.values():
                assert (ev["job"], ev["scope"], sorted(ev["nodes"])) == ("crashed", "job", sorted(big))
            assert plane.policy.alarms == {} and not plane.nodes.fatal
            assert plane.jobs.list("crashed") == []
            assert not [r for r in _decisions(plane) if r["kind"] == "alarm"]
            # The same Xid alone on one node is that node's fault: alarmed, its rank evacuated.
            nodes.log("small-0", 1000, _xid("0000:07:00", 79, "GPU has fallen off the bus."))
            nodes.log("small-0", 1000.001, "NVRM: The NVIDIA GPU 0000:07:00.0 (PCI ID: 10de:2330) installed in "
                                           "this system has fallen off the bus and is not responding to commands.")
            nodes.sweep()
            assert _wait(lambda: plane.jobs.list("small"))
            (d,) = plane.jobs.list("small")
        finally:
            nodes.close()
    assert (d.from_node, d.to_node) == ("small-0", spare)
    assert d.reason in ("fatal Xid 79 on 0000:07:00.0", "fatal gpu lost on 0000:07:00.0")  # the later line names it
    assert set(plane.policy.alarms) == {"small-0"} and len(_job_events(plane)) == 2
    text = generate_latest(plane.registry).decode()
    assert 'foreshock_xid_job_events_total{xid="79"} 1.0' in text and \
        'foreshock_xid_job_events_total{xid="45"} 1.0' in text
    assert 'foreshock_xid_context_sightings_total{outcome="job_event"} 154.0' in text
    assert 'foreshock_xid_context_sightings_total{outcome="node_fault"} 2.0' in text


def test_a_fatal_xid_that_is_never_collateral_acts_at_once_and_a_lone_collateral_one_a_window_later(tmp_path):
    plane = build_server(Settings.insecure_loopback(tmp_path, scorer=NullScorer(), score_interval=30.0,
                                                    policy={"xid_context_seconds": 2.0}))
    plane.start()
    try:
        plane.jobs.register("j", [(0, "n1", [0]), (1, "n2", [0])], [])   # n2 could be one node of its job's many
        nodes = Nodes(tmp_path, plane.address, ["n1", "n2"], time.time_ns() - 1000 * S)
        try:
            nodes.log("n1", 999, _xid("0000:07:00", 95, "Uncontained: LTC TAG (0x2,0x0). RST: Yes, D-RST: No"))
            nodes.log("n2", 999, _xid("0000:07:00", 74, "NVLink: fatal error detected on link 7(0x10000, 0x0)"))
            nodes.sweep()
            # The scoring interval is 30 s: the events round comes at once, the window's round when it ends
            # (the policy's own clock shows the wait: test_too_few_nodes_..._waits_no_longer_than_the_window).
            assert _wait(lambda: "n1" in plane.policy.alarms, timeout=5)
            assert _wait(lambda: "n2" in plane.policy.alarms, timeout=10)
        finally:
            nodes.close()
    finally:
        plane.stop(0)
    assert "Xid 95" in plane.policy.alarms["n1"].reason and "Xid 74" in plane.policy.alarms["n2"].reason


@pytest.mark.parametrize("cols, reason, column", [
    ({"occurrences": -3}, "negative_counter", "occurrences"),
    ({"occurrences": 2, "last_ts": 400 * 86_400 * S}, "ts_future", "last_ts"),
])
def test_a_folded_row_with_an_impossible_count_or_time_is_refused_by_name(plane, cols, reason, column):
    import queue

    from foreshock.collectors.uplink import encode_table
    from foreshock.v1 import telemetry_pb2 as tpb, telemetry_pb2_grpc

    now = time.time_ns()
    if "last_ts" in cols:
        cols = {**cols, "last_ts": now + cols["last_ts"]}
    ev = sch.to_table("events", [{"ts": now, "node": "n1", "kind": "xid", "source": "kmsg", "severity": "fatal",
                                  "xid": 95, "gpu": 0, "message": "Uncontained", **cols}])
    outgoing: queue.Queue = queue.Queue()
    outgoing.put(tpb.SweepBatch(node="n1", collector_id="c1", sequence=1, tables=[
        tpb.TableRows(table="events", schema_version=1, arrow_ipc=encode_table("events", ev))]))

    def requests():
        while (item := outgoing.get()) is not None:
            yield item
    rejections = []
    with grpc.insecure_channel(plane.address) as ch:
        for ack in telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(requests(), timeout=T):
            rejections += [(r.reason, r.detail) for r in ack.rejections]
            if ack.acked_sequence == 1:    # a heartbeat carries what the round's value checks found
                outgoing.put(tpb.SweepBatch(node="n1", collector_id="c1", sequence=2))
            else:
                outgoing.put(None)
    ((got, detail),) = rejections
    assert got == reason and column in detail
    assert plane.policy.alarms == {} and plane.ingest.accepted_rows.get("events", 0) == 0


def test_an_older_collectors_events_without_the_folding_columns_are_taken(plane):
    """Schema v1 before `occurrences`, `first_ts` and `last_ts`: the batch is conformed, not refused."""
    import pyarrow as pa

    from foreshock.v1 import telemetry_pb2 as tpb, telemetry_pb2_grpc

    new = sch.schema("events")
    old = pa.schema([f for f in new if f.name not in ("occurrences", "first_ts", "last_ts")], metadata=new.metadata)
    ev = pa.Table.from_pylist([{"ts": time.time_ns(), "node": "n1", "kind": "xid", "source": "kmsg",
                                "severity": "fatal", "xid": 95, "gpu": 0, "message": "Uncontained"}], schema=old)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ev.schema) as w:
        w.write_table(ev)
    batch = tpb.SweepBatch(node="n1", collector_id="old", sequence=1, tables=[
        tpb.TableRows(table="events", schema_version=1, arrow_ipc=sink.getvalue().to_pybytes())])
    with grpc.insecure_channel(plane.address) as ch:
        (ack,) = list(telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(iter([batch]), timeout=T))
    assert ack.acked_sequence == 1 and not ack.rejections
    assert "n1" in plane.policy.alarms and plane.ingest.accepted_rows["events"] == 1


def test_a_batch_with_an_undecided_collateral_xid_is_not_saved_as_taken_until_it_is_decided(tmp_path):
    """Were its sequence saved while its Xid waits, a service killed in the window would, after the
    restart, refuse the collector's re-sent batch as a duplicate and lose the Xid."""
    from foreshock.service import store as store_mod
    from foreshock.v1 import telemetry_pb2 as tpb, telemetry_pb2_grpc
    from foreshock.collectors.uplink import encode_table

    clock = Clock(time.time_ns())
    plane = build_server(Settings.insecure_loopback(tmp_path, scorer=NullScorer(), scoring_clock=clock))
    plane.jobs.register("J", [(0, "n1", [0]), (1, "n2", [0])], [])
    plane.start()
    try:
        ev = sch.to_table("events", [{"ts": clock.now, "node": "n1", "kind": "xid", "source": "kmsg",
                                      "severity": "fatal", "xid": 79, "gpu": 0}])
        batch = tpb.SweepBatch(node="n1", collector_id="c1", sequence=1, tables=[
            tpb.TableRows(table="events", schema_version=1, arrow_ipc=encode_table("events", ev))])
        with grpc.insecure_channel(plane.address) as ch:
            stream = telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(iter([batch]), timeout=30)
            assert _wait(lambda: plane.ingest.accepted_rows["events"] == 1 and plane.policy.context.pending() == 1)
            taken_at = time.monotonic()
            assert _wait(lambda: plane.sequences_saved_at > taken_at)   # a save ran while it waits ...
            assert plane.policy.context.pending() == 1
            assert store_mod.load_sequences(plane.store).get("c1", 0) == 0   # ... and did not record it
            clock.now += int(plane.policy.settings.xid_context_seconds * S)   # its window ends: decided
            assert _wait(lambda: "n1" in plane.policy.alarms)
            decided_at = time.monotonic()
            assert _wait(lambda: plane.sequences_saved_at > decided_at)
            assert store_mod.load_sequences(plane.store)["c1"] == 1
            assert [a.acked_sequence for a in stream] == [1]
    finally:
        plane.stop(0)


def test_a_job_event_still_open_when_the_service_stops_is_recorded(tmp_path):
    plane = build_server(Settings.insecure_loopback(tmp_path, scorer=NullScorer()))
    plane.jobs.register("J", [(i, f"n{i}", [0]) for i in range(4)], [])
    now = time.time_ns()
    plane.ingest.act_on_events({"events": sch.to_table("events", [
        {"ts": now, "node": f"n{i}", "kind": "xid", "source": "kmsg", "severity": "fatal", "xid": 79, "gpu": 0}
        for i in range(4)])}, now=now)
    plane.policy.evaluate(now)               # declared; it would close a window after its last node
    assert plane.policy.context.job_events == {79: 1} and plane.policy.context.busy()
    plane.stop(0)
    (row,) = [r for r in read_decisions(tmp_path / "decisions").to_pylist() if r["kind"] == "xid_job_event"]
    assert (row["job"], sorted(row["nodes"])) == ("J", ["n0", "n1", "n2", "n3"])


def test_the_xid_context_settings_are_range_checked(tmp_path):
    for bad in ({"xid_context_seconds": -1}, {"xid_context_seconds": 61}, {"xid_context_min_nodes": 1},
                {"xid_context_fraction": 0}, {"xid_context_fraction": 1.5}):
        with pytest.raises(SettingsError, match=f"policy {next(iter(bad))}"):
            build_server(Settings.insecure_loopback(tmp_path, scorer=NullScorer(), policy=bad))


# -- the policy on its own clock ------------------------------------------------------------------------

T0 = 1_800_000_000 * S


@pytest.fixture
def world(tmp_path):
    clock = Clock(T0)
    store = StateStore(tmp_path / "state.sqlite3", clock=clock)
    jobs = JobDirectory(store, clock=clock)
    nodes = NodeBook()
    decisions = DecisionLog(tmp_path / "decisions", fsync=False, clock=clock)
    policy = EvacuationPolicy(PolicySettings(threshold=0.5), nodes, jobs, decisions)
    ingest = Ingest(nodes, sink=lambda p: 0, context=policy.context)

    def events(rows):
        ingest.act_on_events({"events": sch.to_table("events", [
            {"node": "n", "source": "kmsg", "kind": "xid", "gpu": 0, **r} for r in rows])}, now=clock.now)
        return policy.evaluate(clock.now)
    yield clock, store, jobs, nodes, decisions, policy, events
    store.close()


def test_an_nvlink_domain_losing_its_links_at_once_is_one_event_of_the_domain(world):
    # An NVL72 domain: 18 trays; a failure of the domain puts Xid 149 Fatal on every tray at once.
    clock, _, _, nodes, decisions, policy, events = world
    trays = [f"nvl72a-tray{i:02d}" for i in range(18)]
    for n in trays:
        nodes.set_topology(n, Topology(leaf_switch="leaf-1", nvlink_domain="nvl72-a"))
    msg = "NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x025001c6 0x0 0x0 0x0 0x0 0x0)"
    events([{"node": n, "ts": T0 + i * S // 10, "xid": 149, "severity": xidcat.severity(149, msg), "message": msg}
            for i, n in enumerate(trays)])
    assert policy.alarms == {} and not nodes.fatal
    clock.now += 6 * S
    policy.evaluate(clock.now)
    clock.now += 6 * S
    policy.evaluate(clock.now)
    (ev,) = [r for r in decisions.buffered() if r["kind"] == "xid_job_event"]
    assert (ev["scope"], sorted(ev["nodes"])) == ("nvlink_domain", trays) and policy.alarms == {}


def test_a_job_that_deregistered_before_its_teardown_xids_still_scopes_them(world):
    clock, _, jobs, nodes, decisions, policy, events = world
    jobs.register("J", [(i, f"n{i}", [0]) for i in range(6)], [])
    jobs.deregister("J")        # the job ends and says so; its nodes' teardown Xids come after
    clock.now += 2 * S
    events([{"node": f"n{i}", "ts": clock.now + i * S // 10, "xid": 79, "severity": "fatal"} for i in range(4)])
    clock.now += 6 * S
    policy.evaluate(clock.now)
    assert policy.alarms == {} and policy.context.job_events[79] == 1
    # Past the job's memory, the same Xids are each node's fault.
    clock.now += int(xidcontext.JOB_MEMORY_SECONDS * S)
    events([{"node": f"n{i}", "ts": clock.now + i * S // 10, "xid": 79, "severity": "fatal"} for i in range(4)])
    clock.now += 6 * S
    policy.evaluate(clock.now)
    assert set(policy.alarms) == {"n0", "n1", "n2", "n3"}


def test_too_few_nodes_of_a_big_job_are_each_a_fault_and_a_lone_one_waits_no_longer_than_the_window(world):
    clock, _, jobs, nodes, _, policy, events = world
    jobs.register("big", [(i, f"n{i:03d}", [0]) for i in range(100)], [])
    assert [need(s, 3, 0.25) for s in (0, 2, 4, 8, 12, 100)] == [3, 2, 2, 2, 3, 3]
    window = int(policy.settings.xid_context_seconds * S)
    events([{"node": "n000", "ts": clock.now, "xid": 79, "severity": "fatal"},
            {"node": "n001", "ts": clock.now, "xid": 79, "severity": "fatal"}])
    start = clock.now
    clock.now = start + window - 1
    policy.evaluate(clock.now)
    assert policy.alarms == {} and policy.context.next_deadline_ns() == start + window
    clock.now = start + window
    policy.evaluate(clock.now)
    assert set(policy.alarms) == {"n000", "n001"} and policy.context.job_events[79] == 0


def test_a_different_xid_on_the_culprit_is_its_fault_while_its_peers_collateral_ones_are_the_jobs(world):
    # The job crashed because one GPU fell off the bus; its peers log Xid 74 (their NVLink to it broke).
    clock, _, jobs, _, _, policy, events = world
    jobs.register("J", [(i, f"n{i}", [0]) for i in range(8)], [])
    events([{"node": "n0", "ts": clock.now, "xid": 79, "severity": "fatal"}]
           + [{"node": f"n{i}", "ts": clock.now + S // 2, "xid": 74, "severity": "fatal"} for i in range(1, 8)])
    clock.now += 6 * S
    policy.evaluate(clock.now)
    assert set(policy.alarms) == {"n0"} and policy.context.job_events == {74: 1}


def test_a_collateral_xid_on_a_node_in_no_job_and_no_domain_does_not_wait(world):
    clock, _, jobs, nodes, _, policy, events = world
    jobs.register("J", [(0, "n0", [0]), (1, "n1", [0])], [])
    nodes.set_topology("hgx-1", Topology(nvlink_domain="hgx-1"))   # an NVLink domain of one node
    events([{"node": "n0", "ts": clock.now, "xid": 79, "severity": "fatal"},
            {"node": "loner", "ts": clock.now, "xid": 79, "severity": "fatal"},
            {"node": "hgx-1", "ts": clock.now, "xid": 79, "severity": "fatal"}])
    assert set(policy.alarms) == {"loner", "hgx-1"} and policy.context.pending() == 1


def test_never_collateral_fatal_xids_on_many_nodes_at_once_each_alarm_at_once(world):
    clock, _, jobs, _, _, policy, events = world
    jobs.register("J", [(i, f"n{i}", [0]) for i in range(8)], [])
    assert not xidcat.lookup(95).collateral and not xidcat.lookup(48).collateral
    events([{"node": f"n{i}", "ts": clock.now, "xid": 95, "severity": "fatal"} for i in range(8)])
    assert set(policy.alarms) == {f"n{i}" for i in range(8)}


def test_pending_sightings_are_bounded_and_the_oldest_acts_when_there_is_no_room(world, monkeypatch):
    clock, _, jobs, nodes, _, policy, events = world
    jobs.register("J", [(i, f"n{i}", [0]) for i in range(40)], [])
    monkeypatch.setattr(xidcontext, "MAX_PENDING", 3)
    # minutes apart in kernel time: no job event; each waits for its window
    events([{"node": f"n{i}", "ts": clock.now - (5 - i) * 60 * S, "xid": 79, "severity": "fatal"} for i in range(5)])
    assert policy.context.pending() == 3 and policy.context.overflow == 2
    assert set(policy.alarms) == {"n0", "n1"}      # the oldest, at once: nothing waits without bound


def test_xid_162_cancels_an_outstanding_163_in_time_order(world):
    clock, _, _, _, _, policy, events = world
    ctx = policy.context
    events([{"ts": T0, "xid": 163, "severity": "info", "pci_bus_id": "0000:07:00.0", "message": "PSHC disengaged"}])
    assert [(n, d, c) for n, d, c, _ in ctx.outstanding()] == [("n", "0000:07:00.0", 163)]
    events([{"ts": T0 + 2 * S, "xid": 162, "severity": "info", "pci_bus_id": "0000:07:00.0"}])
    assert ctx.outstanding() == []
    # A folded count of 163 whose last line came before the 162 arrives late: it does not reopen it.
    events([{"ts": T0 + 60 * S, "xid": 163, "severity": "info", "pci_bus_id": "0000:07:00.0", "occurrences": 4,
             "first_ts": T0 + S // 2, "last_ts": T0 + S}])
    assert ctx.outstanding() == []
    # A 163 after the 162 is outstanding again; on another GPU the 162 cancels nothing.
    events([{"ts": T0 + 70 * S, "xid": 163, "severity": "info", "pci_bus_id": "0000:07:00.0"},
            {"ts": T0 + 71 * S, "xid": 162, "severity": "info", "pci_bus_id": "0000:08:00.0"}])
    assert [c for _, _, c, _ in ctx.outstanding()] == [163]
    assert policy.alarms == {}     # info: no alarm either way


FATAL = sorted(c for c, e in xidcat.CATALOGUE.items() if e.severity == "fatal" or e.token)


@pytest.mark.parametrize("code", FATAL)
def test_every_fatal_xid_alone_alarms_its_node_at_most_a_window_later(world, code):
    clock, _, jobs, _, _, policy, events = world
    jobs.register("J", [(i, f"n{i}", [0]) for i in range(8)], [])
    msg = "X Fatal XC0 i0 Link 00" if xidcat.lookup(code).token else "boom"
    events([{"node": "n3", "ts": clock.now, "xid": code, "severity": xidcat.severity(code, msg), "message": msg}])
    waits = xidcat.lookup(code).collateral
    assert ("n3" in policy.alarms) is not waits
    clock.now += int(policy.settings.xid_context_seconds * S)
    policy.evaluate(clock.now)
    assert set(policy.alarms) == {"n3"}


@pytest.mark.parametrize("code", FATAL)
def test_every_fatal_xid_on_half_a_job_at_once_is_a_job_event_exactly_when_it_is_collateral(world, code):
    clock, _, jobs, _, _, policy, events = world
    jobs.register("J", [(i, f"n{i}", [0]) for i in range(8)], [])
    msg = "X Fatal XC0 i0 Link 00" if xidcat.lookup(code).token else "boom"
    events([{"node": f"n{i}", "ts": clock.now + i * S // 4, "xid": code, "severity": xidcat.severity(code, msg),
             "message": msg} for i in range(4)])
    clock.now += int(policy.settings.xid_context_seconds * S)
    policy.evaluate(clock.now)
    if xidcat.lookup(code).collateral:
        assert policy.alarms == {} and policy.context.job_events == {code: 1}
    else:
        assert set(policy.alarms) == {"n0", "n1", "n2", "n3"} and not policy.context.job_events


def test_163_repeats_then_162_replayed_through_the_collector_leave_nothing_outstanding(world, tmp_path):
    # A GB200 GPU disengages power smoothing three times, then re-engages it, within one fold window:
    # the collector writes the 163 count before the 162 (collectors/repeats.py), and the service ends
    # with nothing outstanding; a 163 after that is outstanding again.
    clock, _, _, nodes, _, policy, _ = world
    boot = T0 - 1000 * S
    log = tmp_path / "kern.log"
    lines = [(10.0, 163, "PSHC disengaged"), (11.0, 163, "PSHC disengaged"), (12.0, 163, "PSHC disengaged"),
             (13.0, 162, "PSHC reengaged")]
    log.write_text("".join(f"[{990 + t:12.6f}] {_xid('0018:01:00', c, m)}\n" for t, c, m in lines))
    src = KmsgSource("gb", path=str(log), boot_ns=boot)
    rows = src.sweep(T0)["events"].to_pylist()
    assert [(r["xid"], r["occurrences"]) for r in rows] == [(163, None), (163, 2), (162, None)]
    ingest = Ingest(nodes, sink=lambda p: 0, context=policy.context)
    ingest.act_on_events({"events": sch.to_table("events", rows)}, now=T0)
    assert policy.context.outstanding() == []
    with open(log, "a") as fh:
        fh.write(f"[{1005:12.6f}] {_xid('0018:01:00', 163, 'PSHC disengaged')}\n")
    ingest.act_on_events({"events": src.sweep(T0 + 10 * S)["events"]}, now=T0 + 10 * S)
    assert [(n, c) for n, _, c, _ in policy.context.outstanding()] == [("gb", 163)]
