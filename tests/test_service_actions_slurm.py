"""Node actions against a real Slurm: a slurmctld and eight slurmd (Debian's slurm-wlm, installed by
tests/setup.sh) started here on loopback ports, 40 nodes in the partition. The control plane drains a
node on a fatal Xid through its real path (telemetry -> policy -> node actions -> scontrol), the
circuit breaker holds the third node of a 40-node fleet back at a 5 % cap until an operator resumes
one, the count survives a restart, and a controller that does not answer costs a deadline per
attempt, a bounded number of attempts, and nothing else."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import grpc
import pyarrow as pa
import pytest
from prometheus_client import generate_latest

from foreshock import schema as sch
from foreshock.service.actions import ActionSettings, SlurmBackend
from foreshock.service.decisions import read_decisions
from foreshock.service.nodes import FatalEvent
from foreshock.service.scoring import NullScorer
from foreshock.service.server import Settings, build_server
from foreshock.v1 import telemetry_pb2 as tpb
from foreshock.v1 import telemetry_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SLURM = ("slurmctld", "slurmd", "scontrol")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(any(shutil.which(b) is None and not Path("/usr/sbin", b).exists() for b in SLURM),
                       reason="Slurm is not installed (tests/setup.sh installs Debian's slurm-wlm)"),
]
FLEET = [f"gpu{i:02d}" for i in range(1, 41)]
DAEMONS = tuple(FLEET[:8])        # the nodes the tests drain run a slurmd; the rest are configured but silent
T = 10


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, what: str, deadline: float = 30.0, every: float = 0.1):
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"gave up after {deadline:g} s waiting for {what}")


class SlurmCluster:
    """slurmctld + one slurmd per DAEMONS node, auth/none, all state under `root`."""

    def __init__(self, root: Path):
        self.root = root
        for d in ("state", "spool", "log"):
            (root / d).mkdir(parents=True, exist_ok=True)
        self.ctld_port = _free_port()
        ports = {n: _free_port() for n in DAEMONS}
        user = pwd.getpwuid(os.getuid()).pw_name
        lines = [
            "ClusterName=foreshocktest", "SlurmctldHost=localhost(127.0.0.1)", f"SlurmctldPort={self.ctld_port}",
            "AuthType=auth/none", "CredType=cred/none", f"SlurmUser={user}", f"SlurmdUser={user}",
            f"StateSaveLocation={root}/state", f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/slurmctld.pid", f"SlurmdPidFile={root}/slurmd-%n.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log", f"SlurmdLogFile={root}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SwitchType=switch/none",
            "MpiDefault=none", "SchedulerType=sched/builtin", "SelectType=select/linear", "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        ]
        silent_port = _free_port()
        for n in FLEET:
            port = ports.get(n, silent_port)
            lines.append(f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs=1 "
                         "RealMemory=100 State=UNKNOWN")
        lines.append(f"PartitionName=main Nodes={','.join(FLEET)} Default=YES MaxTime=INFINITE State=UP")
        self.conf = root / "slurm.conf"
        self.conf.write_text("\n".join(lines) + "\n")
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        def spawn(*argv):
            self.procs.append(subprocess.Popen(argv, env=self.env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL, start_new_session=True))
        spawn(_binary("slurmctld"), "-D", "-f", str(self.conf))
        for n in DAEMONS:
            spawn(_binary("slurmd"), "-D", "-N", n, "-f", str(self.conf))
        for n in DAEMONS:
            wait_for(lambda n=n: self.state(n)[0].startswith("IDLE") and "NOT_RESPONDING" not in self.state(n)[0],
                     f"slurmd {n} to register with slurmctld ({self.root}/log)", deadline=60, every=0.25)

    @property
    def controller(self) -> subprocess.Popen:
        return self.procs[0]

    def scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([_binary("scontrol"), *args], env=self.env, capture_output=True, text=True, timeout=30)

    def state(self, node: str) -> tuple[str, str]:
        out = self.scontrol("-o", "show", "node", node).stdout
        state = re.search(r"\bState=(\S+)", out)
        reason = re.search(r"\bReason=(.*?)(?: \[[^\]]*\])?(?=\s+\w+=|$)", out)
        return (state.group(1) if state else "", reason.group(1) if reason else "")

    def resume(self, node: str) -> None:
        proc = self.scontrol("update", f"NodeName={node}", "State=RESUME")
        assert proc.returncode == 0, proc.stderr

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _plane(state, cluster: SlurmCluster, **actions):
    settings = ActionSettings(**{"slurm": True, "slurm_conf": str(cluster.conf), "timeout_seconds": 5.0,
                                 "recheck_seconds": 0.2, "backoff_seconds": 0.2, **actions})
    plane = build_server(Settings.insecure_loopback(state, scorer=NullScorer(), decision_flush_seconds=0.0,
                                                    actions=settings))
    now = time.time_ns()
    for n in FLEET:          # the fleet the breaker's share is of: every node the service has heard of
        plane.nodes.seen(n, now)
    plane.start()
    return plane


def _fatal(plane, node: str) -> None:
    now = time.time_ns()
    plane.nodes.record_fatal(FatalEvent(node, now, "xid", "Xid 79 on GPU 0 (fallen off the bus)", now))


def _metric(plane, name: str, **labels) -> float:
    return plane.registry.get_sample_value(name, labels) or 0.0


def _fatal_batch(node: str) -> tpb.SweepBatch:
    ev = sch.to_table("events", [{"ts": dt.datetime.now(dt.timezone.utc), "node": node, "kind": "xid",
                                  "source": "kmsg", "severity": "fatal", "xid": 79, "gpu": 0,
                                  "message": "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus."}])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, ev.schema) as w:
        w.write_table(ev)
    return tpb.SweepBatch(node=node, collector_id=f"c-{node}", sequence=1, tables=[
        tpb.TableRows(table="events", schema_version=1, arrow_ipc=sink.getvalue().to_pybytes())])


def test_a_fatal_xid_streamed_by_a_collector_drains_its_node_in_slurm_once(slurm, tmp_path):
    plane = _plane(tmp_path, slurm)
    try:
        with grpc.insecure_channel(plane.address) as ch:
            acks = list(telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(iter([_fatal_batch("gpu01")]), timeout=T))
            assert acks[-1].acked_sequence == 1
        state, reason = wait_for(lambda: "DRAIN" in slurm.state("gpu01")[0] and slurm.state("gpu01"),
                                 "gpu01 drained in Slurm")
        assert reason.startswith("foreshock: fatal Xid 79") and "GPU 0" in reason, reason
        wait_for(lambda: plane.actions.counts()["taken"] == 1, "the action recorded as taken")
        assert _metric(plane, "foreshock_node_action_calls_total", backend="slurm", call="take", result="ok") == 1
        # The same node's next fatal event: already drained by Foreshock, so no second scontrol run.
        _fatal(plane, "gpu01")
        time.sleep(0.5)
        assert _metric(plane, "foreshock_node_action_calls_total", backend="slurm", call="take", result="ok") == 1
        assert slurm.state("gpu02")[0].startswith("IDLE") and "DRAIN" not in slurm.state("gpu02")[0]
    finally:
        plane.stop(0)
        slurm.resume("gpu01")
    rows = [r for r in read_decisions(tmp_path / "decisions").to_pylist() if r["kind"] == "node_action_taken"]
    assert len(rows) == 1 and rows[0]["node"] == "gpu01" and json.loads(rows[0]["details"]) == {"backends": ["slurm"]}


def test_the_breaker_holds_the_third_node_of_40_until_a_slot_frees_and_its_count_survives_a_restart(
        slurm, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="foreshock.service.actions")
    plane = _plane(tmp_path, slurm)
    try:
        assert plane.actions.limit() == 2                      # 5 % of 40
        for node in ("gpu03", "gpu04", "gpu05"):
            _fatal(plane, node)
        wait_for(lambda: plane.actions.counts()["taken"] == 2, "two nodes drained")
        assert [n for n in ("gpu03", "gpu04", "gpu05") if "DRAIN" in slurm.state(n)[0]] == ["gpu03", "gpu04"]
        assert plane.actions.rows["gpu05"].state == "held"
        assert _metric(plane, "foreshock_node_action_held_total") == 1
        assert _metric(plane, "foreshock_node_actions", state="held") == 1
        assert _metric(plane, "foreshock_node_action_limit") == 2
        held = [r.getMessage() for r in caplog.records if "holding back gpu05" in r.getMessage()]
        assert len(held) == 1 and "2 of at most 2 nodes" in held[0] and "fleet 40" in held[0]
        if shutil.which("promtool"):   # the exposition with the node-action series follows the conventions
            out = subprocess.run(["promtool", "check", "metrics"], input=generate_latest(plane.registry).decode(),
                                 capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stdout + out.stderr
    finally:
        plane.stop(0)

    # A restart: the two drained nodes still hold the two slots (the state store), so a new fatal node
    # is held back too, and acted on once an operator resumes one of the drained ones.
    plane = _plane(tmp_path, slurm)
    try:
        assert plane.actions.counts()["taken"] == 2
        _fatal(plane, "gpu06")
        wait_for(lambda: "gpu06" in plane.actions.rows and plane.actions.rows["gpu06"].state == "held",
                 "gpu06 held after the restart")
        assert "DRAIN" not in slurm.state("gpu06")[0]
        slurm.resume("gpu03")                                   # the operator brings gpu03 back
        wait_for(lambda: "DRAIN" in slurm.state("gpu06")[0], "gpu06 drained once gpu03's slot freed", deadline=15)
        assert plane.actions.rows["gpu03"].state == "released"
        assert "DRAIN" not in slurm.state("gpu03")[0]           # Foreshock never drains it again for that alarm
        # this process's one drain: gpu06 (gpu03 and gpu04 were the previous process's)
        assert _metric(plane, "foreshock_node_action_calls_total", backend="slurm", call="take", result="ok") == 1
    finally:
        plane.stop(0)
        for node in ("gpu04", "gpu06"):
            slurm.resume(node)
    kinds = [(r["kind"], r["node"]) for r in read_decisions(tmp_path / "decisions").to_pylist()
             if r["kind"].startswith("node_action")]
    assert ("node_action_released", "gpu03") in kinds and ("node_action_taken", "gpu06") in kinds


def test_a_controller_that_does_not_answer_costs_a_deadline_per_attempt_and_a_bounded_number_of_them(
        slurm, tmp_path):
    plane = _plane(tmp_path, slurm, timeout_seconds=0.5, max_attempts=3, backoff_seconds=0.2)
    os.kill(slurm.controller.pid, signal.SIGSTOP)              # accepts connections, answers none
    try:
        _fatal(plane, "gpu07")
        wait_for(lambda: plane.actions.rows.get("gpu07") is not None
                 and plane.actions.rows["gpu07"].state == "failed", "gpu07 given up", deadline=20)
        row = plane.actions.rows["gpu07"]
        assert row.attempts == 3 and "did not answer within 0.5 s" in row.detail
        assert _metric(plane, "foreshock_node_action_calls_total", backend="slurm", call="take", result="timeout") == 3
        time.sleep(1.0)                                         # given up means no more calls
        assert _metric(plane, "foreshock_node_action_calls_total", backend="slurm", call="take", result="timeout") == 3
        with grpc.insecure_channel(plane.address) as ch:        # the service goes on serving meanwhile
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=T)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert plane.actions.in_slots() == 0                  # the given-up node gave its slot back
        # The controller wakes up and reads the requests queued on its socket: the drain lands late.
        # The recheck finds it and counts the node as taken after all.
        os.kill(slurm.controller.pid, signal.SIGCONT)
        wait_for(lambda: plane.actions.rows["gpu07"].state == "taken", "the late drain found")
        assert "DRAIN" in slurm.state("gpu07")[0] and plane.actions.in_slots() == 1
    finally:
        os.kill(slurm.controller.pid, signal.SIGCONT)
        plane.stop(0)
        slurm.resume("gpu07")


def test_a_controller_that_is_down_is_a_deadline_not_scontrols_own_retries(slurm, tmp_path):
    """With nothing listening, scontrol retries for about ten seconds by itself; the deadline ends it."""
    conf = tmp_path / "slurm.conf"
    conf.write_text(slurm.conf.read_text().replace(f"SlurmctldPort={slurm.ctld_port}",
                                                   f"SlurmctldPort={_free_port()}"))
    backend = SlurmBackend(_binary("scontrol"), str(conf), timeout=0.5)
    t0 = time.monotonic()
    result = backend.take("gpu08", "fatal Xid 79")
    assert result.result == "timeout" and "0.5 s" in result.detail
    assert time.monotonic() - t0 < 5          # far below scontrol's own ~10 s of retries
    assert backend.present(["gpu08"]) is None  # cannot tell: the drained nodes keep their slots


def test_unknown_and_list_like_node_names_are_refused_not_retried(slurm, tmp_path):
    backend = SlurmBackend(_binary("scontrol"), str(slurm.conf), timeout=5)
    assert backend.take("gpu99", "fatal").result == "unknown_node"
    for bad in ("gpu[01-40]", "gpu01,gpu02", "ALL", "all", "gpu 01", "", "-gpu01"):
        assert backend.check_name(bad), bad
    plane = _plane(tmp_path, slurm)
    try:
        _fatal(plane, "gpu[01-40]")
        _fatal(plane, "gpu99")
        wait_for(lambda: plane.actions.rows.get("gpu99") is not None
                 and plane.actions.rows["gpu99"].state == "failed", "gpu99 given up")
        assert plane.actions.rows["gpu99"].attempts == 1     # unknown to Slurm: no retry can help
        assert "gpu[01-40]" not in plane.actions.rows
        assert _metric(plane, "foreshock_node_action_rejected_names_total") == 1
    finally:
        plane.stop(0)
    assert not [n for n in FLEET if "DRAIN" in slurm.state(n)[0]]


def test_one_drain_call_against_the_real_controller(slurm, capsys):
    backend = SlurmBackend(_binary("scontrol"), str(slurm.conf), timeout=5)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        assert backend.take("gpu02", "fatal Xid 79: timing").ok
        times.append(time.perf_counter() - t0)
        slurm.resume("gpu02")
    assert backend.present(["gpu02", "gpu01"]) == {"gpu02": False, "gpu01": False}
    with capsys.disabled():
        print(f"\nscontrol drain against slurmctld: median {sorted(times)[2] * 1e3:.1f} ms "
              f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})")


def test_the_recheck_sees_foreshocks_drains_only(slurm):
    backend = SlurmBackend(_binary("scontrol"), str(slurm.conf), timeout=5)
    try:
        assert backend.take("gpu08", "fatal Xid 79").ok
        # gpu99 is not in slurm.conf (removed since it was drained): scontrol exits 1 after printing
        # the others, which are still read
        assert backend.present(["gpu08", "gpu99"]) == {"gpu08": True, "gpu99": False}
        # an operator drains it again for a reason of their own: no longer Foreshock's
        proc = slurm.scontrol("update", "NodeName=gpu08", "State=DRAIN", "Reason=bad DIMM, ticket 4711")
        assert proc.returncode == 0, proc.stderr
        assert backend.present(["gpu08"]) == {"gpu08": False}
    finally:
        slurm.resume("gpu08")


def test_foreshock_serve_drains_from_its_config_and_a_kill_9_forgets_nothing(slurm, tmp_path):
    """`foreshock serve --slurm-drain` as operators run it, its settings from FORESHOCK_SERVE_* variables;
    killed with SIGKILL after the drain and restarted on the same state, it still counts the node."""
    import sys
    import urllib.request

    env = dict(os.environ, PYTHONUNBUFFERED="1", FORESHOCK_SERVE_SLURM_CONF=str(slurm.conf),
               FORESHOCK_SERVE_SLURM_SCONTROL=_binary("scontrol"), FORESHOCK_SERVE_ACTION_FLEET_SIZE="40")

    def serve():
        proc = subprocess.Popen(
            [sys.executable, "-m", "foreshock.cli", "serve", "--insecure", "--listen", "127.0.0.1:0",
             "--metrics-listen", "127.0.0.1:0", "--no-model", "--state", str(tmp_path / "state"), "--slurm-drain"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        line = proc.stdout.readline()
        assert "listening on" in line, line
        address = line.split("listening on ")[1].split(",")[0].split(" ")[0]
        metrics = int(line.split("metrics on ")[1].split(" ")[0].rsplit(":", 1)[1])
        return proc, address, metrics

    def taken(port) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        found = re.search(r'^foreshock_node_actions\{state="taken"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else -1.0

    proc, address, metrics = serve()
    try:
        with grpc.insecure_channel(address) as ch:
            list(telemetry_pb2_grpc.TelemetryStub(ch).StreamSweeps(iter([_fatal_batch("gpu03")]), timeout=T))
        wait_for(lambda: "DRAIN" in slurm.state("gpu03")[0], "gpu03 drained by foreshock serve")
        wait_for(lambda: taken(metrics) == 1, "the drain counted")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc, address, metrics = serve()
        assert taken(metrics) == 1
        limit = re.search(r"^foreshock_node_action_limit (\S+)$",
                          urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=5).read().decode(),
                          re.M)
        assert float(limit.group(1)) == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(15)
        slurm.resume("gpu03")
