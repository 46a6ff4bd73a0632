"""Job and site peers across shards: a shard's scorer, given the other shards' totals, computes its
nodes' features as one scorer holding every node does (docs/scaling.md, "Peer features across shards")."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from foreshock.predictor import features as ft
from foreshock.predictor import online, registry, synthetic

STEP_NS = ft.STEP_SECONDS * 1_000_000_000
NODES = ["node-a", "node-b", "node-c", "node-d"]
SHARD_A, SHARD_B = NODES[:2], NODES[2:]      # a leaf each; one job and one site over both
STEPS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory, tiny_model_dir):
    return registry.load_model(tiny_model_dir(tmp_path_factory.mktemp("m") / "m"))


@pytest.fixture(scope="module")
def telemetry():
    tables = {n: synthetic.node_tables(n, STEPS, seed=i, ecc_ramp_from=5 if n == "node-c" else None, interval_s=20)
              for i, n in enumerate(NODES)}
    inv = synthetic.inventory(NODES, leaf_of=lambda i: f"leaf-{i // 2}", job_of=lambda i: "job-1")
    return tables, inv


def _feed(scorer, tables, nodes, step):
    lo, hi = step * STEP_NS, (step + 1) * STEP_NS
    for n in nodes:
        for name, t in tables[n].items():
            ts = pc.cast(t.column("ts"), pa.int64())
            scorer.ingest(name, t.filter(pc.and_(pc.greater_equal(ts, lo), pc.less(ts, hi))))
    return hi + 6_000_000_000   # past the grace


def _scorers(model, inv, **kw):
    whole = online.OnlineScorer(model, explain_top=0)
    a = online.OnlineScorer(model, explain_top=0, share_totals=True, **kw)
    b = online.OnlineScorer(model, explain_top=0, share_totals=True, **kw)
    whole.ingest("inventory", inv)
    for s, nodes in ((a, SHARD_A), (b, SHARD_B)):
        s.ingest("inventory", inv.filter(pc.is_in(inv.column("node"), pa.array(nodes))))
    return whole, a, b


def _steps(tables):
    first = int(pc.min(tables["node-a"]["gpu"].column("ts")).cast(pa.int64()).as_py()) // STEP_NS
    return range(first, first + STEPS * 20 // 60)


def test_shard_with_the_other_shards_totals_of_the_step_equals_one_scorer(model, telemetry):
    tables, inv = telemetry
    whole, a, b = _scorers(model, inv, remote_lag_steps=0)
    checked = 0
    for step in _steps(tables):
        whole.score(_feed(whole, tables, NODES, step))
        b.score(_feed(b, tables, SHARD_B, step))
        (got_step, totals), = b.take_local_totals()
        assert got_step == step and set(totals) == set(ft.CROSS_SHARD_GROUPS)
        a.set_remote_totals(step, totals)
        a.score(_feed(a, tables, SHARD_A, step))
        for n in SHARD_A:
            np.testing.assert_array_equal(a.features_of(n), whole.features_of(n), err_msg=f"{n} step {step}")
            checked += 1
    assert checked >= 2 * 7
    job_col = ft.FEATURE_NAMES.index("traffic_vs_job_5m")
    assert np.isfinite(a.features_of("node-a")[job_col])
    assert a.stats["remote_totals_used"] == len(_steps(tables)) and a.stats["remote_totals_missing"] == 0


def test_the_lag_rule_uses_the_previous_steps_remote_totals_then_local_only(model, telemetry):
    tables, inv = telemetry
    whole, a, b = _scorers(model, inv)   # remote_lag_steps=1
    local_only = online.OnlineScorer(model, explain_top=0)
    local_only.ingest("inventory", inv.filter(pc.is_in(inv.column("node"), pa.array(SHARD_A))))
    steps = list(_steps(tables))
    sent = {}
    for step in steps[:4]:
        b.score(_feed(b, tables, SHARD_B, step))
        sent.update(b.take_local_totals())
        if step - 1 in sent:
            a.set_remote_totals(step - 1, sent[step - 1])   # as over the coordinator: one step late
        a.score(_feed(a, tables, SHARD_A, step))
        local_only.score(_feed(local_only, tables, SHARD_A, step))
    assert a.stats["remote_totals_missing"] == 1 and a.stats["remote_totals_lagged"] == 3
    # the peer signals of step s: this shard's nodes of s plus the other shard's of s - 1
    step = steps[4]
    b_s = {g: {k: v.copy() for k, v in rows.items()} for g, rows in sent[steps[3]].items()}
    a.set_remote_totals(steps[3], b_s)
    for sc in (a, local_only):
        _feed(sc, tables, SHARD_A, step)
    a.score(step * STEP_NS + STEP_NS + 6_000_000_000)
    local_only.score(step * STEP_NS + STEP_NS + 6_000_000_000)
    job_col = ft.FEATURE_NAMES.index("traffic_vs_job_5m")
    assert a.features_of("node-a")[job_col] != local_only.features_of("node-a")[job_col]
    # and with nothing recent enough (two steps stale), the local totals alone
    c = online.OnlineScorer(model, explain_top=0, share_totals=True)
    c.ingest("inventory", inv.filter(pc.is_in(inv.column("node"), pa.array(SHARD_A))))
    c.score(_feed(c, tables, SHARD_A, steps[0]))
    c.set_remote_totals(steps[0], sent[steps[0]])
    c.score(_feed(c, tables, SHARD_A, steps[1]))
    c.score(_feed(c, tables, SHARD_A, steps[2]))
    assert c.stats["remote_totals_lagged"] == 1 and c.stats["remote_totals_missing"] == 2


def test_bad_remote_totals_are_refused_naming_the_fault_and_change_nothing(model, telemetry):
    tables, inv = telemetry
    _, a, _ = _scorers(model, inv)
    step = _steps(tables)[0]
    a.score(_feed(a, tables, SHARD_A, step))
    good = np.zeros(ft.TOTALS_WIDTH)
    good[0] = 2
    k = len(ft.PEER_INPUTS)
    for bad, words in (({"leaf_switch": {"leaf-1": good}}, "group 'leaf_switch'"),
                       ({"job": {"job-1": good[:-1]}}, "a totals row has"),
                       ({"job": {"job-1": np.r_[2, [1] * k, [3] * k]}}, "nonzero counts"),
                       ({"job": {"job-1": np.r_[0, [0] * (2 * k)]}}, "count 0.0"),
                       ({"site": {"site-a": np.r_[np.nan, [0] * (2 * k)]}}, "not finite")):
        with pytest.raises(ValueError, match=words):
            a.set_remote_totals(step, bad)
    with pytest.raises(ValueError, match="older than"):
        a.set_remote_totals(step - 5, {"job": {"job-1": good}})
    with pytest.raises(ValueError, match="unknown step"):
        a.set_remote_totals(step + 10_000, {"job": {"job-1": good}})
    assert a._remote_totals == {}
    with pytest.raises(ValueError, match="remote_lag_steps"):
        online.OnlineScorer(model, remote_lag_steps=online.REMOTE_KEEP_STEPS)


def test_a_scorer_that_does_not_share_keeps_no_totals(model, telemetry):
    tables, inv = telemetry
    whole, _, _ = _scorers(model, inv)
    whole.score(_feed(whole, tables, NODES, _steps(tables)[0]))
    assert whole.take_local_totals() == [] and not whole.stats["remote_totals_missing"]
