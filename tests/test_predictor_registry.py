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
    assert m.manifest["feature_names"] == list(ft.FEATURE_NAMES)
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
    for key, value, needle in [("feature_version", "0", "feature version"),
                               ("feature_names", list(ft.FEATURE_NAMES)[:-1] + ["bogus"], "feature names"),
                               ("schema_version", 99, "schema")]:
        d = tmp_path / key
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
                "feature_names": list(ft.FEATURE_NAMES), "horizon_seconds": 1800, "step_seconds": 60,
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
