"""The jobs coordinator and a shard's forwarder on loopback (service/coordinator.py, service/forwarder.py):
a leader killed in the middle of a directive and its standby taking over on the shared state, with the
job's client (the migrator's) and the shard's forwarder moving to it; no directive issued twice, none
lost. Then the forwarder across a coordinator outage, its bounded buffer, redelivery known by id, a
shard with another model, and the bad input the coordinator refuses. Last, the fabric's services in a
sharded control plane: a shard's judge finding a Fabric Manager down forwards it, and the coordinator
refuses that spare (across a takeover) until the shard clears it."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import Serve, wait_until

from foreshock import fabric
from foreshock.migrator import Ack, AckPhase, MigratorConfig, ServiceClient
from foreshock.migrator.directives import DirectiveBook
from foreshock.service.coordinator import (
    CoordinatorSettings, EventKind, LeaderLock, ShardEvent, check_events)
from foreshock.service.decisions import read_decisions
from foreshock.service.errors import InvalidArgument
from foreshock.service.forwarder import AlarmForwarder, ForwardError, ForwardSettings
from foreshock.service.server import Settings, build_server
from foreshock.v1 import coordinator_pb2, coordinator_pb2_grpc, jobs_pb2, jobs_pb2_grpc

HERE = Path(__file__).parent
K = coordinator_pb2


def _forwarder(*addresses, shard="shard-a", model="m1", **kw) -> AlarmForwarder:
    settings = ForwardSettings(tuple(addresses), shard, backoff_initial_seconds=0.05, backoff_max_seconds=0.3,
                               ack_timeout_seconds=2.0, **kw)
    return AlarmForwarder(settings, model_version=model)


def _coordinator(tmp_path, expected_model: str = "", coordinator_settings: dict | None = None,
                 **settings) -> "object":
    """A jobs coordinator on loopback, leading, started; `coordinator_settings`: more CoordinatorSettings."""
    plane = build_server(Settings.insecure_loopback(
        tmp_path / "state", coordinator=CoordinatorSettings(str(tmp_path / "lease"), expected_model_version=expected_model,
                                                            lock_poll_seconds=0.05, **(coordinator_settings or {})),
        threshold=0.5, policy={"stale_seconds": 3600.0}, **settings))
    plane.start()
    assert wait_until(lambda: plane.leading, 10)
    return plane


def _shard(coordinator, tmp_path) -> "object":
    """A scoring shard "shard-a" (no model) forwarding to `coordinator`, started."""
    from foreshock.service.scoring import NullScorer

    shard = build_server(Settings.insecure_loopback(
        tmp_path / "shard", scorer=NullScorer(), threshold=0.5,
        forward=ForwardSettings((coordinator.address,), "shard-a", summary_seconds=1.0,
                                backoff_initial_seconds=0.05, backoff_max_seconds=0.3)))
    shard.start()
    return shard


def _serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="foreshock.v1.Jobs"), timeout=1)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _directives(address: str) -> list:
    with grpc.insecure_channel(address) as ch:
        return list(jobs_pb2_grpc.JobsStub(ch).ListDirectives(jobs_pb2.ListDirectivesRequest(job_id="j1"),
                                                              timeout=5).directives)


def _register(address: str) -> None:
    with grpc.insecure_channel(address) as ch:
        jobs_pb2_grpc.JobsStub(ch).RegisterJob(jobs_pb2.RegisterJobRequest(
            job_id="j1", ranks=[jobs_pb2.RankPlacement(rank=0, node="n0"), jobs_pb2.RankPlacement(rank=1, node="n1")],
            spare_nodes=["s0", "s1"], max_concurrent_evacuations=2), timeout=5)


def test_event_kinds_mirror_the_proto():
    assert {k.name: int(k) for k in EventKind} == {
        name.removeprefix("SHARD_EVENT_KIND_"): number for name, number in K.ShardEventKind.items() if number}


def test_the_lease_is_held_by_one_and_passed_on_when_it_is_let_go(tmp_path):
    first, second = LeaderLock(tmp_path / "lease", "first"), LeaderLock(tmp_path / "lease", "second")
    stop = threading.Event()
    assert first.acquire(stop, 0.01)
    got = []
    waiter = threading.Thread(target=lambda: got.append(second.acquire(stop, 0.01)))
    waiter.start()
    time.sleep(0.2)
    assert not got and "first" in second.holder()
    first.release()
    waiter.join(5)
    assert got == [True] and "second" in second.holder()
    stop.set()
    assert not LeaderLock(tmp_path / "lease").acquire(stop, 0.01)   # a standby told to stop gives up
    second.release()


def _job_client(addresses: str) -> ServiceClient:
    config = MigratorConfig.from_env({}, job_id="j1", rank=0, world_size=2, node="n0", store="127.0.0.1:1",
                                     service=addresses, rpc_timeout_s=1.0)
    return ServiceClient(config, backoff_initial_s=0.05, backoff_max_s=0.3)


@pytest.mark.parametrize("moment", ["after_commit", "before_commit", "after_job_ack"])
def test_no_directive_twice_none_lost_across_a_takeover(tmp_path, moment):
    """The leader dies in the middle of the shard's fatal event: once it has committed the directive
    (and announced it) but before the shard has its ack, or before the commit, or once the job's
    ACCEPTED ack is committed, before the job hears the answer. The standby, a real
    `foreshock serve --coordinator` on the same lease and state, takes over; the shard's forwarder and the
    job's client find it; the job sees the directive once, by id, and a later fatal event still makes one."""
    state, lease = tmp_path / "state", tmp_path / "lease"
    leader = subprocess.Popen([sys.executable, str(HERE / "coordinator_child.py"), str(state), str(lease), moment],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    standby = client = forwarder = None
    try:
        leader_address = leader.stdout.readline().split("listening on ")[1].strip()
        assert leader.stdout.readline().strip() == "leader"
        standby = Serve(state, "--coordinator", "--lease-file", str(lease))
        assert "coordinator standby" in standby.banner
        with grpc.insecure_channel(standby.address) as ch:   # the standby says what it is
            with pytest.raises(grpc.RpcError) as refused:
                jobs_pb2_grpc.JobsStub(ch).ListDirectives(jobs_pb2.ListDirectivesRequest(job_id="j1"), timeout=2)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "standby" in refused.value.details()
        assert not _serving(standby.address)
        # Kubernetes' readiness probe reads /readyz: the standby is up, exports that it does not lead
        assert standby.ready() == 503 and standby.metric("foreshock_coordinator_leader") == 0

        _register(leader_address)
        client = _job_client(f"{leader_address},{standby.address}")
        client.watch(0)
        book, accepted = DirectiveBook(), []

        def take(seen):
            for d in client.poll():
                if book.offer(d):
                    accepted.append(d)
                    client.ack(Ack(d.directive_id, 0, AckPhase.ACCEPTED))
            return seen()

        forwarder = _forwarder(leader_address, standby.address)
        now = time.time_ns()
        for spare in ("s0", "s1"):
            forwarder.put(K.SHARD_EVENT_KIND_RISK, spare, risk=0.01, ts_ns=now)
        forwarder.put(K.SHARD_EVENT_KIND_FATAL, "n0", risk=0.3, ts_ns=now, fatal_kind="xid",
                      description="Xid 79 on GPU 3")
        forwarder.start()   # the three in one batch: the one the leader dies in

        assert wait_until(lambda: take(lambda: leader.poll() is not None), 15)   # the job acks what it sees
        assert leader.returncode == -9, "the leader did not die in the middle of the directive"
        assert wait_until(lambda: _serving(standby.address), 15), "the standby did not take over"
        assert wait_until(lambda: forwarder.buffered() == 0, 15), "the standby did not ack the shard's events"
        assert wait_until(lambda: take(lambda: len(accepted) >= 1), 15), "the job never saw the directive"

        forwarder.put(K.SHARD_EVENT_KIND_FATAL, "n1", risk=0.3, ts_ns=time.time_ns(), fatal_kind="gpu_lost",
                      description="GPU 1 lost")
        assert wait_until(lambda: take(lambda: len(accepted) >= 2), 15), "no directive after the takeover"
        time.sleep(0.5)   # anything issued twice would have come by now
        take(lambda: True)

        issued = _directives(standby.address)
        assert sorted(d.from_node for d in issued) == ["n0", "n1"]      # none twice, none lost
        assert sorted(d.directive_id for d in issued) == sorted(d.directive_id for d in accepted)
        assert [d.from_node for d in accepted] == ["n0", "n1"] and {d.to_node for d in accepted} == {"s0", "s1"}
        assert forwarder.acked_total == 4 and sum(forwarder.dropped_total.values()) == 0
        took_over = standby.proc.stdout.readline()
        assert "coordinator leader on" in took_over
        assert took_over.split("metrics on ")[1].split()[0] == standby.metrics   # the same listener
        assert standby.ready() == 200 and standby.metric("foreshock_coordinator_leader") == 1
        duplicate = standby.metric('foreshock_coordinator_events_total{result="duplicate",shard="shard-a"}')
        if moment == "after_commit":
            assert duplicate == 3          # the batch the leader died in, sent again and known
        elif moment == "before_commit":
            assert duplicate == 0          # nothing of it was committed: applied by the standby
        else:
            assert {d.from_node: d.state for d in issued}["n0"] == jobs_pb2.DIRECTIVE_STATE_ACCEPTED
    finally:
        if forwarder is not None:
            forwarder.stop(0)
        if client is not None:
            client.close()
        if standby is not None:
            assert standby.term() == 0
        if leader.poll() is None:
            leader.kill()
            leader.wait(10)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_forwarder_buffers_through_an_outage_drops_summaries_first_and_delivers_the_rest(tmp_path, caplog):
    port = _free_port()
    forwarder = _forwarder(f"127.0.0.1:{port}", buffer_events=100, batch_events=32)
    forwarder.start()
    plane = None
    try:
        now = time.time_ns()
        for i in range(90):
            forwarder.put(K.SHARD_EVENT_KIND_RISK, f"r{i:03d}", risk=0.01, ts_ns=now)
        for i in range(30):
            forwarder.put(K.SHARD_EVENT_KIND_ALARM, f"a{i:03d}", risk=0.9, ts_ns=now, description="risk 0.9")
        assert wait_until(lambda: forwarder.reconnects_total >= 2, 10)   # nobody there: it keeps trying
        assert forwarder.buffered() == 100 and forwarder.dropped_total == {"risk": 20}
        assert "forwarder buffer full" in caplog.text and "dropped the oldest risk event" in caplog.text

        plane = _coordinator(tmp_path, listen=f"127.0.0.1:{port}")
        assert wait_until(lambda: forwarder.buffered() == 0, 15), "the buffer was not delivered"
        assert forwarder.connected and forwarder.acked_total == 100
        assert sorted(plane.policy.alarms) == [f"a{i:03d}" for i in range(30)]
        assert sorted(n for n in plane.nodes.risk if n.startswith("r")) == [f"r{i:03d}" for i in range(20, 90)]
        assert plane.coordinator.events_applied == {"shard-a": 100}
    finally:
        forwarder.stop(0)
        if plane is not None:
            plane.stop(0.5)


def test_a_full_forwarder_drops_what_a_later_event_supersedes_before_any_other(tmp_path):
    """With no risk summary left to drop, a full buffer drops the oldest alarm, clear or fabric-finding
    event a later buffered one supersedes (the coordinator ends in the same state), then the oldest;
    a fatal event never goes as superseded. Delivered later, the coordinator's state is what the shard's
    last events say, except for the alarms dropped when nothing superseded was left."""
    port = _free_port()
    forwarder = _forwarder(f"127.0.0.1:{port}", buffer_events=100, batch_events=32)   # not started yet
    now = time.time_ns()
    for i in range(30):
        forwarder.put(K.SHARD_EVENT_KIND_ALARM, f"a{i:02d}", risk=0.9, ts_ns=now, description="risk 0.9")
    for i in range(10):
        forwarder.put(K.SHARD_EVENT_KIND_CLEARED, f"a{i:02d}", risk=0.1, ts_ns=now)
    for i in range(5):
        forwarder.put(K.SHARD_EVENT_KIND_FATAL, f"f{i}", risk=1.0, ts_ns=now, fatal_kind="xid_79")
    for raised in (True, False):
        forwarder.put(K.SHARD_EVENT_KIND_FABRIC_SERVICE, "s0", ts_ns=now, unit=FM, finding="down", raised=raised)
    for i in range(68):   # 115 events in a buffer of 100: 15 drops
        forwarder.put(K.SHARD_EVENT_KIND_ALARM, f"b{i:02d}", risk=0.9, ts_ns=now, description="risk 0.9")
    assert forwarder.buffered() == 100
    assert forwarder.dropped_total == {"alarm": 14, "fabric_service": 1} and forwarder.dropped_superseded_total == 11

    plane = _coordinator(tmp_path, listen=f"127.0.0.1:{port}")
    try:
        forwarder.start()
        assert wait_until(lambda: forwarder.buffered() == 0, 15), "the buffer was not delivered"
        expected = {f"a{i:02d}" for i in range(14, 30)} | {f"b{i:02d}" for i in range(68)} | {f"f{i}" for i in range(5)}
        assert set(plane.policy.alarms) == expected   # a00-a09 cleared; a10-a13 dropped, nothing superseded them
        assert not plane.policy.units.down("s0", FM) and forwarder._latest == {}
    finally:
        forwarder.stop(0)
        plane.stop(0.5)


def test_events_sent_again_apply_once_and_a_stale_epoch_is_refused(tmp_path):
    plane = _coordinator(tmp_path)
    try:
        c = plane.coordinator
        events = [ShardEvent(1, EventKind.RISK, "n1", 0.1, ts_ns=1), ShardEvent(2, EventKind.ALARM, "n2", 0.9, ts_ns=2)]
        assert c.receive("a", 100, "m1", events) == 2
        assert c.receive("a", 100, "m1", events) == 2                        # sent again: known
        assert c.receive("a", 100, "m1", events + [ShardEvent(3, EventKind.CLEARED, "n2", 0.1)]) == 3
        assert (c.events_applied, c.events_duplicate) == ({"a": 3}, {"a": 4})
        assert "n2" not in plane.policy.alarms
        assert c.receive("a", 200, "m1", [ShardEvent(1, EventKind.ALARM, "n3", 0.9, ts_ns=5)]) == 1   # a restart
        assert "n3" in plane.policy.alarms
        with pytest.raises(Exception, match="epoch 100 is older than 200"):
            c.receive("a", 100, "m1", [ShardEvent(4, EventKind.RISK, "n1", 0.2)])
    finally:
        plane.stop(0.5)


def test_a_shard_with_another_model_is_reported_not_refused(tmp_path, caplog):
    plane = _coordinator(tmp_path, expected_model="m1")
    first, other = _forwarder(plane.address, shard="a", model="m1"), _forwarder(plane.address, shard="b", model="m2")
    try:
        for f, node in ((first, "n1"), (other, "n2")):
            f.put(K.SHARD_EVENT_KIND_ALARM, node, risk=0.9, ts_ns=time.time_ns())
            f.start()
        assert wait_until(lambda: first.buffered() == other.buffered() == 0, 10)
        assert plane.coordinator.mismatch == {"a": False, "b": True}
        assert sorted(plane.policy.alarms) == ["n1", "n2"]
        assert "shard b scores with model m2, not m1 as expected" in caplog.text
        from prometheus_client import generate_latest
        text = generate_latest(plane.registry).decode()
        assert 'foreshock_coordinator_shard_model_mismatch{model="m2",shard="b"} 1.0' in text
        assert 'foreshock_coordinator_shard_model_mismatch{model="m1",shard="a"} 0.0' in text
    finally:
        first.stop(0)
        other.stop(0)
        plane.stop(0.5)


@pytest.mark.parametrize("events, message", [
    ([ShardEvent(1, EventKind.RISK, "bad node!", 0.1)], "'bad node!' is not a valid node name"),
    ([ShardEvent(1, EventKind.RISK, "n1", float("nan"))], "risk nan must be in"),
    ([ShardEvent(1, EventKind.RISK, "n1", 1.5)], "risk 1.5 must be in"),
    ([ShardEvent(2, EventKind.RISK, "n1", 0.1), ShardEvent(2, EventKind.RISK, "n2", 0.1)], "sequence 2 does not follow 2"),
    ([ShardEvent(0, EventKind.RISK, "n1", 0.1)], "sequence 0 does not follow 0"),
    ([ShardEvent(i + 1, EventKind.RISK, "n1", 0.1) for i in range(1025)], "1025 events in one request; at most 1024"),
    ([ShardEvent(1, EventKind.FABRIC_SERVICE, "n1", unit="sshd.service", finding="down", raised=True)],
     "event 1: unit 'sshd.service' is not a fabric service (one of nvidia-fabricmanager.service, nvidia-imex.service)"),
    ([ShardEvent(1, EventKind.FABRIC_SERVICE, "n1", unit=fabric.FABRIC_MANAGER, finding="", raised=True)],
     "event 1: finding '' is not one of down, crash_loop"),
    ([ShardEvent(1, EventKind.FABRIC_SERVICE, "bad node!", unit=fabric.FABRIC_MANAGER, finding="down")],
     "event 1 node 'bad node!' is not a valid node name"),
])
def test_bad_events_are_refused_naming_what_is_wrong(events, message):
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        check_events("shard-a", 1, events)


def test_bad_shard_name_and_epoch_are_refused():
    with pytest.raises(InvalidArgument, match="shard 'a b' is not a valid id"):
        check_events("a b", 1, [])
    with pytest.raises(InvalidArgument, match="epoch 0 must be in"):
        check_events("a", 0, [])


def test_an_unknown_event_kind_is_refused_over_grpc(tmp_path):
    plane = _coordinator(tmp_path)
    try:
        with grpc.insecure_channel(plane.address) as ch:
            call = coordinator_pb2_grpc.CoordinatorStub(ch).ForwardAlarms(iter([coordinator_pb2.ForwardRequest(
                shard="a", epoch=1, model_version="m", events=[coordinator_pb2.ShardEvent(sequence=1, kind=9, node="n")])]),
                timeout=5)
            with pytest.raises(grpc.RpcError) as refused:
                list(call)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "kind 9 is not a ShardEventKind" in refused.value.details()
    finally:
        plane.stop(0.5)


@pytest.mark.parametrize("kw, message", [
    ({"addresses": ()}, "coordinator_address is empty"),
    ({"addresses": ("nohost",)}, "'nohost' is not HOST:PORT"),
    ({"shard": ""}, "shard is empty"),
    ({"buffer_events": 10}, r"forward buffer_events 10: must be in \[100, 1e\+07\]"),
    ({"ack_timeout_seconds": float("inf")}, "forward ack_timeout_seconds inf"),
])
def test_bad_forwarder_settings_are_refused_naming_them(kw, message):
    args = {"addresses": ("127.0.0.1:1",), "shard": "a", **kw}
    with pytest.raises(ForwardError, match=message):
        ForwardSettings(args.pop("addresses"), args.pop("shard"), **args)


def test_plaintext_to_a_remote_coordinator_is_refused():
    with pytest.raises(ForwardError, match="plaintext is allowed to loopback addresses only"):
        AlarmForwarder(ForwardSettings(("10.1.2.3:7443",), "a"), model_version="m")


@pytest.mark.parametrize("flags, message", [
    (["--coordinator"], "lease_file is empty"),
    (["--lease-file", "/tmp/x"], "--lease-file is the coordinator's: give --coordinator too"),
    (["--coordinator", "--lease-file", "/tmp/x", "--coordinator-address", "127.0.0.1:1"], "exclusive"),
    (["--coordinator-address", "127.0.0.1:1", "--forward-buffer-events", "5"], "forward_buffer_events"),
    (["--coordinator-address", "127.0.0.1:1"], "--coordinator-address is a shard's: give --shard NAME"),
    (["--coordinator", "--lease-file", "/tmp/x", "--shard", "a", "--shard-map", "/tmp/x"],
     "--coordinator and --shard/--shard-map are exclusive"),
    (["--coordinator", "--lease-file", "/tmp/x", "--coordinator-reconfirm-seconds", "0"],
     "coordinator_reconfirm_seconds"),
])
def test_serve_refuses_bad_coordinator_flags(tmp_path, flags, message):
    run = subprocess.run([sys.executable, "-m", "foreshock.cli", "serve", "--insecure", "--no-model",
                          "--state", str(tmp_path), "--listen", "127.0.0.1:0", "--metrics-listen", "", *flags],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and message in run.stderr, run.stderr[-1000:]


def test_a_shard_forwards_what_its_policy_sees_and_the_coordinator_acts_on_it(tmp_path):
    """A scoring instance with --coordinator-address: its rounds' fatal events, risk alarms and their
    clearing, and its nodes' risks go to the coordinator, whose policy issues the directives."""
    import numpy as np

    from foreshock.service.nodes import FatalEvent, Topology

    coordinator = _coordinator(tmp_path)
    shard = _shard(coordinator, tmp_path)
    try:
        with pytest.raises(grpc.RpcError) as refused:   # one writer of directives: jobs go to the coordinator
            _register(shard.address)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"shard shard-a, which forwards its alarms to the jobs coordinator; jobs register and watch " \
               f"directives there ({coordinator.address})" in refused.value.details()
        _register(coordinator.address)
        now = time.time_ns()
        for node in ("n0", "n1", "s0", "s1"):
            shard.nodes.set_topology(node, Topology(site="x", leaf_switch="leaf-" + node[-1]))
        shard.nodes.update_risk(["n0", "n1", "s0", "s1"], np.array([0.1, 0.1, 0.01, 0.01]), [()] * 4, now)
        assert wait_until(lambda: coordinator.nodes.probability("s1") == 0.01, 10), "no risk summary came"
        assert coordinator.nodes.topo("s1").leaf_switch == "leaf-1"

        shard.nodes.record_fatal(FatalEvent("n0", now, "xid", "Xid 79 on GPU 3"))
        assert wait_until(lambda: [d.from_node for d in _directives(coordinator.address)] == ["n0"], 10)

        shard.policy.evaluate(time.time_ns(), ["n1"], np.array([0.9]))    # a shard's round: n1 above threshold
        assert wait_until(lambda: sorted(d.from_node for d in _directives(coordinator.address)) == ["n0", "n1"], 10)
        issued = {d.from_node: d for d in _directives(coordinator.address)}
        assert issued["n0"].cause == jobs_pb2.DIRECTIVE_CAUSE_FATAL and issued["n1"].cause == jobs_pb2.DIRECTIVE_CAUSE_RISK
        assert "(shard shard-a)" in coordinator.policy.alarms["n1"].reason

        shard.policy.evaluate(time.time_ns(), ["n1"], np.array([0.1]))    # and under clear_below again
        assert wait_until(lambda: "n1" not in coordinator.policy.alarms, 10)
        assert shard.forwarder.buffered() == 0 or wait_until(lambda: shard.forwarder.buffered() == 0, 5)
    finally:
        shard.stop(0.5)
        coordinator.stop(0.5)


# -- the fabric's services, judged by the shards, spares chosen by the coordinator --------------------------

FM, IMEX = fabric.FABRIC_MANAGER, fabric.IMEX
FM_DOWN = "nvidia-fabricmanager down (new CUDA contexts fail)"
FM_LOOPING = "nvidia-fabricmanager crash-looping (new CUDA contexts fail while it restarts)"


def _decisions(plane, kind: str) -> list[dict]:
    plane.decisions.flush()
    return [r for r in read_decisions(plane.state_dir / "decisions").to_pylist() if r["kind"] == kind]


def _drain(address: str, node: str) -> jobs_pb2.Directive:
    with grpc.insecure_channel(address) as ch:
        [d] = jobs_pb2_grpc.JobsStub(ch).DrainNode(jobs_pb2.DrainNodeRequest(node=node, reason="test"),
                                                   timeout=5).directives
    return d


def _finding(seq: int, node: str, finding: str, raised: bool, unit: str = FM) -> ShardEvent:
    return ShardEvent(seq, EventKind.FABRIC_SERVICE, node, ts_ns=seq, unit=unit, finding=finding, raised=raised,
                      description=f"{unit} {finding} on {node}")


def test_a_spare_whose_fabric_manager_a_shard_found_down_is_refused_across_a_takeover_until_cleared(tmp_path):
    """A real coordinator takes a shard's FABRIC_SERVICE event over its stream: the node is no spare for
    an evacuation (the directive falls back and says why) after the coordinator is stopped and another
    takes the state over, and is one again once the shard clears the finding, which a takeover keeps too."""
    port = _free_port()
    plane = _coordinator(tmp_path, listen=f"127.0.0.1:{port}")
    forwarder = _forwarder(plane.address)
    forwarder.start()
    try:
        with grpc.insecure_channel(plane.address) as ch:
            jobs_pb2_grpc.JobsStub(ch).RegisterJob(jobs_pb2.RegisterJobRequest(
                job_id="j1", ranks=[jobs_pb2.RankPlacement(rank=0, node="n0"),
                                    jobs_pb2.RankPlacement(rank=1, node="n1")],
                spare_nodes=["s0"], max_concurrent_evacuations=2), timeout=5)
        forwarder.put(K.SHARD_EVENT_KIND_RISK, "s0", risk=0.01, ts_ns=time.time_ns())
        forwarder.put(K.SHARD_EVENT_KIND_FABRIC_SERVICE, "s0", ts_ns=time.time_ns(), unit=FM, finding="down",
                      raised=True, description="nvidia-fabricmanager.service failed on s0 for 70 s")
        assert wait_until(lambda: forwarder.buffered() == 0, 10)
        assert plane.policy.units.down("s0", FM) and not plane.policy.units.crash_looping("s0", FM)
        [row] = _decisions(plane, "fabric_service_down")
        assert row["node"] == "s0" and row["reason"] == "nvidia-fabricmanager.service failed on s0 for 70 s (shard shard-a)"
        assert '"shard": "shard-a"' in row["details"] and f'"unit": "{FM}"' in row["details"]

        plane.stop(0.5)   # the standby takes the state over
        plane = _coordinator(tmp_path, listen=f"127.0.0.1:{port}")
        assert plane.policy.units.down("s0", FM)
        d = _drain(plane.address, "n0")
        assert d.kind == jobs_pb2.DIRECTIVE_KIND_CHECKPOINT_EXIT and not d.to_node
        assert f"no usable spare (s0: {FM_DOWN})" in d.reason

        forwarder.put(K.SHARD_EVENT_KIND_FABRIC_SERVICE, "s0", ts_ns=time.time_ns(), unit=FM, finding="down",
                      raised=False, description="nvidia-fabricmanager.service on s0 serves again (active)")
        assert wait_until(lambda: not plane.policy.units.down("s0", FM), 15), "the clear did not come"
        assert [r["reason"] for r in _decisions(plane, "fabric_service_cleared")] == [
            "nvidia-fabricmanager.service on s0 serves again (active) (shard shard-a)"]
        d = _drain(plane.address, "n1")
        assert d.kind == jobs_pb2.DIRECTIVE_KIND_EVACUATE and d.to_node == "s0"

        plane.stop(0.5)
        plane = _coordinator(tmp_path, listen=f"127.0.0.1:{port}")
        assert not plane.policy.units.down("s0", FM) and plane.coordinator.findings.findings() == []
        assert plane.coordinator.events_applied == {} and plane.coordinator.shards()["shard-a"][1] == 3
    finally:
        forwarder.stop(0)
        plane.stop(0.5)


def test_fabric_findings_apply_once_and_a_moved_nodes_old_shard_clears_nothing_of_the_new_ones(tmp_path):
    plane = _coordinator(tmp_path)
    try:
        _register(plane.address)   # j1 on n0 and n1, spares s0 and s1
        c, units = plane.coordinator, plane.policy.units
        [job] = plane.jobs.store.jobs()

        def spare():
            return plane.policy.choose_spare(job, "n0", time.time_ns(), set())

        c.receive("a", 1, "m1", [_finding(1, "s0", "crash_loop", True), _finding(2, "s1", "down", True),
                                 _finding(3, "s1", "down", True, unit=IMEX)])
        assert units.crash_looping("s0", FM) and units.down("s1", FM) and units.down("s1", IMEX)
        assert spare() == (None, f"no usable spare (s0: {FM_LOOPING}; s1: {FM_DOWN})")

        # s1's leaf moved to shard b, which finds its Fabric Manager down too; a's clear of it comes later
        c.receive("b", 1, "m1", [_finding(1, "s1", "down", True)])
        c.receive("a", 1, "m1", [_finding(4, "s1", "down", False), _finding(5, "s0", "crash_loop", False)])
        assert units.down("s1", FM) and c.findings.ignored == 1 and not units.crash_looping("s0", FM)
        assert spare() == ("s0", "")
        # sent again after a reconnect: known by sequence, nothing raised again
        assert c.receive("a", 1, "m1", [_finding(1, "s0", "crash_loop", True)]) == 5
        assert not units.crash_looping("s0", FM) and c.events_duplicate["a"] == 1

        # a bad event refuses its whole batch: the good one before it is not applied either
        with pytest.raises(InvalidArgument, match="event 7: unit 'nvidia-fabricmanager' is not a fabric service"):
            c.receive("a", 1, "m1", [_finding(6, "s0", "down", True), _finding(7, "s0", "down", True, unit="nvidia-fabricmanager")])
        assert not units.down("s0", FM) and c.shards()["a"][1] == 5

        c.receive("b", 1, "m1", [_finding(2, "s1", "down", False)])
        assert not units.down("s1", FM) and spare() == ("s0", "")
        assert units.down("s1", IMEX)   # IMEX changes no spare choice: an idle spare's is not judged
        assert plane.store.shard_fabric_findings() == [("s1", IMEX, "down", "a", 3)]
        from prometheus_client import generate_latest
        text = generate_latest(plane.registry).decode()
        assert f'foreshock_coordinator_fabric_service_findings{{finding="down",unit="{IMEX}"}} 1.0' in text
        assert f'foreshock_coordinator_fabric_service_findings{{finding="down",unit="{FM}"}} 0.0' in text
        assert "foreshock_fabric_service_down{" not in text   # each node's series are its shard's
    finally:
        plane.stop(0.5)


def test_a_shard_whose_judge_finds_its_fabric_manager_down_forwards_it_and_its_clearing(tmp_path):
    """A scoring shard's own judge (its systemd_unit rows) raises and clears the finding; the coordinator
    holds what the shard forwarded, and refuses the node as a spare meanwhile."""
    coordinator = _coordinator(tmp_path)
    shard = _shard(coordinator, tmp_path)
    S = 1_000_000_000

    def rows(start: int, state: str, sub: str, result: str) -> list[tuple]:
        return [("s0", FM, start + k * 10 * S, "loaded", state, sub, result, 0) for k in range(8)]

    try:
        t0 = time.time_ns() - 100 * S
        shard.policy.units.observe(rows(t0, "failed", "failed", "exit-code"), time.time_ns())   # 70 s down
        assert wait_until(lambda: _decisions(coordinator, "fabric_service_down"), 15), "the finding was not forwarded"
        assert shard.policy.units.down("s0", FM) and coordinator.policy.units.down("s0", FM)
        [row] = _decisions(coordinator, "fabric_service_down")
        assert "the node's NVSwitch fabric is unmanaged" in row["reason"] and row["reason"].endswith("(shard shard-a)")
        _register(coordinator.address)
        [job] = coordinator.jobs.store.jobs()
        s1_busy = {"s1"}   # s0 is the one spare left
        assert coordinator.policy.choose_spare(job, "n0", time.time_ns(), s1_busy) == (
            None, f"no usable spare (s0: {FM_DOWN}; s1: busy)")

        shard.policy.units.observe(rows(t0 + 80 * S, "active", "running", "success"), time.time_ns())
        assert wait_until(lambda: shard.forwarder.buffered() == 0 and not coordinator.policy.units.down("s0", FM),
                          15), "the clearing was not forwarded"
        assert coordinator.policy.choose_spare(job, "n0", time.time_ns(), s1_busy) == ("s0", "")
        assert coordinator.store.shard_fabric_findings() == []   # acked: committed
    finally:
        shard.stop(0.5)
        coordinator.stop(0.5)


def test_what_a_restarted_shards_new_instance_does_not_raise_again_is_cleared_after_the_reconfirmation(tmp_path):
    """A shard's new instance (a newer epoch) sends what its policy changes, never a clear of what its
    previous instance raised: the coordinator holds those risk alarms and fabric findings for the
    reconfirmation, then clears the ones not raised again, durably; a fatal event, other shards' alarms
    and a finding another shard raised since stay, and another shard's batch ends nothing of it."""
    plane = _coordinator(tmp_path)
    S = 1_000_000_000
    try:
        _register(plane.address)
        c, units, alarms = plane.coordinator, plane.policy.units, plane.policy.alarms
        t = [time.time_ns()]
        c.clock = lambda: t[0]
        c.receive("a", 1, "m1", [ShardEvent(1, EventKind.ALARM, "n2", 0.9, ts_ns=t[0]),
                                 ShardEvent(2, EventKind.ALARM, "n3", 0.9, ts_ns=t[0]),
                                 _finding(3, "s0", "down", True), _finding(4, "s1", "crash_loop", True),
                                 ShardEvent(5, EventKind.FATAL, "n4", 1.0, ts_ns=t[0], fatal_kind="xid_79"),
                                 ShardEvent(6, EventKind.ALARM, "n6", 0.9, ts_ns=t[0]),
                                 _finding(7, "s2", "down", True)])
        c.receive("b", 1, "m1", [ShardEvent(1, EventKind.ALARM, "n5", 0.9, ts_ns=t[0])])
        assert {"n2", "n3", "n4", "n5", "n6"} <= set(alarms)

        t[0] += 10 * S   # shard a restarts: its new instance raises n3 and s1's finding again, not n2 or s0's
        assert c.receive("a", 2, "m1", [ShardEvent(1, EventKind.RISK, "n2", 0.1, ts_ns=t[0])]) == 1
        t[0] += 60 * S   # ... and a fatal event on n6, which is no risk alarm raised again
        c.receive("a", 2, "m1", [ShardEvent(2, EventKind.ALARM, "n3", 0.8, ts_ns=t[0]),
                                 _finding(3, "s1", "crash_loop", True),
                                 ShardEvent(4, EventKind.FATAL, "n6", 1.0, ts_ns=t[0], fatal_kind="xid_79")])
        c.receive("b", 1, "m1", [_finding(2, "s2", "down", True)])   # s2's leaf moved to b, which finds it too
        assert "n2" in alarms and units.down("s0", FM)   # within the reconfirmation: held
        t[0] += 1200 * S
        c.receive("b", 1, "m1", [ShardEvent(3, EventKind.RISK, "n5", 0.9, ts_ns=t[0])])
        assert "n2" in alarms and units.down("s0", FM)   # another shard's batch ends nothing of a's
        assert c.receive("a", 2, "m1", []) == 4          # a's empty request (a totals poll) past the end: ends it
        assert "n2" not in alarms and {"n3", "n4", "n5", "n6"} <= set(alarms)   # n6's alarm is its fatal one now
        assert not units.down("s0", FM) and units.crash_looping("s1", FM)
        assert units.down("s2", FM) and c.findings.held("s2", FM, "down").shard == "b" and c.findings.ignored == 0
        assert c.reconfirm_cleared == {"alarm": 2, "fabric_finding": 1}
        [row] = [r for r in _decisions(plane, "cleared") if r["node"] == "n2"]
        assert "not raised again by shard a's new instance within 1200 s" in row["reason"]
        assert [r["node"] for r in _decisions(plane, "fabric_service_cleared")] == ["s0"]
        [job] = plane.jobs.store.jobs()
        assert plane.policy.choose_spare(job, "n0", t[0], {"s1"}) == ("s0", "")

        plane.stop(0.5)   # durable: a takeover reads back the same
        plane = _coordinator(tmp_path)
        assert {n for n, st in plane.coordinator._state.items() if st.alarm} == {"n3", "n5"}
        assert [f[:4] for f in plane.store.shard_fabric_findings()] == [("s1", FM, "crash_loop", "a"),
                                                                        ("s2", FM, "down", "b")]
        from prometheus_client import generate_latest
        assert 'foreshock_coordinator_reconfirm_cleared_total{kind="alarm"} 0.0' in generate_latest(
            plane.registry).decode()   # a counter of this instance's clearing
    finally:
        plane.stop(0.5)


def test_a_reconfirmation_whose_commit_fails_is_written_by_the_next_try(tmp_path, monkeypatch):
    """The clearing at a reconfirmation's end is in memory before its commit: a commit that fails leaves
    the reconfirmation pending, and the next batch writes what it cleared, so the state read back after a
    takeover is the cleared one."""
    plane = _coordinator(tmp_path)
    S = 1_000_000_000
    try:
        c = plane.coordinator
        t = [time.time_ns()]
        c.clock = lambda: t[0]
        c.receive("a", 1, "m1", [ShardEvent(1, EventKind.ALARM, "n2", 0.9, ts_ns=t[0]), _finding(2, "s0", "down", True)])
        c.receive("a", 2, "m1", [ShardEvent(1, EventKind.RISK, "n2", 0.1, ts_ns=t[0])])
        t[0] += 1201 * S
        real = plane.store.record_shard_events

        def full_disk(*args, **kwargs):
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(plane.store, "record_shard_events", full_disk)
        with pytest.raises(sqlite3.OperationalError):
            c.receive("a", 2, "m1", [])
        assert "n2" not in plane.policy.alarms            # cleared in memory, not yet in the state
        assert [r[:2] for r in plane.store.shard_reconfirmations()] == [("a", 2)]   # pending there still
        monkeypatch.setattr(plane.store, "record_shard_events", real)
        assert c.receive("a", 2, "m1", []) == 1
        plane.stop(0.5)
        plane = _coordinator(tmp_path)
        assert "n2" not in plane.policy.alarms and plane.store.shard_fabric_findings() == []
        assert plane.store.shard_reconfirmations() == [] and plane.coordinator._reconfirm == {}
    finally:
        plane.stop(0.5)


def test_a_takeover_during_a_reconfirmation_ends_it_when_due_clearing_what_the_old_leader_would_have(tmp_path):
    """The pending reconfirmations are in the state, written with the batches that start them and take
    something off them: coordinators that take over during them end them when due (a's by its batch, b's
    by the rounds) and clear what the shards' new instances did not raise again, before a takeover or
    after one, keeping what they did; what is read back after that has nothing pending."""
    plane = _coordinator(tmp_path)
    S = 1_000_000_000
    t = [time.time_ns()]

    def take_over():
        nonlocal plane
        plane.stop(0.5)
        plane = _coordinator(tmp_path)
        plane.coordinator.clock = lambda: t[0]
        return plane.coordinator

    try:
        c = plane.coordinator
        c.clock = lambda: t[0]
        c.receive("a", 1, "m1", [ShardEvent(1, EventKind.ALARM, "n2", 0.9, ts_ns=t[0]),
                                 ShardEvent(2, EventKind.ALARM, "n3", 0.9, ts_ns=t[0]),
                                 ShardEvent(3, EventKind.ALARM, "n7", 0.9, ts_ns=t[0]),
                                 _finding(4, "s0", "down", True), _finding(5, "s1", "crash_loop", True),
                                 _finding(6, "s2", "down", True)])
        c.receive("b", 1, "m1", [ShardEvent(1, EventKind.ALARM, "n5", 0.9, ts_ns=t[0])])
        t[0] += 10 * S   # both restart; a's new instance raises n3 again before the takeover
        c.receive("a", 2, "m1", [ShardEvent(1, EventKind.ALARM, "n3", 0.8, ts_ns=t[0])])
        c.receive("b", 2, "m1", [ShardEvent(1, EventKind.RISK, "n5", 0.1, ts_ns=t[0])])
        until = t[0] + 1200 * S
        assert [r[:4] for r in plane.store.shard_reconfirmations()] == [("a", 2, until, '["n2", "n7"]'),
                                                                        ("b", 2, until, '["n5"]')]

        c = take_over()
        units, alarms = plane.policy.units, plane.policy.alarms
        assert {"n2", "n3", "n5", "n7"} <= set(alarms) and units.down("s0", FM)   # held
        t[0] += 60 * S   # ... and s1's finding and n7 after it, which the next takeover reads back too
        c.receive("a", 2, "m1", [_finding(2, "s1", "crash_loop", True),
                                 ShardEvent(3, EventKind.ALARM, "n7", 0.8, ts_ns=t[0])])
        c = take_over()
        units, alarms = plane.policy.units, plane.policy.alarms
        assert {"n2", "n5"} <= set(alarms) and units.down("s2", FM)
        t[0] += 1200 * S
        assert c.receive("a", 2, "m1", []) == 3 and c.end_due_reconfirmations(t[0]) == 1
        assert not {"n2", "n5"} & set(alarms) and {"n3", "n7"} <= set(alarms)
        assert not units.down("s0", FM) and not units.down("s2", FM) and units.crash_looping("s1", FM)
        assert c.reconfirm_cleared == {"alarm": 2, "fabric_finding": 2}
        [row] = [r for r in _decisions(plane, "cleared") if r["node"] == "n2"]
        assert "not raised again by shard a's new instance within 1200 s" in row["reason"]
        assert plane.store.shard_reconfirmations() == []

        c = take_over()   # durable: nothing pending, what was cleared stays cleared
        assert c._reconfirm == {} and {n for n, st in c._state.items() if st.alarm} == {"n3", "n7"}
        assert [f[:4] for f in plane.store.shard_fabric_findings()] == [("s1", FM, "crash_loop", "a")]
    finally:
        plane.stop(0.5)


def test_a_restarted_forwarder_that_raises_nothing_again_has_its_old_alarm_cleared_by_the_rounds(tmp_path):
    """Over the stream: the shard's first instance forwards an alarm and a Fabric Manager finding, a second
    (a new epoch) forwards one risk summary and then nothing; the coordinator's own rounds end the
    reconfirmation (1 s here) and clear both."""
    plane = build_server(Settings.insecure_loopback(
        tmp_path / "state", coordinator=CoordinatorSettings(str(tmp_path / "lease"), lock_poll_seconds=0.05,
                                                            reconfirm_seconds=1.0),
        threshold=0.5, policy={"stale_seconds": 3600.0}))
    plane.start()
    first = _forwarder(plane.address)
    second = None
    try:
        assert wait_until(lambda: plane.leading, 10)
        first.put(K.SHARD_EVENT_KIND_ALARM, "n2", risk=0.9, ts_ns=time.time_ns(), description="risk 0.9")
        first.put(K.SHARD_EVENT_KIND_FABRIC_SERVICE, "s0", ts_ns=time.time_ns(), unit=FM, finding="down",
                  raised=True, description="nvidia-fabricmanager.service failed on s0 for 70 s")
        first.start()
        assert wait_until(lambda: first.buffered() == 0, 10)
        first.stop(0)
        assert "n2" in plane.policy.alarms and plane.policy.units.down("s0", FM)

        time.sleep(0.01)   # the epoch is the forwarder's start time
        second = _forwarder(plane.address)
        second.put(K.SHARD_EVENT_KIND_RISK, "n2", risk=0.1, ts_ns=time.time_ns())
        second.start()
        assert wait_until(lambda: second.buffered() == 0, 10)
        assert wait_until(lambda: "n2" not in plane.policy.alarms and not plane.policy.units.down("s0", FM), 10), \
            "the coordinator's rounds did not end the reconfirmation"
        assert plane.coordinator.reconfirm_cleared == {"alarm": 1, "fabric_finding": 1}
        assert plane.store.shard_fabric_findings() == []
    finally:
        first.stop(0)
        if second is not None:
            second.stop(0)
        plane.stop(0.5)
