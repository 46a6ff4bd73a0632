"""The fast paths give the slow paths' answers: predictions, one-step features, presorted reductions.

Speed is measured in benchmarks/bench_predictor.py; these tests only pin that every shortcut returns
exactly (or, for predictions, within float rounding) what the general code returns.
"""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.calibration import CalibratedClassifierCV
from sklearn.frozen import FrozenEstimator
from threadpoolctl import threadpool_limits

from foreshock.predictor import features as ft
from foreshock.predictor import kernels
from foreshock.predictor import model as mdl
from foreshock.predictor import registry, signals, synthetic, treewalk


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, ft.N_MODEL)).astype(np.float32)
    X[rng.random(X.shape) < 0.15] = np.nan           # missing values take the trees' missing branch
    X[:, 7] = rng.poisson(1.0, n)                     # a few distinct values (few bins)
    y = ((np.nan_to_num(X[:, 0]) + np.nan_to_num(X[:, 3]) > 1.0) | (X[:, 7] > 3)).astype(int)
    return X, y


def _loaded(estimator, **kw) -> registry.LoadedModel:
    return registry.LoadedModel({"feature_names": list(ft.MODEL_FEATURE_NAMES)}, estimator, path=None, **kw)


@pytest.fixture(scope="module", autouse=True)
def one_openmp_thread():
    # scikit-learn's fit and predict on a busy 2-core machine are much faster on one OpenMP thread
    with threadpool_limits(1, user_api="openmp"):
        yield


@pytest.fixture(scope="module")
def fitted():
    X, y = _data(3000)
    gbdt = mdl.make_model(max_iter=25).fit(X, y)
    return X, y, gbdt


def _check_same(model: registry.LoadedModel, X, rtol=1e-12, atol=1e-15):
    assert model.fast_predictor is not None
    want = model.estimator.predict_proba(model.model_columns(X))   # the estimator reads its own columns
    for threads in (1, 2):
        model.threads = threads
        got = model.predict_proba(X)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def test_fast_prediction_equals_predict_proba(fitted):
    X, y, gbdt = fitted
    cal = CalibratedClassifierCV(FrozenEstimator(gbdt), method="sigmoid").fit(X, y)
    Xt, _ = _data(5000, seed=1)
    Xt[:10] = np.inf                                   # beyond every threshold
    Xt[10:20] = -np.inf
    _check_same(_loaded(cal), Xt)
    _check_same(_loaded(mdl.PriorShift(cal, 25.0).fit()), Xt)


def test_fast_prediction_of_an_ensemble_of_calibrated_models():
    X, y = _data(2000, seed=2)
    # cross-validated calibration: three pipelines with different trees, their probabilities averaged
    cal = CalibratedClassifierCV(mdl.make_model(max_iter=8), method="sigmoid", cv=3).fit(X, y)
    assert len(cal.calibrated_classifiers_) == 3
    _check_same(_loaded(cal), _data(3000, seed=3)[0])


def test_fast_probability_for_training_and_evaluation(fitted):
    X, y, gbdt = fitted
    cal = mdl.PriorShift(CalibratedClassifierCV(FrozenEstimator(gbdt), method="sigmoid").fit(X, y), 5.0).fit()
    np.testing.assert_allclose(treewalk.fast_probability(cal)(X), cal.predict_proba(X)[:, 1], rtol=1e-12, atol=1e-15)
    rule = mdl.RuleBaseline().fit()
    np.testing.assert_array_equal(treewalk.fast_probability(rule)(X), rule.predict_proba(X)[:, 1])
    assert len(treewalk.fast_probability(cal)(X[:0])) == 0


def _linear_rows(n, seed):
    """Rows a linear member meets: zeros, missing values, negatives, values over many orders of magnitude."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n, ft.N_MODEL)) * 10.0 ** rng.integers(-4, 7, (n, 1))
    X[rng.random(X.shape) < 0.4] = 0.0
    X[rng.random(X.shape) < 0.1] = np.nan
    return X.astype(np.float32)


@pytest.fixture(scope="module")
def calibrated_members(fitted):
    X, y, gbdt = fitted
    trees = CalibratedClassifierCV(FrozenEstimator(gbdt), method="sigmoid").fit(X, y)
    linear = CalibratedClassifierCV(FrozenEstimator(mdl.make_logistic().fit(X, y)), method="sigmoid").fit(X, y)
    return trees, linear


@pytest.mark.parametrize("kernel", [True, False])
def test_the_linear_member_takes_its_fast_path(fitted, calibrated_members, kernel):
    """The calibrated logistic regression (model.make_logistic) runs as one folded dot product over
    signed logs, compiled or in numpy, and gives its pipeline's probabilities to rounding."""
    X, y, _ = fitted
    _, linear = calibrated_members
    for est in (linear, mdl.PriorShift(linear, 20.0).fit()):
        fast = treewalk.fast_part(est, kernel=kernel)
        assert isinstance(fast, treewalk.LinearFast) and fast.compiled == (kernel and kernels.AVAILABLE)
        rows = np.concatenate([_linear_rows(3000, 1), X, fast.probe(ft.N_MODEL)])
        want = est.predict_proba(rows)
        for threads in (1, 2):   # a sum in another order, libm's log1p: agreement to rounding
            np.testing.assert_allclose(fast.predict_proba(rows, threads=threads), want, rtol=1e-10, atol=1e-13)
        _check_same(_loaded(est), rows, rtol=1e-10, atol=1e-13)
    with pytest.raises(ValueError, match="features"):
        treewalk.fast_part(linear, kernel=kernel).decision(X[:, :10])


def test_the_trees_averaged_with_the_linear_member_take_the_fast_path(fitted, calibrated_members):
    """train.py's model: the two members averaged on the logit scale with fixed weights (model.LogitBlend
    `weights`), prior-shifted; and a user's model stacked on it. Both run through BlendedFast."""
    X, y, _ = fitted
    trees, linear = calibrated_members
    blend = mdl.LogitBlend([trees, linear], weights=(0.5, 0.5)).fit(X, y)
    assert blend.coef_[0] == pytest.approx(blend.coef_[1]) and blend.coef_[0] > 0
    shipped = mdl.PriorShift(blend, 20.0).fit()
    rows = np.concatenate([_linear_rows(2000, 2), _data(2000, seed=5)[0]])
    model = _loaded(shipped)
    _check_same(model, rows, rtol=1e-10, atol=1e-13)
    fast = model.fast_predictor
    assert isinstance(fast, treewalk.BlendedFast)
    assert [type(p) for p in fast.parts] == [treewalk.FastPredictor, treewalk.LinearFast]
    # the linear member reads every column with a coefficient: more than the trees split on
    assert set(fast.parts[0].input_columns()) < set(model.used_features.tolist())
    stacked = mdl.LogitBlend([shipped, trees]).fit(X, y)
    _check_same(_loaded(stacked), rows, rtol=1e-10, atol=1e-13)
    assert isinstance(_loaded(stacked).fast_predictor.parts[0], treewalk.BlendedFast)


def test_other_estimators_fall_back_to_predict_proba(fitted):
    X, y, gbdt = fitted
    for est in (mdl.make_logistic().fit(X[:500], y[:500]), mdl.RuleBaseline().fit(),
                CalibratedClassifierCV(FrozenEstimator(gbdt), method="isotonic").fit(X, y)):
        model = _loaded(est)
        assert model.fast_predictor is None
        np.testing.assert_array_equal(model.predict_proba(X[:50]), est.predict_proba(X[:50]))
    cal = CalibratedClassifierCV(FrozenEstimator(gbdt), method="sigmoid").fit(X, y)
    off = _loaded(cal, fast=False)
    assert off.fast_predictor is None
    np.testing.assert_array_equal(off.predict_proba(X[:50]), cal.predict_proba(X[:50]))


def test_the_shipped_model_takes_the_fast_path():
    model = registry.load_model()
    X = ft.full_width(model.manifest["reference_features"])[None].repeat(400, axis=0)
    rng = np.random.default_rng(4)
    X *= rng.lognormal(0.0, 1.5, X.shape).astype(np.float32)
    X[rng.random(X.shape) < 0.2] = np.nan
    _check_same(model, X)


needs_numba = pytest.mark.skipif(not kernels.AVAILABLE, reason="numba not installed")


def _shipped_trees(model: registry.LoadedModel):
    """The shipped estimator's calibrated trees: the estimator itself, or its first blend member that
    is trees (a model with the linear member is a LogitBlend of the two)."""
    est = model.estimator.estimator if type(model.estimator) is mdl.PriorShift else model.estimator
    if type(est) is mdl.LogitBlend:
        est = next(m for m in est.estimators if type(treewalk.fast_part(m)) is treewalk.FastPredictor)
    return est


@needs_numba
def test_the_compiled_walk_is_the_binned_walk_bit_for_bit():
    model = registry.load_model()
    assert model.fast_predictor.compiled       # the shipped model runs in the compiled kernel
    rng = np.random.default_rng(8)
    # the estimator's own columns: the fast predictor walks the trees on them
    X = model.model_columns(ft.full_width(model.manifest["reference_features"])[None]).repeat(5000, axis=0)
    X *= rng.lognormal(0.0, 2.0, X.shape).astype(np.float32)
    X[rng.random(X.shape) < 0.1] = np.nan
    X[:5] = np.inf
    X[5:10] = 0.0
    trees = _shipped_trees(model)
    compiled = treewalk.FastPredictor(trees)
    X = np.concatenate([X, compiled.probe(X.shape[1])])   # on and around every threshold
    binned = treewalk.FastPredictor(trees, kernel=False)
    assert not binned.compiled
    want = binned.members[0][0].decision(compiled.trends.transform(X))
    wide = np.concatenate([X, np.full((len(X), 3), np.nan, np.float32)], axis=1)[:, :X.shape[1]]
    assert not wide.flags.c_contiguous                 # the leading columns of wider rows: walked in place
    for threads in (1, 2):
        np.testing.assert_array_equal(compiled.members[0][0].decision(X, threads=threads), want)
        np.testing.assert_array_equal(compiled.members[0][0].decision(wide, threads=threads), want)
        np.testing.assert_array_equal(compiled.predict_proba(X, threads=threads), binned.predict_proba(X))
    with pytest.raises(ValueError, match="features"):
        compiled.members[0][0].decision(X[:, :10])


@needs_numba
@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the infinities, in the numpy path
def test_the_one_step_kernel_is_the_numpy_step_bit_for_bit():
    rng = np.random.default_rng(9)
    n, s = 2500, len(ft.ALL_NAMES)                     # over run_rows' split: two threads write the state
    states = {True: ft.FeatureState.empty(n), False: ft.FeatureState.empty(n)}
    for step in range(75):                             # the rings wrap; the gauges' running maximum rebuilds
        x = rng.poisson(0.3, (n, s)) * rng.choice([0.0, 1.0, 1000.0], (n, s), p=[0.3, 0.6, 0.1])
        x[rng.random((n, s)) < 0.05] = np.nan
        x[:50] = np.nan                                # nodes that report nothing
        x[rng.random((n, s)) < 0.002] = np.inf         # nan_to_num's largest double
        x[rng.random((n, s)) < 0.002] = -np.inf
        flags = ft.FABRIC_IDX[:len(signals.FABRIC_FLAGS)]
        x[:, flags] = np.where(np.isnan(x[:, flags]), np.nan, rng.random((n, len(flags))) < 0.05)
        # counts the rings' running sums cannot take (fractions, -0.0, huge): those nodes' windows are
        # summed slot by slot until the values have left them
        counts = ft.STEP_TIME_IDX[1:] + ft.FABRIC_IDX[len(signals.FABRIC_FLAGS):]
        odd = rng.random((n, len(counts))) < 0.003
        x[:, counts] = np.where(odd, rng.choice([0.1, 2.5, -0.0, 2.0 ** 60], (n, len(counts))), x[:, counts])
        got = {}
        for use in (True, False):
            got[use] = ft.compute(x[:, None].copy(), np.array([500 + step]), states[use], kernel=use)[0]
        np.testing.assert_array_equal(got[True], got[False])
    for name in ("cum", "cumv", "ring", "ringv", "gring", "z", "zr", "seen", "last_event", "zd", "za", "zar",
                 "tring", "fring", "flast", "zc"):
        np.testing.assert_array_equal(getattr(states[True], name), getattr(states[False], name), err_msg=name)
    for name in ("head", "ghead", "thead", "fhead"):
        assert getattr(states[True], name) == getattr(states[False], name), name


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "numpy"])
def test_one_step_features_equal_block_features_in_any_mix(use_kernels):
    rng = np.random.default_rng(5)
    n, t = 3, 140
    x = rng.poisson(0.4, (n, t, len(ft.ALL_NAMES))).astype(float) * 1.3
    g = ft.GAUGE_IDX
    x[:, :, g] = rng.normal(60, 5, (n, t, len(g)))
    x[0, 20:75, :] = np.nan                            # a node silent for longer than the window
    x[1, :, g[0]] = np.nan                             # a gauge never reported
    x[2, rng.random(t) < 0.3] = np.nan
    whole, _ = ft.compute(x, np.arange(t), ft.FeatureState.empty(n))
    state, parts, i = ft.FeatureState.empty(n), [], 0
    for size in [1] * 40 + [7, 1, 1, 30] + [1] * 35 + [3] * 5 + [1] * 100:
        if i >= t:
            break
        f, state = ft.compute(x[:, i:i + size], np.arange(i, min(i + size, t)), state, kernel=use_kernels)
        parts.append(f)
        i += size
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), whole)


def test_presorted_reduction_equals_the_sorted_one():
    tables = synthetic.node_tables("node-a", 30, seed=3, interval_s=20)
    stage = signals.SampleStage()
    s = stage.samples("rdma_port", tables["rdma_port"])
    assert signals._sorted_by(s.node * signals.STEP_SHIFT + s.step, s.key) is False  # three steps per key
    shuffled = s.select(np.random.default_rng(0).permutation(len(s)))
    a = signals.reduce_steps("rdma_port", s)
    b = signals.reduce_steps("rdma_port", shuffled)
    one_step = s.select(s.step == s.step.min())
    assert signals._sorted_by(one_step.node * signals.STEP_SHIFT + one_step.step, one_step.key)
    c = signals.reduce_steps("rdma_port", one_step)
    d = signals.reduce_steps("rdma_port", one_step.select(np.random.default_rng(1).permutation(len(one_step))))
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.values, b.values)
    np.testing.assert_array_equal(c.keys, d.keys)
    np.testing.assert_array_equal(c.values, d.values)
    assert np.isfinite(c.values).any()


def test_feature_workers_give_the_serial_features_in_node_order(tmp_path):
    from foreshock import dataset
    from foreshock.predictor import offline

    nodes = [f"node-{k}" for k in range(5)]
    w = dataset.DatasetWriter(tmp_path / "data", fsync=False)
    for i, n in enumerate(nodes):
        for name, t in synthetic.node_tables(n, 40, seed=i, ecc_ramp_from=5 if i == 2 else None).items():
            w.write_table(name, t)
    w.write_table("inventory", synthetic.inventory(nodes, leaf_of=lambda i: f"leaf-{i // 2}"))
    runs = {}
    for workers in (1, 2):
        with offline.FeatureBuilder(tmp_path / "data", workers=workers) as fb:
            assert fb.workers == workers
            runs[workers] = list(fb)
    assert [nf.node for nf in runs[2]] == [nf.node for nf in runs[1]] == nodes
    for a, b in zip(runs[1], runs[2]):
        np.testing.assert_array_equal(a.steps, b.steps)
        np.testing.assert_array_equal(a.present, b.present)
        np.testing.assert_array_equal(a.X, b.X)
    assert np.isfinite(runs[2][2].X[:, ft.FEATURE_NAMES.index("leaf_peers_link_err_frac_30m")]).any()
    assert offline.feature_workers(3) == 3 and offline.feature_workers(3, nodes=2) == 2
    assert offline.feature_workers(None, nodes=4) == 1   # too small a dataset to start workers


def test_online_rounds_give_the_same_features_however_rows_are_batched(tmp_path, tiny_model_dir):
    import pyarrow as pa
    import pyarrow.compute as pc

    from foreshock.predictor import online

    step_ns = ft.STEP_SECONDS * 1_000_000_000
    nodes = ["node-a", "node-b"]
    tables = {n: synthetic.node_tables(n, 36, seed=i, interval_s=20, ecc_ramp_from=6 if i else None)
              for i, n in enumerate(nodes)}
    model = registry.load_model(tiny_model_dir(tmp_path / "m"))
    t0 = synthetic.T0_NS - synthetic.T0_NS % step_ns

    def rows(name, lo, hi):
        parts = []
        for n in nodes:
            ts = pc.cast(tables[n][name].column("ts"), pa.int64())
            parts.append(tables[n][name].filter(pc.and_(pc.greater_equal(ts, lo), pc.less(ts, hi))))
        return pa.concat_tables(parts)

    def run(cuts):
        """cuts(lo, hi) -> the [a, b) time slices of one step's rows, each ingested as one batch."""
        scorer = online.OnlineScorer(model, explain_top=4)
        scorer.set_inventory(synthetic.inventory(nodes))
        feats = []
        for k in range(12):
            lo = t0 + k * step_ns
            for a, b in cuts(lo, lo + step_ns):
                for name in tables["node-a"]:
                    scorer.ingest(name, rows(name, a, b))
            batch = scorer.score(lo + step_ns + 6_000_000_000)
            feats.append(np.stack([scorer.features_of(n) for n in nodes]))
        assert scorer.stats["steps_reduced_again"] == 0   # the parts' reductions were merged
        return np.stack(feats), batch

    whole, b1 = run(lambda lo, hi: [(lo, hi)])
    # an entity's samples of one step in two batches: reduced again at the round
    split, b2 = run(lambda lo, hi: [(lo, lo + 25_000_000_000), (lo + 25_000_000_000, hi)])
    np.testing.assert_array_equal(split, whole)
    # rows of the next step arrive before the round: the batch straddles the boundary
    scorer = online.OnlineScorer(model, explain_top=4)
    scorer.set_inventory(synthetic.inventory(nodes))
    straddled = []
    for k in range(12):
        lo = t0 + k * step_ns
        for name in tables["node-a"]:
            scorer.ingest(name, rows(name, lo + (0 if k == 0 else 30_000_000_000), lo + step_ns + 30_000_000_000))
        scorer.score(lo + step_ns + 6_000_000_000)
        straddled.append(np.stack([scorer.features_of(n) for n in nodes]))
    np.testing.assert_array_equal(np.stack(straddled), whole)
    assert scorer.stats["steps_reduced_again"] == 0
    # a collector's once-a-second batches: every sample of a step a batch of its own
    sweeps, _ = run(lambda lo, hi: [(a, a + 20_000_000_000) for a in range(lo, hi, 20_000_000_000)])
    np.testing.assert_array_equal(sweeps, whole)
    assert np.isfinite(whole[-1]).any()
    assert [s.description for s in b2.signals[1]] == [s.description for s in b1.signals[1]]


def test_explanations_skip_only_signals_the_model_never_reads(fitted):
    from foreshock.predictor import explain

    X, y, gbdt = fitted
    model = _loaded(CalibratedClassifierCV(FrozenEstimator(gbdt), method="sigmoid").fit(X, y))
    used = model.used_features
    assert used is not None and 0 < len(used) < ft.N_FEATURES
    rows = np.zeros((40, ft.N_FEATURES), dtype=np.float32)   # explanations read full-width rows
    rows[:, :ft.N_MODEL] = X[:40]
    p = model.probability(rows)
    reference = ft.full_width(np.nanmedian(X, axis=0))
    every = explain.explain(model.probability, rows, p, reference, top=5)
    fast = explain.explain(model.probability, rows, p, reference, top=5, used_features=used)
    key = lambda out: [[(s.name, s.contribution, s.description) for s in sigs] for sigs in out]  # noqa: E731
    assert key(every) == key(fast) and any(every)


def test_dataset_hash_is_remembered_only_for_the_same_files(tmp_path):
    import hashlib
    import os

    from foreshock.predictor import offline

    part = tmp_path / "table=gpu" / "date=2026-01-05" / "node=a"
    part.mkdir(parents=True)
    (part / "x.parquet").write_bytes(b"one")
    want = hashlib.sha256(b"table=gpu/date=2026-01-05/node=a/x.parquet\0one").hexdigest()
    assert offline.dataset_hash(tmp_path) == want
    assert offline.dataset_hash(tmp_path) == want
    (part / "x.parquet").write_bytes(b"two!")
    os.utime(part / "x.parquet", ns=(1, 1))
    assert offline.dataset_hash(tmp_path) == hashlib.sha256(b"table=gpu/date=2026-01-05/node=a/x.parquet\0two!").hexdigest()


@needs_numba
def test_group_totals_kernel_is_the_bincount_path():
    from foreshock.predictor import online

    rng = np.random.default_rng(10)
    for n in (1, 7, 3000):
        codes = rng.integers(-1, 40, n)                # -1: a node without a leaf/job/site label
        present = rng.random(n) < 0.9
        own = (rng.poisson(2, (n, 3)) * rng.choice([0.0, 1.0, 1e6], (n, 3))).astype(float)
        got = online.group_totals_lookup(codes, present, own)
        want = online.group_totals_lookup(codes, present, own, kernel=False)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


@needs_numba
def test_the_entity_extremes_kernel_is_the_numpy_path():
    from foreshock.predictor import online

    rng = np.random.default_rng(11)
    for rows, cols, n in ((0, 0, 5), (7, 0, 9), (40, 8, 40), (30, 5, 45)):   # nodes past the arrays' rows
        total = rng.poisson(1.0, (rows, cols)) * rng.choice([0.0, 1.0, 1e9], (rows, cols))
        total[rng.random((rows, cols)) < 0.3] = np.nan     # an entity with no known value
        peak = np.where(rng.random((rows, cols)) < 0.3, np.nan, rng.normal(60.0, 10.0, (rows, cols)))
        idx = np.flatnonzero(rng.random(n) < 0.8)
        want_max = online._across_entities(total, np.fmax, n)[idx]
        want_min = online._across_entities(peak, np.fmin, n)[idx]
        got = np.full((len(idx), 3), -1.0)
        kernels.across_entities(total, True, idx, got, 0)
        kernels.across_entities(peak, False, idx, got, 2)
        np.testing.assert_array_equal(got[:, 0], want_max)
        np.testing.assert_array_equal(got[:, 2], want_min)
        assert (got[:, 1] == -1.0).all()


@needs_numba
@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # 0/0 in the numpy path
def test_the_finish_kernel_is_the_numpy_join():
    rng = np.random.default_rng(12)
    n = 600
    keys = np.arange(n, dtype=np.int64) * signals.STEP_SHIFT + 77

    def block(table):
        names = tuple(sig for sig, _, _ in signals.REDUCTIONS[table])
        v = rng.poisson(2.0, (n, len(names))) * rng.choice([0.0, 1.0, 1e7], (n, len(names)), p=[0.2, 0.7, 0.1])
        v[rng.random(v.shape) < 0.1] = np.nan
        return signals.StepSignals(keys, names, v)

    for tables in (list(signals.REDUCTIONS), ["gpu", "nvlink"], ["rdma_port", "host_net", "events"]):
        blocks = [block(t) for t in tables]
        blocks[0].values[:5] = np.inf                   # a sum over infinities, an infinite ratio
        want = signals.finish(blocks, kernel=False)
        got = signals.finish(blocks, kernel=True)
        assert got.names == want.names
        np.testing.assert_array_equal(got.keys, want.keys)
        np.testing.assert_array_equal(got.values, want.values)


@needs_numba
@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # empty groups' 0/0 in the numpy path
def test_the_peer_kernels_are_the_numpy_peer_path():
    from foreshock.predictor import online

    rng = np.random.default_rng(13)
    n = 3000
    x = rng.poisson(1.0, (n, 1, len(signals.STEP_NAMES))) * rng.choice([0.0, 1.0, 64.0, 1 / 64], (n, 1, 1))
    x[rng.random(x.shape) < 0.2] = np.nan
    x[:40] = np.nan                                    # nodes that report nothing
    x[40:45, 0, signals.BASE_INDEX["temp_max"]] = -1.0  # a gauge below zero: not "known" to the job mean
    own, present = ft.step_inputs(x, kernel=True)
    want_own, want_present = ft.step_inputs(x, kernel=False)
    np.testing.assert_array_equal(own, want_own)
    np.testing.assert_array_equal(present, want_present)
    own, present = own[:, 0], present[:, 0]
    codes = {g: rng.integers(-1, k, n) for g, k in (("leaf_switch", 400), ("job", 30), ("site", 3))}
    codes["leaf_switch"][:200] = np.arange(200)        # nodes alone under their leaf
    totals = {g: online.group_totals_lookup(c, present, own, kernel=False) for g, c in codes.items()}
    got = ft.peer_signals(own, present, codes, totals, kernel=True)
    np.testing.assert_array_equal(got, ft.peer_signals(own, present, codes, totals))
    peers = got[:, None]
    step_times = rng.random((n, 1, 3))
    np.testing.assert_array_equal(ft.all_signals(x, peers, step_times, kernel=True),
                                  ft.all_signals(x, peers, step_times))


def test_the_riskiest_rows_are_the_full_sorts():
    from foreshock.predictor import online

    rng = np.random.default_rng(14)
    for n, k in ((0, 16), (5, 16), (100, 16), (5000, 16), (5000, 1)):
        for prob in (rng.random(n), np.round(rng.random(n), 2), np.zeros(n)):   # ties, all alike
            prob = prob.copy()
            prob[rng.random(n) < 0.01] = np.nan
            want = np.argsort(-prob, kind="stable")[:k]
            np.testing.assert_array_equal(online._top(prob, k), want)
    prob = np.full(50, np.nan)
    prob[:3] = 0.5                                     # fewer numbers than k
    np.testing.assert_array_equal(online._top(prob, 16), np.argsort(-prob, kind="stable")[:16])


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "numpy"])
def test_the_worst_entity_kept_as_parts_arrive_is_the_maximum_at_the_close(kernel):
    from foreshock.predictor import online

    rng = np.random.default_rng(15)
    for table in ("gpu", "nvlink", "rdma_port"):
        columns = sorted({c for _, c, _ in signals.REDUCTIONS[table]})
        for shrinking in (False, True):                # a negative count: the maximum is taken at the close
            accs = {running: online._StepAccumulator(table, 40, running) for running in (True, False)}
            for _ in range(6):                         # parts of one step, nodes and entities overlapping
                rows = 300
                node = rng.integers(0, 40, rows)
                key = node * signals.NODE_SHIFT + 1000 + rng.integers(0, 6, rows)
                cols = {}
                for c in columns:
                    v = rng.poisson(1.0, rows) * rng.choice([0.0, 1.0, 1e6], rows)
                    v[rng.random(rows) < 0.2] = np.nan
                    if shrinking:
                        v[rng.random(rows) < 0.02] = -3.0
                    cols[c] = v
                part = signals.Samples(node, np.full(rows, 7, dtype=np.int64), key, cols)
                for acc in accs.values():
                    acc.merge(signals.reduce_steps(table, part), part)
            assert (accs[True].best is None) == shrinking
            got, want = (accs[r].frame(7, 45, kernel=kernel) for r in (True, False))
            np.testing.assert_array_equal(got.keys, want.keys)
            np.testing.assert_array_equal(got.values, want.values)
