"""The model registry: a model directory (skops estimator + manifest.json), saved and loaded safely.

A model directory holds:

    model.skops          the calibrated estimator (skops format: loading it cannot run code)
    baselines.skops      the logistic baseline (optional; `foreshock evaluate` compares with it)
    manifest.json        versions, feature names, horizon, thresholds, training summary, metrics,
                         and the sha256 of each .skops file
    evaluation.json/html the evaluation report (optional)
    REPRODUCE.md         the command that rebuilt it (optional)

Loading checks, in order, and refuses with a ModelError that names the file: the manifest parses and
has the required keys; each .skops file's sha256 matches the manifest; its schema version, feature
version and feature names match the running code; and the file contains only the types in
TRUSTED_TYPES (skops.io.get_untrusted_types), so a tampered file cannot smuggle in a callable.
Never pickle or joblib.

Feature rows are the full width of the running code (features.FEATURE_NAMES); the estimator reads
the first len(manifest["feature_names"]) of them (features.MODEL_FEATURE_NAMES), and a manifest with
a `novelty` section (novelty.py) raises the probability to the novelty alarm's where that is higher.
A manifest's `hard_evidence` (a list of model.HARD_EVIDENCE_CONDITIONS features) names the conditions that alarm
whatever the probability (`LoadedModel.hard_evidence`, model.HardEvidence); it leaves the probability as it is.

Prediction (`LoadedModel.predict_proba`) takes the fast tree walk (predictor/treewalk.py) for the
estimator train.py builds, when the model is loaded with `fast=True` (the default) and the walk
reproduces predict_proba on a probe matrix at load; anything else uses the estimator's own
predict_proba, the written reference.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from foreshock import schema as sch
from foreshock.risk import threshold_for_budget
from foreshock.predictor import features as ft
from foreshock.predictor.errors import ModelError
from foreshock.predictor.model import HardEvidence
from foreshock.predictor.novelty import NoveltyAlarm
from foreshock.predictor.treewalk import FastPart, FastPredictor

log = logging.getLogger(__name__)

MODEL_FILE = "model.skops"
BASELINES_FILE = "baselines.skops"
MANIFEST_FILE = "manifest.json"
MANIFEST_VERSION = 1
REQUIRED_KEYS = ("version", "schema_version", "feature_version", "feature_names", "horizon_seconds",
                 "step_seconds", "thresholds", "recommended_threshold", "files")

# Every type a Foreshock model file may contain beyond skops' built-in safe set (most of scikit-learn,
# numpy arrays, builtins): nothing else is accepted. Found with skops.io.get_untrusted_types on the estimators train.py builds.
TRUSTED_TYPES: tuple[str, ...] = (
    "foreshock.predictor.model.FeatureGuard",
    "foreshock.predictor.model.TrendRatios",
    "foreshock.predictor.model.RuleBaseline",
    "foreshock.predictor.model.PriorShift",
    "foreshock.predictor.model.LogitBlend",
    "foreshock.predictor.model._signed_log1p",
    "numpy.dtype",
    "sklearn.calibration._CalibratedClassifier",
    "sklearn.calibration._SigmoidCalibration",
    "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",
)


def default_model_path() -> Path:
    """models/default inside the installed package (foreshock.models package data)."""
    return Path(str(resources.files("foreshock.models").joinpath("default")))


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def predict_threads() -> int:
    """Threads for a large prediction: FORESHOCK_PREDICT_THREADS, else up to 2 of the machine's CPUs
    (the walk over 10,000 nodes splits in two; more threads would take cores the service needs)."""
    return ft.kernel_threads()


@dataclass
class LoadedModel:
    """A verified model: `manifest` (dict), the estimator, and the baselines saved beside it."""
    manifest: dict[str, Any]
    estimator: Any
    path: Path
    baselines: dict[str, Any] = field(default_factory=dict)

    @property
    def feature_names(self) -> list[str]:
        return list(self.manifest["feature_names"])

    @property
    def horizon_seconds(self) -> int:
        return int(self.manifest["horizon_seconds"])

    @property
    def version(self) -> str:
        return str(self.manifest["version"])

    threads: int = field(default_factory=lambda: predict_threads())  # the fast path's tree-walk threads
    fast: bool = True       # the fast tree walk (treewalk.py) when the estimator has the known structure;
    #                         False: the estimator's predict_proba

    def __post_init__(self):
        self._fast: FastPart | None = None
        self._fast_checked = False
        section = self.manifest.get("novelty")
        self.novelty: NoveltyAlarm | None = (NoveltyAlarm.from_manifest(section, f"{self.path}/{MANIFEST_FILE}")
                                             if section else None)
        self.hard_evidence: HardEvidence | None = hard_evidence_of(self.manifest, f"{self.path}/{MANIFEST_FILE}")

    @property
    def n_model_features(self) -> int:
        """How many leading feature columns the estimator reads."""
        return len(self.manifest["feature_names"])

    def model_columns(self, X) -> np.ndarray:
        """The estimator's columns of feature rows X (full width, or already the estimator's)."""
        X = np.asarray(X, dtype=np.float32)
        n = self.n_model_features
        if X.ndim != 2 or X.shape[1] not in (n, ft.N_FEATURES):
            raise ValueError(f"X must be [n, {ft.N_FEATURES}] features in features.FEATURE_NAMES order; "
                             f"got shape {X.shape}")
        return X[:, :n] if X.shape[1] != n else X

    @property
    def fast_predictor(self) -> "FastPart | None":
        """The fast path for this estimator (None: predict_proba is used), built on first use."""
        if not self._fast_checked:
            self._fast_checked = True
            self._fast = FastPredictor.build(self.estimator, self.n_model_features) if self.fast else None
        return self._fast

    @property
    def used_features(self) -> np.ndarray | None:
        """The feature columns the model's trees split on (None: unknown, any may matter)."""
        fast = self.fast_predictor
        if fast is None:
            return None
        cols = fast.input_columns()
        if self.novelty is not None:
            cols = np.concatenate([cols, np.arange(ft.N_FEATURES)[ft.STEADY_COLS]])
        return cols

    def predict_proba(self, X) -> np.ndarray:
        """scikit-learn style: [n, 2] (column 1 = probability of failing within the horizon). X: full
        width feature rows; with a novelty alarm in the manifest, full width is required."""
        X = np.asarray(X, dtype=np.float32)
        Xm = self.model_columns(X)
        if len(X) == 0:
            return np.zeros((0, 2))
        proba = self._estimator_proba(Xm)
        if self.novelty is None:
            return proba
        if X.shape[1] != ft.N_FEATURES:
            raise ValueError(f"{self.path}: the novelty alarm reads the steadiness columns: X must be "
                             f"[n, {ft.N_FEATURES}]; got shape {X.shape}")
        p = self.novelty.fuse(proba[:, 1], X)
        return np.column_stack([1.0 - p, p])

    def supervised_probability(self, X) -> np.ndarray:
        """[n]: the estimator's probability alone, without the novelty alarm."""
        Xm = self.model_columns(X)
        return self._estimator_proba(Xm)[:, 1] if len(Xm) else np.zeros(0)

    def _estimator_proba(self, Xm: np.ndarray) -> np.ndarray:
        fast = self.fast_predictor
        return fast.predict_proba(Xm, threads=self.threads) if fast is not None else self.estimator.predict_proba(Xm)

    def baseline_probability(self, name: str):
        """X -> [n]: the saved baseline `name`'s probability (it reads the estimator's columns)."""
        est = self.baselines[name]
        return lambda X: est.predict_proba(self.model_columns(X))[:, 1]

    def probability(self, X) -> np.ndarray:
        """[n]: the calibrated probability of failing within the horizon."""
        return self.predict_proba(X)[:, 1]

    def threshold(self, budget: float | None = None, model: str = "model") -> float:
        """The threshold for a false-evacuation budget (per 1,000 node-days; None: the recommended one),
        by the one rule (foreshock.risk.threshold_for_budget)."""
        th = threshold_for_budget(self.manifest, budget, model)
        if th is None:
            raise ModelError(f"{self.path}: the manifest names no threshold for {model}")
        return th


def hard_evidence_of(manifest: dict, where: str = "model manifest") -> HardEvidence | None:
    """The conditions the manifest's `hard_evidence` names (model.HardEvidence), or None: a model without
    the key alarms on its score alone. Raises ValueError naming `where` for a value that is not a list of
    model.HARD_EVIDENCE_CONDITIONS features."""
    names = (manifest or {}).get("hard_evidence")
    if names is None:
        return None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: hard_evidence {names!r} must be a list of feature names")
    return HardEvidence(names, where) if names else None


def manifest_threshold(manifest: dict, budget: float, model: str = "model") -> float | None:
    """The threshold the manifest lists for exactly this budget (`thresholds`, `baseline_thresholds`), or None."""
    table = manifest.get("thresholds") if model == "model" else (manifest.get("baseline_thresholds") or {}).get(model)
    for key, value in (table or {}).items():
        try:
            if float(key) == float(budget):
                return float(value)
        except (TypeError, ValueError):
            continue
    return None


def save_model(model_dir: str | os.PathLike, estimator, manifest: dict, *,
               baselines: dict[str, Any] | None = None) -> Path:
    """Write the estimator (skops), baselines, and the manifest with the files' sha256."""
    import skops.io as sio

    out = Path(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, obj in ((MODEL_FILE, estimator), (BASELINES_FILE, baselines)):
        if obj is None:
            continue
        tmp = out / f".{name}.tmp"
        sio.dump(obj, tmp)
        untrusted = set(sio.get_untrusted_types(file=tmp)) - set(TRUSTED_TYPES)
        if untrusted:
            tmp.unlink()
            raise ModelError(f"{out / name}: would contain types outside TRUSTED_TYPES: {sorted(untrusted)}")
        os.replace(tmp, out / name)
        files[name] = sha256_file(out / name)
    manifest = dict(manifest)
    manifest.setdefault("manifest_version", MANIFEST_VERSION)
    manifest.setdefault("schema_version", sch.SCHEMA_VERSION)
    manifest.setdefault("feature_version", ft.FEATURE_VERSION)
    manifest.setdefault("feature_names", list(ft.MODEL_FEATURE_NAMES))
    manifest.setdefault("step_seconds", ft.STEP_SECONDS)
    manifest["files"] = files
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise ModelError(f"{out / MANIFEST_FILE}: manifest lacks {missing}")
    tmp = out / f".{MANIFEST_FILE}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=_json_default) + "\n")
    os.replace(tmp, out / MANIFEST_FILE)
    return out


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o)}")


def read_manifest(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelError(f"{path}: no manifest (is {model_dir} a model directory?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path}: unreadable manifest: {exc}") from None
    if not isinstance(manifest, dict):
        raise ModelError(f"{path}: manifest is not a JSON object")
    missing = [k for k in REQUIRED_KEYS if k not in manifest]
    if missing:
        raise ModelError(f"{path}: manifest lacks {missing}")
    return manifest


def check_compatible(manifest: dict, where: str) -> None:
    """Refuse a model whose schema or features differ from the running code's."""
    if int(manifest["schema_version"]) != sch.SCHEMA_VERSION:
        raise ModelError(f"{where}: model was trained on schema v{manifest['schema_version']}; "
                         f"this code reads schema v{sch.SCHEMA_VERSION}")
    if str(manifest["feature_version"]) not in ft.READABLE_VERSIONS:
        raise ModelError(f"{where}: model has feature version {manifest['feature_version']!r}; this code "
                         f"computes feature version {ft.FEATURE_VERSION!r} and reads models of "
                         f"{', '.join(ft.READABLE_VERSIONS)}: retrain with `foreshock train`")
    names = list(manifest["feature_names"])
    if len(names) < ft.N_MODEL or names != list(ft.FEATURE_NAMES[:len(names)]):
        missing = [n for n in ft.FEATURE_NAMES if n not in names]
        extra = [n for n in names if n not in ft.FEATURE_NAMES]
        raise ModelError(f"{where}: model's feature names differ from this code's (the code has "
                         f"{missing[:5]} the model lacks, the model has {extra[:5]} the code lacks, "
                         f"or the order differs): retrain with `foreshock train`")
    if int(manifest["step_seconds"]) != ft.STEP_SECONDS:
        raise ModelError(f"{where}: model step {manifest['step_seconds']} s; this code uses {ft.STEP_SECONDS} s")


def _load_skops(path: Path, expected_sha: str | None):
    import skops.io as sio

    if not path.exists():
        raise ModelError(f"{path}: missing")
    if expected_sha is None:
        raise ModelError(f"{path}: the manifest has no sha256 for it")
    actual = sha256_file(path)
    if actual != expected_sha:
        raise ModelError(f"{path}: sha256 {actual} does not match the manifest's {expected_sha}")
    try:
        untrusted = set(sio.get_untrusted_types(file=path))
    except Exception as exc:  # a corrupt archive: skops raises zipfile/json errors
        raise ModelError(f"{path}: not a readable skops file: {exc}") from None
    refused = untrusted - set(TRUSTED_TYPES)
    if refused:
        raise ModelError(f"{path}: contains types outside the trusted list: {sorted(refused)}")
    try:
        return sio.load(path, trusted=sorted(untrusted))
    except Exception as exc:
        raise ModelError(f"{path}: could not be loaded: {exc}") from None


def load_model(path: str | os.PathLike | None = None) -> LoadedModel:
    """Load and verify a model directory (default: the shipped default model)."""
    model_dir = Path(path) if path is not None else default_model_path()
    manifest = read_manifest(model_dir)
    check_compatible(manifest, str(model_dir / MANIFEST_FILE))
    files = manifest.get("files") or {}
    estimator = _load_skops(model_dir / MODEL_FILE, files.get(MODEL_FILE))
    baselines = {}
    if BASELINES_FILE in files:
        baselines = _load_skops(model_dir / BASELINES_FILE, files.get(BASELINES_FILE))
        if not isinstance(baselines, dict):
            raise ModelError(f"{model_dir / BASELINES_FILE}: expected a dict of estimators")
    try:   # builds the novelty alarm the manifest describes, refusing one that does not fit this code
        return LoadedModel(manifest=manifest, estimator=estimator, path=model_dir, baselines=baselines)
    except ValueError as exc:
        raise ModelError(str(exc)) from None
