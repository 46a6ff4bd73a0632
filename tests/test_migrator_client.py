"""The migrator's gRPC client against the real control plane in-process (port 0): delivery, acks,
re-delivery after a service restart, TLS with bearer tokens, deadlines, and never raising."""

from __future__ import annotations

import socket
import subprocess
import time

import grpc
import pytest

from foreshock.migrator import Ack, AckPhase, DirectiveKind, MigratorConfig, MigratorConfigError, ServiceClient
from foreshock.migrator.client import open_channel
from foreshock.service.auth import parse_identity
from foreshock.service.scoring import NullScorer
from foreshock.service.server import Settings, build_server
from foreshock.v1 import jobs_pb2, jobs_pb2_grpc
from support import free_port

POLICY = {"lead_seconds": 0.1, "min_steps_ahead": 3, "stale_seconds": 3600.0}


def _config(address, job="j1", rank=0, **kw):
    return MigratorConfig.from_env({}, job_id=job, rank=rank, world_size=2, node=f"n{rank}",
                                   store="127.0.0.1:1", service=address, rpc_timeout_s=1.0, **kw)


def _client(address, **kw):
    return ServiceClient(_config(address, **kw), backoff_initial_s=0.05, backoff_max_s=0.3)


def _poll_until(client, pred, timeout=10.0):
    seen = []
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        seen += client.poll()
        if pred(seen):
            return seen
        time.sleep(0.02)
    raise AssertionError(f"condition not met; saw {seen}")


def _drain(address, node):
    with grpc.insecure_channel(address) as ch:
        return jobs_pb2_grpc.JobsStub(ch).DrainNode(jobs_pb2.DrainNodeRequest(node=node, reason="t"), timeout=5)


@pytest.fixture
def plane_settings():
    return {"scorer": NullScorer(), "policy": POLICY}


def test_directive_delivered_and_acks_advance_the_service(plane):
    p, address = plane, plane.address
    c = _client(address)
    try:
        assert c.register({0: "n0", 1: "n1"}, ["n9"], fallback="shrink") is not None
        c.watch(0)
        c.report_step(10, 0.05)
        end = time.monotonic() + 5
        while p.store.job("j1").step != 10 and time.monotonic() < end:   # reports go out asynchronously
            time.sleep(0.02)
        assert p.store.job("j1").step == 10
        resp = _drain(address, "n1")
        did = resp.directives[0].directive_id
        (d,) = _poll_until(c, lambda s: any(x.directive_id == did for x in s))
        assert (d.kind, d.ranks, d.from_node, d.to_node) == (DirectiveKind.EVACUATE, (1,), "n1", "n9")
        assert d.at_step >= 10 + 3 and not d.cancelled
        for phase in (AckPhase.ACCEPTED, AckPhase.STATE_TRANSFERRED, AckPhase.COMPLETED):
            c.ack(Ack(did, 0, phase, f"{phase.value} ok", 0.01))
        # each state change comes back on the stream; COMPLETED withdraws it (nothing left to act on)
        _poll_until(c, lambda s: any(x.directive_id == did and x.cancelled for x in s))
        assert p.store.directive(did).state.name == "COMPLETED"
        assert [a.phase.name for a in p.store.acks(did)] == ["ACCEPTED", "STATE_TRANSFERRED", "COMPLETED"]
        assert p.store.job("j1").ranks[1].node == "n9"          # the service applied the move
        assert c.healthy and c.dropped_acks == 0
    finally:
        c.close(deregister=True)
    assert p.store.find_job("j1") is None


def test_a_job_that_stops_stepping_is_not_extrapolated_past_where_it_is(plane):
    """A job paused at step 10 (a checkpoint, a stall) keeps saying so, so a switch is scheduled a few
    steps past 10, not (pause / step time) steps past it, after the job's end."""
    p, address = plane, plane.address
    c = _client(address, report_interval_s=0.1)
    try:
        assert c.register({0: "n0", 1: "n1"}, ["n9"], fallback="shrink") is not None
        c.report_step(10, 0.01)
        end = time.monotonic() + 5
        while p.store.job("j1").step != 10 and time.monotonic() < end:
            time.sleep(0.02)
        first = p.store.job("j1").step_at_ns
        time.sleep(2.0)                        # paused: 200 steps' worth of time at 0.01 s a step
        job = p.store.job("j1")
        assert job.step == 10 and job.step_at_ns > first     # said again while paused
        d = _drain(address, "n1").directives[0]
        # lead 0.1 s = 10 steps ahead, plus the steps of the time since the last report (the report
        # interval and the sender's 0.2 s poll: 30 at most), not the 200 of the whole pause
        assert 10 + 10 <= d.at_step <= 10 + 10 + 30, d.at_step
    finally:
        c.close(deregister=True)


def test_service_restart_redelivers_and_nothing_raises(tmp_path):
    state = tmp_path / "state"
    p = build_server(Settings.insecure_loopback(state, scorer=NullScorer(), policy=POLICY))
    port = p.start()
    address = f"127.0.0.1:{port}"
    c = _client(address)
    try:
        c.register({0: "n0", 1: "n1"}, [], fallback="shrink")
        c.watch(1)
        did = _drain(address, "n1").directives[0].directive_id
        (d,) = _poll_until(c, lambda s: len(s) >= 1)
        assert d.kind == DirectiveKind.SHRINK and d.directive_id == did
        p.stop(grace=0.1)
        # the service is gone: every call returns at once with "nothing", nothing raises
        t = time.monotonic()
        assert c.register({0: "n0"}, []) is None
        c.report_step(11, 0.05)
        c.ack(Ack(did, 1, AckPhase.ACCEPTED))
        assert c.poll() == [] and not c.healthy
        assert time.monotonic() - t < 2.5
        p = build_server(Settings(state_dir=state, listen=address, insecure=True, scorer=NullScorer(),
                                  policy=POLICY))
        p.start()
        # after the reconnect the still-unfinished directive comes again, with the same id
        again = _poll_until(c, lambda s: any(x.directive_id == did for x in s), timeout=15)
        assert {x.directive_id for x in again} == {did}
        _poll_until(c, lambda s: True)
        assert c.healthy
    finally:
        c.close()
        p.stop(grace=0.1)


def test_every_call_has_a_deadline():
    # a peer that accepts connections and never speaks HTTP/2
    with socket.socket() as sink:
        sink.bind(("127.0.0.1", 0))
        sink.listen(16)
        c = _client(f"127.0.0.1:{sink.getsockname()[1]}")
        try:
            t = time.monotonic()
            assert c.register({0: "n0"}, []) is None
            assert time.monotonic() - t < 3.0
            c.watch(0)
            time.sleep(0.3)
            assert c.poll() == []
        finally:
            t = time.monotonic()
            c.close()
            assert time.monotonic() - t < 5.0


def test_plaintext_only_to_loopback():
    with pytest.raises(MigratorConfigError, match="loopback only"):
        open_channel(_config("10.1.2.3:50051"))


def test_tls_and_bearer_tokens(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    good, other = "job-token-0123456789abcdef", "other-token-0123456789abcdef"
    p = build_server(Settings(state_dir=tmp_path / "state", listen="127.0.0.1:0", scorer=NullScorer(),
                              tls_cert=str(cert), tls_key=str(key), policy=POLICY,
                              tokens={good: parse_identity("job:secure-job"), other: parse_identity("job:else")}))
    port = p.start()
    address = f"localhost:{port}"
    try:
        ok = _client(address, job="secure-job", token=good, tls_ca=str(cert))
        assert ok.register({0: "n0", 1: "n1"}, []) is not None and ok.healthy
        ok.close()
        for token in ("wrong-token-0123456789abcdef", other, ""):
            bad = _client(address, job="secure-job", token=token, tls_ca=str(cert))
            assert bad.register({0: "n0", 1: "n1"}, []) is None and not bad.healthy
            bad.close()
    finally:
        p.stop(grace=0.1)


def test_the_service_may_list_a_coordinator_and_its_standby(plane):
    """FORESHOCK_SERVICE=A,B: a call answered UNAVAILABLE (nobody at A here) moves to B."""
    nobody = f"127.0.0.1:{free_port()}"
    c = _client(f"{nobody},{plane.address}")
    try:
        end = time.monotonic() + 10
        while c.register({0: "n0", 1: "n1"}, ["n9"]) is None and time.monotonic() < end:
            time.sleep(0.05)
        assert c.healthy and plane.jobs.job("j1").spares == ("n9",)
    finally:
        c.close()
    with pytest.raises(MigratorConfigError, match="service \\(FORESHOCK_SERVICE\\): expected HOST:PORT, got 'nohost'"):
        _config(f"{plane.address},nohost")
