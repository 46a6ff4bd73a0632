"""`foreshock evaluate`: figures at budgets 1, 2 and 5 per family and node type, the training-data overlap
warning, and leave-one-out training (a family's or a node type's steps left out of train.train)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from foreshock import cli
from foreshock import dataset as ds
from foreshock import schema as sch
from foreshock.predictor import evaluate as ev
from foreshock.predictor import groups
from foreshock.predictor import labels as lb
from foreshock.predictor import offline, registry, train

SMALL = "4 GPU / 4 HCA"
WARNING = "WARNING: the evaluated data overlaps the model's training data"


def _simulate(out, days: int, seed: int, start: str | None = None):
    args = ["simulate", "--nodes", "16", "--days", str(days), "--interval", "60", "--seed", str(seed),
            "--rate-scale", "200", "--out", str(out)]
    assert cli.main(args + (["--start", start] if start else [])) == 0
    return out


def _make_half_small(root) -> None:
    """The inventory says nodes 0-7 are 4-GPU / 4-HCA nodes (telemetry unchanged): two node types."""
    for path in sorted((root / "table=inventory").rglob("*.parquet")):
        t = pq.read_table(path)
        small = np.array([int(n.rsplit("-", 1)[1]) < 8 for n in t.column("node").to_pylist()])
        for col in ("gpus", "hcas"):
            i = t.schema.get_field_index(col)
            vals = np.where(small, 4, t.column(col).to_numpy(zero_copy_only=False))
            t = t.set_column(i, t.schema.field(i), pa.array(vals, type=t.schema.field(i).type))
        pq.write_table(t, path)


@pytest.fixture(scope="module")
def serial_features():
    # 16 nodes: spawning feature workers costs more than it saves
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORESHOCK_FEATURE_WORKERS", "1")
        yield


@pytest.fixture(scope="module")
def train_data(tmp_path_factory, serial_features):
    out = _simulate(tmp_path_factory.mktemp("sim") / "train", days=3, seed=3)
    _make_half_small(out)
    return out


@pytest.fixture(scope="module")
def later_data(tmp_path_factory, serial_features):
    # the same 16 node names, the day after the training data ends
    return _simulate(tmp_path_factory.mktemp("sim") / "later", days=2, seed=4, start="2026-01-08T00:00:00Z")


@pytest.fixture(scope="module")
def model_dir(train_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "m"
    train.train(train_data, out, max_iter=20)
    return out


def test_evaluate_on_the_training_data_reports_budgets_groups_and_warns_of_the_overlap(
        train_data, model_dir, tmp_path, capsys):
    js, page = tmp_path / "e.json", tmp_path / "e.html"
    rc = cli.main(["evaluate", "--data", str(train_data), "--model", str(model_dir), "--json", str(js),
                   "--html", str(page)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert WARNING in captured.err and "not evidence of how the model does on new data" in captured.err
    rep = json.loads(js.read_text())
    man = registry.read_manifest(model_dir)
    assert rep["overlap"]["overlaps"] and rep["overlap"]["same_data_hash"] and rep["overlap"]["same_node_names"]
    assert 'class="overlap"' in page.read_text()
    assert set(rep["at_budgets"]) == {"1.0", "2.0", "5.0"}
    for b, per in rep["at_budgets"].items():
        assert set(per) == {"model", "rule", "logistic"}
        for name, m in per.items():
            assert m["threshold"] == registry.manifest_threshold(man, float(b), name)
            fam = m["per_family"]
            # every precursor incident is in exactly one family and one signature
            assert sum(f["incidents"] for f in fam.values()) == m["incidents_precursor"]
            assert sum(f["incidents"] for f in m["per_signature"].values()) == m["incidents_precursor"]
            detected = round(m["incident_recall_precursor"] * m["incidents_precursor"])
            assert sum(f["detected"] for f in fam.values()) == detected
            types = m["per_node_type"]
            assert set(types) == {"8 GPU / 8 HCA", SMALL}
            assert sum(t["false_evacuations"] for t in types.values()) == m["false_evacuations"]
            assert sum(t["node_days"] for t in types.values()) == pytest.approx(m["node_days"])
            low, high = m["false_evacuations_per_1000_node_days_interval"]
            assert low <= m["false_evacuations_per_1000_node_days"] < high
            assert ev.rate_interval(m["false_evacuations"], m["node_days"]) == [low, high]
    # each budget's figures are printed with their intervals
    budget2 = rep["at_budgets"]["2.0"]["model"]
    rate_low, rate_high = budget2["false_evacuations_per_1000_node_days_interval"]
    assert f"FE/1k {budget2['false_evacuations_per_1000_node_days']:6.2f} [{rate_low:.2f}-{rate_high:.2f}]" in captured.out
    # on its own training data, the model catches some incident of some family at budget 5
    fam5 = rep["at_budgets"]["5.0"]["model"]["per_family"]
    assert any(f["detected"] > 0 and f["recall"] > 0 for f in fam5.values())
    assert rep["node_types"] == {"8 GPU / 8 HCA": 8, SMALL: 8}


def test_a_later_time_range_of_the_same_nodes_is_not_an_overlap(later_data, model_dir, tmp_path, capsys):
    js, page = tmp_path / "e.json", tmp_path / "e.html"
    rc = cli.main(["evaluate", "--data", str(later_data), "--model", str(model_dir), "--json", str(js),
                   "--html", str(page)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert WARNING not in captured.err
    # after the feature bars, the judging of the scores says where it is too
    assert "judging: 0/4" in captured.err and "judging: 4/4 (100 %)" in captured.err, captured.err
    ov = json.loads(js.read_text())["overlap"]
    assert ov["overlaps"] is False and ov["same_node_names"] is True and ov["time_ranges_intersect"] is False
    assert 'class="overlap"' not in page.read_text()


def test_a_label_horizon_goes_with_leave_one_out_and_is_range_checked(train_data, tmp_path, capsys):
    base = ["evaluate", "--data", str(train_data), "--json", str(tmp_path / "e.json")]
    assert cli.main(base + ["--label-horizon-minutes", "360"]) == 2
    assert "go with --leave-one-out" in capsys.readouterr().err
    assert cli.main(base + ["--leave-one-out", "family", "--train-data", str(train_data),
                            "--label-horizon-minutes", "0.5"]) == 2
    assert "0 (the horizon) or between 1 and 2160" in capsys.readouterr().err
    assert not (tmp_path / "e.json").exists()


def test_the_overlap_rule_and_manifests_that_predate_node_names():
    train_side = {"data_hash": "a" * 64, "node_names_sha256": "n1", "nodes": 4,
                  "first_step_end": "2026-01-05T00:01:00+00:00", "last_step_end": "2026-01-08T00:00:00+00:00"}
    evaluated = {**train_side, "data": "x", "data_hash": "b" * 64}
    assert ev.overlap(train_side, evaluated)["overlaps"]                          # same nodes, same days
    assert not ev.overlap(train_side, {**evaluated, "node_names_sha256": "n2"})["overlaps"]   # other nodes
    later = {**evaluated, "first_step_end": "2026-01-08T00:01:00+00:00", "last_step_end": "2026-01-09T00:00:00+00:00"}
    assert not ev.overlap(train_side, later)["overlaps"]
    assert ev.overlap(train_side, {**later, "data_hash": "a" * 64})["reason"].startswith("the same data hash")
    old = {k: v for k, v in train_side.items() if k != "node_names_sha256"}
    got = ev.overlap(old, evaluated)
    assert not got["overlaps"] and got["same_node_names"] is None and "only the data hashes" in got["note"]
    assert ev.overlap(old, {**evaluated, "data_hash": "a" * 64})["overlaps"]


def test_a_budget_the_manifest_has_no_threshold_for_is_said_so_not_made_up():
    ends = (np.arange(120) + 1) * 60 * 10**9
    incidents = lb.Incidents.from_table(sch.to_table("incidents", [
        {"ts": pd.Timestamp(int(ends[100]), tz="UTC"), "node": "n1", "incident_id": "a", "scope": "node",
         "category": "gpu_hbm", "description": "HBM3 wear: rows remapped", "has_precursor": True}]))
    s = np.zeros(120, np.float32)
    s[90:101] = 0.9
    y, excl = lb.node_labels(ends, incidents.of_node("n1"), 1800)
    nodes = [ev.NodeScores("n1", ends, y, ~excl, {"model": s})]
    manifest = {"thresholds": {"2.0": 0.5, "5.0": 0.95}}
    got = ev.at_budgets(nodes, incidents, manifest, ["model"], {"n1": SMALL}, 1800)
    assert got["1.0"]["model"]["threshold"] is None and "no threshold" in got["1.0"]["model"]["missing"]
    at2 = got["2.0"]["model"]
    assert at2["per_family"]["gpu_hbm"]["recall"] == 1.0
    assert at2["per_signature"]["gpu_hbm: HBM3 wear"]["detected"] == 1
    assert at2["per_node_type"][SMALL]["recall"] == 1.0
    assert got["5.0"]["model"]["per_family"]["gpu_hbm"]["detected"] == 0


def _family_with_most_precursor_incidents(root) -> str:
    by = lb.Incidents.from_table(ds.read_table(root, "incidents")).by_incident
    return by[by["has_precursor"].astype(bool)]["category"].value_counts().index[0]


def test_leave_one_family_out_trains_without_its_steps_and_evaluates_on_new_data(
        train_data, later_data, tmp_path, capsys):
    family = _family_with_most_precursor_incidents(train_data)
    js, page = tmp_path / "loo.json", tmp_path / "loo.html"
    rc = cli.main(["evaluate", "--leave-one-out", "family", "--train-data", str(train_data), "--data", str(later_data),
                   "--only", family, "--max-iter", "20", "--json", str(js), "--html", str(page)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    # progress lines although stderr is not a terminal; the later data does not overlap
    assert "leave-one-out 1/2: training on everything" in captured.err
    assert f"leave-one-out 2/2: training without family '{family}'" in captured.err
    assert WARNING not in captured.err
    rep = json.loads(js.read_text())
    assert list(rep["held_out"]) == [family] and rep["overlap"]["overlaps"] is False
    entry = rep["held_out"][family]
    held, full = entry["training"], rep["everything_training"]
    assert held["held_out"]["kind"] == "family" and held["held_out"]["name"] == family
    assert held["held_out"]["positive_steps_left_out"] > 0
    assert held["held_out"]["steps_left_out"] > held["held_out"]["positive_steps_left_out"]
    # no training row is in the horizon of one of the family's incidents; with everything, some are
    assert held["train_positive_rows_by_family"].get(family, 0) == 0
    assert full["train_positive_rows_by_family"][family] > 0
    assert held["train_positive_rows"] < full["train_positive_rows"]
    for key in ("held_out_model", "model_trained_on_everything"):
        assert set(entry[key]) == {"1.0", "2.0", "5.0"}
        for m in entry[key].values():
            assert {"incident_recall_precursor", "median_lead_minutes",
                    "false_evacuations_per_1000_node_days"} <= set(m) or m["threshold"] is None
    assert family in page.read_text()


def test_leaving_a_node_type_out_leaves_all_its_steps_out_of_training(train_data, tmp_path):
    types = groups.node_types(ds.read_table(train_data, "inventory"))
    holdout = groups.node_type_holdout(types, SMALL)
    assert sorted(holdout.windows) == [f"node-{i:03d}" for i in range(8)]
    man = train.train(train_data, tmp_path / "m", max_iter=5, holdout=holdout)
    tr = man["training"]
    assert tr["train_rows_sampled_by_node_type"].get(SMALL, 0) == 0
    assert tr["train_rows_sampled_by_node_type"]["8 GPU / 8 HCA"] > 0
    # every present, not-excluded step of the held-out nodes is left out (the 8-GPU nodes' are not)
    incidents = lb.Incidents.from_table(ds.read_table(train_data, "incidents"))
    expected = 0
    with offline.FeatureBuilder(train_data, nodes=sorted(holdout.windows)) as fb:
        for nf in fb:
            _, excluded = lb.node_labels(nf.step_end_ns, incidents.of_node(nf.node), man["horizon_seconds"])
            expected += int((nf.scoreable & ~excluded).sum())
    assert tr["held_out"]["steps_left_out"] == expected


def test_leave_one_out_refuses_a_group_the_training_data_lacks(train_data, later_data, capsys):
    rc = cli.main(["evaluate", "--leave-one-out", "family", "--train-data", str(train_data), "--data",
                   str(later_data), "--only", "no_such_family"])
    assert rc == 1 and "no_such_family" in capsys.readouterr().err
    assert cli.main(["evaluate", "--leave-one-out", "family", "--data", str(later_data)]) == 2
    assert "--train-data" in capsys.readouterr().err
    assert cli.main(["evaluate", "--leave-one-out", "families", "--train-data", str(train_data),
                     "--data", str(later_data)]) == 2
    assert "one of family, signature, node_type" in capsys.readouterr().err


def test_thresholds_refits_a_model_on_a_fleets_later_history_and_evaluate_flags_that_data(
        later_data, model_dir, tmp_path, capsys):
    out = tmp_path / "calibrated"
    rc = cli.main(["thresholds", "--data", str(later_data), "--model", str(model_dir), "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "budget 2: threshold" in captured.out
    before, man = registry.read_manifest(model_dir), registry.read_manifest(out)
    fc = man["fleet_calibration"]
    assert fc["from_model"] == before["version"] and fc["thresholds_before"] == before["thresholds"]
    assert fc["fleet_node_days"] > 0 and man["training"]["calibration"]["data_hash"] == offline.dataset_hash(later_data)
    # one rule for every reader: each budget's threshold is the pooled curve's, which the registry reads too
    for key, th in man["thresholds"].items():
        assert ev.pick_threshold(man["threshold_curves"]["model"], float(key)) == th
    loaded = registry.load_model(out)
    assert loaded.threshold() == man["recommended_threshold"] == loaded.threshold(man["budget"])
    # judged on the data its thresholds were fitted on: flagged, naming why
    js = tmp_path / "e.json"
    rc = cli.main(["evaluate", "--data", str(later_data), "--model", str(out), "--json", str(js)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert WARNING in captured.err and "the data its thresholds were calibrated on" in captured.err
    rep = json.loads(js.read_text())
    assert rep["overlap"]["calibration"]["overlaps"] is True
    # the fleet-calibrated figures are reported beside the manifest's, with the thresholds that were in force
    fleet = rep["fleet_calibrated"]["at_budgets"]
    assert set(fleet) == {"1.0", "2.0", "5.0"}
    assert fleet["2.0"]["manifest_threshold"] == man["thresholds"]["2.0"]
    assert fleet["2.0"]["thresholds_in_force"][0][1] == man["thresholds"]["2.0"]
    assert "fleet-calibrated" in captured.out


def test_thresholds_refuses_the_training_data_the_models_own_folder_and_a_bad_weight(
        train_data, later_data, model_dir, tmp_path, capsys):
    out = tmp_path / "calibrated"
    assert cli.main(["thresholds", "--data", str(train_data), "--model", str(model_dir), "--out", str(out)]) == 1
    assert "overlaps the model's training data" in capsys.readouterr().err and not out.exists()
    assert cli.main(["thresholds", "--data", str(later_data), "--model", str(model_dir), "--out", str(model_dir)]) == 1
    assert "the model's own directory" in capsys.readouterr().err
    assert cli.main(["thresholds", "--data", str(later_data), "--model", str(model_dir), "--out", str(out),
                     "--prior-node-days", "0"]) == 2
    assert "prior_node_days from flag --prior-node-days: must be in [1, 1e+07]" in capsys.readouterr().err
    assert not out.exists()


def test_thresholds_refitted_on_a_fleet_take_its_score_level(later_data, model_dir, tmp_path, capsys, monkeypatch):
    """A manifest's score-level reference is the level its thresholds were chosen at (fleetlevel.py):
    thresholds re-fitted on a fleet's history take that history's level, or none (fixed thresholds)
    when it has fewer nodes than a level is taken over."""
    import shutil

    from foreshock.predictor import fleetlevel
    levelled = tmp_path / "levelled"
    shutil.copytree(model_dir, levelled)
    man = json.loads((levelled / registry.MANIFEST_FILE).read_text())
    man["score_level"] = {"reference": 0.001, "rule": fleetlevel.RULE, "chosen_on": "a test"}
    (levelled / registry.MANIFEST_FILE).write_text(json.dumps(man))
    model = registry.load_model(levelled)
    scored = ev.score_dataset(later_data, {"model": model.probability}, model.horizon_seconds)
    for min_nodes in (4, len(scored.nodes) + 1):
        monkeypatch.setattr(fleetlevel, "MIN_NODES", min_nodes)
        out = tmp_path / f"calibrated-{min_nodes}"
        assert cli.main(["thresholds", "--data", str(later_data), "--model", str(levelled), "--out", str(out)]) == 0, \
            capsys.readouterr().err
        calibrated = registry.read_manifest(out)
        want = fleetlevel.reference_level(scored.nodes, "model")
        if min_nodes == 4:
            assert calibrated["score_level"]["reference"] == want != 0.001
            assert calibrated["score_level"]["chosen_on"] == "the fleet history the thresholds were fitted on"
        else:
            assert want is None and "score_level" not in calibrated
