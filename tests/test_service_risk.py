"""Risk end to end with the real predictor: a small model trained here (the real pipeline, skops, the
registry's manifest and checks), real collectors on simulated nodes, the online scorer in the service,
the evacuation of the node whose risk crosses the threshold, the Risk API, and a real Prometheus server
scraping the service and answering for the risk through its HTTP API. promtool checks the exposition."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import grpc
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from foreshock.collectors.collector import Collector
from foreshock.collectors.simulated import SimpleNodeModel, SimulatedSource
from foreshock.collectors.uplink import StreamingUplink
from foreshock.service.server import Settings, build_server
from foreshock.v1 import jobs_pb2 as jpb
from foreshock.v1 import jobs_pb2_grpc, risk_pb2, risk_pb2_grpc
from support import Clock

T = 10
S = 1_000_000_000
SWEEP_NS = 30 * S


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A real model (synthetic.pcie_replay_model_dir: a climbing PCIe replay rate means failure), saved
    through the registry (skops + manifest + sha256)."""
    from foreshock.predictor import synthetic
    return synthetic.pcie_replay_model_dir(tmp_path_factory.mktemp("model"))


class PcieRamp:
    """A simulated node whose GPU 0 starts replaying PCIe packets at `start_ns` (a degrading link)."""

    def __init__(self, node, start_ns=None):
        self.node = node
        self.inner = SimpleNodeModel(node, gpus=2, hcas=2, seed=hash(node) % 1000)
        self.start_ns = start_ns
        self.extra = 0

    def sample(self, ts_ns):
        tables = self.inner.sample(ts_ns)
        if self.start_ns is not None and ts_ns >= self.start_ns:
            self.extra += 10_000
            gpu = tables["gpu"]
            bump = pa.array(np.where(np.arange(gpu.num_rows) == 0, self.extra, 0).astype(np.uint64))
            col = pc.add(gpu.column("pcie_replay_counter").fill_null(0), bump)
            tables["gpu"] = gpu.set_column(gpu.schema.get_field_index("pcie_replay_counter"),
                                           gpu.schema.field("pcie_replay_counter"), col)
        return tables


def drain(stream, into):
    try:
        for item in stream:
            into.append(item)
    except grpc.RpcError:
        pass


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prom_query(port, expr):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())["data"]["result"]


@pytest.mark.slow
def test_risk_crossing_evacuates_and_prometheus_reads_the_risk(model_dir, tmp_path):
    start = (time.time_ns() // (60 * S)) * 60 * S - 30 * 60 * S      # replay 30 minutes of telemetry fast
    clock = Clock(start)
    plane = build_server(Settings.insecure_loopback(
        tmp_path / "state", model_path=str(model_dir), scoring_clock=clock, metrics_listen="127.0.0.1:0",
        decision_flush_seconds=0.0, scoring_process=True))   # the worker process, as `foreshock serve` runs
    assert plane.policy.settings.threshold == 0.5 and plane.scorer.model_version == "test-pcie-1"
    plane.start()
    prom = None
    nodes = ["n0", "n1", "n2", "n3"]
    models = {n: PcieRamp(n) for n in nodes}
    ups = {n: StreamingUplink(plane.address, node=n, backoff_initial=0.1).start() for n in nodes}
    collectors = [Collector(n, [SimulatedSource(n, node_model=models[n])], None, uplink=ups[n]) for n in nodes]
    try:
        ch = grpc.insecure_channel(plane.address)
        jobs, risk = jobs_pb2_grpc.JobsStub(ch), risk_pb2_grpc.RiskStub(ch)
        jobs.RegisterJob(jpb.RegisterJobRequest(
            job_id="train", ranks=[jpb.RankPlacement(rank=i, node=nodes[i], gpus=[0, 1]) for i in range(3)],
            spare_nodes=["n3"], current_step=1), timeout=T)
        jobs.ReportStep(jpb.ReportStepRequest(job_id="train", step=1, step_seconds=1.0), timeout=T)
        got = []
        watch = jobs.WatchDirectives(jpb.WatchDirectivesRequest(job_id="train", rank=1), timeout=120)

        threading.Thread(target=drain, args=(watch, got), daemon=True).start()
        risk_watch = risk.WatchRisk(risk_pb2.WatchRiskRequest(nodes=["n1"], min_change=0.2), timeout=120)
        changes = []
        threading.Thread(target=drain, args=(risk_watch, changes), daemon=True).start()

        fault_at = start + 10 * 60 * S
        models["n1"].start_ns = fault_at
        ts = start
        healthy_seen = False
        while not got and ts < start + 30 * 60 * S:
            for c in collectors:
                c.sweep_once(ts)
            deadline = time.monotonic() + 10
            while any(u.stats()["acked"] < u.stats()["submitted"] for u in ups.values()):
                assert time.monotonic() < deadline, [u.stats() for u in ups.values()]
                time.sleep(0.002)
            clock.now = ts + 3 * S
            while plane.scoring.last_round_ns < clock.now:   # a scoring round has seen the new clock
                time.sleep(0.005)
            if ts < fault_at and plane.nodes.risk:
                healthy_seen = True
                assert max(r.probability for r in plane.nodes.snapshot()) < 0.5
            ts += SWEEP_NS
        assert healthy_seen, "the healthy phase was never scored"
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got, f"no directive; risk {[(r.node, r.probability) for r in plane.nodes.snapshot()]}"
        d = got[0]
        assert (d.kind, list(d.ranks), d.from_node, d.to_node) == (jpb.DIRECTIVE_KIND_EVACUATE, [1], "n1", "n3")
        assert d.risk > 0.5 and "above threshold 0.5" in d.reason
        assert ts - fault_at <= 10 * 60 * S    # within minutes of (simulated) telemetry after the fault began

        r = risk.GetNodeRisk(risk_pb2.GetNodeRiskRequest(node="n1"), timeout=T)
        assert r.probability > 0.5 and r.above_threshold and r.model_version == "test-pcie-1"
        assert r.horizon_seconds == 1800 and r.signals and "pcie" in (r.signals[0].name + r.signals[0].description).lower()
        top = risk.ListRiskiest(risk_pb2.ListRiskiestRequest(limit=2), timeout=T).nodes
        assert top[0].node == "n1" and top[1].probability < 0.5
        with pytest.raises(grpc.RpcError) as info:
            risk.GetNodeRisk(risk_pb2.GetNodeRiskRequest(node="nobody"), timeout=T)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert any(c.node == "n1" and c.probability > 0.5 for c in changes)

        # promtool: the exposition follows Prometheus' conventions.
        with urllib.request.urlopen(f"http://127.0.0.1:{plane.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert 'foreshock_node_failure_risk{leaf_switch="",node="n1",site=""}' in text
        # the level people read: the risk over the threshold in force (0.5 here)
        level = re.search(r'^foreshock_node_risk_level\{leaf_switch="",node="n1",site=""\} (\S+)$', text, re.M)
        assert level and float(level.group(1)) == pytest.approx(plane.nodes.risk["n1"].probability / 0.5)
        assert 'foreshock_directives_issued_total{kind="evacuate"} 1.0' in text
        # n1 crossed once and no other node did: one risk alarm, against the budget the threshold is for
        assert re.search(r'^foreshock_risk_alarms_total\{cause="risk"\} 1\.0$', text, re.M)
        assert re.search(r'^foreshock_risk_alarms_total\{cause="hard_evidence"\} 0\.0$', text, re.M)
        assert re.search(r'^foreshock_evacuation_budget \S+$', text, re.M)
        top_signal = r.signals[0].name
        assert f'foreshock_node_risk_signal_contribution{{node="n1",signal="{top_signal}"}}' in text
        if shutil.which("promtool"):
            out = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True,
                                 timeout=30)
            assert out.returncode == 0, out.stdout + out.stderr

        # A real Prometheus scrapes the service and answers for n1's risk.
        binary = shutil.which("prometheus")
        assert binary, "prometheus is missing: tests/setup.sh installs Debian's package"
        port = _free_port()
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                       f"  - job_name: foreshock\n    static_configs:\n      - targets: ['127.0.0.1:{plane.metrics_port}']\n")
        prom = subprocess.Popen([binary, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        value, deadline = None, time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                res = _prom_query(port, 'foreshock_node_failure_risk{node="n1"}')
                if res:
                    value = float(res[0]["value"][1])
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert value is not None and abs(value - plane.nodes.risk["n1"].probability) < 0.2 and value > 0.5
        up = _prom_query(port, 'up{job="foreshock"}')
        assert up and up[0]["value"][1] == "1"
        watch.cancel()
        risk_watch.cancel()
        ch.close()
    finally:
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(10)
            except subprocess.TimeoutExpired:
                prom.kill()
        for u in ups.values():
            u.close(0.5)
        plane.stop(0)


def test_the_evacuation_threshold_for_a_budget_is_the_registrys(model_dir, tmp_path):
    """The control plane asks its scorer, and the scorer asks the model registry: one rule decides the
    threshold for a false-evacuation budget (foreshock/risk.py), whichever side reads it."""
    from foreshock.predictor import registry
    from foreshock.service.scoring import NullScorer, PredictorScorer

    loaded = registry.load_model(model_dir)
    tiered = tmp_path / "tiered"
    registry.save_model(tiered, loaded.estimator, {"version": "test-tiered", "horizon_seconds": 1800,
                                                   "thresholds": {"1": 0.7, "2": 0.5, "5": 0.3},
                                                   "recommended_threshold": 0.45})
    model = registry.load_model(tiered)
    scorer = PredictorScorer(tiered)
    for budget in (None, 0.5, 1.0, 3.0, 5.0):
        assert scorer.threshold(budget) == model.threshold(budget)
    assert [scorer.threshold(b) for b in (None, 0.5, 3.0)] == [0.45, 0.7, 0.5]
    assert NullScorer().threshold(2.0) is None
    plane = build_server(Settings.insecure_loopback(tmp_path / "state", model_path=str(tiered),
                                                    false_evacuation_budget=5.0))
    try:
        assert plane.policy.settings.threshold == 0.3
        assert plane.evacuation_budget == 5.0     # exported beside the threshold (foreshock_evacuation_budget)
    finally:
        plane.stop(0)
    # the manifest's own budget when none is asked; none when the threshold is set by hand
    registry.save_model(tmp_path / "budgeted", loaded.estimator, {**model.manifest, "version": "test-budgeted",
                                                                  "budget": 2.0})
    for settings, budget in (({}, 2.0), ({"threshold": 0.6}, None)):
        plane = build_server(Settings.insecure_loopback(tmp_path / "state", model_path=str(tmp_path / "budgeted"),
                                                        **settings))
        try:
            assert plane.evacuation_budget == budget
        finally:
            plane.stop(0)


def test_the_threshold_follows_the_fleets_score_level(model_dir, tmp_path):
    """A manifest with a score-level reference: the policy's threshold rises within the hour on a fleet
    whose healthy nodes score above it (predictor/fleetlevel.py), carries across a restart, and falls back
    when they quiet down; a threshold set by hand does not move; a reference that is not a probability
    stops the service, named."""
    from foreshock.predictor import registry
    from foreshock.service.scoring import ScoreResult
    from foreshock.service.server import SettingsError

    loaded = registry.load_model(model_dir)
    path = tmp_path / "levelled"
    registry.save_model(path, loaded.estimator, {**loaded.manifest, "version": "test-levelled",
                                                 "thresholds": {"2": 0.3}, "recommended_threshold": 0.3,
                                                 "score_level": {"reference": 0.01}})
    nodes = [f"node-{i:02d}" for i in range(20)]

    def hour(plane, start_ns, level):
        for k in range(60):
            plane._after_round(ScoreResult(nodes, np.full(len(nodes), level)), start_ns + k * 60 * S, "test", 0.0)
        return plane.policy.settings.threshold

    plane = build_server(Settings.insecure_loopback(tmp_path / "state", model_path=str(path)))
    try:
        t0 = 1_790_000_000 * S
        assert plane.policy.settings.threshold == 0.3
        assert hour(plane, t0, 0.02) == 0.3                       # no level during the first hour
        assert hour(plane, t0 + 3600 * S, 0.001) == pytest.approx(0.6)   # the hour before: 2x the reference
        assert plane.policy.settings.clear_below == pytest.approx(0.8 * 0.6)
    finally:
        plane.stop(0)
    # a restart carries the hours seen (state_dir/score-level.npz): the first round is at the level
    plane = build_server(Settings.insecure_loopback(tmp_path / "state", model_path=str(path)))
    try:
        plane._after_round(ScoreResult(nodes, np.full(len(nodes), 0.001)), t0 + 7000 * S, "test", 0.0)
        assert plane.policy.settings.threshold == pytest.approx(0.6)
        # a day later the noisy hour has left the window
        assert hour(plane, t0 + 26 * 3600 * S, 0.001) == 0.3
    finally:
        plane.stop(0)
    # a state file that cannot be written costs the carry, not the rounds
    (tmp_path / "state" / "score-level.npz").unlink()
    (tmp_path / "state" / "score-level.npz").mkdir()
    plane = build_server(Settings.insecure_loopback(tmp_path / "state", model_path=str(path)))
    try:
        assert hour(plane, t0 + 30 * 3600 * S, 0.02) == 0.3 and hour(plane, t0 + 31 * 3600 * S, 0.001) > 0.3
    finally:
        plane.stop(0)
    plane = build_server(Settings.insecure_loopback(tmp_path / "state2", model_path=str(path), threshold=0.3))
    try:
        hour(plane, t0, 0.02)
        assert hour(plane, t0 + 3600 * S, 0.02) == 0.3
    finally:
        plane.stop(0)
    registry.save_model(tmp_path / "bad", loaded.estimator, {**loaded.manifest, "version": "test-bad",
                                                            "score_level": {"reference": 3}})
    with pytest.raises(SettingsError, match="score_level.reference"):
        build_server(Settings.insecure_loopback(tmp_path / "state3", model_path=str(tmp_path / "bad")))
