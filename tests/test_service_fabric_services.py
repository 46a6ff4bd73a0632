"""The fabric's services judged (service/fabricunits.py): real collectors (the systemd source over a fake
`systemctl` per node, the streaming uplink) into a real control plane on a loopback port, which is
asked over gRPC (the Jobs API) and /metrics' registry, and whose decision log is read back. An idle
node's IMEX down is recorded and judged by no one; the same node inside a compute domain (a job,
registered or the inventory's label, on two or more nodes of one NVLink domain) is a finding. A Fabric Manager down for
the hold is a finding and its node no spare; a restart's samples are not. A unit that systemd restarts
over and over, sampled active between its crashes, is crash-looping by the growth of its NRestarts (a
finding of its own, its node no spare), one restarted once is not, and the finding clears after a quiet
window; a lower count (a reset) is no growth, a missing one judges nothing. Unknown states and units,
and counts that cannot be, have a clear outcome, and the service goes on."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import time

import grpc
import pytest
from prometheus_client import generate_latest

from foreshock import fabric
from foreshock import schema as sch
from foreshock.collectors.collector import Collector
from foreshock.collectors.systemd import SystemdSource
from foreshock.collectors.uplink import StreamingUplink
from foreshock.config import ConfigError, resolve
from foreshock.service import command
from foreshock.service.decisions import read_decisions
from foreshock.service.fabricunits import FabricServices
from foreshock.service.policy import PolicySettings
from foreshock.service.scoring import NullScorer
from foreshock.v1 import jobs_pb2 as jpb
from foreshock.v1 import jobs_pb2_grpc
from support import UNIT_FAILED, UNIT_RUNNING, FakeSystemctl, wait_until

FM, IMEX = fabric.FABRIC_MANAGER, fabric.IMEX
S = 1_000_000_000
T = 10
RACK = "0c1d2e3f-0000-4000-8000-000000000001/7"
_wait = functools.partial(wait_until, timeout=30.0)


def _state(active: str, sub: str = "", result: str = "success", restarts: int | None = 0) -> str:
    """A unit's `systemctl show` block; restarts None: no NRestarts line (systemd older than 235)."""
    count = "" if restarts is None else f"NRestarts={restarts}\n"
    return f"Result={result}\n{count}Id={{unit}}\nLoadState=loaded\nActiveState={active}\nSubState={sub}\n"


def _up(restarts: int | None) -> str:
    return _state("active", "running", restarts=restarts)


def _restarting(restarts: int | None) -> str:
    """Sampled between a crash and systemd's automatic restart (Restart=on-failure)."""
    return _state("activating", "auto-restart", "exit-code", restarts=restarts)


ACTIVATING = _state("activating", "auto-restart", "exit-code")


@pytest.fixture
def plane_settings():
    return {"scorer": NullScorer(), "decision_flush_seconds": 0.0}


class Nodes:
    """One real collector per node, the systemd source over its own fake systemctl, streaming to the
    plane. Sweeps are stamped by the test (`sweep(ts)`): the hold is judged on the samples' times."""

    def __init__(self, tmp_path, address, names):
        self.fakes, self.collectors, self.uplinks = {}, {}, {}
        for node in names:
            self.fakes[node] = FakeSystemctl(tmp_path / node)
            up = StreamingUplink(address, node=node, backoff_initial=0.1, ack_timeout=15).start()
            self.uplinks[node] = up
            self.collectors[node] = Collector(node, [SystemdSource(node, systemctl=self.fakes[node].path)],
                                              None, uplink=up)

    def sweep(self, ts: int) -> None:
        for c in self.collectors.values():
            c.sweep_once(ts)

    def send(self, node: str, table: str, rows: list[dict]) -> None:
        """Rows of a table sent as the node's collector would (inventory; rows no systemctl writes)."""
        assert self.uplinks[node].submit({table: sch.to_table(table, rows)})

    def close(self) -> None:
        for c in self.collectors.values():
            c.close()
            c.uplink.close(1.0)


@pytest.fixture
def cluster(tmp_path, plane):
    made = []

    def make(names):
        nodes = Nodes(tmp_path, plane.address, names)
        made.append(nodes)
        return nodes

    yield make
    for nodes in made:
        nodes.close()


def _decisions(plane, kind: str) -> list[dict]:
    plane.decisions.flush()
    return [r for r in read_decisions(plane.state_dir / "decisions").to_pylist() if r["kind"] == kind]


def _metrics(plane) -> str:
    return generate_latest(plane.registry).decode()


def _unit(plane, node: str, unit: str):
    return next((u for u in plane.policy.units.snapshot() if (u.node, u.unit) == (node, unit)), None)


def _taken(plane, node: str, unit: str, ts: int) -> bool:
    """The plane has taken the node's sample at `ts` and judged it since."""
    u = _unit(plane, node, unit)
    return u is not None and u.ts_ns >= ts and plane.policy.units.judged_ns > u.received_ns


def _sweeps(nodes: Nodes, start: int, count: int) -> int:
    """`count` polls 10 s apart from `start` (sample times); returns the last one's time."""
    ts = start
    for k in range(count):
        ts = start + k * 10 * S
        nodes.sweep(ts)
    return ts


def _replay(nodes: Nodes, unit: str, start: int, steps: list[dict[str, str]]) -> int:
    """One poll per step, 10 s apart from `start`, each node's unit first set to its block in the step;
    returns the last poll's time."""
    ts = start
    for k, blocks in enumerate(steps):
        ts = start + k * 10 * S
        for node, block in blocks.items():
            nodes.fakes[node].unit(unit, block)
        nodes.sweep(ts)
    return ts


def _inventory(node: str, **labels) -> dict:
    return {"ts": time.time_ns(), "node": node, "leaf_switch": "leaf-1", "nvlink_domain": RACK, **labels}


def _assert_lints_clean(text: str) -> None:
    lint = subprocess.run([shutil.which("promtool") or "promtool", "check", "metrics"], input=text,
                          capture_output=True, text=True, timeout=30)
    assert lint.returncode == 0, lint.stdout + lint.stderr


def _register_rack_job(ch) -> "jobs_pb2_grpc.JobsStub":
    """Registers job mnnvl with a rank on tray-0 and one on tray-1 (a compute domain on the rack's
    NVLink domain); returns the Jobs stub."""
    jobs = jobs_pb2_grpc.JobsStub(ch)
    jobs.RegisterJob(jpb.RegisterJobRequest(job_id="mnnvl", ranks=[
        jpb.RankPlacement(rank=0, node="tray-0", gpus=[0]), jpb.RankPlacement(rank=1, node="tray-1", gpus=[0])]),
        timeout=T)
    return jobs


def _assert_no_spare(plane, why: str) -> None:
    """A job on hgx-1 drained with hgx-0 as its only spare falls back to a checkpoint-exit, saying why."""
    with grpc.insecure_channel(plane.address) as ch:
        jobs = jobs_pb2_grpc.JobsStub(ch)
        jobs.RegisterJob(jpb.RegisterJobRequest(job_id="j", ranks=[jpb.RankPlacement(rank=0, node="hgx-1", gpus=[0])],
                                                spare_nodes=["hgx-0"], current_step=5), timeout=T)
        [d] = jobs.DrainNode(jpb.DrainNodeRequest(node="hgx-1", reason="test"), timeout=T).directives
        assert d.kind == jpb.DIRECTIVE_KIND_CHECKPOINT_EXIT and not d.to_node
        assert why in d.reason


def test_idle_imex_down_is_recorded_not_judged_and_a_compute_domain_on_the_node_makes_it_a_finding(plane, cluster):
    nodes = cluster(["tray-0", "tray-1", "tray-2", "tray-3"])
    fakes = nodes.fakes
    fakes["tray-0"].unit(IMEX, UNIT_FAILED)          # idle: nothing runs on it
    fakes["tray-1"].unit(IMEX, UNIT_RUNNING)
    fakes["tray-2"].unit(IMEX, UNIT_FAILED)          # idle too, until the inventory says otherwise
    fakes["tray-3"].unit(IMEX, UNIT_RUNNING)
    for n in nodes.collectors:
        nodes.send(n, "inventory", [_inventory(n)])
    start = time.time_ns() - 280 * S
    last = _sweeps(nodes, start, 10)                  # 90 s of samples: past the 60-s hold
    assert _wait(lambda: _taken(plane, "tray-0", IMEX, last) and _taken(plane, "tray-2", IMEX, last))
    text = _metrics(plane)
    assert ('foreshock_fabric_service_up{judged="false",node="tray-0",state="failed",'
            'unit="nvidia-imex.service"} 0.0') in text
    assert 'foreshock_fabric_service_up{judged="false",node="tray-1",state="active",unit="nvidia-imex.service"} 1.0' \
        in text
    assert "foreshock_fabric_service_down{" not in text       # nothing judged, so no finding series at all
    assert _decisions(plane, "fabric_service_down") == []
    assert plane.policy.alarms == {}
    # No Fabric Manager is installed on these trays (it runs on the rack's switch trays): nothing of it.
    assert 'unit="nvidia-fabricmanager.service"' not in text

    # A multi-node job across the rack's trays: a compute domain uses tray-0 and tray-1 now.
    with grpc.insecure_channel(plane.address) as ch:
        jobs = _register_rack_job(ch)
        assert _wait(lambda: _decisions(plane, "fabric_service_down"))
        [down] = _decisions(plane, "fabric_service_down")
        details = json.loads(down["details"])
        assert down["node"] == "tray-0" and details["unit"] == IMEX and details["active_state"] == "failed"
        assert details["compute_domain"] == f"registered job mnnvl (NVLink domain {RACK})"
        assert details["since_ns"] == start
        assert 'foreshock_fabric_service_down{node="tray-0",unit="nvidia-imex.service"} 1.0' in _metrics(plane)
        assert 'foreshock_fabric_service_down{node="tray-1",unit="nvidia-imex.service"} 0.0' in _metrics(plane)
        # A finding, not an alarm: nothing is evacuated or drained for it.
        assert plane.policy.alarms == {} and plane.jobs.list("mnnvl") == []

        # The scheduler's inventory labels a job on tray-2 alone: one node is no compute domain ...
        nodes.send("tray-2", "inventory", [_inventory("tray-2", job="slurm-881")])
        assert _wait(lambda: plane.nodes.topo("tray-2").job == "slurm-881")
        time.sleep(1.5)                                           # a judgement or more later
        assert [r["node"] for r in _decisions(plane, "fabric_service_down")] == ["tray-0"]
        # ... and on tray-3 too: the job spans two nodes of the rack, so tray-2's IMEX is judged.
        nodes.send("tray-3", "inventory", [_inventory("tray-3", job="slurm-881")])
        assert _wait(lambda: any(r["node"] == "tray-2" for r in _decisions(plane, "fabric_service_down")))
        row = next(r for r in _decisions(plane, "fabric_service_down") if r["node"] == "tray-2")
        assert json.loads(row["details"])["compute_domain"] == f"job slurm-881 (NVLink domain {RACK})"

        # The job ends: tray-0 is idle again, its IMEX no longer judged; the finding clears.
        jobs.DeregisterJob(jpb.DeregisterJobRequest(job_id="mnnvl"), timeout=T)
        assert _wait(lambda: any(r["node"] == "tray-0" for r in _decisions(plane, "fabric_service_cleared")))
        cleared = next(r for r in _decisions(plane, "fabric_service_cleared") if r["node"] == "tray-0")
        assert "no compute domain uses the node" in cleared["reason"]
        assert 'foreshock_fabric_service_down{node="tray-0"' not in _metrics(plane)


def test_fabric_manager_down_past_the_hold_is_a_finding_and_no_spare_but_a_restart_is_not(plane, cluster):
    nodes = cluster(["hgx-0", "hgx-1"])
    fm0, fm1 = nodes.fakes["hgx-0"], nodes.fakes["hgx-1"]
    fm1.unit(FM, UNIT_RUNNING)
    start = time.time_ns() - 280 * S
    # A restart: activating (auto-restart) between active samples, and a start that takes 50 s: within the hold.
    ts = start
    for block in (UNIT_RUNNING, ACTIVATING, UNIT_RUNNING, ACTIVATING, ACTIVATING, ACTIVATING, ACTIVATING,
                  ACTIVATING, UNIT_RUNNING):
        fm0.unit(FM, block)
        nodes.sweep(ts)
        ts += 10 * S
    last = ts - 10 * S
    assert _wait(lambda: _taken(plane, "hgx-0", FM, last))
    assert _decisions(plane, "fabric_service_down") == []
    assert 'foreshock_fabric_service_down{node="hgx-0",unit="nvidia-fabricmanager.service"} 0.0' in _metrics(plane)

    # Then it fails and stays down: a finding once its samples span the hold (60 s), not before.
    fm0.unit(FM, UNIT_FAILED)
    first_down = ts
    for _ in range(6):                                       # 50 s of samples
        nodes.sweep(ts)
        ts += 10 * S
    assert _wait(lambda: _taken(plane, "hgx-0", FM, ts - 10 * S))
    assert _decisions(plane, "fabric_service_down") == []
    nodes.sweep(ts)                                          # 60 s
    assert _wait(lambda: _decisions(plane, "fabric_service_down"))
    [down] = _decisions(plane, "fabric_service_down")
    details = json.loads(down["details"])
    assert (down["node"], details["unit"], details["since_ns"]) == ("hgx-0", FM, first_down)
    assert (details["sub_state"], details["result"], details["n_restarts"]) == ("failed", "exit-code", 5)
    assert "new CUDA contexts fail" in down["reason"]
    text = _metrics(plane)
    assert 'foreshock_fabric_service_down{node="hgx-0",unit="nvidia-fabricmanager.service"} 1.0' in text
    assert 'foreshock_fabric_service_down{node="hgx-1",unit="nvidia-fabricmanager.service"} 0.0' in text
    _assert_lints_clean(text)
    assert plane.policy.alarms == {}

    # The node is no spare meanwhile: a job on hgx-1 drained with hgx-0 as its only spare falls back.
    _assert_no_spare(plane, "hgx-0: nvidia-fabricmanager down")

    # It serves again: the finding clears.
    fm0.unit(FM, UNIT_RUNNING)
    nodes.sweep(ts + 10 * S)
    assert _wait(lambda: _decisions(plane, "fabric_service_cleared"))
    assert "serves again" in _decisions(plane, "fabric_service_cleared")[0]["reason"]
    assert 'foreshock_fabric_service_down{node="hgx-0",unit="nvidia-fabricmanager.service"} 0.0' in _metrics(plane)


def test_a_masked_fabric_manager_is_not_judged(plane, cluster):
    nodes = cluster(["pcie-0"])
    nodes.fakes["pcie-0"].unit(FM, "Result=success\nNRestarts=0\nId={unit}\nLoadState=masked\n"
                                    "ActiveState=inactive\nSubState=dead\n")
    last = _sweeps(nodes, time.time_ns() - 280 * S, 10)
    assert _wait(lambda: _taken(plane, "pcie-0", FM, last))
    text = _metrics(plane)
    assert ('foreshock_fabric_service_up{judged="false",node="pcie-0",state="inactive",'
            'unit="nvidia-fabricmanager.service"} 0.0') in text
    assert "foreshock_fabric_service_down{" not in text
    assert _decisions(plane, "fabric_service_down") == []


def test_unknown_states_and_units_have_a_clear_outcome_and_the_service_goes_on(plane, cluster):
    nodes = cluster(["hgx-7"])
    fake = nodes.fakes["hgx-7"]
    # An ActiveState systemd does not define, from the real collector: taken as not serving.
    fake.unit(FM, _state("exploding", "weird"))
    # A row no systemctl writes (empty states, a unit that is no fabric service), sent as a collector would.
    start = time.time_ns() - 280 * S
    nodes.send("hgx-7", "systemd_unit", [
        {"ts": start - 5 * S, "node": "hgx-7", "unit": IMEX},                        # every state null
        {"ts": start - 5 * S, "node": "hgx-7", "unit": "sshd.service", "active_state": "active"},
        {"ts": start - 5 * S, "node": "hgx-7", "unit": FM, "active_state": "x" * 5000}])
    assert _wait(lambda: plane.policy.units.row_counts()["unknown_unit"] == 1)
    last = _sweeps(nodes, start, 8)                              # 70 s of the unknown state
    assert _wait(lambda: _taken(plane, "hgx-7", FM, last))
    counts = plane.policy.units.row_counts()
    assert counts["unknown_unit"] == 1 and counts["unknown_state"] >= 10 and counts["taken"] == 0
    text = _metrics(plane)
    assert 'foreshock_fabric_service_rows_total{result="unknown_unit"} 1.0' in text
    assert ('foreshock_fabric_service_up{judged="true",node="hgx-7",state="unknown",'
            'unit="nvidia-fabricmanager.service"} 0.0') in text
    # A unit not known to serve for the hold is a finding, with the state named as unknown.
    assert _wait(lambda: _decisions(plane, "fabric_service_down"))
    [down] = _decisions(plane, "fabric_service_down")
    assert json.loads(down["details"])["active_state"] == "unknown" and "weird" in down["reason"]
    # The service goes on: a later sample is taken and judged, and the API answers.
    fake.unit(FM, UNIT_RUNNING)
    nodes.sweep(last + 10 * S)
    assert _wait(lambda: _decisions(plane, "fabric_service_cleared"))
    with grpc.insecure_channel(plane.address) as ch:
        assert jobs_pb2_grpc.JobsStub(ch).ListDirectives(jpb.ListDirectivesRequest(), timeout=T).directives == []


def test_with_the_scoring_worker_the_states_come_back_from_it_and_are_judged(tmp_path):
    # `foreshock serve`'s pipeline: bulk telemetry (systemd_unit is not urgent) is checked in the worker
    # process, which hands the states back with its verdicts.
    from foreshock.predictor.registry import default_model_path
    from foreshock.service.server import Settings, build_server
    if default_model_path() is None:
        pytest.skip("no shipped model")
    p = build_server(Settings.insecure_loopback(tmp_path / "state", scoring_process=True,
                                                decision_flush_seconds=0.0))
    p.start()
    nodes = None
    try:
        assert p.scoring.worker is not None and p.scoring.worker.up
        nodes = Nodes(tmp_path, p.address, ["hgx-3"])
        nodes.fakes["hgx-3"].unit(FM, UNIT_FAILED)
        last = _sweeps(nodes, time.time_ns() - 280 * S, 8)
        assert _wait(lambda: _decisions(p, "fabric_service_down"))
        assert _taken(p, "hgx-3", FM, last) and p.ingest.accepted_rows["systemd_unit"] == 8
        assert 'foreshock_fabric_service_down{node="hgx-3",unit="nvidia-fabricmanager.service"} 1.0' in _metrics(p)
    finally:
        if nodes is not None:
            nodes.close()
        p.stop(0)


def test_the_hold_is_range_checked_where_it_is_declared():
    for bad in (0, 5, 3601, float("nan")):
        with pytest.raises(ValueError, match="fabric_service_hold_seconds"):
            PolicySettings(fabric_service_hold_seconds=bad)
        with pytest.raises(ValueError, match="fabric_service_hold_seconds"):
            FabricServices(bad)
    with pytest.raises(ConfigError, match="fabric_service_hold_seconds"):
        resolve("serve", command.DEFAULTS, env={}, flags={"fabric_service_hold_seconds": 5.0}, checks=command.CHECKS)
    cfg = resolve("serve", command.DEFAULTS, env={}, flags={"fabric_service_hold_seconds": 120.0}, checks=command.CHECKS)
    settings = command.settings_from({**cfg, "no_model": True, "insecure": True})
    assert settings.policy["fabric_service_hold_seconds"] == 120.0


# -- crash-looping: judged from the growth of NRestarts ---------------------------------------------
def _looping(plane, node: str) -> list[dict]:
    return [r for r in _decisions(plane, "fabric_service_crash_loop") if r["node"] == node]


def _loop_metric(node: str, unit: str, value: float) -> str:
    return f'foreshock_fabric_service_crash_looping{{node="{node}",unit="{unit}"}} {value}'


def test_a_fabric_manager_restarting_over_and_over_is_crash_looping_though_sampled_active(plane, cluster):
    nodes = cluster(["hgx-0", "hgx-1"])
    start = time.time_ns() - 800 * S
    # hgx-0 crashes every 30 s and systemd restarts it within the poll: two samples of three say active,
    # none of its runs not serving comes near the hold. hgx-1 crashes once and runs on.
    steps = [{"hgx-0": _up(0), "hgx-1": _up(0)}, {"hgx-0": _up(0), "hgx-1": _up(0)},
             {"hgx-0": _restarting(1), "hgx-1": _restarting(1)}, {"hgx-0": _up(1), "hgx-1": _up(1)},
             {"hgx-0": _up(1), "hgx-1": _up(1)}, {"hgx-0": _restarting(2), "hgx-1": _up(1)},
             {"hgx-0": _up(2), "hgx-1": _up(1)}, {"hgx-0": _up(2), "hgx-1": _up(1)}]
    last = _replay(nodes, FM, start, steps)
    assert _wait(lambda: _taken(plane, "hgx-0", FM, last) and _taken(plane, "hgx-1", FM, last))
    assert _decisions(plane, "fabric_service_crash_loop") == []        # two restarts: not yet
    text = _metrics(plane)
    assert _loop_metric("hgx-0", FM, 0.0) in text and _loop_metric("hgx-1", FM, 0.0) in text

    # The third restart within the window (10 minutes) makes it a finding; the samples never made it down.
    third = _replay(nodes, FM, last + 10 * S, [{"hgx-0": _restarting(3), "hgx-1": _up(1)}])
    assert _wait(lambda: _decisions(plane, "fabric_service_crash_loop"))
    [loop] = _decisions(plane, "fabric_service_crash_loop")
    details = json.loads(loop["details"])
    assert loop["node"] == "hgx-0" and details["unit"] == FM and details["n_restarts"] == 3
    assert (details["restarts_in_window"], details["window_seconds"]) == (3, 600.0)
    assert (details["since_ns"], details["last_restart_ns"]) == (start + 20 * S, third)
    assert "restarted 3 times within 600 s" in loop["reason"] and "refused as a spare" in loop["reason"]
    assert _decisions(plane, "fabric_service_down") == []
    text = _metrics(plane)
    assert _loop_metric("hgx-0", FM, 1.0) in text and _loop_metric("hgx-1", FM, 0.0) in text
    assert 'foreshock_fabric_service_down{node="hgx-0",unit="nvidia-fabricmanager.service"} 0.0' in text
    _assert_lints_clean(text)
    assert plane.policy.alarms == {}

    # Meanwhile hgx-0 is no spare: a job on hgx-1 drained with it as its only spare falls back.
    _assert_no_spare(plane, "hgx-0: nvidia-fabricmanager crash-looping")

    # It stops restarting: the finding holds until the count has not grown for the window, then clears.
    quiet = [{"hgx-0": _up(3), "hgx-1": _up(1)}] * 59
    last = _replay(nodes, FM, third + 10 * S, quiet)                     # 590 s after the third restart
    assert _wait(lambda: _taken(plane, "hgx-0", FM, last))
    assert _decisions(plane, "fabric_service_crash_loop_cleared") == []
    last = _replay(nodes, FM, last + 10 * S, quiet[:1])                  # 600 s
    assert _wait(lambda: _decisions(plane, "fabric_service_crash_loop_cleared"))
    [cleared] = _decisions(plane, "fabric_service_crash_loop_cleared")
    assert cleared["node"] == "hgx-0" and "has not restarted for 600 s" in cleared["reason"]
    assert json.loads(cleared["details"])["restarts_in_window"] == 0
    assert _loop_metric("hgx-0", FM, 0.0) in _metrics(plane)
    assert _looping(plane, "hgx-1") == [] and _decisions(plane, "fabric_service_down") == []
    counts = plane.policy.units.restart_counts()
    assert (counts["first"], counts["grew"], counts["reset"], counts["absurd"]) == (2, 4, 0, 0)


def test_a_reset_is_no_growth_a_missing_count_judges_nothing_and_an_impossible_one_is_counted(plane, cluster,
                                                                                              caplog):
    nodes = cluster(["hgx-2", "hgx-3", "hgx-4"])
    start = time.time_ns() - 500 * S
    steps = [
        # hgx-2: its first count is a baseline (when those 4 restarts happened is not known); one restart;
        # an operator's `systemctl restart` starts NRestarts at 0 again; one more restart.
        {"hgx-2": _up(4), "hgx-3": _up(None), "hgx-4": _up(0)},
        {"hgx-2": _up(4), "hgx-3": _restarting(None), "hgx-4": _up(0)},
        {"hgx-2": _restarting(5), "hgx-3": _up(None), "hgx-4": _up(4_000_000_000)},   # hgx-4: 4e9 in 10 s
        {"hgx-2": _up(0), "hgx-3": _restarting(None), "hgx-4": _up(4_000_000_000)},
        {"hgx-2": _up(0), "hgx-3": _up(None), "hgx-4": _up(0)},                # back: a reset, no growth
        {"hgx-2": _restarting(1), "hgx-3": _restarting(None), "hgx-4": _up(0)},
        {"hgx-2": _up(1), "hgx-3": _up(None), "hgx-4": _up(0)},
    ]
    with caplog.at_level("WARNING", "foreshock.service.fabricunits"):
        last = _replay(nodes, FM, start, steps)
        assert _wait(lambda: all(_taken(plane, n, FM, last) for n in ("hgx-2", "hgx-3", "hgx-4")))
    time.sleep(1.5)                                                    # a judgement or more later
    assert _decisions(plane, "fabric_service_crash_loop") == []
    assert "grew faster than 100 a second" in caplog.text and "hgx-4" in caplog.text
    counts = plane.policy.units.restart_counts()
    assert (counts["reset"], counts["absurd"], counts["missing"], counts["grew"]) == (2, 1, 7, 2)
    text = _metrics(plane)
    assert 'foreshock_fabric_service_restart_samples_total{result="reset"} 2.0' in text
    assert 'foreshock_fabric_service_restart_samples_total{result="missing"} 7.0' in text
    assert _loop_metric("hgx-2", FM, 0.0) in text and _loop_metric("hgx-4", FM, 0.0) in text
    # Without NRestarts the judgement is not made: no crash-loop series, and no error anywhere.
    assert 'foreshock_fabric_service_crash_looping{node="hgx-3"' not in text
    assert all(src.errors == 0 for c in nodes.collectors.values() for src in c.sources)

    # The reset took nothing away either: a third restart within the window, across it, is a loop.
    last = _replay(nodes, FM, last + 10 * S, [{"hgx-2": _restarting(2), "hgx-3": _up(None), "hgx-4": _up(0)}])
    assert _wait(lambda: _looping(plane, "hgx-2"))
    assert json.loads(_looping(plane, "hgx-2")[0]["details"])["restarts_in_window"] == 3
    assert [r["node"] for r in _decisions(plane, "fabric_service_crash_loop")] == ["hgx-2"]


def test_a_crash_looping_imex_is_judged_only_while_a_compute_domain_uses_the_node(plane, cluster):
    nodes = cluster(["tray-0", "tray-1"])
    for n in nodes.collectors:
        nodes.send(n, "inventory", [_inventory(n)])
    start = time.time_ns() - 400 * S
    steps = [{"tray-0": (_up if k % 2 else _restarting)(k), "tray-1": _up(0)} for k in range(6)]
    last = _replay(nodes, IMEX, start, steps)                         # five restarts in 50 s, on an idle tray
    assert _wait(lambda: _taken(plane, "tray-0", IMEX, last))
    time.sleep(1.5)
    assert _decisions(plane, "fabric_service_crash_loop") == []
    assert "foreshock_fabric_service_crash_looping{" not in _metrics(plane)    # nothing judged
    with grpc.insecure_channel(plane.address) as ch:
        jobs = _register_rack_job(ch)
        assert _wait(lambda: _looping(plane, "tray-0"))
        [loop] = _looping(plane, "tray-0")
        details = json.loads(loop["details"])
        assert details["unit"] == IMEX and details["restarts_in_window"] == 5
        assert details["compute_domain"] == f"registered job mnnvl (NVLink domain {RACK})"
        assert _loop_metric("tray-0", IMEX, 1.0) in _metrics(plane)
        assert _loop_metric("tray-1", IMEX, 0.0) in _metrics(plane)
        jobs.DeregisterJob(jpb.DeregisterJobRequest(job_id="mnnvl"), timeout=T)
        assert _wait(lambda: _decisions(plane, "fabric_service_crash_loop_cleared"))
        [cleared] = _decisions(plane, "fabric_service_crash_loop_cleared")
        assert cleared["node"] == "tray-0" and "no compute domain uses the node" in cleared["reason"]


def test_the_crash_loop_rule_is_range_checked_where_it_is_declared():
    for restarts, window in ((1, 600), (1001, 600), (3.0, 600), (True, 600), (3, 59), (3, 86_401),
                             (3, float("nan"))):
        name = "restarts" if window == 600 else "window_seconds"
        with pytest.raises(ValueError, match=f"fabric_service_crash_loop_{name}"):
            PolicySettings(fabric_service_crash_loop_restarts=restarts,
                           fabric_service_crash_loop_window_seconds=window)
        with pytest.raises(ValueError, match=f"fabric_service_crash_loop_{name}"):
            FabricServices(crash_loop_restarts=restarts, crash_loop_window_seconds=window)
    for flags in ({"fabric_service_crash_loop_restarts": 1}, {"fabric_service_crash_loop_window_seconds": 30.0}):
        with pytest.raises(ConfigError, match=next(iter(flags))):
            resolve("serve", command.DEFAULTS, env={}, flags=flags, checks=command.CHECKS)
    cfg = resolve("serve", command.DEFAULTS, env={}, checks=command.CHECKS,
                  flags={"fabric_service_crash_loop_restarts": 5, "fabric_service_crash_loop_window_seconds": 1800.0})
    settings = command.settings_from({**cfg, "no_model": True, "insecure": True})
    assert (settings.policy["fabric_service_crash_loop_restarts"],
            settings.policy["fabric_service_crash_loop_window_seconds"]) == (5, 1800.0)
    defaults = FabricServices()
    assert (defaults.loop_restarts, defaults.loop_window_ns) == (3, 600 * S)


def test_observe_counts_a_restart_count_that_is_none_and_goes_on():
    # Counts the wire cannot carry (the schema's uint32 refuses a negative one at receipt, as bad_schema)
    # can still reach `observe` from a caller of its own: counted, never raised.
    units = FabricServices()
    rows = [("n", FM, k * 10 * S, "loaded", "active", "running", "success", n)
            for k, n in enumerate((0, -1, "7", 2.5, 1 << 32, 0))]
    units.observe(rows, 0)
    assert units.restart_counts()["absurd"] == 4 and units.restart_counts()["same"] == 1
    assert units.judge(10 * S, lambda: (lambda node: "")) == [] and not units.crash_looping("n", FM)
