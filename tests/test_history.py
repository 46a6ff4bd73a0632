"""Node history score: trace import, no leakage, the default for unseen nodes, ranking, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from foreshock import dataset
from foreshock.cli import main
from foreshock.predictor import history as h

TRACE = (Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "infinitehbd-trace"
         / "fault_trace_days_0_250.json")
GPU_DBE = {"Level": "Hardware Failure", "Class": "GPU", "Desc": "GPU DBE(Double Bit ECC) > Threshold"}
CABLE = {"Level": "Hardware Failure", "Class": "Parameter Plane Cable", "Desc": "Link Down"}
SOFT = {"Level": "Software Failure", "Class": "Operating System", "Desc": "Kernel Panic"}


def _ev(node, t, kind, ft):
    return {"node_id": node, "event_time": t, "event_type": kind, "fault_type": ft}


def _synthetic_trace() -> list[dict]:
    """A lemon node (faults every 5 days), a node that faulted once long ago, a quiet node, and others."""
    events = []
    for k in range(30):
        t = 2.0 + 5 * k
        events += [_ev("lemon", t, "fault_start", GPU_DBE), _ev("lemon", t + 0.5, "fault_end", GPU_DBE)]
    events += [_ev("once", 3.0, "fault_start", CABLE), _ev("once", 4.0, "fault_end", CABLE)]
    events += [_ev("quiet", 1.0, "fault_start", SOFT), _ev("quiet", 1.1, "fault_end", SOFT)]
    for i in range(20):
        t = 7.0 * i + 1.5
        events += [_ev(f"n{i}", t, "fault_start", CABLE), _ev(f"n{i}", t + 1, "fault_end", CABLE)]
    events.append(_ev("open", 140.0, "fault_start", SOFT))
    return sorted(events, key=lambda e: e["event_time"])


def _write(tmp_path, events, name="trace.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(events))
    return path


def test_import_round_trip(tmp_path):
    trace = _write(tmp_path, _synthetic_trace())
    out = tmp_path / "data"
    assert main(["history", "import", "--format", "infinitehbd", str(trace), "--out", str(out),
                 "--fleet-size", "50"]) == 0
    inc = dataset.read_table(out, "incidents").to_pandas()
    assert len(inc) == 30 + 1 + 1 + 20 + 1
    lemon = inc[inc.node == "lemon"].sort_values("ts")
    assert lemon.iloc[0].ts == pd.Timestamp("2024-04-01T00:00Z")  # day 2 after 2024-03-30
    assert lemon.iloc[0].repaired_at == pd.Timestamp("2024-04-01T12:00Z")
    assert set(lemon.category) == {"gpu_hbm"} and set(lemon.component) == {"GPU"}
    assert "GPU DBE(Double Bit ECC) > Threshold" in lemon.iloc[0].description
    assert inc[inc.node == "once"].category.item() == "network_switch_cable"
    assert inc[inc.node == "quiet"].category.item() == "software_bug"
    assert pd.isna(inc[inc.node == "open"].repaired_at.item())
    assert inc.has_precursor.isna().all()
    log, fleet = h.load(out)
    assert fleet == 50 and len(log.start) == len(inc)
    assert sorted(dataset.list_nodes(out, "inventory")) == sorted(inc.node.unique())


@pytest.mark.parametrize("content, message", [
    ("not json", "not a readable JSON file"),
    (json.dumps({"node_id": "a"}), "expected a JSON list"),
    (json.dumps([_ev("a", 1.0, "fault_start", SOFT), {"node_id": "a", "event_time": 2.0}]), "record 1: missing fields"),
    (json.dumps([_ev("a", 1.0, "fault_begin", SOFT)]), "record 0: unknown event_type 'fault_begin'"),
    (json.dumps([_ev("a", "x", "fault_start", SOFT)]), "record 0: event_time must be"),
    (json.dumps([_ev("a", 1.0, "fault_start", {"Level": "Hardware Failure"})]), "record 0: fault_type must be"),
])
def test_import_refuses_bad_input(tmp_path, capsys, content, message):
    trace = tmp_path / "bad.json"
    trace.write_text(content)
    out = tmp_path / "data"
    assert main(["history", "import", "--format", "infinitehbd", str(trace), "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(trace) in err and message in err
    assert not out.exists() or not any(out.iterdir())


def test_a_repair_that_pairs_with_no_fault_is_left_out_and_named_not_the_trace(tmp_path, capsys):
    """Out of file order, a repair reclassified (its fault_end names another fault type than its start),
    a repair of a node with no open fault and one before its node's fault: the trace still imports; the
    two that pair with nothing are left out and named on stderr; the rest pair as the times say."""
    events = [_ev("late", 9.0, "fault_start", CABLE), _ev("a", 1.0, "fault_start", SOFT),
              _ev("a", 2.0, "fault_end", GPU_DBE), _ev("b", 0.5, "fault_end", SOFT),
              _ev("b", 1.0, "fault_start", SOFT), _ev("c", 4.0, "fault_end", CABLE),
              _ev("late", 9.5, "fault_end", CABLE), _ev("d", 3.0, "fault_start", SOFT), _ev("d", 3.0, "fault_end", SOFT)]
    out = tmp_path / "data"
    trace = _write(tmp_path, events)
    assert main(["history", "import", "--format", "infinitehbd", str(trace), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    said = f"foreshock history import: {tmp_path / 'trace.json'}: record"
    assert captured.err.splitlines() == [f"{said} 3: fault_end at day 0.5 with no open fault of node b: left out",
                                         f"{said} 5: fault_end at day 4 with no open fault of node c: left out"]
    assert "4 incidents on 4 nodes" in captured.out
    assert "2 fault_end records with no open fault left out" in captured.out
    inc = dataset.read_table(out, "incidents").to_pandas().set_index("node")
    day = pd.Timedelta(days=1)
    assert inc.loc["a", "repaired_at"] == h.INFINITEHBD_DAY0 + 2 * day        # the reclassified repair
    assert pd.isna(inc.loc["b", "repaired_at"])                                   # its repair came first
    assert inc.loc["d", "repaired_at"] == inc.loc["d", "ts"] == h.INFINITEHBD_DAY0 + 3 * day
    assert inc.loc["late", "repaired_at"] == h.INFINITEHBD_DAY0 + 9.5 * day


def test_unknown_fault_types_fall_back_to_their_level():
    assert h.infinitehbd_category("Hardware Failure", "GPU", "something new") == "faulty_gpu"
    assert h.infinitehbd_category("Hardware Failure", "Riser", "new") == "hardware_other"
    assert h.infinitehbd_category("Martian Failure", "X", "Y") == "unknown"
    assert "hardware_other" in h.HARDWARE_CATEGORIES and "unknown" not in h.HARDWARE_CATEGORIES


def _fault_log(tmp_path, events) -> h.FaultLog:
    return h.FaultLog.from_incidents(pd.DataFrame(h.read_infinitehbd(_write(tmp_path, events))), h.INFINITEHBD_DAY0)


def test_events_at_or_after_the_cutoff_never_change_the_scores(tmp_path):
    events = _synthetic_trace()
    # Cut at day 100.2: the lemon's fault of day 100 is open, its fault_end (100.5) comes after the cut.
    at = 100.2
    before = [e for e in events if e["event_time"] < at]
    full, cut = _fault_log(tmp_path, events), _fault_log(tmp_path, before)
    nodes = sorted(set(cut.node))
    m_full = h.NodeHistoryModel(fleet_size=50).fit(full, at)
    m_cut = h.NodeHistoryModel(fleet_size=50).fit(cut, at)
    np.testing.assert_allclose(m_full.predict_proba(full, nodes, at), m_cut.predict_proba(cut, nodes, at))
    assert m_full.default_proba(full, at) == pytest.approx(m_cut.default_proba(cut, at))
    # ... and the later events are really there and do change a score made after them.
    assert len(full.start) > len(cut.start)
    later = h.NodeHistoryModel(fleet_size=50).fit(full, 145.0)
    assert not np.allclose(later.predict_proba(full, nodes, 145.0), m_full.predict_proba(full, nodes, at))


def test_lemon_ranks_above_quiet_and_unseen_nodes_get_the_default(tmp_path):
    log = _fault_log(tmp_path, _synthetic_trace())
    at = 120.0
    model = h.NodeHistoryModel(fleet_size=50).fit(log, at)
    names = ["lemon", "once", "quiet", "never-seen"]
    p = dict(zip(names, model.predict_proba(log, names, at)))
    default = model.default_proba(log, at)
    assert p["lemon"] > p["once"] >= default
    assert p["lemon"] > 3 * default
    assert p["never-seen"] == pytest.approx(default)
    assert 0 < default < 1
    assert model.half_life_days_ in model.half_lives and model.n_training_rows_ > 0


def test_no_training_cutoff_gives_the_fleet_rate(tmp_path):
    log = _fault_log(tmp_path, _synthetic_trace())
    model = h.NodeHistoryModel(fleet_size=50).fit(log, 10.0)
    assert len(model.cutoffs_) == 0
    assert 0 < model.default_proba(log, 10.0) < 1


def test_estimator_checks_its_settings(tmp_path):
    log = _fault_log(tmp_path, _synthetic_trace())
    with pytest.raises(ValueError, match="horizon_days"):
        h.NodeHistoryModel(horizon_days=0).fit(log, 100.0)
    with pytest.raises(ValueError, match="half_lives"):
        h.NodeHistoryModel(half_lives=(0.0,)).fit(log, 100.0)


def test_top_lift_counts_ties_in_proportion():
    scores = np.array([3.0, 1, 1, 1, 0, 0, 0, 0, 0, 0] * 2)
    labels = np.array([1, 1, 0, 0, 0, 0, 0, 0, 0, 0] * 2)
    # top 10 % = the two 3.0 nodes, both positives: rate 1 over a base rate of 0.2
    assert h.top_lift(scores, labels, 0.10) == pytest.approx(5.0)
    # top 20 %: the two 3.0 nodes and 2 of the six tied 1.0 nodes (1/3 of them positive)
    assert h.top_lift(scores, labels, 0.20) == pytest.approx((2 + 2 / 3) / 4 / 0.2)


def test_score_cli_accepts_days_and_iso_times(tmp_path):
    trace = _write(tmp_path, _synthetic_trace())
    out = tmp_path / "data"
    assert main(["history", "import", "--format", "infinitehbd", str(trace), "--out", str(out),
                 "--fleet-size", "50"]) == 0
    by_days, by_time = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["history", "score", "--data", str(out), "--at", "100", "--json", str(by_days)]) == 0
    assert main(["history", "score", "--data", str(out), "--at", "2024-07-08T00:00Z", "--json", str(by_time)]) == 0
    a, b = json.loads(by_days.read_text()), json.loads(by_time.read_text())
    assert a["scores"] == b["scores"] and a["default"] == b["default"] and a["at_days"] == 100.0
    assert "open" not in a["scores"] and max(a["scores"], key=a["scores"].get) == "lemon"
    assert main(["history", "score", "--data", str(out), "--at", "soon", "--json", str(by_days)]) == 2
    (tmp_path / "empty").mkdir()
    assert main(["history", "score", "--data", str(tmp_path / "empty"), "--at", "1", "--json", str(by_days)]) == 1


def test_stats(tmp_path, capsys):
    trace = _write(tmp_path, _synthetic_trace())
    out = tmp_path / "data"
    assert main(["history", "import", "--format", "infinitehbd", str(trace), "--out", str(out),
                 "--fleet-size", "50"]) == 0
    capsys.readouterr()
    assert main(["history", "stats", "--data", str(out)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["span_days"] == 148.0 and stats["faults"] == 53 and stats["repairs_closed"] == 52
    assert stats["faults_per_1000_node_days"] == pytest.approx(53 / (50 * 148) * 1000)
    assert stats["repair_hours_median_hardware"] == pytest.approx(12.0)   # the lemon's 30 half-day repairs
    assert stats["repeat_fault_gap_days_median"] == pytest.approx(5.0)


@pytest.mark.skipif(not TRACE.exists(), reason="../shared/datasets/infinitehbd-trace is not here")
def test_cli_end_to_end_on_the_real_trace(tmp_path):
    out, scores = tmp_path / "ihbd", tmp_path / "scores.json"
    assert main(["history", "import", "--format", "infinitehbd", str(TRACE), "--out", str(out)]) == 0
    inc = dataset.read_table(out, "incidents").to_pandas()
    assert len(inc) == 412 and inc.node.nunique() == 196
    assert main(["history", "score", "--data", str(out), "--at", "250", "--json", str(scores)]) == 0
    result = json.loads(scores.read_text())
    assert result["fleet_size"] == 400 and len(result["scores"]) == 196
    assert all(result["default"] <= p < 1 for p in result["scores"].values())
    stats = h.fault_statistics(h.load(out)[0], 400, 250.0)
    assert 15 < stats["repair_hours_median"] < 40 and stats["repair_hours_p90"] > 100


# -- the control plane: the exported gauge and spares with a clean history --------------------------
def test_policy_prefers_the_spare_with_the_cleanest_history(tmp_path):
    from foreshock.service.decisions import DecisionLog
    from foreshock.service.jobs import JobDirectory
    from foreshock.service.nodes import NodeBook, Topology
    from foreshock.service.policy import EvacuationPolicy, PolicySettings
    from foreshock.service.store import StateStore

    now = 1_800_000_000 * 10**9
    store = StateStore(tmp_path / "state.sqlite3", clock=lambda: now)
    try:
        jobs = JobDirectory(store, clock=lambda: now)
        nodes = NodeBook()
        for n in ("r0", "r1", "sa", "sb"):
            nodes.set_topology(n, Topology(site="s", leaf_switch="l1" if n.startswith("s") else "l0"))
            nodes.seen(n, now)
        jobs.register("J", [(0, "r0", [0]), (1, "r1", [0])], ["sa", "sb"], current_step=10)
        policy = EvacuationPolicy(PolicySettings(threshold=0.5), nodes, jobs,
                                  DecisionLog(tmp_path / "decisions", fsync=False, clock=lambda: now))
        # Without a history the first spare by name is taken; with "sa" a lemon, "sb" (no past fault).
        assert policy.choose_spare(store.job("J"), "r0", now, set()) == ("sa", "")
        nodes.set_history({"sa": 0.4}, default=0.05)
        assert nodes.history_risk("sb") == 0.05
        assert policy.choose_spare(store.job("J"), "r0", now, set()) == ("sb", "")
    finally:
        store.close()


def test_control_plane_exports_the_history_score(tmp_path):
    from foreshock.service.scoring import NullScorer
    from foreshock.service.server import ControlPlane, Settings, SettingsError

    trace = _write(tmp_path, _synthetic_trace())
    data = tmp_path / "data"
    assert main(["history", "import", "--format", "infinitehbd", str(trace), "--out", str(data),
                 "--fleet-size", "50"]) == 0
    at_ns = (h.INFINITEHBD_DAY0 + pd.Timedelta(days=120)).value
    plane = ControlPlane(Settings.insecure_loopback(tmp_path / "state", scorer=NullScorer(), history_dir=str(data),
                                                    scoring_clock=lambda: at_ns, fsync=False))
    try:
        gauges = {tuple(s.labels.values()): s.value for fam in plane.registry.collect()
                  if fam.name == "foreshock_node_history_risk" for s in fam.samples}
        assert gauges[("lemon",)] > 3 * gauges[("quiet",)] and len(gauges) == 20  # lemon, once, quiet, n0..n16
        assert plane.nodes.history_default == pytest.approx(gauges[("quiet",)], rel=0.5)
    finally:
        plane.decisions.close()
        plane.store.close()
    with pytest.raises(SettingsError, match="history"):
        ControlPlane(Settings.insecure_loopback(tmp_path / "state2", scorer=NullScorer(),
                                                history_dir=str(tmp_path / "missing")))
