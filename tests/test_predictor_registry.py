"""The model registry: skops only, sha256 and feature checks on load, the shipped default model."""

from __future__ import annotations

import json

import numpy as np
import pytest

from foreshock.predictor import features as ft
from foreshock.predictor import registry


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_model_dir):
    return tiny_model_dir(tmp_path_factory.mktemp("model") / "m")


def test_save_and_load_round_trip(model_dir):
    m = registry.load_model(model_dir)
    assert m.manifest["feature_names"] == list(ft.MODEL_FEATURE_NAMES)
    assert m.manifest["feature_version"] == ft.FEATURE_VERSION
    assert m.horizon_seconds == 1800
    X = np.zeros((4, ft.N_FEATURES), dtype=np.float32)
    X[1, ft.FEATURE_NAMES.index("ecc_sbe_30m")] = 80
    proba = m.predict_proba(X)
    assert proba.shape == (4, 2)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0)
    assert m.probability(X)[1] > m.probability(X)[0]
    assert "rule" in m.baselines


def test_tampered_model_file_is_refused(model_dir, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    data = bytearray((bad / registry.MODEL_FILE).read_bytes())
    data[100] ^= 0xFF
    (bad / registry.MODEL_FILE).write_bytes(bytes(data))
    with pytest.raises(registry.ModelError, match="sha256"):
        registry.load_model(bad)


def test_feature_mismatch_is_refused_with_a_clear_error(model_dir, tmp_path):
    import shutil
    for k, (key, value, needle) in enumerate([("feature_version", "0", "feature version"),
                               ("feature_names", list(ft.MODEL_FEATURE_NAMES)[:-1] + ["bogus"], "feature names"),
                               ("feature_names", list(ft.MODEL_FEATURE_NAMES)[:-1], "feature names"),
                               ("schema_version", 99, "schema")]):
        d = tmp_path / f"{key}-{k}"
        shutil.copytree(model_dir, d)
        man = json.loads((d / registry.MANIFEST_FILE).read_text())
        man[key] = value
        (d / registry.MANIFEST_FILE).write_text(json.dumps(man))
        with pytest.raises(registry.ModelError, match=needle):
            registry.load_model(d)


def test_untrusted_types_are_refused(tmp_path):
    """A skops file holding a type outside TRUSTED_TYPES is refused before anything is built."""
    import skops.io as sio
    from sklearn.preprocessing import FunctionTransformer

    d = tmp_path / "evil"
    d.mkdir()
    sio.dump(FunctionTransformer(func=eval), d / registry.MODEL_FILE)
    manifest = {"version": "x", "schema_version": 1, "feature_version": ft.FEATURE_VERSION,
                "feature_names": list(ft.MODEL_FEATURE_NAMES), "horizon_seconds": 1800, "step_seconds": 60,
                "thresholds": {}, "recommended_threshold": 0.5,
                "files": {registry.MODEL_FILE: registry.sha256_file(d / registry.MODEL_FILE)}}
    (d / registry.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(registry.ModelError, match="trusted"):
        registry.load_model(d)
    with pytest.raises(registry.ModelError, match="TRUSTED_TYPES"):
        registry.save_model(tmp_path / "evil2", FunctionTransformer(func=eval), manifest)


def test_missing_or_corrupt_manifest(tmp_path):
    with pytest.raises(registry.ModelError, match="no manifest"):
        registry.load_model(tmp_path)
    (tmp_path / registry.MANIFEST_FILE).write_text("{not json")
    with pytest.raises(registry.ModelError, match="unreadable"):
        registry.load_model(tmp_path)


def test_default_model_path_is_inside_the_package():
    p = registry.default_model_path()
    assert p.name == "default" and p.parent.name == "models"


def test_the_shipped_default_model_loads_and_has_its_report():
    m = registry.load_model()  # models/default, verified: sha256, features, trusted types
    man = m.manifest
    assert man["horizon_seconds"] == 1800 and man["training"]["data_hash"] and man["training"]["command"]
    assert (m.path / "REPRODUCE.md").read_text().count("foreshock ") >= 3
    rep = json.loads((m.path / "evaluation.json").read_text())
    for name in ("model", "rule", "logistic"):
        assert {"pr_auc", "roc_auc", "brier", "incident_recall_precursor", "incident_recall_all",
                "median_lead_minutes", "false_evacuations_per_1000_node_days"} <= set(rep[name])
    assert (m.path / "evaluation.html").stat().st_size > 10_000
    assert (m.path / registry.MODEL_FILE).stat().st_size < 8_000_000   # a few MB at most
    X = np.zeros((3, ft.N_FEATURES), dtype=np.float32)
    p = m.probability(X)
    assert p.shape == (3,) and np.all((0 <= p) & (p <= 1))
    # trained on feature version 7: today's rows (8 appended the step-time columns, 9 the fabric's, 10
    # the context's, 11 the warming's, 14 the onset's) still feed it
    assert man["feature_version"] == "7" and ft.FEATURE_VERSION == "14"
    assert len(man["feature_names"]) < ft.N_FEATURES
    X[:, ft.STEP_TIME_COLS] = [1.5, 1.5, 0.5]
    X[:, ft.FABRIC_COLS] = 1.0
    X[:, ft.CONTEXT_COLS] = 3.0
    X[:, ft.WARMING_COLS] = 4.0
    X[:, ft.ONSET_COLS] = 30.0
    np.testing.assert_array_equal(m.probability(X), p)


def test_a_model_of_the_previous_feature_version_reads_its_columns_of_todays_rows(model_dir, tmp_path):
    """Version 7 only appended the steadiness columns: a version-6 model (the names it reads are the
    first N_MODEL) loads, and full-width rows give the same probabilities as its own columns."""
    import shutil
    old = tmp_path / "v6"
    shutil.copytree(model_dir, old)
    man = json.loads((old / registry.MANIFEST_FILE).read_text())
    man["feature_version"] = "6"
    man["reference_features"] = man["reference_features"][:ft.N_MODEL]
    (old / registry.MANIFEST_FILE).write_text(json.dumps(man))
    m = registry.load_model(old)
    X = np.random.default_rng(1).random((5, ft.N_FEATURES)).astype(np.float32)
    np.testing.assert_array_equal(m.probability(X), m.probability(X[:, :ft.N_MODEL]))
    ref = ft.full_width(m.manifest["reference_features"])
    assert ref.shape == (ft.N_FEATURES,) and np.all(ref[ft.N_MODEL:] == 0)
    with pytest.raises(ValueError, match=str(ft.N_FEATURES)):
        m.probability(X[:, :-1])


@pytest.mark.parametrize("version, width, appended", [
    ("7", ft.STEADY_COLS.stop, (ft.STEP_TIME_COLS, ft.FABRIC_COLS)),
    ("8", ft.FABRIC_COLS.start, (ft.FABRIC_COLS,)),
], ids=["v7: step times and fabric appended since", "v8: fabric appended since"])
def test_a_model_of_an_earlier_feature_version_loads_and_reads_none_of_the_columns_appended_since(
        model_dir, tmp_path, version, width, appended):
    """Versions 8 and 9 only appended columns (the step times, the NVLink fabric's): an older manifest
    (its reference features as wide as its version's rows) loads, its probabilities do not move with
    the appended columns, its reference reads them as 0 and its model uses none of them."""
    import shutil
    old = tmp_path / f"v{version}"
    shutil.copytree(model_dir, old)
    man = json.loads((old / registry.MANIFEST_FILE).read_text())
    man["feature_version"] = version
    man["reference_features"] = man["reference_features"][:width]
    (old / registry.MANIFEST_FILE).write_text(json.dumps(man))
    m = registry.load_model(old)
    X = np.random.default_rng(1).random((5, ft.N_FEATURES)).astype(np.float32)
    Y = X.copy()
    for cols in appended:
        Y[:, cols] = np.where(np.arange(cols.stop - cols.start) % 2, np.nan, 1.0)
        assert np.all(ft.full_width(m.manifest["reference_features"])[cols] == 0)
        assert set(m.used_features.tolist()).isdisjoint(range(ft.N_FEATURES)[cols])
    np.testing.assert_array_equal(m.probability(X), m.probability(Y))


def _with_novelty(model_dir, tmp_path, **changes):
    import shutil
    from foreshock.predictor import novelty
    d = tmp_path / "novel"
    shutil.copytree(model_dir, d)
    healthy = novelty.HealthySteadiness()
    healthy.add(np.random.default_rng(2).random((novelty.MIN_HEALTHY_ROWS, len(ft.STEADY))) * 0.2)
    alarm = novelty.NoveltyAlarm().fit(healthy).calibrate(0.01)
    man = json.loads((d / registry.MANIFEST_FILE).read_text())
    man["novelty"] = {**alarm.to_manifest(), **changes}
    (d / registry.MANIFEST_FILE).write_text(json.dumps(man))
    return d, alarm


def test_the_novelty_alarm_raises_the_risk_of_a_steadily_counting_signal_only(model_dir, tmp_path):
    d, alarm = _with_novelty(model_dir, tmp_path)
    np.testing.assert_allclose(alarm.scales_, 0.2, atol=1e-3)   # the healthy rows' extreme
    m = registry.load_model(d)
    X = np.zeros((3, ft.N_FEATURES), dtype=np.float32)
    col = ft.FEATURE_NAMES.index("pcie_replay_steadiness_2h")
    X[1, col] = 0.15                                          # within the healthy extreme
    X[2, col] = 0.6                                           # 3x it: the novelty alarm
    p, alone = m.probability(X), m.supervised_probability(X)
    np.testing.assert_array_equal(p[:2], alone[:2])
    assert p[2] > alone[2] and p[2] >= 0.01                   # at least the model's evacuation probability
    used = set(m.used_features.tolist())
    assert set(range(ft.N_FEATURES)[ft.STEADY_COLS]) <= used
    assert used.isdisjoint(range(ft.N_FEATURES)[ft.STEP_TIME_COLS])   # read by no model: never re-scored
    assert used.isdisjoint(range(ft.N_FEATURES)[ft.FABRIC_COLS])
    with pytest.raises(ValueError, match="steadiness"):
        m.probability(X[:, :ft.N_MODEL])


@pytest.mark.parametrize("changes, needle", [({"scales": [0.0] * len(ft.STEADY)}, "positive"),
                                             ({"signals": ["ecc_sbe"]}, "signals"),
                                             ({"reference_probability": 2.0}, "out of range"),
                                             ({"slope": "steep"}, "unreadable")])
def test_a_novelty_section_that_does_not_fit_is_refused_naming_the_manifest(model_dir, tmp_path, changes, needle):
    d, _ = _with_novelty(model_dir, tmp_path, **changes)
    with pytest.raises(registry.ModelError, match=needle) as err:
        registry.load_model(d)
    assert registry.MANIFEST_FILE in str(err.value)


@pytest.mark.parametrize("value, needle", [("nvl_links_down_now", "must be a list"),
                                           (["nvl_links_down_now", "ecc_sbe_30m"], "ecc_sbe_30m")])
def test_a_hard_evidence_list_that_names_no_rule_condition_is_refused_naming_the_manifest(model_dir, tmp_path,
                                                                                          value, needle):
    import shutil
    d = tmp_path / "hard"
    shutil.copytree(model_dir, d)
    man = json.loads((d / registry.MANIFEST_FILE).read_text())
    assert registry.load_model(d).hard_evidence is None or "hard_evidence" in man
    man["hard_evidence"] = value
    (d / registry.MANIFEST_FILE).write_text(json.dumps(man))
    with pytest.raises(registry.ModelError, match=needle) as err:
        registry.load_model(d)
    assert registry.MANIFEST_FILE in str(err.value)
