"""The Jobs API on a real server on port 0: register, drain, watch, ack, cancel; durable across restarts;
every message type refused with the right status when malformed, with nothing changed."""

from __future__ import annotations

import math

import grpc
import pytest

from foreshock.service import domain
from foreshock.service.server import Settings, SettingsError, build_server
from foreshock.v1 import jobs_pb2 as pb
from foreshock.v1 import jobs_pb2_grpc

T = 10  # seconds: every call in these tests has a deadline


def _register(stub, job_id="j1", nodes=("n0", "n1"), spares=("s0",), step=100, **kw):
    ranks = [pb.RankPlacement(rank=i, node=nodes[i // 2], gpus=[i % 2]) for i in range(2 * len(nodes))]
    return stub.RegisterJob(pb.RegisterJobRequest(job_id=job_id, ranks=ranks, spare_nodes=list(spares),
                                                  current_step=step, **kw), timeout=T)


@pytest.fixture
def plane_settings():
    """The shipped default model instead of NullScorer; decisions written as they are made."""
    return {"decision_flush_seconds": 0.0}


@pytest.fixture
def stub(plane):
    with grpc.insecure_channel(plane.address) as ch:
        yield jobs_pb2_grpc.JobsStub(ch)


def test_enums_mirror_the_proto():
    for enum, proto_enum, prefix in ((domain.DirectiveKind, pb.DirectiveKind, "DIRECTIVE_KIND_"),
                                     (domain.DirectiveState, pb.DirectiveState, "DIRECTIVE_STATE_"),
                                     (domain.AckPhase, pb.AckPhase, "ACK_PHASE_"),
                                     (domain.Fallback, pb.FallbackPolicy, "FALLBACK_POLICY_"),
                                     (domain.DirectiveCause, pb.DirectiveCause, "DIRECTIVE_CAUSE_")):
        for member in enum:
            assert proto_enum.Value(prefix + member.name) == member.value


def test_drain_watch_ack_moves_the_ranks_to_the_spare(plane, stub):
    assert _register(stub).generation == 1
    stub.ReportStep(pb.ReportStepRequest(job_id="j1", step=120, step_seconds=0.5), timeout=T)
    watch = stub.WatchDirectives(pb.WatchDirectivesRequest(job_id="j1", rank=0), timeout=T)
    drained = stub.DrainNode(pb.DrainNodeRequest(node="n1", reason="maintenance"), timeout=T).directives
    assert len(drained) == 1
    d = next(watch)
    assert d.directive_id == drained[0].directive_id
    assert (d.kind, list(d.ranks), d.from_node, d.to_node) == (pb.DIRECTIVE_KIND_EVACUATE, [2, 3], "n1", "s0")
    assert d.at_step >= 120 + 20   # 10 s lead at 0.5 s a step: every rank hears before the boundary
    assert "maintenance" in d.reason and d.state == pb.DIRECTIVE_STATE_PENDING
    # Draining again returns the same directive: never issued twice.
    again = stub.DrainNode(pb.DrainNodeRequest(node="n1"), timeout=T).directives
    assert [x.directive_id for x in again] == [d.directive_id]
    for phase, state in ((pb.ACK_PHASE_ACCEPTED, pb.DIRECTIVE_STATE_ACCEPTED),
                         (pb.ACK_PHASE_STATE_TRANSFERRED, pb.DIRECTIVE_STATE_STATE_TRANSFERRED),
                         (pb.ACK_PHASE_COMPLETED, pb.DIRECTIVE_STATE_COMPLETED)):
        got = stub.AckDirective(pb.AckDirectiveRequest(job_id="j1", directive_id=d.directive_id, rank=2,
                                                       phase=phase, phase_seconds=0.1), timeout=T)
        assert got.state == state
    # A late duplicate ack changes nothing.
    late = stub.AckDirective(pb.AckDirectiveRequest(job_id="j1", directive_id=d.directive_id, rank=3,
                                                    phase=pb.ACK_PHASE_ACCEPTED), timeout=T)
    assert late.state == pb.DIRECTIVE_STATE_COMPLETED
    job = plane.store.job("j1")
    assert job.generation == 2 and job.ranks_on("s0") == (2, 3) and job.spares == ()
    assert len(plane.store.acks(d.directive_id)) == 4
    watch.cancel()


def test_no_spare_falls_back_to_the_jobs_policy(plane, stub):
    _register(stub, "shrinker", spares=(), fallback=pb.FALLBACK_POLICY_SHRINK)
    _register(stub, "ckpt", nodes=("m0", "m1"), spares=())
    (d,) = stub.DrainNode(pb.DrainNodeRequest(node="n0"), timeout=T).directives
    assert d.kind == pb.DIRECTIVE_KIND_SHRINK and "no usable spare" in d.reason
    (d,) = stub.DrainNode(pb.DrainNodeRequest(node="m0"), timeout=T).directives
    assert d.kind == pb.DIRECTIVE_KIND_CHECKPOINT_EXIT


def test_cancel_reaches_the_watcher_and_is_final(plane, stub):
    _register(stub)
    watch = stub.WatchDirectives(pb.WatchDirectivesRequest(job_id="j1", rank=1), timeout=T)
    (d,) = stub.DrainNode(pb.DrainNodeRequest(node="n0"), timeout=T).directives
    assert next(watch).state == pb.DIRECTIVE_STATE_PENDING
    got = stub.CancelDirective(pb.CancelDirectiveRequest(directive_id=d.directive_id, reason="false alarm"), timeout=T)
    assert got.state == pb.DIRECTIVE_STATE_CANCELLED
    seen = next(watch)
    assert (seen.directive_id, seen.state) == (d.directive_id, pb.DIRECTIVE_STATE_CANCELLED)
    ack = stub.AckDirective(pb.AckDirectiveRequest(job_id="j1", directive_id=d.directive_id, rank=0,
                                                   phase=pb.ACK_PHASE_COMPLETED), timeout=T)
    assert ack.state == pb.DIRECTIVE_STATE_CANCELLED
    assert plane.store.job("j1").generation == 1  # the cancelled move never happened
    watch.cancel()


def test_state_survives_a_restart_and_watchers_get_unfinished_directives_again(tmp_path):
    state = tmp_path / "state"
    plane = build_server(Settings.insecure_loopback(state))
    plane.start()
    with grpc.insecure_channel(plane.address) as ch:
        stub = jobs_pb2_grpc.JobsStub(ch)
        _register(stub)
        (d,) = stub.DrainNode(pb.DrainNodeRequest(node="n1"), timeout=T).directives
        stub.AckDirective(pb.AckDirectiveRequest(job_id="j1", directive_id=d.directive_id, rank=2,
                                                 phase=pb.ACK_PHASE_ACCEPTED), timeout=T)
    plane.stop(grace=0)
    plane = build_server(Settings.insecure_loopback(state))
    plane.start()
    try:
        with grpc.insecure_channel(plane.address) as ch:
            stub = jobs_pb2_grpc.JobsStub(ch)
            watch = stub.WatchDirectives(pb.WatchDirectivesRequest(job_id="j1", rank=2), timeout=T)
            first = next(watch)
            assert (first.directive_id, first.state) == (d.directive_id, pb.DIRECTIVE_STATE_ACCEPTED)
            again = stub.DrainNode(pb.DrainNodeRequest(node="n1"), timeout=T).directives
            assert [x.directive_id for x in again] == [d.directive_id]
            listed = stub.ListDirectives(pb.ListDirectivesRequest(job_id="j1"), timeout=T).directives
            assert len(listed) == 1
            watch.cancel()
    finally:
        plane.stop(grace=0)


# -- bad input: every message type -------------------------------------------------------------------
def _code(call, *args):
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=T)
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("req, needle", [
    (pb.RegisterJobRequest(job_id="", ranks=[pb.RankPlacement(rank=0, node="n0")]), "job_id"),
    (pb.RegisterJobRequest(job_id="bad id!", ranks=[pb.RankPlacement(rank=0, node="n0")]), "job_id"),
    (pb.RegisterJobRequest(job_id="j9"), "ranks is empty"),
    (pb.RegisterJobRequest(job_id="j9", ranks=[pb.RankPlacement(rank=0, node="n0"),
                                              pb.RankPlacement(rank=0, node="n1")]), "rank 0 is placed twice"),
    (pb.RegisterJobRequest(job_id="j9", ranks=[pb.RankPlacement(rank=0, node="")]), "node"),
    (pb.RegisterJobRequest(job_id="j9", ranks=[pb.RankPlacement(rank=0, node="n0", gpus=[1, 1])]), "gpus"),
    (pb.RegisterJobRequest(job_id="j9", ranks=[pb.RankPlacement(rank=0, node="n0")], spare_nodes=["n0"]),
     "spare node 'n0' also hosts"),
    (pb.RegisterJobRequest(job_id="j9", ranks=[pb.RankPlacement(rank=0, node="n0")], fallback=7), "fallback"),
    (pb.RegisterJobRequest(job_id="j9", ranks=[pb.RankPlacement(rank=0, node="n0")],
                           max_concurrent_evacuations=5000), "max_concurrent"),
])
def test_bad_register_is_refused_and_stores_nothing(plane, stub, req, needle):
    code, details = _code(stub.RegisterJob, req)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details
    assert plane.store.jobs() == []


def test_bad_step_reports(plane, stub):
    _register(stub)
    assert _code(stub.ReportStep, pb.ReportStepRequest(job_id="nope", step=1))[0] == grpc.StatusCode.NOT_FOUND
    for bad in (math.nan, math.inf, -1.0):
        code, details = _code(stub.ReportStep, pb.ReportStepRequest(job_id="j1", step=5, step_seconds=bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "step_seconds" in details
    assert plane.store.job("j1").step == 100


def test_bad_deregister_watch_ack_cancel_list_drain(plane, stub):
    _register(stub)
    _register(stub, "other", nodes=("m0", "m1"), spares=())
    (d,) = stub.DrainNode(pb.DrainNodeRequest(node="n0"), timeout=T).directives
    nf, ia, pd = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED
    assert _code(stub.DeregisterJob, pb.DeregisterJobRequest(job_id="nope"))[0] == nf
    assert _code(stub.DeregisterJob, pb.DeregisterJobRequest(job_id=""))[0] == ia
    with pytest.raises(grpc.RpcError) as info:
        next(stub.WatchDirectives(pb.WatchDirectivesRequest(job_id="nope"), timeout=T))
    assert info.value.code() == nf
    ack = pb.AckDirectiveRequest(job_id="j1", directive_id=d.directive_id, rank=0, phase=pb.ACK_PHASE_ACCEPTED)
    for change, code, needle in (
            ({"directive_id": "missing"}, nf, "missing"),
            ({"phase": pb.ACK_PHASE_UNSPECIFIED}, ia, "phase"),
            ({"phase": 9}, ia, "phase"),
            ({"rank": 77}, ia, "no rank 77"),
            ({"phase_seconds": math.nan}, ia, "phase_seconds"),
            ({"reason": "x" * 5000}, ia, "reason"),
            ({"job_id": "other"}, pd, "another job")):   # a rank acknowledging another job's directive
        bad = pb.AckDirectiveRequest()
        bad.CopyFrom(ack)
        for k, v in change.items():
            setattr(bad, k, v)
        got_code, details = _code(stub.AckDirective, bad)
        assert got_code == code and needle in details, (change, got_code, details)
    assert plane.store.directive(d.directive_id).state == domain.DirectiveState.PENDING
    assert plane.store.acks(d.directive_id) == []
    assert _code(stub.CancelDirective, pb.CancelDirectiveRequest(directive_id="missing"))[0] == nf
    assert _code(stub.CancelDirective, pb.CancelDirectiveRequest(directive_id=""))[0] == ia
    assert _code(stub.ListDirectives, pb.ListDirectivesRequest(job_id="bad id!"))[0] == ia
    assert _code(stub.DrainNode, pb.DrainNodeRequest(node="unknown-node"))[0] == nf
    assert _code(stub.DrainNode, pb.DrainNodeRequest(node=""))[0] == ia
    assert len(plane.store.directives()) == 1


def test_deregister_cancels_active_directives(plane, stub):
    _register(stub)
    (d,) = stub.DrainNode(pb.DrainNodeRequest(node="n0"), timeout=T).directives
    stub.DeregisterJob(pb.DeregisterJobRequest(job_id="j1"), timeout=T)
    assert plane.store.directive(d.directive_id).state == domain.DirectiveState.CANCELLED
    assert plane.store.find_job("j1") is None


def test_insecure_mode_is_loopback_only(tmp_path):
    with pytest.raises(SettingsError, match="loopback"):
        build_server(Settings(state_dir=tmp_path, listen="0.0.0.0:0", insecure=True))
    with pytest.raises(SettingsError, match="TLS"):
        build_server(Settings(state_dir=tmp_path, listen="0.0.0.0:0"))


@pytest.mark.parametrize("field, value, says", [
    ("listen", "garbage", "not HOST:PORT"), ("listen", "127.0.0.1:99999", "99999"),
    ("metrics_listen", "9464", "not HOST:PORT")])
def test_an_address_that_is_not_host_port_is_named_as_such(tmp_path, field, value, says):
    kwargs = {"listen": "127.0.0.1:0", field: value}
    with pytest.raises(SettingsError, match=f"{field} '{value}': .*{says}"):
        build_server(Settings(state_dir=tmp_path, insecure=True, **kwargs))


def test_bad_risk_requests(plane):
    from foreshock.v1 import risk_pb2, risk_pb2_grpc
    with grpc.insecure_channel(plane.address) as ch:
        risk = risk_pb2_grpc.RiskStub(ch)
        ia = grpc.StatusCode.INVALID_ARGUMENT
        assert _code(risk.GetNodeRisk, risk_pb2.GetNodeRiskRequest(node=""))[0] == ia
        assert _code(risk.GetNodeRisk, risk_pb2.GetNodeRiskRequest(node="n0"))[0] == grpc.StatusCode.NOT_FOUND
        code, details = _code(risk.ListRiskiest, risk_pb2.ListRiskiestRequest(limit=5000))
        assert code == ia and "limit" in details
        for bad in (math.nan, -0.5, 2.0):
            code, details = _code(risk.ListRiskiest, risk_pb2.ListRiskiestRequest(min_probability=bad))
            assert code == ia and "min_probability" in details
        assert risk.ListRiskiest(risk_pb2.ListRiskiestRequest(), timeout=T).nodes == []
        for req, needle in ((risk_pb2.WatchRiskRequest(min_change=math.nan), "min_change"),
                            (risk_pb2.WatchRiskRequest(nodes=["bad node!"]), "node")):
            with pytest.raises(grpc.RpcError) as info:
                next(risk.WatchRisk(req, timeout=T))
            assert info.value.code() == ia and needle in info.value.details()


def test_a_replay_clock_is_the_one_clock_of_step_reports_and_drains(tmp_path):
    """With a scoring clock hours behind the wall (a replay), the switch step is still a few steps ahead."""
    import time as _time

    import grpc as _grpc

    from foreshock.service.server import Settings, build_server
    from foreshock.v1 import jobs_pb2 as pb, jobs_pb2_grpc as pbg

    offset = 5 * 3600 * 10**9
    plane = build_server(Settings.insecure_loopback(tmp_path, scoring_clock=lambda: _time.time_ns() - offset))
    port = plane.start()
    try:
        with _grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            jobs = pbg.JobsStub(ch)
            jobs.RegisterJob(pb.RegisterJobRequest(job_id="replay", spare_nodes=["s0"], ranks=[
                pb.RankPlacement(rank=0, node="a"), pb.RankPlacement(rank=1, node="b")]), timeout=5)
            jobs.ReportStep(pb.ReportStepRequest(job_id="replay", step=100, step_seconds=1.0), timeout=5)
            (d,) = jobs.DrainNode(pb.DrainNodeRequest(node="b", reason="test"), timeout=5).directives
            assert 100 < d.at_step < 150, d.at_step
            assert abs(d.issued_at.seconds - (_time.time_ns() - offset) / 1e9) < 60
    finally:
        plane.stop()
