"""The online scorer's checkpoint: a restarted scorer carries on with its baselines, day-long counts,
last events and counter positions, and after 30 steps computes exactly what a scorer that never
stopped computes."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from foreshock.predictor import features as ft
from foreshock.predictor import onset, online, registry, synthetic

STEP_NS = ft.STEP_SECONDS * 1_000_000_000
NODES = ["node-a", "node-b", "node-c"]
SAMPLES = 330            # at 20 s: 110 steps
RESTART_AT = 40          # steps fed before the restart


@pytest.fixture(scope="module")
def telemetry():
    tables = {n: synthetic.node_tables(n, SAMPLES, seed=i, ecc_ramp_from=30 if n == "node-b" else None,
                                       wrap_port_counter=True, interval_s=20)
              for i, n in enumerate(NODES)}
    inv = synthetic.inventory(NODES, leaf_of=lambda i: "leaf-0", job_of=lambda i: "job-1")
    first = int(pc.min(pc.cast(tables["node-a"]["gpu"].column("ts"), pa.int64())).as_py()) // STEP_NS
    return tables, inv, first


def _feed(scorer, tables, step):
    lo, hi = step * STEP_NS, (step + 1) * STEP_NS
    for name in tables[NODES[0]]:
        parts = []
        for n in NODES:
            t = tables[n][name]
            ts = pc.cast(t.column("ts"), pa.int64())
            parts.append(t.filter(pc.and_(pc.greater_equal(ts, lo), pc.less(ts, hi))))
        scorer.ingest(name, pa.concat_tables(parts))
    return scorer.score(hi + 6_000_000_000)


def _cols(suffix=None, prefix=None):
    return [i for i, n in enumerate(ft.FEATURE_NAMES)
            if (suffix and n.endswith(suffix)) or (prefix and n.startswith(prefix))]


def _rewritten(path, out, version, drop=()):
    """The checkpoint at `path` as a scorer of feature version `version` wrote it, without `drop`."""
    import json

    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files if k not in drop}
    meta = json.loads(arrays["meta"].tobytes())
    meta["feature_version"] = version
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    np.savez(out, **arrays)
    return out


def _fed_pair(tmp_path, telemetry, tiny_model_dir):
    """The model, and two scorers fed the same first RESTART_AT steps."""
    tables, inv, first = telemetry
    model = registry.load_model(tiny_model_dir(tmp_path / "m"))
    pair = online.OnlineScorer(model, explain_top=0), online.OnlineScorer(model, explain_top=0)
    for s in pair:
        s.ingest("inventory", inv)
    for step in range(first, first + RESTART_AT):
        for s in pair:
            _feed(s, tables, step)
    return model, *pair


def test_a_restored_scorer_carries_on(tmp_path, telemetry, tiny_model_dir):
    tables, inv, first = telemetry
    model, steady, before = _fed_pair(tmp_path, telemetry, tiny_model_dir)
    path = tmp_path / "scorer-state.npz"
    assert before.save_state(path) > 0 and not (tmp_path / "scorer-state.npz.tmp").exists()

    after = online.OnlineScorer(model, explain_top=0)
    said = after.restore_state(path)
    assert said.startswith("restored 3 nodes") and after.nodes == NODES
    # the first step after the restart: scored, with the long-lived parts exactly as if it never stopped
    day = _cols(suffix="_decayed_12h") + _cols(prefix="minutes_since_")
    total_remaps = ft.FEATURE_NAMES.index("remap_rows_total_now")
    for k, step in enumerate(range(first + RESTART_AT, first + SAMPLES * 20 // 60)):
        a, b = _feed(steady, tables, step), _feed(after, tables, step)
        assert a.nodes == b.nodes == NODES, step
        for n in NODES:
            want, got = steady.features_of(n), after.features_of(n)
            np.testing.assert_array_equal(got[day], want[day], err_msg=f"{n}, {k} steps after the restart")
            assert got[total_remaps] == want[total_remaps] or np.isnan(want[total_remaps])
            if k >= ft.HISTORY:   # the 30-step windows have refilled: everything is the same
                np.testing.assert_array_equal(got, want, err_msg=f"{n}, {k} steps after the restart")
        if k >= ft.HISTORY:
            np.testing.assert_array_equal(a.probability, b.probability)
    # not vacuous: the sick node's corrected ECC and its baseline ratio are live at the end
    sick = steady.features_of("node-b")
    assert sick[ft.FEATURE_NAMES.index("ecc_sbe_30m")] > 0
    assert sick[ft.FEATURE_NAMES.index("ecc_sbe_30m_vs_baseline")] > 1


def test_a_checkpoint_of_feature_version_9_keeps_its_baselines_and_learns_the_context_again(tmp_path, telemetry,
                                                                                            tiny_model_dir):
    """Version 10 only added the context filter's state and 11 the warming filters': a version-9
    checkpoint restores, every column but the context's and the warming's carries on as if the scorer
    never stopped, and those start over; a checkpoint of a version that carried a state, without it, is
    refused."""
    tables, inv, first = telemetry
    model, steady, before = _fed_pair(tmp_path, telemetry, tiny_model_dir)
    path = tmp_path / "state.npz"
    before.save_state(path)
    after = online.OnlineScorer(model, explain_top=0)
    after.restore_state(_rewritten(path, tmp_path / "v9.npz", "9", drop=("features.zc", "features.zw")))
    broken = online.OnlineScorer(model, explain_top=0)
    with pytest.raises(ValueError, match="v10.npz: feature state zc: missing from a version-10 state"):
        broken.restore_state(_rewritten(path, tmp_path / "v10.npz", "10", drop=("features.zc", "features.zw")))
    with pytest.raises(ValueError, match="v11.npz: feature state zw: missing from a version-11 state"):
        broken.restore_state(_rewritten(path, tmp_path / "v11.npz", "11", drop=("features.zw",)))
    assert broken.nodes == []
    # a version-10 checkpoint lacks only the warming filters
    v10 = online.OnlineScorer(model, explain_top=0)
    v10.restore_state(_rewritten(path, tmp_path / "v10w.npz", "10", drop=("features.zw",)))
    assert v10.nodes == after.nodes
    # version-11, 12 and 13 checkpoints carry what 14 does but the GPUs' onset state (12 and 13 changed
    # when and how the slow share counts, not the state): the onset starts over, a GPU judged again after
    # its hours (onset.MIN_SEEN_HOURS), so in these few hours every column is the same
    onset_arrays = tuple(f"stage.onset.{name}" for name in onset.STATE_FIELDS)
    with np.load(path) as z:
        assert set(onset_arrays) <= set(z.files)
    v11, v12, v13, v14 = (online.OnlineScorer(model, explain_top=0) for _ in range(4))
    v11.restore_state(_rewritten(path, tmp_path / "v11full.npz", "11", drop=onset_arrays))
    v12.restore_state(_rewritten(path, tmp_path / "v12.npz", "12", drop=onset_arrays))
    v13.restore_state(_rewritten(path, tmp_path / "v13.npz", "13", drop=onset_arrays))
    v14.restore_state(path)
    restarted = set(range(ft.N_FEATURES)[ft.CONTEXT_COLS]) | set(range(ft.N_FEATURES)[ft.WARMING_COLS])
    others = [i for i in range(ft.N_FEATURES) if i not in restarted]
    for k, step in enumerate(range(first + RESTART_AT, first + RESTART_AT + ft.HISTORY + 3)):
        _feed(steady, tables, step)
        _feed(after, tables, step)
        for scorer in (v11, v12, v13, v14):
            _feed(scorer, tables, step)
        for n in NODES:
            for scorer in (v11, v12, v13):
                np.testing.assert_array_equal(scorer.features_of(n), v14.features_of(n))
        if k >= ft.HISTORY:
            for n in NODES:
                np.testing.assert_array_equal(after.features_of(n)[others], steady.features_of(n)[others])
    # the context started over: node-b's loud HBM is its peers' usual, learnt again from 0
    col = ft.FEATURE_NAMES.index("leaf_peers_ecc_3d")
    assert 0 < after.features_of("node-a")[col] < steady.features_of("node-a")[col]


def test_a_cold_scorer_differs_so_the_checkpoint_matters(tmp_path, telemetry, tiny_model_dir):
    tables, inv, first = telemetry
    model = registry.load_model(tiny_model_dir(tmp_path / "m"))
    steady, cold = online.OnlineScorer(model, explain_top=0), online.OnlineScorer(model, explain_top=0)
    for s in (steady, cold):
        s.ingest("inventory", inv)
    for step in range(first, first + RESTART_AT):
        _feed(steady, tables, step)
    for step in range(first + RESTART_AT, first + RESTART_AT + ft.HISTORY + 2):
        _feed(steady, tables, step)
        _feed(cold, tables, step)
    col = ft.FEATURE_NAMES.index("ecc_sbe_30m_vs_baseline")
    assert steady.features_of("node-b")[col] != cold.features_of("node-b")[col]


def test_a_bad_state_file_is_refused_and_changes_nothing(tmp_path, telemetry, tiny_model_dir):
    tables, inv, first = telemetry
    model = registry.load_model(tiny_model_dir(tmp_path / "m"))
    scorer = online.OnlineScorer(model, explain_top=0)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not an npz")
    with pytest.raises(ValueError, match="junk.npz: not a scorer state file"):
        scorer.restore_state(junk)
    # another feature version
    donor = online.OnlineScorer(model, explain_top=0)
    donor.ingest("inventory", inv)
    _feed(donor, tables, first)
    _feed(donor, tables, first + 1)
    good = tmp_path / "good.npz"
    donor.save_state(good)
    with pytest.raises(ValueError, match="old.npz: saved with feature version '0'"):
        scorer.restore_state(_rewritten(good, tmp_path / "old.npz", "0"))
    assert scorer.nodes == []
    # a scorer that has taken rows does not restore over them
    with pytest.raises(ValueError, match="only before it takes rows"):
        donor.restore_state(good)
    scorer.restore_state(good)
    assert scorer.nodes == NODES


def test_the_service_sets_an_unusable_checkpoint_aside_and_starts_cold(tmp_path, caplog, tiny_model_dir):
    from foreshock.service.scoring import PredictorScorer

    scorer = PredictorScorer(tiny_model_dir(tmp_path / "m"))
    state = tmp_path / "scorer-state.npz"
    assert scorer.restore_state(state) is None            # none yet: nothing said, nothing moved
    state.write_bytes(b"\x00" * 64)
    assert scorer.restore_state(state) is None
    assert not state.exists() and (tmp_path / "scorer-state.npz.refused").read_bytes() == b"\x00" * 64
    assert "scorer checkpoint not used" in caplog.text and "not a scorer state file" in caplog.text
    assert scorer.checkpoint(state, 300.0) is None        # not due yet
    assert scorer.checkpoint(state, 300.0, force=True) > 0 and state.is_file()
