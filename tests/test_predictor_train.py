"""`foreshock train` and `foreshock evaluate` end to end on a small simulated cluster, and the metrics."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest

from foreshock import cli, risk
from foreshock import schema as sch
from foreshock.predictor import evaluate as ev
from foreshock.predictor import features as ft
from foreshock.predictor import labels as lb
from foreshock.predictor import model as mdl
from foreshock.predictor import calibration, registry, treewalk

STEP_NS = 60 * 10**9


@pytest.fixture(scope="module")
def sim_data(tmp_path_factory):
    out = tmp_path_factory.mktemp("sim") / "data"
    rc = cli.main(["simulate", "--nodes", "8", "--days", "2", "--interval", "60", "--seed", "3",
                   "--rate-scale", "400", "--out", str(out)])
    assert rc == 0
    return out


@pytest.fixture(scope="module")
def trained(sim_data, tmp_path_factory):
    """`foreshock train` with its defaults (stacked with the shipped model, compared with it) on sim_data:
    (the model directory, stdout, stderr). Two tests read this one run; neither writes to it."""
    import contextlib
    import io

    model_dir = tmp_path_factory.mktemp("trained") / "model"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["train", "--data", str(sim_data), "--out", str(model_dir), "--max-iter", "10"])
    assert rc == 0, err.getvalue()
    return model_dir, out.getvalue(), err.getvalue()


def test_train_then_evaluate_writes_model_manifest_and_reports(sim_data, trained, tmp_path, capsys):
    model_dir, out, err = trained
    # stderr is no terminal here: progress comes as plain lines, each phase to its end
    assert "base signals: 8/8 (100 %)" in err and "features: 8/8 (100 %)" in err, err
    m = registry.load_model(model_dir)
    man = m.manifest
    assert man["horizon_seconds"] == 1800 and man["training"]["data_hash"]
    assert set(man["thresholds"]) == {"0.5", "1.0", "2.0", "5.0", "10.0"}
    assert 0 < man["recommended_threshold"] <= 1
    assert set(m.baselines) == {"rule", "logistic"}
    # the shipped model, scored on the same validation slice for the user to compare
    shipped = registry.load_model(registry.default_model_path())
    compared = man["metrics"]["validation_compared"]
    assert compared["model_version"] == shipped.version and "incident_recall_precursor" in compared
    assert f"(model {shipped.version}) on the same slice" in out
    # a slice this small cannot set a threshold that carries: the command says so, naming its size
    days = man["metrics"]["validation"]["model"]["node_days"]
    assert f"WARNING: the thresholds rest on a validation slice of {days:,.0f} node-days" in err, err
    # nor a score level: 8 nodes are fewer than a level is taken over, so the thresholds stay fixed
    assert "score_level" not in man
    # the hard evidence by default, its alarms counted in the thresholds chosen, and what each part spent on
    # the validation slice, in the manifest and printed
    assert man["hard_evidence"] == list(mdl.HARD_EVIDENCE) and m.hard_evidence.names == mdl.HARD_EVIDENCE
    vparts = man["metrics"]["validation_parts"]
    assert vparts["budget"] == 2 and [c["condition"] for c in vparts["conditions"]] == list(mdl.HARD_EVIDENCE)
    assert vparts["hard_evidence_alone"]["node_days"] == pytest.approx(days)
    assert "model at budget 2 on the validation slice, each part alone" in out
    js, page = tmp_path / "e.json", tmp_path / "e.html"
    rc = cli.main(["evaluate", "--data", str(sim_data), "--model", str(model_dir), "--json", str(js),
                   "--html", str(page), "--budget", "5"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    rep = json.loads(js.read_text())
    assert rep["budget"] == 5
    assert rep["hard_evidence"] == list(mdl.HARD_EVIDENCE) and "nvl_links_down_now, pcie_width_deficit_now" in printed.out
    # where the alarms come from: the risk alone, the hard evidence alone and each condition, at the budget asked
    parts = rep["policy_parts"]
    assert parts["budget"] == 5 and [m["condition"] for m in parts["conditions"]] == list(mdl.HARD_EVIDENCE)
    assert parts["hard_evidence_alone"]["node_days"] == pytest.approx(rep["model"]["node_days"])
    assert "model at budget 5, each part alone" in printed.out and 'id="policy-parts"' in page.read_text()
    for name in ("model", "rule", "logistic"):
        for key in ("pr_auc", "roc_auc", "brier", "incident_recall_precursor", "incident_recall_all",
                    "median_lead_minutes", "false_evacuations_per_1000_node_days"):
            assert key in rep[name], (name, key)
        assert 0 <= rep[name]["brier"] <= 1
    # no-precursor categories are reported apart and never counted in the precursor recall
    cats = rep["model"]["per_category"]
    assert any(not c["has_precursor"] for c in cats.values())
    html = page.read_text()
    assert html.count("data:image/png;base64,") >= 3 and "not credited" in html


def test_train_compares_with_a_model_of_other_features_by_saying_why_not(sim_data, tmp_path, capsys):
    old = tmp_path / "old-model"
    shutil.copytree(registry.default_model_path(), old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["feature_version"] = "0"
    (old / "manifest.json").write_text(json.dumps(manifest))
    model_dir = tmp_path / "model"
    rc = cli.main(["train", "--data", str(sim_data), "--out", str(model_dir), "--max-iter", "5",
                   "--compare-with", str(old)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    compared = registry.load_model(model_dir).manifest["metrics"]["validation_compared"]
    assert compared["skipped"] == f"it reads feature version 0, this one {ft.FEATURE_VERSION}"
    assert f"not compared with {old}" in out


@pytest.mark.parametrize("flag, value, words", [
    *[("--label-horizon-minutes", v, "must be 0 (the horizon) or between 1 and 2160")
      for v in ("0.5", "-30", "3000")],
    *[("--threshold-prior-node-days", v, "must be 0 (the validation slice alone) or between 1 and 1e7")
      for v in ("0.5", "-3", "2e7")]])
def test_train_refuses_a_setting_out_of_range_before_reading_anything(tmp_path, capsys, flag, value, words):
    assert cli.main(["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "m"), flag, value]) == 2
    err = capsys.readouterr().err
    assert flag[2:].replace("-", "_") in err and words in err, err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("columns", ["-1", "17"])
def test_train_refuses_steadiness_columns_out_of_range_before_writing_anything(sim_data, tmp_path, capsys, columns):
    assert cli.main(["train", "--data", str(sim_data), "--out", str(tmp_path / "m"),
                     "--steadiness-columns", columns]) in (1, 2)
    err = capsys.readouterr().err
    assert "steadiness" in err and ("must be 0 or more" in err or f"must be between 0 and {len(ft.STEADINESS)}" in err), err
    assert not (tmp_path / "m").exists()


def test_trees_that_read_steadiness_columns_load_score_and_rise_with_them(sim_data, tmp_path, capsys):
    """--steadiness-columns 2: the estimators read the model columns and the first two STEADINESS
    columns (a prefix of FEATURE_NAMES, so the registry loads it), the trees constrained to rise with
    them; the shipped model, which reads fewer columns, is not stacked with it, and says why; full-width
    rows score as the model's own columns do, through the fast path."""
    from foreshock.predictor import model as mdl

    model_dir = tmp_path / "steady"
    assert cli.main(["train", "--data", str(sim_data), "--out", str(model_dir), "--max-iter", "10",
                     "--steadiness-columns", "2"]) == 0
    capsys.readouterr()
    m = registry.load_model(model_dir)
    names = list(ft.MODEL_FEATURE_NAMES) + ["ecc_sbe_steadiness_2h", "remap_correctable_steadiness_2h"]
    assert m.manifest["feature_names"] == names and m.n_model_features == ft.N_MODEL + 2
    stacked = m.manifest["estimator"]["stacked_with_base"]
    shipped = registry.load_model(registry.default_model_path())
    if shipped.n_model_features != len(names):
        assert stacked["skipped"] == (f"it reads {shipped.n_model_features} feature columns, "
                                      f"this model {len(names)}")
    gbdt = m.estimator.calibrated_classifiers_[0].estimator.estimator     # calibrated, frozen, the pipeline
    assert list(gbdt.named_steps["gbdt"].monotonic_cst[ft.N_MODEL:ft.N_MODEL + 2]) == [1, 1]
    X = np.nan_to_num(np.random.default_rng(2).standard_normal((200, ft.N_FEATURES)).astype(np.float32))
    assert m.fast_predictor is not None
    np.testing.assert_array_equal(m.probability(X), m.probability(X[:, :len(names)]))
    np.testing.assert_allclose(m.probability(X), m.estimator.predict_proba(X[:, :len(names)])[:, 1],
                               rtol=1e-9, atol=1e-12)
    # the steadiness columns reach the score: raising them never lowers it
    hi = X.copy()
    hi[:, ft.N_MODEL:ft.N_MODEL + 2] += 5.0
    assert np.all(m.probability(hi) >= m.probability(X) - 1e-12)
    with pytest.raises(ValueError, match=f"between 0 and {len(ft.STEADINESS)}"):
        mdl.estimator_feature_names(len(ft.STEADINESS) + 1)


def test_trees_that_read_the_step_time_columns_hold_the_steadiness_before_them_constant(sim_data, tmp_path,
                                                                                         capsys):
    """--step-time-columns: the estimators read through the job step-time columns; the steadiness
    columns they pass over are in the names (a prefix) but no tree splits on them, and the trees are
    constrained to rise with the step-time columns."""
    from foreshock.predictor import model as mdl

    model_dir = tmp_path / "steps"
    assert cli.main(["train", "--data", str(sim_data), "--out", str(model_dir), "--max-iter", "10", "--base", "",
                     "--step-time-columns"]) == 0
    capsys.readouterr()
    m = registry.load_model(model_dir)
    width = ft.STEP_TIME_COLS.stop
    assert m.manifest["feature_names"] == list(ft.FEATURE_NAMES[:width])
    assert {f.name for f in ft.STEADINESS} <= set(m.manifest["estimator"]["blind_to"])
    gbdt = m.estimator.calibrated_classifiers_[0].estimator.estimator.named_steps["gbdt"]
    assert list(gbdt.monotonic_cst[ft.STEP_TIME_COLS]) == [1] * len(ft.STEP_TIMES)
    split_on = {int(f) for t in gbdt._predictors for f in t[0].nodes["feature_idx"][t[0].nodes["is_leaf"] == 0]}
    assert not split_on & set(range(width)[ft.STEADY_COLS])
    assert mdl.steadiness_held(mdl.estimator_feature_names(2, step_times=True), 2) == list(
        range(ft.N_MODEL + 2, ft.STEADY_COLS.stop))
    X = np.nan_to_num(np.random.default_rng(3).standard_normal((100, ft.N_FEATURES)).astype(np.float32))
    np.testing.assert_array_equal(m.probability(X), m.probability(X[:, :width]))


def test_trees_that_read_the_context_columns_hold_the_step_times_and_fabric_before_them_constant(sim_data, tmp_path,
                                                                                                 capsys):
    """--context-columns: the estimators read through the CONTEXT columns (a prefix of FEATURE_NAMES);
    the steadiness, step-time and fabric columns they pass over are in the names but no tree splits on
    them; the context columns are free to move the risk either way (a loud neighbourhood can lower it)."""
    from foreshock.predictor import model as mdl

    model_dir = tmp_path / "context"
    assert cli.main(["train", "--data", str(sim_data), "--out", str(model_dir), "--max-iter", "10", "--base", "",
                     "--context-columns"]) == 0
    capsys.readouterr()
    m = registry.load_model(model_dir)
    # through the context columns, not the warming columns after them (features v11)
    assert m.manifest["feature_names"] == list(ft.FEATURE_NAMES[:ft.CONTEXT_COLS.stop])
    assert m.n_model_features == ft.CONTEXT_COLS.stop < ft.N_FEATURES
    held = {f.name for f in ft.STEADINESS + ft.STEP_TIMES + ft.FABRIC}
    assert held <= set(m.manifest["estimator"]["blind_to"])
    assert not {f.name for f in ft.CONTEXT} & set(m.manifest["estimator"]["blind_to"])
    gbdt = m.estimator.calibrated_classifiers_[0].estimator.estimator.named_steps["gbdt"]
    assert list(gbdt.monotonic_cst[ft.CONTEXT_COLS]) == [0] * len(ft.CONTEXT)
    split_on = {int(f) for t in gbdt._predictors for f in t[0].nodes["feature_idx"][t[0].nodes["is_leaf"] == 0]}
    assert not split_on & set(range(ft.N_MODEL, ft.CONTEXT_COLS.start))
    assert mdl.context_held(mdl.estimator_feature_names(context=True), step_times=True) == list(
        range(ft.FABRIC_COLS.start, ft.FABRIC_COLS.stop))
    assert mdl.context_held(mdl.estimator_feature_names()) == []
    X = np.nan_to_num(np.random.default_rng(4).standard_normal((100, ft.N_FEATURES)).astype(np.float32))
    np.testing.assert_allclose(m.probability(X), m.estimator.predict_proba(X[:, :ft.CONTEXT_COLS.stop])[:, 1],
                               rtol=1e-9, atol=1e-12)


def test_train_takes_the_hard_evidence_conditions_it_is_given_and_refuses_an_unknown_one(sim_data, tmp_path, capsys):
    """`--hard-evidence NAMES`: only those conditions alarm the model (the manifest's hard_evidence) and are
    counted on the validation slice; a name that is no condition is refused, naming it, before anything is
    written, and a list that is not names is refused as a setting."""
    chosen = ["ib_link_downed_30m", "nvl_links_down_now"]
    out = tmp_path / "two"
    assert cli.main(["train", "--data", str(sim_data), "--out", str(out), "--max-iter", "10", "--compare-with", "",
                     "--base", "", "--no-novelty", "--hard-evidence", " ,".join(chosen)]) == 0, capsys.readouterr().err
    man = registry.load_model(out).manifest
    assert man["hard_evidence"] == chosen
    assert [c["condition"] for c in man["metrics"]["validation_parts"]["conditions"]] == chosen
    capsys.readouterr()
    assert cli.main(["train", "--data", str(sim_data), "--out", str(tmp_path / "bad"),
                     "--hard-evidence", "nvl_links_down_now,nvlink_flapping"]) == 1
    err = capsys.readouterr().err
    assert "nvlink_flapping" in err and "are not hard evidence" in err and "ib_link_downed_30m" in err, err
    assert not (tmp_path / "bad").exists()
    assert cli.main(["train", "--data", str(sim_data), "--out", str(tmp_path / "bad"),
                     "--hard-evidence", "nvl links down"]) == 2
    assert "hard_evidence_conditions" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_train_warns_when_the_hard_evidence_alone_spends_over_the_budget_and_names_what_spends_it():
    from foreshock.predictor.command import hard_evidence_over_budget

    def manifest(hard: float) -> dict:
        conditions = [{"condition": "nvl_links_down_now", "false_evacuations_per_1000_node_days": 0.5 * hard},
                      {"condition": "steptime_slow_share_30m", "false_evacuations_per_1000_node_days": 0.75 * hard}]
        return {"budget": 2.0, "thresholds": {"0.5": 0.9, "1.0": 0.9, "2.0": 0.9, "5.0": 0.3, "10.0": 0.1},
                "metrics": {"validation_parts": {"hard_evidence_alone": {"false_evacuations_per_1000_node_days": hard},
                                                 "conditions": conditions}}}

    assert hard_evidence_over_budget(manifest(1.9)) is None        # under its budget: the risk has the rest
    assert hard_evidence_over_budget({"budget": 2.0, "thresholds": {}, "metrics": {}}) is None
    warning = hard_evidence_over_budget(manifest(4.0))
    assert "spent 4.00 false evacuations/1,000 node-days, over the budgets 0.5, 1, 2:" in warning
    # the condition that spends most first, so the one to leave out is named first
    assert "Each condition alone: steptime_slow_share_30m 3.00, nvl_links_down_now 2.00." in warning
    assert "--hard-evidence" in warning and "--no-hard-evidence" in warning


def test_train_refuses_a_missing_dataset(tmp_path, capsys):
    assert cli.main(["train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "m")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_longer_label_horizon_trains_on_earlier_steps_and_keeps_the_horizons_probabilities(sim_data, tmp_path,
                                                                                            capsys):
    from foreshock.predictor import train

    from foreshock.predictor import command

    # the CLI's defaults are the labels module's recipe
    assert (command.TRAIN_DEFAULTS["label_horizon_minutes"] * 60 or None) == lb.TRAINING_LABEL_HORIZON_S
    assert command.TRAIN_DEFAULTS["early_label_weight"] == lb.EARLY_LABEL_WEIGHT
    assert command.TRAIN_DEFAULTS["threshold_prior_node_days"] == calibration.DEFAULT_PRIOR_NODE_DAYS
    short = train.train(sim_data, tmp_path / "short", max_iter=5, compare_with=None, base=None,
                        label_horizon_s=1800, early_label_weight=1.0)
    long = train.train(sim_data, tmp_path / "long", max_iter=5, compare_with=None, base=None,
                       label_horizon_s=4 * 3600, early_label_weight=0.25)
    # earlier steps are positives too, and they do not move the boundary into the validation slice
    assert long["training"]["train_positive_rows"] > short["training"]["train_positive_rows"]
    assert long["training"]["label_horizon_seconds"] == 4 * 3600 and long["training"]["early_label_weight"] == 0.25
    # thresholds and probabilities keep the 30-min horizon's meaning
    assert long["horizon_seconds"] == short["horizon_seconds"] == 1800
    # outside [horizon, horizon + label gap]: refused before any work, naming the setting
    with pytest.raises(ValueError, match="label horizon 20 min"):
        train.train(sim_data, tmp_path / "bad", label_horizon_s=1200)
    with pytest.raises(ValueError, match="early label weight 0"):
        train.train(sim_data, tmp_path / "bad", label_horizon_s=3600, early_label_weight=0.0)
    assert not (tmp_path / "bad").exists()
    rc = cli.main(["train", "--data", str(sim_data), "--out", str(tmp_path / "bad"), "--early-label-weight", "2"])
    assert rc == 2 and "early_label_weight" in capsys.readouterr().err


def test_the_novelty_alarm_is_fitted_on_healthy_training_rows_and_the_thresholds_on_the_fused_risk(
        sim_data, trained, tmp_path, monkeypatch):
    from foreshock.predictor import novelty, train

    # the default run: 8 nodes x 2 days is too few healthy rows to place a 1e-5 quantile
    man = registry.load_model(trained[0]).manifest
    assert "novelty" not in man and "healthy training rows" in man["training"]["novelty_skipped"]
    assert "no novelty alarm: " in trained[1]
    monkeypatch.setattr(novelty, "MIN_HEALTHY_ROWS", 1000)
    fused = train.train(sim_data, tmp_path / "fused", max_iter=5, compare_with=None, base=None)
    section = fused["novelty"]
    assert section["healthy_rows"] > 1000 and len(section["scales"]) == len(ft.STEADY)
    assert all(v >= novelty.SCALE_FLOOR for v in section["scales"])
    assert 0 < section["reference_probability"] < 1
    assert "incident_recall_precursor" in section["validation_without"]
    m = registry.load_model(tmp_path / "fused")
    assert m.novelty is not None and fused["feature_names"] == list(ft.MODEL_FEATURE_NAMES)
    X = np.random.default_rng(0).random((200, ft.N_FEATURES)).astype(np.float32)
    assert np.all(m.probability(X) >= m.supervised_probability(X))
    alone = train.train(sim_data, tmp_path / "alone", max_iter=5, compare_with=None, base=None, novelty=False)
    assert "novelty" not in alone and "--no-novelty" in alone["training"]["novelty_skipped"]


def _incidents(rows):
    return lb.Incidents.from_table(sch.to_table("incidents", rows))


def test_episode_recall_lead_and_false_evacuations_by_hand():
    t = 600
    ends = (np.arange(t) + 1) * STEP_NS
    inc_ts = int(ends[300] + 10 * 10**9)
    incidents = _incidents([
        {"ts": pd.Timestamp(inc_ts, tz="UTC"), "node": "n1", "incident_id": "a", "scope": "node",
         "category": "gpu_hbm", "has_precursor": True},
        {"ts": pd.Timestamp(int(ends[500]), tz="UTC"), "node": "n2", "incident_id": "b", "scope": "node",
         "category": "software_bug", "has_precursor": False}])
    s1 = np.zeros(t, np.float32)
    s1[281:301] = 0.9          # alerts the 20 steps before the incident: lead 20 min
    s1[100:103] = 0.9          # 3 h before the failure: strictly false (outside the horizon), yet justified
    s1[110] = 0.9              # 7 steps after: the same episode (cool-down)
    s2 = np.zeros(t, np.float32)
    s3 = np.zeros(t, np.float32)
    s3[200:205] = 0.9          # a node that never fails: a false evacuation by any count
    nodes = []
    for node, s in (("n1", s1), ("n2", s2), ("n3", s3)):
        y, excl = lb.node_labels(ends, incidents.of_node(node), 1800)
        nodes.append(ev.NodeScores(node, ends, y, ~excl, {"m": s}))
    res = ev.summarise(ev.at_threshold(nodes, "m", 0.5, incidents, 1800), incidents)
    assert res["incident_recall_precursor"] == 1.0 and res["incident_recall_all"] == 0.5
    # the episode starts at the end of step 281 (282 min); the incident is at 301 min 10 s
    assert res["median_lead_minutes"] == pytest.approx(19 + 10 / 60, abs=0.01)
    assert res["false_evacuations"] == 1 and res["evacuations"] == 3
    assert res["false_evacuations_strict"] == 2
    # the strict rate counts the early episode as well
    ev_late = ev.at_threshold(nodes, "m", 0.5, incidents, 1800)
    assert ev_late["false_evacuations_per_1000_node_days"] < ev_late["false_evacuations_strict_per_1000_node_days"]
    assert res["per_category"]["software_bug"]["recall"] == 0.0
    # one precursor failure caught of one: the share's 90 % interval is [0.05, 1] (0.05 ** (1/1))
    assert res["incident_recall_precursor_interval"] == pytest.approx([0.05, 1.0])
    low, high = res["false_evacuations_per_1000_node_days_interval"]
    assert low < res["false_evacuations_per_1000_node_days"] < high
    curve = ev.threshold_curve(nodes, "m", incidents, 1800)
    assert ev.pick_threshold(curve, 0.0) > 0.9 or curve[-1][1] > 0


def test_hard_evidence_alarms_the_model_whatever_its_score_and_no_other_predictor():
    t = 300
    ends = (np.arange(t) + 1) * STEP_NS
    incidents = _incidents([{"ts": pd.Timestamp(int(ends[200]), tz="UTC"), "node": "n1", "incident_id": "a",
                             "scope": "node", "category": "faulty_gpu", "has_precursor": True}])
    X = np.zeros((t, ft.N_FEATURES), np.float32)
    links, width = (list(ft.FEATURE_NAMES).index(n) for n in ("nvl_links_down_now", "pcie_width_deficit_now"))
    X[185:200, links] = 2              # two NVLink links down 15 min before the failure
    X[185:200, list(ft.FEATURE_NAMES).index("nvl_links_down_max30m")] = 2
    X[50, width] = np.nan              # unknown meets nothing
    hard = mdl.HardEvidence()
    forced = hard.met(X)
    assert forced.sum() == 15 and not forced[50]
    evidence = hard.met_each(X)
    assert evidence.shape == (t, len(hard.names)) and (evidence.any(axis=1) == forced).all()
    assert evidence[:, list(hard.names).index("nvl_links_down_now")].sum() == 15
    assert hard.reasons(X[190]) == ["NVLink links down on the worst GPU: 2 links now, 2 links at most in 30 min"]
    assert hard.reasons(X[10]) == []
    y, excl = lb.node_labels(ends, incidents.of_node("n1"), 1800)
    quiet = np.zeros(t, np.float32)
    node = ev.NodeScores("n1", ends, y, ~excl, {"model": quiet, "rule": quiet}, forced, evidence)
    caught = ev.summarise(ev.at_threshold([node], "model", 0.5, incidents, 1800), incidents)
    assert caught["incident_recall_precursor"] == 1.0 and caught["median_lead_minutes"] == pytest.approx(15)
    # each part alone: the quiet risk catches nothing, the hard evidence (its NVLink condition) the failure
    parts = ev.policy_parts([node], incidents, 0.5, hard.names, 1800)
    assert parts["risk_alone"]["incident_recall_precursor"] == 0.0
    assert parts["hard_evidence_alone"]["incident_recall_precursor"] == 1.0
    assert parts["hard_evidence_alone"]["median_lead_minutes"] == pytest.approx(15)
    assert {m["condition"]: m["incident_recall_precursor"] for m in parts["conditions"]} == {
        "nvl_links_down_now": 1.0, "pcie_width_deficit_now": 0.0, "ib_link_downed_30m": 0.0,
        "hbm_gap_excess_remapping": 0.0, "steptime_slow_share_30m": 0.0, "ecc_onset_bins_now": 0.0}
    assert parts["added_by_hard_evidence"] == 1
    # a risk that warns 20 min ahead on its own: the hard evidence adds nothing, and the risk's own episode
    # starting 20 min out is what the risk alone is judged by
    loud = quiet.copy()
    loud[180:200] = 0.9
    parts = ev.policy_parts([ev.NodeScores("n1", ends, y, ~excl, {"model": loud}, forced, evidence)],
                            incidents, 0.5, hard.names, 1800)
    assert parts["risk_alone"]["median_lead_minutes"] == pytest.approx(20) and parts["added_by_hard_evidence"] == 0
    assert ev.summarise(ev.at_threshold([node], "rule", 0.5, incidents, 1800), incidents)[
        "incident_recall_precursor"] == 0.0
    # a threshold at its cap (fleetlevel.governed's 1) is reached by no score, not even a saturated one
    node.scores["model"] = np.ones(t, np.float32)
    capped = ev.at_threshold([node], "model", lambda e: np.ones(len(e)), incidents, 1800)
    assert capped["evacuations"] == 1 and capped["lead_minutes"] == {"a": pytest.approx(15)}   # the forced steps'
    node.forced = None
    assert ev.at_threshold([node], "model", 1.0, incidents, 1800)["evacuations"] == 0
    assert ev.at_threshold([node], "model", 0.999, incidents, 1800)["evacuations"] == 1
    with pytest.raises(ValueError, match="ib_counter_saturated_now"):
        mdl.HardEvidence(["nvl_links_down_now", "ib_counter_saturated_now"])


def test_hard_evidence_asks_more_than_the_rule_of_an_infiniband_link_down():
    """One IB link-down (a reseat, a switch reboot), which the rule counts, is not hard evidence; a link down
    twice in 30 min is, and its reason says what it shows. A node's GPUs in slowdown are not (refused:
    docs/predictor.md, Hard evidence)."""
    col = {n: i for i, n in enumerate(ft.FEATURE_NAMES)}
    X = np.zeros((3, ft.N_FEATURES), np.float32)
    X[:, col["minutes_since_ib_link_downed"]] = 3
    X[0, [col["ib_link_downed_5m"], col["ib_link_downed_30m"]]] = 1
    X[1, col["ib_link_downed_30m"]] = 2
    X[2, [col["thermal_throttle_frac_now"], col["thermal_throttle_frac_max30m"]]] = 1.0
    hard = mdl.HardEvidence()
    assert list(hard.met(X)) == [False, True, False]
    assert mdl.RuleBaseline().fit().predict(X[:, :len(ft.MODEL_FEATURE_NAMES)]).tolist() == [1, 0, 1]
    assert hard.reasons(X[1]) == ["InfiniBand link-down events (link_downed) on the worst port: 2 in the last 30 "
                                  "min, the last 3 min ago"]
    assert list(mdl.HardEvidence(["nvl_links_down_now"]).met(X)) == [False] * 3
    with pytest.raises(ValueError, match="thermal_throttle_frac_now"):
        mdl.HardEvidence(["thermal_throttle_frac_now"])


def test_hard_evidence_of_hbm_warming_apart_from_its_die_reads_a_column_past_the_models():
    """The HBM condition reads the warming column after every column the estimators read, from
    full-width rows: met where the node remaps rows and one GPU's HBM warms apart from its die, not
    where the HBM warms without a remap (the column reads 0 there), and its reason says both."""
    col = {n: i for i, n in enumerate(ft.FEATURE_NAMES)}
    assert col["hbm_gap_excess_remapping"] >= ft.N_MODEL
    X = np.zeros((2, ft.N_FEATURES), np.float32)
    X[:, col["hbm_gap_excess_vs_usual"]] = 3.2
    X[0, col["hbm_gap_excess_remapping"]] = 3.2
    X[0, col["remap_correctable_decayed_12h"]] = 2.6
    hard = mdl.HardEvidence(["hbm_gap_excess_remapping"])
    assert list(hard.met(X)) == [True, False]
    assert hard.reasons(X[0]) == ["One GPU's HBM warmer than its die, beyond the node's other GPUs: +3.2 degC "
                                  "against its usual, about 3 HBM rows remapped over the last day"]


def test_hard_evidence_of_a_node_its_job_waits_for_asks_for_sustained_slowness():
    """A node whose ranks were slow against their job (the fail-slow rule's comparison) in more than 9 of 10
    of their steps judged over 30 minutes is hard evidence, and its reason says how slow; a node slow in
    half of them, or in one slow minute (the ratio's 30-minute maximum alone), or with no step judged (NaN:
    its job reports none), is not."""
    col = {n: i for i, n in enumerate(ft.FEATURE_NAMES)}
    X = np.zeros((4, ft.N_FEATURES), np.float32)
    X[:, col["steptime_vs_job_30m"]] = [1.53, 1.41, 1.62, np.nan]
    X[:, col["steptime_vs_job_5m"]] = [1.52, 1.40, 1.01, np.nan]
    X[:, col["steptime_slow_share_30m"]] = [0.97, 0.5, 0.04, np.nan]
    hard = mdl.HardEvidence(["steptime_slow_share_30m"])
    assert list(hard.met(X)) == [True, False, False, False]
    assert hard.reasons(X[0]) == ["Step time against its job's other ranks (its slowest rank): 1.53x its job's "
                                  "median at most in 30 min (1.52x in 5 min), slow in 97% of its judged steps"]
    assert list(mdl.HardEvidence().met(X)) == [True, False, False, False]


def test_hard_evidence_of_a_gpu_whose_corrected_ecc_starts_needs_27_of_the_last_30_bins():
    """The onset condition reads the column after every column the estimators read: met from 27 of the last
    30 ten-minute bins on, not at 26, never where the GPU's usual was too high (0) or not judged yet (NaN),
    and its reason says how many bins counted against what."""
    col = ft.FEATURE_NAMES.index("ecc_onset_bins_now")
    assert col >= ft.N_MODEL
    X = np.zeros((4, ft.N_FEATURES), np.float32)
    X[:, col] = [27.0, 26.0, 0.0, np.nan]
    hard = mdl.HardEvidence(["ecc_onset_bins_now"])
    assert list(hard.met(X)) == [True, False, False, False]
    assert hard.reasons(X[0]) == ["Ten-minute bins in which a GPU that seldom counted corrected ECC counted: 27 of "
                                  "the last 30, where it had counted in at most 20% of its bins before"]


def test_the_validation_slice_counts_episodes_as_evaluate_does_across_a_repair():
    """train.validation_slice keeps a repair's steps, masked: an alarm before the failure and one after
    the repair are two episodes, the second a false evacuation, as evaluate counts them. With the
    repair's steps dropped the two would be index neighbours and one episode: the thresholds would be
    chosen on fewer false evacuations than evaluate then finds."""
    from foreshock.predictor import train

    ends = (np.arange(600) + 1) * STEP_NS
    incidents = _incidents([{"ts": pd.Timestamp(int(ends[300]), tz="UTC"), "node": "n1", "incident_id": "a",
                             "scope": "node", "category": "gpu_hbm", "has_precursor": True,
                             "repaired_at": pd.Timestamp(int(ends[400]), tz="UTC")}])
    y, excluded = lb.node_labels(ends, incidents.of_node("n1"), 1800)
    score = np.zeros(600, np.float32)
    score[290:300] = 0.9         # before the failure: caught
    score[403:406] = 0.9         # just after the repair, and nothing follows: false
    keep, node = train.validation_slice("n1", ends, y, ~excluded, int(ends[100]))
    assert keep.sum() == 500 and (~node.usable).sum() == excluded[100:].sum() > 50
    node.scores["m"] = score[keep]
    res = ev.at_threshold([node], "m", 0.5, incidents, 1800)
    whole = ev.at_threshold([ev.NodeScores("n1", ends, y, ~excluded, {"m": score})], "m", 0.5, incidents, 1800)
    assert res["evacuations"] == whole["evacuations"] == 2
    assert res["false_evacuations"] == whole["false_evacuations"] == 1


def test_trend_ratios_tell_a_rising_rate_from_a_burst_that_ended():
    from foreshock.predictor import features as ft
    from foreshock.predictor import model as mdl

    names = list(ft.MODEL_FEATURE_NAMES)
    tr = mdl.TrendRatios().fit()
    X = np.zeros((2, len(names)), np.float32)
    col = {n: names.index(n) for n in ("ecc_sbe_1m", "ecc_sbe_5m", "ecc_sbe_30m")}
    X[0, [col["ecc_sbe_1m"], col["ecc_sbe_5m"], col["ecc_sbe_30m"]]] = (40, 150, 300)    # rising
    X[1, [col["ecc_sbe_1m"], col["ecc_sbe_5m"], col["ecc_sbe_30m"]]] = (0, 10, 3000)     # a burst, over
    out = tr.transform(X)
    out_names = list(tr.get_feature_names_out())
    assert out.shape == (2, len(out_names)) and out_names[: len(names)] == names
    rising = out[:, out_names.index("ecc_sbe_rising_5m_vs_30m")]
    assert rising[0] == pytest.approx((30 + 1e-3) / (10 + 1e-3)) and rising[1] < 0.1
    assert out[0, out_names.index("ecc_sbe_rising_1m_vs_5m")] == pytest.approx((40 + 1e-3) / (30 + 1e-3))
    # the derived columns map back to the windows they are made of (explanations occlude those)
    j = out_names.index("ecc_sbe_rising_5m_vs_30m")
    assert set(tr.source_columns(np.array([j]))) == {col["ecc_sbe_5m"], col["ecc_sbe_30m"]}
    with pytest.raises(ValueError, match="features"):
        tr.transform(X[:, :10])


def test_trees_blind_to_the_absolute_counts_read_them_only_through_baselines_and_trends():
    """fit_model with constant_columns (model.baselined_counts, train's default; --absolute-counts turns
    it off): no tree splits on a baselined error signal's absolute window counts even where they alone
    carry the label, while the trend ratios made from them are still learnt from; the fitted pipeline
    is the usual one."""
    from foreshock.predictor import features as ft
    from foreshock.predictor import model as mdl

    names = list(ft.MODEL_FEATURE_NAMES)
    blind = mdl.baselined_counts()
    assert {"ib_ack_timeout_5m", "pcie_replay_1m", "nvl_replay_30m"} <= {names[i] for i in blind}
    assert not {"ecc_sbe_30m", "ecc_sbe_30m_vs_baseline", "remap_correctable_30m", "xid_fatal_5m"} & {
        names[i] for i in blind}
    rng = np.random.default_rng(0)
    X = rng.standard_normal((4000, len(names))).astype(np.float32)
    a, b = names.index("ib_ack_timeout_5m"), names.index("ib_ack_timeout_30m")
    X[:, a] = rng.exponential(1.0, len(X))
    X[:, b] = rng.exponential(1.0, len(X))
    y = (X[:, a] > 1.5).astype(int)                        # the absolute count alone tells
    split_on = {}
    for constant in ((), blind):
        m = mdl.fit_model(mdl.make_model(max_iter=15), X, y, constant_columns=constant)
        assert [type(s).__name__ for _, s in m.steps] == ["FeatureGuard", "TrendRatios", "HistGradientBoostingClassifier"]
        split_on[len(constant) > 0] = {int(f) for t in m.named_steps["gbdt"]._predictors
                                       for f in t[0].nodes["feature_idx"][t[0].nodes["is_leaf"] == 0]}
    assert a in split_on[False] and not split_on[True] & set(blind)
    ratio = len(names) + list(m.named_steps["trends"].ratio_names_).index("ib_ack_timeout_rising_5m_vs_30m")
    assert ratio in split_on[True]


def test_steps_hours_before_an_incident_are_left_out_of_training_only_outside_the_horizon():
    ends = (np.arange(24 * 60) + 1) * STEP_NS
    inc = pd.DataFrame({"ts": [int(ends[900])]})
    early = lb.before_horizon(ends, inc, 1800, 12 * 3600.0)
    y, _ = lb.node_labels(ends, inc.assign(end=int(ends[900]) + 3600 * 10**9), 1800)
    assert early.sum() == 12 * 60 - 30 and not (early & (y == 1)).any()
    assert early[900 - 31] and not early[900 - 30] and not early[900 - 12 * 60 - 1]
    assert not lb.before_horizon(ends, inc, 1800, 1800.0).any()


def test_a_wide_failures_rows_weigh_one_over_its_nodes_with_incident_weights():
    import pyarrow as pa
    ends = (np.arange(12 * 60) + 1) * STEP_NS
    ts = lambda i: pd.Timestamp(int(ends[i]), tz="UTC")
    table = pa.table({"ts": [ts(100), ts(400), ts(600)], "node": ["a", "leaf-1", "b"],
                      "incident_id": ["own", "switch", "other"], "scope": ["node", "switch", "node"],
                      "affected_nodes": [["a"], ["a", "b", "c", "d"], ["b"]],
                      "category": ["gpu_hbm", "network_switch_cable", "gpu_hbm"],
                      "component": ["gpu0", "leaf-1", "gpu1"], "description": ["hbm", "leaf_switch: ports", "hbm"],
                      "has_precursor": [True, True, True],
                      "precursor_start": pa.array([None] * 3, pa.timestamp("ns", tz="UTC")),
                      "repaired_at": [ts(200), ts(500), ts(700)]})
    inc = lb.Incidents.from_table(table)
    assert inc.nodes_per_incident == {"own": 1, "switch": 4, "other": 1}
    w = lb.incident_weights(ends, inc.of_node("a"), 1800, inc.nodes_per_incident)
    y, _ = lb.node_labels(ends, inc.of_node("a"), 1800)
    # the switch's horizon weighs a quarter, the node's own failure and every other step 1
    assert (w[370:400] == 0.25).all() and w[369] == 1.0 and w[400] == 1.0
    assert (w[70:100] == 1.0).all() and set(np.unique(w)) == {0.25, 1.0}
    assert ((w < 1) <= (y == 1)).all()


def test_evaluate_refuses_an_unwritable_report_before_the_work(sim_data, tmp_path, capsys):
    """An --html or --json that cannot be written fails at once, naming the path, and writes nothing."""
    for flag, path in (("--html", tmp_path / "missing" / "e.html"), ("--json", tmp_path)):
        rc = cli.main(["evaluate", "--data", str(sim_data), "--model", str(tmp_path / "no-model"),
                       flag, str(path)])
        err = capsys.readouterr().err
        assert rc == 2 and str(path) in err, err
    assert not (tmp_path / "missing").exists() and list(tmp_path.iterdir()) == []


def test_figure_intervals_are_the_exact_ones():
    """Garwood's interval of a Poisson count and Clopper-Pearson's of a share, against closed forms and
    tabled values: a rate from 0 events tops out at -ln(0.05) = 2.996 per unit of exposure, from 6 at
    chi2(0.05, 12) / 2 = 2.613 and chi2(0.95, 14) / 2 = 11.842; 0 of n and n of n have one-sided closed
    forms; no exposure or no failure has no interval."""
    assert ev.rate_interval(0, 1000.0) == pytest.approx([0.0, 2.9957], abs=1e-4)
    assert ev.rate_interval(6, 2000.0) == pytest.approx([2.6130 / 2, 11.8424 / 2], abs=1e-3)
    assert ev.rate_interval(6, 2000.0, per=1.0) == pytest.approx([2.6130 / 2000, 11.8424 / 2000], rel=1e-3)
    assert ev.proportion_interval(0, 27) == pytest.approx([0.0, 1 - 0.05 ** (1 / 27)])
    assert ev.proportion_interval(5, 5) == pytest.approx([0.05 ** (1 / 5), 1.0])
    low, high = ev.proportion_interval(28, 64)
    assert low < 28 / 64 < high and (1 - high, 1 - low) == pytest.approx(tuple(ev.proportion_interval(36, 64)))
    wider = ev.proportion_interval(28, 64, level=0.99)
    assert wider[0] < low and wider[1] > high
    assert all(np.isnan(ev.rate_interval(3, 0.0))) and all(np.isnan(ev.proportion_interval(0, 0)))


def test_evaluate_refuses_a_dataset_without_incidents_and_summarises_a_quiet_one(tmp_path, capsys):
    """A foreign dataset (telemetry, no incidents table) gets one line naming it, not a traceback; a
    dataset whose incidents table is empty is a quiet period: recall is unknown, nothing fails."""
    from foreshock import dataset
    w = dataset.DatasetWriter(tmp_path / "foreign", fsync=False)
    w.append_rows("gpu", [{"ts": pd.Timestamp("2026-12-02T00:00:00Z") + pd.Timedelta(minutes=i), "node": "n1",
                           "gpu": 0, "ecc_corrected_volatile": i} for i in range(5)])
    w.close()
    rc = cli.main(["evaluate", "--data", str(tmp_path / "foreign"), "--model", str(registry.default_model_path())])
    err = capsys.readouterr().err
    assert rc == 1 and "no incidents table" in err and str(tmp_path / "foreign") in err, err
    quiet = ev.summarise({"lead_minutes": {}, "false_evacuations": 0, "false_evacuations_strict": 0,
                          "evacuations": 0, "node_days": 1.0, "false_evacuations_per_1000_node_days": 0.0,
                          "false_evacuations_strict_per_1000_node_days": 0.0, "threshold": 0.1, "by_node": {}},
                         lb.Incidents.from_table(None))
    assert quiet["incidents"] == 0 and np.isnan(quiet["incident_recall_precursor"])
    assert all(np.isnan(quiet["incident_recall_precursor_interval"]))
    # no false evacuation in one node-day still allows up to -ln(0.05) per node-day at 90 %
    assert quiet["false_evacuations_per_1000_node_days_interval"] == pytest.approx([0.0, 2995.7], abs=0.1)


def test_train_stacks_with_the_shipped_model_by_default(sim_data, trained, tmp_path, capsys):
    """A user's history seldom holds enough incidents to learn from: `foreshock train` stacks its model
    with the shipped one (model.LogitBlend), the weights fitted on the validation slice, and the
    stacked model keeps the compiled fast path; `--base ''` trains from the history alone."""
    from foreshock.predictor import model as mdl

    (stacked_dir, out, _), alone_dir = trained, tmp_path / "alone"
    shipped = registry.load_model(registry.default_model_path())
    stacked = registry.load_model(stacked_dir)
    info = stacked.manifest["estimator"]["stacked_with_base"]
    assert info["model_version"] == shipped.version and set(info["weights"]) == {"base", "this_history"}
    assert min(info["weights"].values()) >= 0 and max(info["weights"].values()) > 0
    assert f"stacked with {registry.default_model_path()}" in out
    assert type(stacked.estimator) is mdl.LogitBlend
    # the training data of the base is recorded for evaluate's overlap rule
    assert stacked.manifest["training"]["base"]["data_hash"] == shipped.manifest["training"]["data_hash"]
    fast = stacked.fast_predictor
    assert isinstance(fast, treewalk.BlendedFast) and fast.compiled
    X = np.nan_to_num(np.random.default_rng(1).standard_normal((300, len(stacked.feature_names))).astype(np.float32))
    X = np.concatenate([X, fast.probe(X.shape[1])])
    np.testing.assert_allclose(stacked.predict_proba(X), stacked.estimator.predict_proba(X), rtol=1e-9, atol=1e-12)
    assert stacked.used_features is not None
    # its thresholds are chosen on the validation slice with the base's curve as the prior
    # (calibration.pooled_with_base); the slice's own are kept beside
    pool = stacked.manifest["threshold_pooling"]
    assert pool["base_model_version"] == shipped.version and pool["prior_node_days"] == 1000.0
    assert set(pool["thresholds_slice_alone"]) == set(stacked.manifest["thresholds"])
    for b, th in stacked.manifest["thresholds"].items():
        assert risk.pick_threshold(stacked.manifest["threshold_curves"]["model"], float(b)) == th
    assert len(pool["slice_false_evacuations_at_carried"]) == len(pool["carried_base_curve"])
    assert "with the base model's validation curve as a prior worth 1,000 node-days" in out

    assert cli.main(["train", "--data", str(sim_data), "--out", str(alone_dir), "--max-iter", "10", "--base", ""]) == 0
    capsys.readouterr()
    alone = registry.load_model(alone_dir)
    assert "stacked_with_base" not in alone.manifest["estimator"] and "base" not in alone.manifest["training"]
    assert "threshold_pooling" not in alone.manifest
    assert type(alone.estimator).__name__ == "CalibratedClassifierCV"
    assert alone.manifest["estimator"]["linear_member"] is None
    # relative counts by default: the trees are blind to the baselined signals' absolute counts
    blind = alone.manifest["estimator"]["blind_to"]
    assert blind == [alone.feature_names[i] for i in mdl.baselined_counts()] and "ib_ack_timeout_30m" in blind

    # --linear-member: the trees averaged with the logistic regression, weights fixed (train.LINEAR_MEMBER_WEIGHTS);
    # --absolute-counts: the trees split on every count
    blend_dir = tmp_path / "blend"
    assert cli.main(["train", "--data", str(sim_data), "--out", str(blend_dir), "--max-iter", "10", "--base", "",
                     "--linear-member", "--absolute-counts"]) == 0
    assert "the trees averaged with a logistic regression" in capsys.readouterr().out
    blend = registry.load_model(blend_dir)
    assert type(blend.estimator) is mdl.LogitBlend
    assert [type(m).__name__ for m in blend.estimator.estimators] == ["CalibratedClassifierCV"] * 2
    assert blend.estimator.coef_[0] == pytest.approx(blend.estimator.coef_[1])
    linear = blend.manifest["estimator"]["linear_member"]
    assert linear["weights"] == {"trees": 0.5, "linear": 0.5} and linear["logit_scale"] == pytest.approx(
        float(blend.estimator.coef_.sum()))
    assert {"incident_recall_precursor", "pr_auc"} <= set(linear["validation_trees_alone"])
    assert [type(p) for p in blend.fast_predictor.parts] == [treewalk.FastPredictor, treewalk.LinearFast]
    assert blend.manifest["estimator"]["blind_to"] == []


def test_a_base_curve_that_cannot_be_carried_leaves_the_slices_thresholds(sim_data, tmp_path, monkeypatch):
    from foreshock.predictor import train

    def refuse(*args, **kwargs):
        raise ValueError("the base reaches none of its curve's thresholds on the slice")

    monkeypatch.setattr(calibration, "pooled_with_base", refuse)
    manifest = train.train(sim_data, tmp_path / "m", max_iter=5, compare_with=None,
                           base=registry.default_model_path(), novelty=False)
    assert manifest["threshold_pooling"]["skipped"] == "the base reaches none of its curve's thresholds on the slice"
    curve = manifest["threshold_curves"]["model"]
    assert manifest["thresholds"] == {str(b): risk.pick_threshold(curve, b) for b in train.BUDGETS}


def _noisy_probabilities(rng, y, failing: float, healthy: float, sd: float) -> np.ndarray:
    """A member's probabilities: `failing` or `healthy` by the label, plus normal noise, in (0, 1)."""
    return np.clip(np.where(y == 1, failing, healthy) + rng.normal(0, sd, len(y)), 0.01, 0.99)


class _Fixed:
    """A fitted 'model' whose probability is a column of X."""

    def __init__(self, col):
        self.col = col

    def predict_proba(self, X):
        p = np.asarray(X)[:, self.col]
        return np.column_stack([1 - p, p])


def test_logit_blend_drops_a_member_that_would_be_used_against_its_sense():
    from foreshock.predictor import model as mdl

    rng = np.random.default_rng(0)
    y = (rng.random(4000) < 0.2).astype(int)
    good = _noisy_probabilities(rng, y, 0.7, 0.3, 0.1)
    inverted = _noisy_probabilities(rng, y, 0.2, 0.6, 0.1)
    X = np.column_stack([good, inverted])
    blend = mdl.LogitBlend([_Fixed(0), _Fixed(1)]).fit(X, y)
    assert blend.coef_[0] > 0 and blend.coef_[1] == 0
    p = blend.predict_proba(X)[:, 1]
    assert p[y == 1].mean() > p[y == 0].mean()


def test_a_fixed_weight_blend_fits_only_its_scale_and_offset():
    from foreshock.predictor import model as mdl

    rng = np.random.default_rng(0)
    y = (rng.random(4000) < 0.2).astype(int)
    a = _noisy_probabilities(rng, y, 0.7, 0.3, 0.1)
    b = _noisy_probabilities(rng, y, 0.6, 0.4, 0.2)
    X = np.column_stack([a, b])
    free = mdl.LogitBlend([_Fixed(0), _Fixed(1)]).fit(X, y)
    fixed = mdl.LogitBlend([_Fixed(0), _Fixed(1)], weights=(3, 1)).fit(X, y)
    assert free.coef_[0] / free.coef_[1] != pytest.approx(3.0, rel=0.05)
    assert fixed.coef_[0] / fixed.coef_[1] == pytest.approx(3.0)
    for bad in ((1.0,), (1.0, 0.0), (1.0, -1.0)):
        with pytest.raises(ValueError, match="weights"):
            mdl.LogitBlend([_Fixed(0), _Fixed(1)], weights=bad).fit(X, y)


def test_overlap_counts_the_base_models_training_data():
    def ident(h, names="n", t0="2026-01-01T00:00:00+00:00", t1="2026-01-10T00:00:00+00:00"):
        return {"data": h, "data_hash": h, "nodes": 8, "node_names_sha256": names, "first_step_end": t0,
                "last_step_end": t1}

    training = {**ident("own", names="user"), "base": ident("shipped")}
    assert not ev.overlap(training, ident("other", names="other"))["overlaps"]
    got = ev.overlap(training, ident("shipped"))
    assert got["overlaps"] and "the model it is stacked with" in got["reason"] and got["base"]["same_data_hash"]
    assert "WARNING" in ev.overlap_warning(got)
