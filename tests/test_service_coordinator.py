"""The jobs coordinator and a shard's forwarder on loopback (service/coordinator.py, service/forwarder.py):
a leader killed in the middle of a directive and its standby taking over on the shared state, with the
job's client (the migrator's) and the shard's forwarder moving to it; no directive issued twice, none
lost. Then the forwarder across a coordinator outage, its bounded buffer, redelivery known by id, a
shard with another model, and the bad input the coordinator refuses."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import Serve, wait_until

from foreshock.migrator import Ack, AckPhase, MigratorConfig, ServiceClient
from foreshock.migrator.directives import DirectiveBook
from foreshock.service.coordinator import (
    CoordinatorSettings, EventKind, LeaderLock, ShardEvent, check_events)
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


def _coordinator(tmp_path, **settings) -> "object":
    plane = build_server(Settings.insecure_loopback(
        tmp_path / "state", coordinator=CoordinatorSettings(str(tmp_path / "lease"), lock_poll_seconds=0.05),
        threshold=0.5, policy={"stale_seconds": 3600.0}, **settings))
    plane.start()
    assert wait_until(lambda: plane.leading, 10)
    return plane


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


@pytest.mark.parametrize("moment", ["after_commit", "before_commit"])
def test_no_directive_twice_none_lost_across_a_takeover(tmp_path, moment):
    """The leader dies in the middle of the shard's fatal event: once it has committed the directive
    (and announced it) but before the shard has its ack, or before the commit. The standby, a real
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

        assert leader.wait(15) == -9, "the leader did not die in the middle of the directive"
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
        standby.metrics = took_over.split("metrics on ")[1].split()[0]
        duplicate = standby.metric('foreshock_coordinator_events_total{result="duplicate",shard="shard-a"}')
        assert duplicate == (3 if moment == "after_commit" else 0)
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
