"""TLS, mutual TLS and per-role credentials on a real server: certificates made here with the openssl CLI;
a collector may only stream telemetry (for its own node), a job only touches its own job, an operator
reads everything and cancels or drains; health checking and reflection answer without credentials."""

from __future__ import annotations

import datetime as dt
import shutil
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from foreshock import schema as sch
from foreshock.collectors.uplink import StreamingUplink, encode_table
from foreshock.service.auth import Principal, load_token_file, parse_identity
from foreshock.service.errors import InvalidArgument
from foreshock.service.scoring import NullScorer
from foreshock.service.server import Settings, build_server
from foreshock.v1 import jobs_pb2 as pb
from foreshock.v1 import jobs_pb2_grpc, risk_pb2, risk_pb2_grpc, telemetry_pb2 as tpb, telemetry_pb2_grpc

T = 10
TOKENS = {"collector-token-0123456789": "collector:n1", "job-token-llama-0123456789": "job:llama",
          "operator-token-0123456789": "operator:alice"}

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=foreshock-test-ca",
             "-days", "2", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name, cn, ext in (("server", "localhost", "server.ext"), ("job", "job:llama", "client.ext"),
                          ("collector", "collector:n1", "client.ext"), ("operator", "operator:alice", "client.ext"),
                          ("bare-job", "job", "client.ext")):
        _openssl("req", "-new", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", ext, cwd=d)
    return d


def _tokens():
    return {t: parse_identity(spec) for t, spec in TOKENS.items()}


def _creds(pki, client=None):
    key = (pki / f"{client}.key").read_bytes() if client else None
    cert = (pki / f"{client}.pem").read_bytes() if client else None
    return grpc.ssl_channel_credentials((pki / "ca.pem").read_bytes(), key, cert)


def _md(token):
    return (("authorization", f"Bearer {token}"),) if token else ()


def _code(fn, *args, **kw):
    try:
        fn(*args, timeout=T, **kw)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _register(jobs, job_id, token):
    return _code(jobs.RegisterJob, pb.RegisterJobRequest(job_id=job_id, ranks=[pb.RankPlacement(rank=0, node="n1")],
                                                         spare_nodes=["s1"]), metadata=_md(token))


def _sweep(node="n1"):
    t = sch.to_table("gpu", [{"ts": dt.datetime.now(dt.timezone.utc), "node": node, "gpu": 0, "gpu_lost": False}])
    return tpb.SweepBatch(node=node, collector_id=f"c-{node}", sequence=1,
                          tables=[tpb.TableRows(table="gpu", schema_version=1, arrow_ipc=encode_table("gpu", t))])


@pytest.fixture
def tls_plane(pki, tmp_path):
    p = build_server(Settings(state_dir=tmp_path, listen="127.0.0.1:0", tls_cert=str(pki / "server.pem"),
                              tls_key=str(pki / "server.key"), tokens=_tokens(), scorer=NullScorer()))
    p.start()
    yield p
    p.stop(0)


def test_roles_over_tls(pki, tls_plane):
    U, P, OK = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OK
    col, job, op = "collector-token-0123456789", "job-token-llama-0123456789", "operator-token-0123456789"
    with grpc.secure_channel(tls_plane.address, _creds(pki)) as ch:
        jobs, risk = jobs_pb2_grpc.JobsStub(ch), risk_pb2_grpc.RiskStub(ch)
        tele = telemetry_pb2_grpc.TelemetryStub(ch)
        assert _register(jobs, "llama", None) == U
        assert _register(jobs, "llama", "not-a-token-at-all-000") == U
        assert _register(jobs, "llama", col) == P
        assert _register(jobs, "other", job) == P
        assert _register(jobs, "llama", job) == OK
        assert _register(jobs, "other", op) == OK
        assert tls_plane.store.find_job("other") is not None
        assert _code(jobs.DrainNode, pb.DrainNodeRequest(node="n1"), metadata=_md(job)) == P
        assert _code(jobs.ListDirectives, pb.ListDirectivesRequest(), metadata=_md(job)) == P
        assert _code(jobs.ListDirectives, pb.ListDirectivesRequest(job_id="llama"), metadata=_md(job)) == OK
        assert _code(risk.ListRiskiest, risk_pb2.ListRiskiestRequest(), metadata=_md(job)) == P
        with pytest.raises(grpc.RpcError) as info:
            next(jobs.WatchDirectives(pb.WatchDirectivesRequest(job_id="other"), timeout=T, metadata=_md(job)))
        assert info.value.code() == P
        # The operator drains n1 (both jobs have a rank there) and cancels one; the job may not cancel.
        drained = jobs.DrainNode(pb.DrainNodeRequest(node="n1"), timeout=T, metadata=_md(op)).directives
        assert sorted(d.job_id for d in drained) == ["llama", "other"]
        other = [d for d in drained if d.job_id == "other"][0]
        assert _code(jobs.CancelDirective, pb.CancelDirectiveRequest(directive_id=other.directive_id),
                     metadata=_md(job)) == P
        assert _code(jobs.AckDirective, pb.AckDirectiveRequest(job_id="other", directive_id=other.directive_id,
                                                               phase=pb.ACK_PHASE_ACCEPTED), metadata=_md(job)) == P
        assert _code(jobs.CancelDirective, pb.CancelDirectiveRequest(directive_id=other.directive_id),
                     metadata=_md(op)) == OK
        # Telemetry: only collectors, and only for their own node.
        with pytest.raises(grpc.RpcError) as info:
            list(tele.StreamSweeps(iter([_sweep()]), timeout=T, metadata=_md(job)))
        assert info.value.code() == P
        (ack,) = list(tele.StreamSweeps(iter([_sweep("n1")]), timeout=T, metadata=_md(col)))
        assert not ack.rejections
        (ack,) = list(tele.StreamSweeps(iter([_sweep("n2")]), timeout=T, metadata=_md(col)))
        assert [r.reason for r in ack.rejections] == ["node_mismatch"]
        # Health and reflection need no credential.
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="foreshock.v1.Jobs"),
                                                      timeout=T)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=T)
        names = {s.name for s in next(refl).list_services_response.service}
        assert {"foreshock.v1.Telemetry", "foreshock.v1.Risk", "foreshock.v1.Jobs", "grpc.health.v1.Health"} <= names
    with grpc.insecure_channel(tls_plane.address) as plain:
        assert _register(jobs_pb2_grpc.JobsStub(plain), "llama", job) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_maps_the_client_certificate_cn_to_a_role(pki, tmp_path):
    plane = build_server(Settings(state_dir=tmp_path, listen="127.0.0.1:0", tls_cert=str(pki / "server.pem"),
                                  tls_key=str(pki / "server.key"), tls_client_ca=str(pki / "ca.pem"),
                                  scorer=NullScorer()))
    plane.start()
    try:
        with grpc.secure_channel(plane.address, _creds(pki, "job")) as ch:
            jobs = jobs_pb2_grpc.JobsStub(ch)
            assert _register(jobs, "llama", None) == grpc.StatusCode.OK
            assert _register(jobs, "other", None) == grpc.StatusCode.PERMISSION_DENIED
        with grpc.secure_channel(plane.address, _creds(pki, "operator")) as ch:
            assert _code(jobs_pb2_grpc.JobsStub(ch).DrainNode, pb.DrainNodeRequest(node="n1")) == grpc.StatusCode.OK
        with grpc.secure_channel(plane.address, _creds(pki, "bare-job")) as ch:  # CN `job`: no subject, no wildcard
            assert _register(jobs_pb2_grpc.JobsStub(ch), "llama", None) == grpc.StatusCode.UNAUTHENTICATED
        with grpc.secure_channel(plane.address, _creds(pki)) as ch:   # no client certificate: no handshake
            assert _register(jobs_pb2_grpc.JobsStub(ch), "llama", None) == grpc.StatusCode.UNAVAILABLE
        # The real uplink over mutual TLS with the collector's certificate.
        up = StreamingUplink(plane.address, node="n1",
                             tls=(pki / "ca.pem", pki / "collector.pem", pki / "collector.key")).start()
        try:
            up.submit({"gpu": sch.to_table("gpu", [{"ts": dt.datetime.now(dt.timezone.utc), "node": "n1", "gpu": 0,
                                                    "gpu_lost": False}])})
            end = time.monotonic() + 10
            while up.stats()["acked"] < 1 and time.monotonic() < end:
                time.sleep(0.05)
            assert up.stats()["acked"] == 1
            while plane.ingest.accepted_rows["gpu"] < 1 and time.monotonic() < end:   # the round's checks
                time.sleep(0.05)
            assert plane.ingest.accepted_rows["gpu"] == 1
        finally:
            up.close(1)
    finally:
        plane.stop(0)


def test_token_file_and_identities(tmp_path):
    f = tmp_path / "tokens"
    f.write_text("# role[:subject] token\ncollector:n7 aaaaaaaaaaaaaaaaaaaa\noperator  bbbbbbbbbbbbbbbbbbbb\n")
    got = load_token_file(f)
    assert got["aaaaaaaaaaaaaaaaaaaa"] == Principal(frozenset({"collector"}), "n7")
    assert got["bbbbbbbbbbbbbbbbbbbb"].is_operator
    for text, needle in (("admin:x cccccccccccccccccccc\n", "role 'admin'"), ("job:j short\n", "shorter"),
                         ("just-one-field\n", "expected")):
        f.write_text(text)
        with pytest.raises(InvalidArgument, match=needle):
            load_token_file(f)


def test_a_scoped_role_needs_a_subject_and_only_the_explicit_wildcard_acts_for_all(tmp_path):
    for spec in ("job", "collector", "job:", "collector: "):
        with pytest.raises(InvalidArgument, match=r"needs a subject.*:\*"):
            parse_identity(spec)
    f = tmp_path / "tokens"
    f.write_text("operator ops-0123456789abcdef\njob job-0123456789abcdef0\n")
    with pytest.raises(InvalidArgument, match="line 2.*needs a subject"):
        load_token_file(f)
    scheduler, one = parse_identity("job:*"), parse_identity("job:llama")
    assert scheduler.may_act_for_job("llama") and scheduler.may_act_for_job("other")
    assert one.may_act_for_job("llama") and not one.may_act_for_job("other")
    fleet, node = parse_identity("collector:*"), parse_identity("collector:n1")
    assert fleet.may_report_node("n9") and node.may_report_node("n1") and not node.may_report_node("n9")
    assert parse_identity("operator").may_act_for_job("anything")


@pytest.mark.parametrize("metrics_listen", [":0", "0.0.0.0:0", "[::]:0", "10.0.0.1:9464"])
def test_insecure_mode_refuses_metrics_on_other_than_loopback(tmp_path, metrics_listen):
    from foreshock.service.server import SettingsError
    with pytest.raises(SettingsError, match="metrics_listen.*loopback"):
        build_server(Settings.insecure_loopback(tmp_path, scorer=NullScorer(), metrics_listen=metrics_listen))
    assert not (tmp_path / "state.sqlite3").exists()   # refused before anything was opened
