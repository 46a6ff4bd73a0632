"""Job step times and the fail-slow rule: the migrator's gRPC client reporting each rank's step times to
a real control plane on a port (service/steptimes.py, docs/service.md "Fail-slow").

A synchronous job is modelled as it runs: every rank's whole step is the same (all wait for the slowest
in the all-reduce), and only the compute part differs."""

from __future__ import annotations

import math
import random
import socket
import subprocess
import time

import grpc
import pytest
from prometheus_client import generate_latest

from foreshock.migrator import MigratorConfig, ServiceClient
from foreshock.service.scoring import NullScorer
from foreshock.service.server import Settings, SettingsError, build_server
from foreshock.v1 import jobs_pb2 as pb
from foreshock.v1 import jobs_pb2_grpc
from support import wait_until

T = 5.0
S = 10**9                   # ns
NODES = ["n0", "n1", "n2", "n3", "n4", "n5"]
POLICY = {"lead_seconds": 0.1, "min_steps_ahead": 3, "stale_seconds": 3600.0}


@pytest.fixture
def plane_settings():
    return {"scorer": NullScorer(), "policy": POLICY, "decision_flush_seconds": 3600}


@pytest.fixture
def stub(plane):
    with grpc.insecure_channel(plane.address) as ch:
        yield jobs_pb2_grpc.JobsStub(ch)


def _register(stub, job="j1", nodes=NODES, spares=("s0",)):
    return stub.RegisterJob(pb.RegisterJobRequest(
        job_id=job, ranks=[pb.RankPlacement(rank=i, node=n) for i, n in enumerate(nodes)],
        spare_nodes=list(spares), fallback=pb.FALLBACK_POLICY_SHRINK), timeout=T)


def _clients(address, job="j1", nodes=NODES, interval=0.05):
    out = []
    for rank, node in enumerate(nodes):
        config = MigratorConfig.from_env({}, job_id=job, rank=rank, world_size=len(nodes), node=node,
                                         store="127.0.0.1:1", service=address, rpc_timeout_s=1.0,
                                         step_report_interval_s=interval)
        out.append(ServiceClient(config, backoff_initial_s=0.05, backoff_max_s=0.3))
    return out


def _run_job(clients, steps, compute_of, seed=0):
    """Each rank records `steps` synchronous steps: compute_of(rank, step) seconds of its own work,
    then the all-reduce, which ends for everyone when the slowest rank has entered it."""
    rng = random.Random(seed)
    for step in range(steps):
        compute = [compute_of(rank, step, rng) for rank in range(len(clients))]
        total = max(compute) + 0.01
        for rank, c in enumerate(clients):
            c.record_step_time(rank, step, total, compute[rank])


def _wait(pred, timeout=10.0, what="condition"):
    value = wait_until(pred, timeout, 0.02)
    if not value:
        raise AssertionError(f"{what} not met in {timeout} s")
    return value


def _directives(stub, job="j1"):
    return list(stub.ListDirectives(pb.ListDirectivesRequest(job_id=job), timeout=T).directives)


def _kept(plane):
    return plane.step_times.samples["kept"]


def _received(plane):
    """Step times the service has taken in: kept, old (a rank's batch that came after the others'
    newer steps had pushed its steps out of the window) or repeated."""
    return sum(plane.step_times.samples.values())


def _close(clients):
    for c in clients:
        c.close()


def _metric(plane, name, labels):
    for family in plane.registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def test_a_rank_slow_in_its_compute_gets_a_fail_slow_directive_for_its_node(plane, stub):
    _register(stub)
    clients = _clients(plane.address)
    try:
        # rank 2 computes 1.5x as long as the others; every rank's whole step is the same
        _run_job(clients, 40, lambda r, s, rng: (0.075 if r == 2 else 0.05) * rng.uniform(0.97, 1.03))
        d = _wait(lambda: _directives(stub), what="a directive")[0]
        assert d.cause == pb.DIRECTIVE_CAUSE_FAIL_SLOW
        assert (d.kind, list(d.ranks), d.from_node, d.to_node) == (pb.DIRECTIVE_KIND_EVACUATE, [2], "n2", "s0")
        assert "fail-slow: rank 2 compute time 1.5" in d.reason, d.reason
        _wait(lambda: _received(plane) == 40 * len(NODES), what="every step time in")
        assert all(c.dropped_step_times == 0 for c in clients)
        # its own alarm class: logged, and exported per node and job
        kinds = [(r["kind"], r["node"]) for r in plane.decisions.buffered()]
        assert ("fail_slow", "n2") in kinds and ("evacuate", "n2") in kinds
        assert _metric(plane, "foreshock_node_fail_slow", {"node": "n2", "job": "j1"}) == 1.0
        assert 1.4 < _metric(plane, "foreshock_node_fail_slow_ratio", {"node": "n2", "job": "j1"}) < 1.6
        assert _metric(plane, "foreshock_node_fail_slow", {"node": "n1", "job": "j1"}) is None
        text = generate_latest(plane.registry).decode()
        assert 'foreshock_node_fail_slow{job="j1",node="n2"} 1.0' in text
        checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                                 timeout=30)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        # the move completes: the window starts over on the new placement and the alarm clears
        for phase in (pb.ACK_PHASE_ACCEPTED, pb.ACK_PHASE_STATE_TRANSFERRED, pb.ACK_PHASE_COMPLETED):
            stub.AckDirective(pb.AckDirectiveRequest(job_id="j1", directive_id=d.directive_id, rank=0,
                                                     phase=phase), timeout=T)
        _wait(lambda: not plane.policy.fail_slow, what="the alarm to clear")
        assert ("fail_slow_cleared", "n2") in [(r["kind"], r["node"]) for r in plane.decisions.buffered()]
    finally:
        _close(clients)


def test_a_job_whose_ranks_are_all_equally_slow_raises_no_alarm(plane, stub):
    _register(stub)
    clients = _clients(plane.address)
    try:
        # the whole job runs at twice its usual step time, every rank alike (jitter of a few per cent)
        _run_job(clients, 40, lambda r, s, rng: 0.1 * rng.uniform(0.95, 1.05))
        _wait(lambda: _received(plane) == 40 * len(NODES), what="every step time in")
        rounds = plane.scoring.rounds["interval"]
        _wait(lambda: plane.scoring.rounds["interval"] >= rounds + 3, what="three policy rounds")
        assert plane.policy.fail_slow == {}
        assert _directives(stub) == []
        assert "fail_slow" not in [r["kind"] for r in plane.decisions.buffered()]
    finally:
        _close(clients)


def test_an_occasional_slow_step_is_not_fail_slow(plane, stub):
    _register(stub)
    clients = _clients(plane.address)
    try:
        # rank 4 is slow at one step in four (a garbage collection, a checkpoint write): under 12 of 16
        _run_job(clients, 40, lambda r, s, rng: 0.1 if (r == 4 and s % 4 == 0) else 0.05)
        _wait(lambda: _received(plane) == 40 * len(NODES), what="every step time in")
        rounds = plane.scoring.rounds["interval"]
        _wait(lambda: plane.scoring.rounds["interval"] >= rounds + 3, what="three policy rounds")
        assert plane.policy.fail_slow == {}
    finally:
        _close(clients)


def test_fail_slow_directives_keep_the_jobs_limits(plane, stub):
    _register(stub)
    clients = _clients(plane.address)
    try:
        # two slow nodes, one active evacuation per job (the default): the second waits, and says so
        _run_job(clients, 40, lambda r, s, rng: 0.08 if r in (1, 4) else 0.05)
        _wait(lambda: len(plane.policy.fail_slow) == 2, what="two nodes fail-slow")
        _wait(lambda: _directives(stub), what="a directive")
        rounds = plane.scoring.rounds["interval"]
        _wait(lambda: plane.scoring.rounds["interval"] >= rounds + 3, what="three policy rounds")
        ds = _directives(stub)      # the second node waits for the first's move: one directive
        assert len(ds) == 1 and ds[0].cause == pb.DIRECTIVE_CAUSE_FAIL_SLOW
        assert "deferred_max_concurrent" in [r["kind"] for r in plane.decisions.buffered()]
    finally:
        _close(clients)


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_unreachable_control_plane_drops_and_counts_and_never_raises():
    config = MigratorConfig.from_env({}, job_id="j1", rank=0, world_size=1, node="n0", store="127.0.0.1:1",
                                     service=f"127.0.0.1:{_closed_port()}", rpc_timeout_s=0.5,
                                     step_report_interval_s=0.05)
    client = ServiceClient(config, backoff_initial_s=0.05, backoff_max_s=0.3)
    try:
        for step in range(3000):      # the loop goes on; the ring holds 1,024, the rest is counted
            client.record_step_time(0, step, 0.01, 0.005)
        _wait(lambda: client.dropped_step_times == 3000, what="every step time counted as dropped")
        assert client.sent_step_times == 0 and not client.healthy
    finally:
        client.close()


def _report(stub, steps, job="j1", rank=0, node="n0"):
    request = pb.ReportStepTimesRequest(job_id=job, rank=rank, node=node, steps=steps)
    return stub.ReportStepTimes(request, timeout=T)


@pytest.mark.parametrize("steps, rank, node, job, code, words", [
    ([pb.StepTime(step=1, step_seconds=-0.5)], 0, "n0", "j1", "INVALID_ARGUMENT", "steps[0].step_seconds -0.5"),
    ([pb.StepTime(step=1, step_seconds=0.5), pb.StepTime(step=2, step_seconds=math.nan)], 0, "n0", "j1",
     "INVALID_ARGUMENT", "steps[1].step_seconds nan"),
    ([pb.StepTime(step=1, step_seconds=0.5, compute_seconds=0.9)], 0, "n0", "j1", "INVALID_ARGUMENT",
     "steps[0].compute_seconds 0.9"),
    ([pb.StepTime(step=1, step_seconds=0.5, compute_seconds=-1)], 0, "n0", "j1", "INVALID_ARGUMENT",
     "steps[0].compute_seconds -1"),
    ([pb.StepTime(step=i, step_seconds=0.5) for i in range(1025)], 0, "n0", "j1", "INVALID_ARGUMENT",
     "at most 1024"),
    ([pb.StepTime(step=1, step_seconds=0.5, end_ns=time.time_ns() + 3600 * S)], 0, "n0", "j1",
     "INVALID_ARGUMENT", "steps[0].end_ns"),
    ([pb.StepTime(step=1, step_seconds=0.5, end_ns=time.time_ns()),
      pb.StepTime(step=2, step_seconds=0.5, end_ns=time.time_ns() - 2 * 86_400 * S)], 0, "n0", "j1",
     "INVALID_ARGUMENT", "steps[1].end_ns"),
    ([pb.StepTime(step=1, step_seconds=0.5, end_ns=-1)], 0, "n0", "j1", "INVALID_ARGUMENT", "steps[0].end_ns -1"),
    ([], 0, "n0", "j1", "INVALID_ARGUMENT", "steps is empty"),
    ([pb.StepTime(step=1, step_seconds=0.5)], 17, "n0", "j1", "INVALID_ARGUMENT", "has no rank 17"),
    ([pb.StepTime(step=1, step_seconds=0.5)], 0, "n9", "j1", "FAILED_PRECONDITION",
     "placed on node 'n0', not 'n9'"),
    ([pb.StepTime(step=1, step_seconds=0.5)], 0, "bad node!", "j1", "INVALID_ARGUMENT", "node 'bad node!'"),
    ([pb.StepTime(step=1, step_seconds=0.5)], 0, "n0", "nope", "NOT_FOUND", "job 'nope' is not registered"),
])
def test_bad_step_times_are_refused_naming_the_field(plane, stub, steps, rank, node, job, code, words):
    _register(stub)
    with pytest.raises(grpc.RpcError) as err:
        _report(stub, steps, job=job, rank=rank, node=node)
    assert err.value.code().name == code
    assert words in err.value.details(), err.value.details()
    assert _kept(plane) == 0 and plane.step_times.refused_reports == 1
    # the service keeps running, and takes a good report
    assert _report(stub, [pb.StepTime(step=1, step_seconds=0.5, compute_seconds=0.4)]).accepted == 1
    assert _report(stub, [pb.StepTime(step=1, step_seconds=0.5, compute_seconds=0.4)]).accepted == 0  # re-sent


def test_every_rpc_has_its_roles_so_none_is_open_by_omission():
    from foreshock.service.auth import PERMISSIONS
    for service in pb.DESCRIPTOR.services_by_name.values():
        for method in service.methods:
            assert f"/{service.full_name}/{method.name}" in PERMISSIONS, method.name
    assert PERMISSIONS["/foreshock.v1.Jobs/ReportStepTimes"] == {"job", "operator"}


def test_fail_slow_settings_are_range_checked(tmp_path):
    for bad, words in (({"ratio": 1.0}, "fail_slow_ratio 1.0"),
                       ({"window": 8, "min_steps": 9}, "fail_slow_min_steps 9 must be <= fail_slow_window 8"),
                       ({"min_ranks": 2}, "fail_slow_min_ranks 2"), ({"mad_k": math.nan}, "fail_slow_mad_k nan"),
                       ({"window": 2.5}, "fail_slow_window 2.5"), ({"windows": 3}, "windows")):
        with pytest.raises(SettingsError, match="fail_slow") as err:
            build_server(Settings.insecure_loopback(tmp_path / "s", scorer=NullScorer(), fail_slow=bad))
        assert words in str(err.value)


def test_serve_takes_the_fail_slow_settings_from_its_config(tmp_path):
    from foreshock import config
    from foreshock.service import command

    cfg = config.resolve("serve", command.DEFAULTS, env={"FORESHOCK_SERVE_FAIL_SLOW_RATIO": "1.5"},
                         flags={"fail_slow_window": 20, "state": str(tmp_path), "no_model": True,
                                "insecure": True, "metrics_listen": ""},
                         checks=command.CHECKS)
    settings = command.settings_from(cfg)
    assert settings.fail_slow == {"enabled": True, "ratio": 1.5, "min_steps": 12, "window": 20}
    plane = build_server(settings)   # not started: the settings are checked at construction
    assert (plane.step_times.settings.ratio, plane.step_times.settings.window) == (1.5, 20)
    plane.store.close()
    cfg["fail_slow_min_steps"] = 30
    with pytest.raises(SettingsError, match="fail_slow_min_steps 30 must be <= fail_slow_window 20"):
        build_server(command.settings_from(cfg))


def test_ranks_cut_their_reports_into_the_same_blocks_of_steps():
    from foreshock.migrator.client import step_block

    assert step_block(0.1, 5.0) == 32 and step_block(0.01, 5.0) == 256 and step_block(0.001, 5.0) == 256
    assert step_block(10.0, 5.0) == 1 and step_block(2.5, 5.0) == 2


def test_short_steps_are_judged_with_every_rank(plane, stub):
    """Steps of 10 ms: each rank sends blocks of 256 steps aligned on step numbers, more than the
    service's window holds; it keeps the newest steps of each block, which every rank sent."""
    _register(stub)
    clients = _clients(plane.address, interval=2.56)
    try:
        _run_job(clients, 512, lambda r, s, rng: 0.012 if r == 3 else 0.008)
        _wait(lambda: all(c.sent_step_times == 512 for c in clients), what="every block sent")
        (d,) = _wait(lambda: _directives(stub), what="a directive")
        assert (d.cause, d.from_node) == (pb.DIRECTIVE_CAUSE_FAIL_SLOW, "n3")
        assert plane.step_times.samples["kept"] >= len(NODES) * 32
    finally:
        _close(clients)


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_accepted_step_times_are_archived_and_refused_ones_are_not(tmp_path, process):
    """Each accepted report's new samples become `step_times` rows of the archive (schema v1), through its
    writer thread or its process; a refused report, and a re-sent sample, add none."""
    from foreshock import dataset as ds
    from foreshock import schema as sch
    from foreshock.service.archive import ArchiveSettings

    archive = tmp_path / "archive"
    now = 1_767_571_200 * 10**9
    plane = build_server(Settings.insecure_loopback(
        tmp_path / "state", scorer=NullScorer(), policy=POLICY, decision_flush_seconds=3600, fsync=False,
        scoring_clock=lambda: now, archive=ArchiveSettings(str(archive), fsync=False, process=process)))
    plane.start()
    try:
        with grpc.insecure_channel(plane.address) as ch:
            stub = jobs_pb2_grpc.JobsStub(ch)
            generation = _register(stub).generation
            good = [pb.StepTime(step=s, step_seconds=0.5 + s / 100, compute_seconds=0.3 if s % 2 else 0.0)
                    for s in range(1, 5)]
            assert _report(stub, good, rank=2, node="n2").accepted == 4
            assert _report(stub, good[:2], rank=2, node="n2").accepted == 0          # re-sent: kept already
            with pytest.raises(grpc.RpcError):                                          # refused: wrong node
                _report(stub, [pb.StepTime(step=9, step_seconds=0.5)], rank=2, node="n3")
            with pytest.raises(grpc.RpcError):                                          # refused: bad value
                _report(stub, [pb.StepTime(step=9, step_seconds=0.5, compute_seconds=0.6)], rank=2, node="n2")
    finally:
        plane.stop(0.5)
    got = ds.read_table(archive, "step_times")
    assert got.schema.equals(sch.schema("step_times"))
    rows = sorted(got.to_pylist(), key=lambda r: r["step"])
    assert [(r["job"], r["generation"], r["rank"], r["node"], r["step"]) for r in rows] == \
        [("j1", generation, 2, "n2", s) for s in range(1, 5)]
    assert [r["step_seconds"] for r in rows] == [0.5 + s / 100 for s in range(1, 5)]
    assert [r["compute_seconds"] for r in rows] == [0.3, None, 0.3, None]   # 0: not measured
    assert {int(r["ts"].timestamp()) for r in rows} == {now // 10**9}


def test_archived_step_times_carry_each_steps_end(tmp_path):
    """A row's ts is the step's end as the rank sent it (its own wall clock, checked against the
    service's within the bounds), or, for a step sent without one (a migrator from before end_ns), when
    the service took the report (its scoring clock). A report with an end time out of bounds is refused
    whole: nothing kept, nothing archived. The migrator's client sends each step's end."""
    from foreshock import dataset as ds
    from foreshock.service.archive import ArchiveSettings
    from foreshock.service.steptimes import MAX_END_AGE_SECONDS, MAX_END_AHEAD_SECONDS

    archive = tmp_path / "archive"
    taken = 1_767_571_200 * 10**9        # the scoring clock: far from the wall clock the ends are checked on
    plane = build_server(Settings.insecure_loopback(
        tmp_path / "state", scorer=NullScorer(), policy=POLICY, decision_flush_seconds=3600, fsync=False,
        scoring_clock=lambda: taken, archive=ArchiveSettings(str(archive), fsync=False, process=False)))
    plane.start()
    client = None
    try:
        with grpc.insecure_channel(plane.address) as ch:
            stub = jobs_pb2_grpc.JobsStub(ch)
            _register(stub)
            wall = time.time_ns()
            ends = {1: wall - int((MAX_END_AGE_SECONDS - 60) * S), 2: wall - 3 * S,
                    3: wall + int((MAX_END_AHEAD_SECONDS - 60) * S)}     # within a minute of either bound
            sent = [pb.StepTime(step=s, step_seconds=0.5, end_ns=e) for s, e in ends.items()]
            assert _report(stub, sent, rank=0, node="n0").accepted == 3
            assert _report(stub, [pb.StepTime(step=s, step_seconds=0.5) for s in (1, 2)],
                           rank=1, node="n1").accepted == 2
            for bad in (wall + int((MAX_END_AHEAD_SECONDS + 60) * S), wall - int((MAX_END_AGE_SECONDS + 60) * S)):
                with pytest.raises(grpc.RpcError) as err:
                    _report(stub, [pb.StepTime(step=7, step_seconds=0.5, end_ns=wall),
                                   pb.StepTime(step=8, step_seconds=0.5, end_ns=bad)], rank=2, node="n2")
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert f"steps[1].end_ns {bad}" in err.value.details(), err.value.details()
            assert _kept(plane) == 5 and plane.step_times.refused_reports == 2
            # the migrator: an end it measured, or, not given, the time it recorded the step
            config = MigratorConfig.from_env({}, job_id="j1", rank=3, world_size=len(NODES), node="n3",
                                             store="127.0.0.1:1", service=plane.address, rpc_timeout_s=1.0,
                                             step_report_interval_s=0.05)
            client = ServiceClient(config, backoff_initial_s=0.05, backoff_max_s=0.3)
            before = time.time_ns()
            client.record_step_time(3, 1, 0.5, 0.3, end_ns=wall - 5 * S)
            client.record_step_time(3, 2, 0.5, 0.3)
            after = time.time_ns()
            _wait(lambda: client.sent_step_times == 2, what="the migrator's steps sent")
    finally:
        if client is not None:
            client.close()
        plane.stop(0.5)
    rows = {(r["rank"], r["step"]): r["ts"].value for r in ds.read_table(archive, "step_times").to_pylist()}
    assert set(rows) == {(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (3, 1), (3, 2)}   # rank 2's refused: none
    assert [rows[(0, s)] for s in (1, 2, 3)] == [ends[1], ends[2], ends[3]]
    assert rows[(1, 1)] == rows[(1, 2)] == taken
    assert rows[(3, 1)] == wall - 5 * S and before <= rows[(3, 2)] <= after


def test_the_migrator_stamps_each_steps_end_by_the_wall_clock():
    """StepClock (migrator/world.py), the CPU path: the step's end is when end_step ran."""
    pytest.importorskip("torch")
    from foreshock.migrator.world import StepClock

    clock = StepClock()
    clock.begin()
    before = time.time_ns()
    ((step, total, compute, end_ns),) = clock.end(4)
    assert step == 4 and total > 0 and compute == 0.0 and before <= end_ns <= time.time_ns()


def test_the_migrator_stamps_a_cuda_steps_end_when_end_step_ran(monkeypatch):
    """StepClock's CUDA path, on stand-in events (no GPU here): a step's times are read a step late,
    and its end is still the time its own end_step ran."""
    torch = pytest.importorskip("torch")
    from foreshock.migrator.world import StepClock

    class Event:
        done = True

        def __init__(self, enable_timing=False):
            self.at = None

        def record(self):
            self.at = time.monotonic()

        def query(self):
            return Event.done

        def elapsed_time(self, other):
            return (other.at - self.at) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    clock = StepClock()
    clock.cuda = True
    clock.begin()
    Event.done = False                  # the GPU is behind: step 0's end is not known at its end_step
    before = time.time_ns()
    assert clock.end(0) == []
    after = time.time_ns()
    clock.begin()
    Event.done = True
    (first, second) = clock.end(1)
    assert [first[0], second[0]] == [0, 1] and before <= first[3] <= after <= second[3]


class _RecordingScorer(NullScorer):
    def __init__(self):
        self.taken = []

    def ingest(self, table, data):
        self.taken.append((table, data))


def test_accepted_step_times_reach_the_scorer_as_the_archive_gets_them(tmp_path):
    """An unsharded service hands each accepted report's new samples to the online scorer, as the same
    `step_times` rows the archive gets (the predictor's step-time features read them); a re-sent sample
    and a refused report add none."""
    scorer = _RecordingScorer()
    plane = build_server(Settings.insecure_loopback(
        tmp_path / "state", scorer=scorer, policy=POLICY, decision_flush_seconds=3600, fsync=False))
    plane.start()
    try:
        with grpc.insecure_channel(plane.address) as ch:
            stub = jobs_pb2_grpc.JobsStub(ch)
            _register(stub)
            good = [pb.StepTime(step=s, step_seconds=0.5, compute_seconds=0.3) for s in range(1, 5)]
            assert _report(stub, good, rank=1, node="n1").accepted == 4
            assert _report(stub, good[:2], rank=1, node="n1").accepted == 0
            with pytest.raises(grpc.RpcError):
                _report(stub, [pb.StepTime(step=9, step_seconds=0.5)], rank=1, node="n3")

            def rows():
                return [r for t, d in scorer.taken if t == "step_times" for r in d.to_pylist()]
            _wait(lambda: len(rows()) >= 4, what="the rows at the scorer")
    finally:
        plane.stop(0.5)
    assert sorted((r["job"], r["rank"], r["node"], r["step"], r["compute_seconds"]) for r in rows()) == \
        [("j1", 1, "n1", s, 0.3) for s in range(1, 5)]


def test_the_predictors_scorer_takes_the_accepted_step_times(tmp_path, tiny_model_dir):
    """With a model, the rows reach the predictor's online scorer, which keeps them all for their step's
    close: none refused."""
    from foreshock.service.scoring import PredictorScorer

    plane = build_server(Settings.insecure_loopback(
        tmp_path / "state", scorer=PredictorScorer(tiny_model_dir(tmp_path / "model")), policy=POLICY,
        decision_flush_seconds=3600, fsync=False))
    plane.start()
    try:
        with grpc.insecure_channel(plane.address) as ch:
            stub = jobs_pb2_grpc.JobsStub(ch)
            _register(stub)
            for rank, node in enumerate(NODES):
                steps = [pb.StepTime(step=s, step_seconds=0.5, compute_seconds=0.3 if rank != 3 else 0.45)
                         for s in range(1, 9)]
                assert _report(stub, steps, rank=rank, node=node).accepted == 8
            online = plane.scorer._online
            _wait(lambda: online.stats["rows_step_times"] == 8 * len(NODES), what="the rows at the scorer")
            assert sum(p.num_rows for parts in online._step_rows.values() for p in parts) == 8 * len(NODES)
            assert plane.scoring.ingest_errors == 0
            # what the scorer leaves out is exported by reason, from the drain that fed it
            text = generate_latest(plane.registry).decode()
            for reason in ("late_rows", "late_step_times", "step_times_ahead", "step_times_unknown_node",
                           "step_times_bad_step_seconds", "fabric_mask_undefined"):
                assert f'foreshock_scorer_rows_left_out_total{{reason="{reason}"}} 0.0' in text, reason
    finally:
        plane.stop(0.5)


def test_the_service_ends_the_judging_thread_of_the_scorer_it_built_when_it_stops(tmp_path, tiny_model_dir):
    """The service that loaded the model owns its scorer: its stop, after the last checkpoint, ends the
    online scorer's step-time judging thread (a scorer given in the settings is its giver's to close)."""
    import pandas as pd

    from foreshock import schema as sch
    from foreshock.predictor import features as ft
    from foreshock.predictor import synthetic

    plane = build_server(Settings.insecure_loopback(
        tmp_path / "state", model_path=str(tiny_model_dir(tmp_path / "model")), policy=POLICY,
        decision_flush_seconds=3600, fsync=False))
    online = plane.scorer._online
    step_ns = ft.STEP_SECONDS * 1_000_000_000
    first = synthetic.T0_NS // step_ns
    nodes = NODES[:4]
    tables = {n: synthetic.node_tables(n, 4, seed=i) for i, n in enumerate(nodes)}
    rows = sch.to_table("step_times", [
        {"ts": pd.Timestamp((first + 1) * step_ns + r, tz="UTC"), "node": n, "job": "j1", "rank": r, "step": 0,
         "step_seconds": 2.0, "compute_seconds": 1.5 if r == 2 else 1.0} for r, n in enumerate(nodes)])
    threads = []
    try:
        for k in range(4):
            synthetic.ingest_sample(online, tables, k)
            if k == 1:
                online.ingest("step_times", rows)
            if k == 3:   # the judgement of minute first+1 started
                threads = list(online._judge_pool._threads)
            online.score((first + k + 1) * step_ns + 6_000_000_000)
    finally:
        plane.stop(0)
    assert threads and not any(t.is_alive() for t in threads)
    assert online.stats["step_times_judged_in_round"] == 0
